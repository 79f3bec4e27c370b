"""vLLM's hidden-states files: what ``ExampleHiddenStatesConnector`` writes per request.

vLLM (≥ 0.18) saves each request's decoder-layer outputs itself, without hooks, when the LLM is
built with ``speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
"draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": IDS}}}`` and
``kv_transfer_config`` naming ``ExampleHiddenStatesConnector`` (``shared_storage_path``: the
folder): one ``{request id}.safetensors`` per request holding

- ``hidden_states``: ``[prompt tokens, len(IDS), hidden]`` in the model's dtype;
- ``token_ids``: ``[prompt tokens]``, the prompt (positions 0..T-1).

tracer's own connector (:class:`tracer.engines.vllm.hidden_states.HostHiddenStatesConnector`) may
write a request's window alone: then ``hidden_states`` holds the rows of positions ``w0..w1-1``
only, ``token_ids`` still the whole prompt, and a third tensor ``window`` (int64 ``[w0, w1]``)
says which positions the rows are. Both kinds are read here.

Slot ``j`` holds "aux hidden state" ``IDS[j]``: id 0 is the embedding's output, id ``k ≥ 1`` is
decoder layer ``k - 1``'s output, ``hidden + residual`` added in the model's dtype (vLLM's
``_maybe_add_hidden_state``), which is HF's ``model.layers.{k-1}``. The file does not record
``IDS``: tracer reads the file written with every id, ``IDS = list(range(L + 1))`` (the embedding
and all ``L`` layers), and refuses another count against the reference's layers
(:func:`check_slots`). It works with vLLM's compiled and graph-captured forward (the states are
written into a cache-only attention layer's KV cache inside the graph) and covers prompt tokens
only and no sublayer point.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tracer.errors import TracerError
from tracer.execute.records import DumpEntry, RawDump

#: the tensors of one hidden-states file, exactly
KEYS = frozenset({"hidden_states", "token_ids"})
#: the tensors of one written for a window of positions alone (module docstring)
WINDOW_KEYS = KEYS | {"window"}
#: :attr:`RawDump.layout` of such a file
LAYOUT = "vllm-hidden-states"
#: :attr:`RawDump.engine` of such a file
ENGINE = "vLLM hidden states"
#: the floating dtypes :func:`read_window` reads (safetensors' names; tracer compares these)
_FLOATS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def is_hidden_states(tensors: dict[str, Any]) -> bool:
    """Whether a safetensors file's tensors are a vLLM hidden-states file (exactly :data:`KEYS`, or
    :data:`WINDOW_KEYS`: the rows of a window alone)."""
    return set(tensors) in (KEYS, WINDOW_KEYS)


def _file_window(window: Any, n_rows: int, n_tokens: int) -> tuple[int, int] | None:
    """A window file's ``window`` tensor as ``(w0, w1)``, where it is two integers with ``0 <= w0 < w1
    <= n_tokens`` and ``w1 - w0 == n_rows``; None otherwise."""
    if not isinstance(window, torch.Tensor) or window.shape != (2,) or window.is_floating_point() or window.is_complex():
        return None
    w0, w1 = (int(x) for x in window.tolist())
    return (w0, w1) if 0 <= w0 < w1 <= n_tokens and w1 - w0 == n_rows else None


def slot_module(slot: int) -> str:
    """The module whose output aux hidden state ``slot`` is (ids ``0..L``): ``model.embed_tokens``
    for 0, ``model.layers.{slot - 1}`` after."""
    return "model.embed_tokens" if slot == 0 else f"model.layers.{slot - 1}"


def read_hidden_states(path: str, tensors: dict[str, torch.Tensor], ledger: Any = None) -> RawDump:
    """The :class:`RawDump` of one hidden-states file (one step, positions 0..T-1, or ``w0..w1-1`` for a
    window's file; one entry per slot named by :func:`slot_module`, each a contiguous ``[rows, hidden]``
    view of one copy of the rows regrouped by slot, charged to ``ledger``; the slot count is
    ``facts["hidden_state_slots"]``, a window's file adds ``facts["window"]`` and
    ``facts["prompt_tokens"]``).

    Raises:
        TracerError: ``hidden_states`` not ``[rows, slots, hidden]`` of a floating dtype, ``token_ids``
            not T integers, one per row (or, with ``window``, a ``window`` that is not ``[w0, w1]``
            inside the prompt with one row per position) (one line naming the file).
    """
    hs, ids = tensors["hidden_states"], tensors["token_ids"]
    if hs.dim() != 3 or not hs.is_floating_point():
        raise TracerError(f"{path}: hidden_states is {tuple(hs.shape)} {str(hs.dtype).removeprefix('torch.')}; vLLM's "
                          "hidden-states file holds [tokens, layers, hidden] in the model's dtype")
    if ids.dim() != 1:
        raise TracerError(f"{path}: token_ids {tuple(ids.shape)} are not one row of the prompt's ids; vLLM's "
                          "hidden-states file holds them as [tokens]: the file is damaged")
    window = None
    if "window" in tensors:
        window = _file_window(tensors["window"], hs.shape[0], ids.shape[0])
        if window is None:
            w = tensors["window"]
            raise TracerError(f"{path}: its window {w.tolist() if w.numel() <= 4 else tuple(w.shape)} does not name "
                              f"the positions [w0, w1) of its {hs.shape[0]} rows inside its {ids.numel()} token ids; "
                              "the file is damaged")
    elif ids.shape[0] != hs.shape[0]:
        raise TracerError(f"{path}: token_ids {tuple(ids.shape)} do not give one id per row of hidden_states "
                          f"{tuple(hs.shape)}; the file is damaged")
    if _not_ids(ids):
        raise TracerError(f"{path}: token_ids are {'empty' if ids.numel() == 0 else str(ids.dtype)} or negative; vLLM "
                          "writes the prompt's token ids (non-negative integers) there")
    w0, w1 = window or (0, ids.numel())
    if ledger is not None:
        ledger.charge((w1 - w0) * 16, f"{path}: the int64 ids and positions of its {w1 - w0:,} tokens")
    tokens = {0: {"input_ids": ids[w0:w1].to(torch.long), "positions": torch.arange(w0, w1), "file": path}}
    if window is not None:  # the prompt the rows follow: rows after an id other than the reference's are not compared
        tokens[0]["prompt_ids"] = ids
    if ledger is not None:
        ledger.charge(hs.numel() * hs.element_size(), f"{path}: its rows regrouped by layer")
    facts = _facts(hs.shape[1])
    if window is not None:
        facts.update(window=[w0, w1], prompt_tokens=int(ids.numel()))
    return RawDump(path=path, layout=LAYOUT, engine=ENGINE, entries=_entries(path, hs), tokens=tokens, facts=facts)


def _not_ids(ids: torch.Tensor) -> bool:
    """Whether ``ids`` are not token ids int64 holds: floating, complex, empty, or negative once
    widened to int64 (uint64 ids from 2**63 on; torch compares no unsigned dtype wider than 8 bits
    with 0, so those are looked at as what they widen to)."""
    if ids.is_floating_point() or ids.is_complex() or ids.numel() == 0:
        return True
    if ids.dtype == torch.uint64:
        return bool((ids.view(torch.int64) < 0).any())
    return ids.is_signed() and bool((ids < 0).any())


def _entries(path: str, hs: torch.Tensor) -> list[DumpEntry]:
    """One entry per slot of ``hs`` (``[rows, slots, hidden]``), named by :func:`slot_module`, each a
    contiguous ``[rows, hidden]`` view of one copy of the rows regrouped by slot (a copy even where
    the regrouping moves nothing: ``hs`` may be a view of a mapped file)."""
    by_slot = hs.permute(1, 0, 2).clone(memory_format=torch.contiguous_format)  # a slot's rows then lie together
    return [DumpEntry(name=f"hidden_states[:, {j}]", module=slot_module(j), element=None, step=0, tp_rank=0,
                      tp_size=1, pp_rank=0, dims=None, tensor=by_slot[j], file=path) for j in range(hs.shape[1])]


def _facts(slots: int) -> dict[str, Any]:
    return {"framework": "vllm", "hidden_state_slots": int(slots)}


def read_window(path: str, window: tuple[int, int], n_layers: int) -> tuple[list[DumpEntry], torch.Tensor, dict] | None:
    """The rows of positions ``window`` of a hidden-states file, read alone (safetensors'
    ``get_slice``: the file's other rows are never read or copied), for
    :func:`tracer.engines.dumps.namemap.map_window`.

    Returns:
        ``(entries, token_ids, facts)``: one :class:`DumpEntry` per slot as :func:`read_hidden_states`
        names it, holding its ``[w1 - w0, hidden]`` rows (a view of one copy regrouped by slot);
        the file's ``T`` token ids (int64); the dump's facts. None where the file is not one that
        :func:`tracer.engines.dumps.read.read_dump` and :func:`check_slots` accept as it is
        (not a ``.safetensors`` regular file of exactly :data:`KEYS` or :data:`WINDOW_KEYS`;
        ``hidden_states`` not ``[rows, n_layers + 1, hidden]`` of a dtype tracer compares; ``token_ids``
        not ``T`` non-negative integers; ``window`` outside the file's rows (``0..T-1``, or a window
        file's own ``window``); a whole read over the input
        budget; an unreadable file): reading it whole then says what is wrong, in one line.
    """
    from safetensors import safe_open

    from tracer.files import check_input_file, input_budget

    w0, w1 = int(window[0]), int(window[1])
    p = Path(path)
    try:
        budget = input_budget()
        size = check_input_file(p, "engine dump", budget).stat().st_size  # a regular file: nothing blocks
        if p.suffix != ".safetensors":
            return None
        with safe_open(str(p), framework="pt") as f:
            keys = set(f.keys())
            if keys not in (KEYS, WINDOW_KEYS):
                return None
            hs, ids = f.get_slice("hidden_states"), f.get_tensor("token_ids")
            shape, dtype = hs.get_shape(), _FLOATS.get(hs.get_dtype())
            if len(shape) != 3 or dtype is None or shape[1] != n_layers + 1 or ids.dim() != 1 or _not_ids(ids):
                return None
            # the positions the file's rows are: 0..T-1, or a window file's own window
            f0, f1 = (0, ids.shape[0]) if keys == KEYS else (_file_window(f.get_tensor("window"), shape[0],
                                                                           ids.shape[0]) or (-1, -1))
            if f1 - f0 != shape[0] or not f0 <= w0 < w1 <= f1:
                return None
            # what the whole read allocates (the file, the ids and positions, the rows regrouped) within the budget
            if size + ids.numel() * 16 + shape[0] * shape[1] * shape[2] * dtype.itemsize > budget:
                return None
            rows = hs[w0 - f0:w1 - f0]
    except Exception:  # noqa: BLE001 - any failure: the whole read names it (safetensors raises its own types)
        return None
    return _entries(str(p), rows), ids.to(torch.long), _facts(shape[1])


def is_window_file(path: str) -> bool:
    """Whether ``path`` is a hidden-states file of a window's rows alone (its tensors exactly
    :data:`WINDOW_KEYS`; only the safetensors header is read). False for any other file, one that is
    not a regular file (a FIFO is never opened: it could block) or one that cannot be read (reading it
    whole then says what is wrong)."""
    from safetensors import safe_open

    try:
        if not Path(path).is_file():
            return False
        with safe_open(str(path), framework="pt") as f:
            return set(f.keys()) == WINDOW_KEYS
    except Exception:  # noqa: BLE001 - safetensors raises its own types
        return False


def check_slots(raw: RawDump, n_layers: int) -> None:
    """Refuse a hidden-states file whose slot count is not the reference's layers + 1 (the ids it was
    written with are not in the file, so any other count cannot be placed).

    Raises:
        TracerError: another count (one line naming the setting that writes a file tracer reads).
    """
    slots = raw.facts.get("hidden_state_slots") if raw.layout == LAYOUT else None
    if slots is not None and slots != n_layers + 1:
        raise TracerError(f"{raw.path} holds {slots} hidden states per token but the reference has {n_layers} layers; "
                          "the file does not say which layers vLLM saved, so tracer reads it when written with "
                          f"eagle_aux_hidden_state_layer_ids = list(range({n_layers + 1})) (the embedding and every layer)")


__all__ = ["KEYS", "WINDOW_KEYS", "LAYOUT", "ENGINE", "is_hidden_states", "slot_module", "read_hidden_states",
           "read_window", "is_window_file", "check_slots"]
