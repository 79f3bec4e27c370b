"""Writing a stored HF run in SGLang's dumper format: a **synthetic** engine dump, for examples and tests.

No engine runs here. This takes the sublayer captures of one run of a trace (made by hooks on
the HF model) and writes the files SGLang's dumper (``python/sglang/srt/debug_utils/dumper.py``,
non-intrusive mode ``all``) would write for a Llama-family model served with tensor parallelism:

- file names ``step=S___rank=R___dump_index=I___name=NAME___recompute_status=disabled[___layer_id=L].pt``
  in ``<out>/<exp_name>/``, each ``torch.save({"value": tensor, "meta": {...}})`` with the tags, the
  static meta (``world_rank``, ``world_size``, ``sglang_parallel_info``, ``tokenizer_path``);
- SGLang's module names and semantics: fused ``self_attn.qkv_proj`` (per rank ``[q_r | k_r | v_r]``)
  and ``mlp.gate_up_proj`` (``[gate_r | up_r]``), ``mlp.act_fn`` = act(gate) * up, the attention
  core ``self_attn.attn``, decoder layers returning ``(hidden_states, residual)`` (``output.0`` = the
  MLP output, ``output.1`` = the residual before it), norms with a residual returning
  ``(normed, residual)``, the root's ``next_token_logits`` (last position only);
- column-parallel outputs split into ``tp`` shards (one file per rank), row-parallel and
  replicated outputs written whole on every rank; ``input_ids`` and ``positions`` per step.

What it cannot reproduce: modules HF has no counterpart for (``rotary_emb``), module inputs, and
the engine's own kernels — the values are HF's, bit for bit. A cache hit is expressed by the run's
window: only the positions the run kept (e.g. the suffix a prefix-cache hit computes) are dumped.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import torch

from tracer.errors import TracerError
from tracer.execute.family import infer_roles
from tracer.execute.kinds import PointKind
from tracer.store.trace import TraceReader

_COLUMN = ("qkv_proj", "gate_up_proj", "act_fn", "attn")


def _shard(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    w = t.shape[-1]
    if w % tp:
        raise TracerError(f"width {w} does not split into {tp} TP shards; pick a tp that divides it")
    return t[..., rank * (w // tp):(rank + 1) * (w // tp)]


def _layer_tensors(get: Any, layer: str, hf: dict[str, str], prev: torch.Tensor, first: bool) -> list[tuple[str, Any, str]]:
    """``(engine module, value or tuple, parallel style)`` of one decoder layer, in execution order.

    ``layer`` is SGLang's layer path (``model.layers.3``); ``hf`` maps each role of the block
    (:data:`tracer.execute.roles.ROLES`, and ``attention_core``/``mlp_hidden``) to the HF capture
    name of that layer in the stored run. The names on the left are SGLang's Llama module names.
    """
    attn = get(hf["attention"])
    mid = prev + attn  # HF: hidden_states = residual + hidden_states (the residual before the MLP)
    mlp = get(hf["mlp"])
    ln_in = get(hf["attn_norm"])
    return [
        (f"{layer}.input_layernorm", ln_in if first else (ln_in, prev), "replicated"),
        (f"{layer}.self_attn.qkv_proj", [get(hf[f"{x}_proj"]) for x in "qkv"], "fused"),
        (f"{layer}.self_attn.attn", get(hf["attention_core"]), "column"),
        (f"{layer}.self_attn.o_proj", get(hf["o_proj"]), "replicated"),
        (f"{layer}.self_attn", attn, "replicated"),
        (f"{layer}.post_attention_layernorm", (get(hf["mlp_norm"]), mid), "replicated"),
        (f"{layer}.mlp.gate_up_proj", [get(hf["gate_proj"]), get(hf["up_proj"])], "fused"),
        (f"{layer}.mlp.act_fn", get(hf["mlp_hidden"]), "column"),
        (f"{layer}.mlp.down_proj", get(hf["down_proj"]), "replicated"),
        (f"{layer}.mlp", mlp, "replicated"),
        (layer, (mlp, mid), "replicated"),
    ]


#: the roles a Llama-style layer needs for SGLang's layout (its fused q/k/v and gate/up are split)
_ROLES = ("attn_norm", "attention", "q_proj", "k_proj", "v_proj", "attention_core", "o_proj", "mlp_norm",
          "mlp", "gate_proj", "up_proj", "mlp_hidden", "down_proj")


def capture_getter(r: Any, run: str, trace: Any, perturb: dict[str, torch.Tensor] | None = None
                   ) -> Callable[[str], torch.Tensor]:
    """``get(name)``: capture ``name`` of ``run`` in the open trace ``r`` as ``(rows, features)``, plus
    ``perturb[name]`` where given (a planted difference), read once and kept.

    Raises:
        TracerError: (from ``get``) the run has no such capture.
    """
    names = set(r.capture_names(run))
    cache: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:
        if name not in cache:
            if name not in names:
                raise TracerError(f"run {run} of {trace} has no capture {name}; trace it with --granularity sublayers")
            t = r.tensor(run, name)
            t = t.reshape(t.shape[0], -1)
            cache[name] = t + perturb[name] if perturb and name in perturb else t
        return cache[name]

    return get


def layer_roles(r: Any, run: str, names: list[str], layer: str) -> dict[str, str]:
    """Role → HF capture name of one decoder layer of a stored run: the roles stored with the
    captures, or for a trace without them the roles inferred from the names.

    Raises:
        TracerError: a role SGLang's Llama layout needs that the run lacks.
    """
    members = [n for n in names if n.startswith(layer + ".")]
    stored = {n: r.capture_info(run, n).get("role", "") for n in members}
    if not any(stored.values()):
        guessed = infer_roles([n[len(layer) + 1:] for n in members])
        stored = {n: guessed.get(n[len(layer) + 1:], "") for n in members}
    out = {role: n for n, role in stored.items() if role}
    out["layer"] = layer
    missing = [role for role in _ROLES if role not in out]
    if missing:
        raise TracerError(f"run {run} has no {missing[0]} point in {layer}; SGLang's dump layout needs a Llama-style "
                          "layer captured with --granularity sublayers")
    return out


def write_sglang_dump(trace: str, run: str, out: str | Path, *, tp: int = 2, chunk: int | None = None,
                      exp_name: str = "dump_synthetic", tokenizer_path: str | None = None,
                      perturb: dict[str, float] | None = None, layout: str = "sglang-dumper",
                      steps: list[int] | None = None, logits: str = "last") -> Path:
    """Write run ``run`` of ``trace`` (captured with ``granularity="sublayers"``) as an SGLang dumper folder.

    Args:
        trace, run: the HF run to express; its kept window (``P..N-1``) is what the dump holds.
        out: the dumper's ``dir``; files go to ``out/exp_name/``.
        tp: number of tensor-parallel ranks to shard column-parallel outputs over.
        chunk: split the window into chunked-prefill steps of at most this many tokens (one
            dumper step each); None: one step.
        steps: the number of tokens of each step, in order (instead of ``chunk``): e.g. a rollout's
            ``[prefill, 1, 1, ...]``, the prefill then one decode step per generated token. They
            must add up to the window.
        logits: ``last``: next-token logits after the last step only (a prefill); ``every-step``:
            after every step, at its last token (a rollout's prefill and decode steps: the logits
            the engine samples each token from).
        layout: ``sglang-dumper`` (the dumper's ``k=v___k=v.pt`` files) or ``passes`` (SGLang's
            ``--debug-tensor-dump-output-folder`` layout: ``TP{r}_PP0_Rank{r}_pid0/Pass{NNNNN}.pt``
            dicts of leaf modules).
        perturb: ``{HF capture name: delta}``: add ``delta`` to that point's tensor before writing
            (for tests of the comparison; only that tensor changes).

    Returns:
        the folder written (``out/exp_name``).

    Raises:
        TracerError: the run lacks sublayer captures, ``out/exp_name`` is not empty, a width that
            ``tp`` does not divide.
    """
    if layout not in ("sglang-dumper", "passes"):
        raise TracerError(f"unknown dump layout {layout!r}; use sglang-dumper or passes")
    if logits not in ("last", "every-step"):
        raise TracerError(f"unknown logits mode {logits!r}; use last or every-step")
    folder = Path(out) / exp_name
    if folder.exists() and any(folder.iterdir()):
        raise TracerError(f"{folder} exists and is not empty; choose another --out")
    with TraceReader(trace) as r:
        rec = r.run(run, load_tensors=False)
        names = r.capture_names(run)
        get = capture_getter(r, run, trace, perturb)

        layers = [n for n in names if r.capture_info(run, n)["kind"] == PointKind.LAYER]
        emb = [n for n in names if r.capture_info(run, n)["kind"] == PointKind.EMBEDDING][0]
        norm = [n for n in names if r.capture_info(run, n)["kind"] == PointKind.FINAL_NORM][0]
        items: list[tuple[str, Any, str]] = [("model.embed_tokens", get(emb), "replicated")]
        prev = get(emb)
        for i, layer in enumerate(layers):
            hf = layer_roles(r, run, names, layer)
            items += _layer_tensors(get, f"model.layers.{i}", hf, prev, first=(i == 0))
            prev = get(layer)
        items += [("model.norm", (get(norm), prev), "replicated"), ("model", get(norm), "replicated")]
        lo, hi = rec.window
        ids = torch.tensor(rec.token_ids[lo:hi], dtype=torch.long)
        all_logits = get([n for n in names if r.capture_info(run, n)["kind"] == PointKind.LOGITS][0])
    if steps is not None:
        if sum(steps) != hi - lo or any(n < 1 for n in steps):
            raise TracerError(f"steps {steps} do not add up to the run's {hi - lo} kept tokens; give positive sizes that do")
        cuts = [sum(steps[:i]) for i in range(len(steps) + 1)]
        bounds = list(zip(cuts, cuts[1:]))
    else:
        bounds = [(a, min(a + (chunk or hi - lo), hi - lo)) for a in range(0, hi - lo, chunk or hi - lo)]
    folder.mkdir(parents=True, exist_ok=True)
    for step, (a, b) in enumerate(bounds):
        for rank in range(tp):
            logits_rows = all_logits[b - 1:b] if logits == "every-step" or b == hi - lo else None
            if layout == "passes":
                _write_pass(folder, step, rank, tp, items, ids, lo, a, b, logits_rows)
            else:
                _write_step(folder, step, rank, tp, items, ids, lo, a, b, tokenizer_path, logits_rows)
    return folder


#: modules with children: SGLang's per-pass hook (--debug-tensor-dump-output-folder) dumps leaves only
_NOT_LEAF = re.compile(r"^model(\.layers\.\d+(\.self_attn|\.mlp)?)?$")


def _write_pass(folder: Path, step: int, rank: int, tp: int, items: list, ids: torch.Tensor, lo: int,
                a: int, b: int, logits: torch.Tensor | None) -> None:
    """One ``Pass{step:05d}.pt`` of rank ``rank``: leaf module name → tensor (list for a tuple output)."""
    data: dict[str, Any] = {
        "model.forward_batch_info.input_ids": ids[a:b].clone(),
        "model.forward_batch_info.positions": torch.arange(lo + a, lo + b, dtype=torch.long),
    }
    for module, value, style in items:
        if _NOT_LEAF.match(module):
            continue
        if isinstance(value, tuple):
            data[module] = [v[a:b].clone() for v in value]
        elif style == "fused":
            data[module] = torch.cat([_shard(v[a:b], tp, rank) for v in value], dim=-1)
        elif style == "column":
            data[module] = _shard(value[a:b], tp, rank).clone()
        else:
            data[module] = value[a:b].clone()
    if logits is not None:
        data["logits_processor"] = logits.clone()
    sub = folder / f"TP{rank}_PP0_Rank{rank}_pid0"
    sub.mkdir(exist_ok=True)
    torch.save(data, sub / f"Pass{step:05d}.pt")


def _write_step(folder: Path, step: int, rank: int, tp: int, items: list, ids: torch.Tensor, lo: int,
                a: int, b: int, tokenizer_path: str | None, logits: torch.Tensor | None) -> None:
    """One dumper step (rows ``a..b-1`` of the window) on one rank, in execution order."""
    static = {"world_rank": rank, "world_size": tp,
              "sglang_parallel_info": {"tp_rank": rank, "tp_size": tp, "pp_rank": 0, "pp_size": 1},
              **({"tokenizer_path": tokenizer_path} if tokenizer_path else {})}
    index = 0

    def dump(name: str, value: torch.Tensor, layer_id: int | None = None) -> None:
        nonlocal index
        index += 1
        tags = {"step": step, "rank": rank, "dump_index": index, "name": name, "recompute_status": "disabled"}
        if layer_id is not None:
            tags["layer_id"] = layer_id
        fname = "___".join(f"{k}={v}" for k, v in tags.items()) + ".pt"
        torch.save({"value": value.clone(), "meta": {**tags, **static}}, folder / fname)

    dump("input_ids", ids[a:b])
    dump("positions", torch.arange(lo + a, lo + b, dtype=torch.long))
    for module, value, style in items:
        parts = module.split(".")
        layer_id = int(parts[2]) if len(parts) > 3 and parts[1] == "layers" else None
        if isinstance(value, tuple):
            for k, v in enumerate(value):
                dump(f"non_intrusive__{module}.output.{k}", v[a:b], layer_id)
            continue
        if style == "fused":
            value = torch.cat([_shard(v[a:b], tp, rank) for v in value], dim=-1)
        elif style == "column":
            value = _shard(value[a:b], tp, rank)
        else:
            value = value[a:b]
        dump(f"non_intrusive__{module}.output", value, layer_id)
    if logits is not None:
        dump("non_intrusive__logits_processor.output.next_token_logits", logits)
        dump("non_intrusive__output.next_token_logits", logits)
