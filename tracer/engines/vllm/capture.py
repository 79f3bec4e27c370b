"""Capture hooks inside vLLM's model, expressed as HF capture points, kept on vLLM's device.

vLLM runs one forward pass per scheduler step over the tokens of every scheduled request,
flattened: each module sees ``[tokens, features]``. :class:`VllmCapture` owns ordinary forward
hooks on vLLM's ``nn.Module`` and reads nothing of the model runner (whose internals differ
between the V1 and V2 runners and between releases):

- a forward pre-hook on the root model reads the step from what the forward receives
  (:func:`read_step`: ``input_ids``, ``positions``, the forward context's ``query_start_loc`` and
  ``slot_mapping``; one host copy per step) and finds the rows of the requests it follows by their
  content and positions (:class:`tracer.engines.vllm.requests.Tracker`), whatever the order the
  runner put them in;
- a forward hook on every vLLM module that the engine map (``hooks/engine-llama.toml`` and
  ``hooks/engine-vllm.toml``) maps onto a capture point keeps those rows **on the device**, mapped
  as they are taken: a fused q/k/v or gate/up output split by the HF widths, a ``(hidden,
  residual)`` pair summed in the HF dtype, a Linear's ``(output, None)`` read as its output (one
  copy per point and step, no host synchronisation). A second module mapped onto a point already
  taken in the step (a fused add + RMSNorm's residual is the previous layer's output) is compared
  with it on the device; a difference is named in the notes, the first source is kept;
- the attention layer's inputs ``(query, key, value)`` give the ``kv_cache`` points: the post-RoPE
  keys and the values vLLM writes into its paged KV cache (``kv_cache_dtype`` ``auto``: stored
  without conversion), for every prompt position the followed requests computed;
- the logits processor's output (one row per request of the step) gives the logits where vLLM
  samples, per followed request.

:meth:`VllmCapture.records` assembles the rows of each point in position order (the first
computation of a position wins) as :class:`~tracer.execute.records.CaptureRecord` objects on
vLLM's device. Nothing is dropped silently: a capture point with no vLLM counterpart, or without
every compared position, is listed with the reason. The capture's state is plain tensors and
JSON-able step facts (:meth:`VllmCapture.state`), so it can be filled in one process and
assembled in another.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from tracer.errors import TracerError
from tracer.execute.handles import Hooks
from tracer.execute.points import CapturePoint
from tracer.engines.dumps.namemap import RefLayout, hf_name, locate
from tracer.engines.vllm.requests import StepInputs, Tracker, boundaries_from_positions
from tracer.execute.records import CaptureRecord, SchedulerStep, TracedPositions

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}


def _shapes(x: Any) -> list[list[int]]:
    if isinstance(x, torch.Tensor):
        return [list(x.shape)]
    if isinstance(x, (tuple, list)):
        return [s for item in x for s in _shapes(item)]
    return []


def _runner_name(runner: Any) -> str:
    return runner if isinstance(runner, str) else f"{type(runner).__module__}.{type(runner).__name__}"


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001 - only for a message
        return "?"


def read_step(args: tuple, kwargs: dict, runner: Any) -> StepInputs:
    """What one forward pass of vLLM's model computes, read from the pass itself: its token ids,
    positions, request boundaries (``query_start_loc`` of the forward context's attention metadata;
    derived from the positions and KV slots where the metadata has none, e.g. FlashInfer's) and KV
    slots, copied to the host in one transfer.

    Raises:
        TracerError: the pass has no ``input_ids``/1-D ``positions`` or no forward context
            (a runner tracer cannot read: named with the vLLM version), or micro-batched metadata.
    """
    from vllm.forward_context import get_forward_context, is_forward_context_available

    ids = kwargs.get("input_ids", args[0] if args else None)
    pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
    why = None
    if not isinstance(ids, torch.Tensor):
        why = "no input_ids (inputs_embeds only)"
    elif not isinstance(pos, torch.Tensor) or pos.dim() != 1:
        why = "no 1-D positions (M-RoPE or none)"
    elif not is_forward_context_available():
        why = "no forward context"
    if why is not None:
        raise TracerError(f"tracer cannot read the requests of vLLM {_vllm_version()}'s {_runner_name(runner)}: its "
                          f"forward pass has {why}; tracer reads input_ids, positions and the attention metadata's "
                          "query_start_loc (text-only models, eager)")
    ctx = get_forward_context()
    md = ctx.attn_metadata
    if isinstance(md, list):
        raise TracerError(f"vLLM {_vllm_version()}'s {_runner_name(runner)} runs this step as micro-batches (dual-batch "
                          "overlap); tracer reads one flattened batch per forward pass: turn micro-batching off")
    metas = list(md.values()) if isinstance(md, dict) else ([md] if md is not None else [])
    qsl = next((m.query_start_loc for m in metas if isinstance(getattr(m, "query_start_loc", None), torch.Tensor)), None)
    slots = next((m.slot_mapping for m in metas if isinstance(getattr(m, "slot_mapping", None), torch.Tensor)), None)
    if slots is None and isinstance(getattr(ctx, "slot_mapping", None), dict) and ctx.slot_mapping:
        slots = next(iter(ctx.slot_mapping.values()))
    table = next((getattr(m, k) for m in metas for k in ("block_table", "block_table_tensor")
                  if isinstance(getattr(m, k, None), torch.Tensor)), None)
    t = ids.shape[0]
    parts = [ids.reshape(-1), pos.reshape(-1)]
    if slots is not None:
        parts.append(slots.reshape(-1)[:t].to(ids.device))
    if qsl is not None:
        parts.append(qsl.reshape(-1).to(ids.device))
    host = torch.cat([p.to(torch.int64) for p in parts]).cpu().numpy()  # the step's one host copy
    h_ids, h_pos = host[:t], host[t:2 * t]
    rest = host[2 * t:]
    h_slots = None
    if slots is not None:
        h_slots, rest = rest[:min(t, slots.numel())], rest[min(t, slots.numel()):]
        if len(h_slots) < t:
            h_slots = None
    if qsl is not None:
        starts = np.minimum(rest, t)  # padded entries (V2 pads with the token count) are empty requests
        how = "query_start_loc"
    else:
        starts = boundaries_from_positions(h_pos, h_slots)
        how = "positions"

    def block_table() -> np.ndarray:
        return table.to(torch.int64).cpu().numpy()

    return StepInputs(ids=h_ids, positions=h_pos, starts=starts.astype(np.int64), slots=h_slots,
                      block_table=block_table if table is not None else None, boundaries=how)


@dataclass
class _Action:
    """One rule of the engine map compiled for one hooked module: which output element(s) become
    which HF point(s)."""

    how: str  # take | sum | split | logits
    elements: tuple  # (element,) for take/split (None: the tensor itself); the summed elements for sum
    targets: tuple  # HF names (split: one per part)
    sizes: tuple = ()  # split: the HF widths
    dtype: torch.dtype | None = None  # sum: the HF dtype the pair is added in
    describe: str = ""
    shard: str | None = None  # TP > 1: "columns" (each rank a column shard) or "partial" (partial sums); None: whole


def _elements(out: Any) -> dict[int | None, torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return {None: out}
    if isinstance(out, (tuple, list)):
        return {i: v for i, v in enumerate(out) if isinstance(v, torch.Tensor)}
    return {}


def _pick(els: dict[int | None, torch.Tensor], el: int | None, what: str) -> torch.Tensor | None:
    """Element ``el`` of a module's output (as :mod:`tracer.engines.dumps.namemap` reads a dump):
    None picks the tensor itself, or the only tensor of ``(output, None)``."""
    if el is None:
        if None in els:
            return els[None]
        if set(els) == {0}:
            return els[0]
        raise TracerError(f"{what} is a tuple of {len(els)} tensors; its map rule must pick an element "
                          "(element = 0) or add them (sum = [1, 0])")
    return els.get(el, els.get(None) if el == 0 else None)


#: per vLLM model (weakly: a dropped LLM frees its entry), per (engine map, reference layout): the
#: compiled rules, the hooked modules and the module paths (every run of a model builds a capture)
_CACHE: "weakref.WeakKeyDictionary[nn.Module, dict[tuple, dict[str, Any]]]" = weakref.WeakKeyDictionary()


class VllmCapture(Hooks):
    """Context manager owning the hooks on vLLM's model for one run of one prompt.

    Args:
        model: vLLM's ``nn.Module`` (``LlamaForCausalLM`` of ``vllm.model_executor.models``).
        runner: vLLM's model runner, or its name: only named in errors (nothing of it is read).
        emap: the merged engine map (:func:`tracer.engines.dumps.rules.load_engine_map` with
            ``engine="vllm"``), whose ``capture`` table names the KV and logits modules.
        ref: the HF reference layout (capture names → kind, op, feature shape, dtype).
        token_ids: the traced prompt, N ints (positions 0..N-1 are captured).
        window: the compared positions ``(start, stop)``; activation rows outside it are not kept.
        kv_points: decoder layer index → the HF name of its ``kv_cache`` point (empty: none).
        kv_positions: the positions 0..kv_positions-1 a ``kv_cache`` point holds (default N; a
            rollout's last sampled token is never computed, so its cache holds N - 1).
        block_size: vLLM's KV block size (to follow a request across a block boundary).
        positions: the positions 0..positions-1 whose rows are kept (default N, the prompt; more keeps
            the rows of decode steps beyond it).
        tp: vLLM's tensor-parallel size (this model is one rank's): a fused output is split by the
            HF widths / ``tp``, and the points a rank holds a shard of are named in :attr:`tp_shards`
            (``columns``: the map's ``shard = "columns"``; ``partial``: a row-parallel layer that does not
            all-reduce its output), for :func:`tracer.engines.vllm.remote.gather_ranks` to join.

    Say which requests to follow with :meth:`follow` (before they are scheduled) and
    :meth:`close` (after they finish); rows of other requests (a batch's other rows) are never kept.

    Raises:
        TracerError: a forward pass tracer cannot read (:func:`read_step`); (:meth:`hooked`) HF
            widths that ``tp`` ranks do not divide.
    """

    def __init__(self, model: nn.Module, runner: Any, emap: dict[str, Any], ref: RefLayout,
                 token_ids: list[int], window: tuple[int, int], kv_points: dict[int, str],
                 kv_positions: int | None = None, *, block_size: int = 16, positions: int | None = None,
                 tp: int = 1) -> None:
        self.model, self.runner, self.emap, self.ref = model, _runner_name(runner), emap, ref
        self.token_ids = list(token_ids)
        self.n = len(token_ids) if positions is None else int(positions)
        self.kv_n = self.n if kv_positions is None else int(kv_positions)  # positions 0..kv_n-1 the KV points hold
        self.window = (int(window[0]), int(window[1]))
        self.kv_points = dict(kv_points)
        self.tracker = Tracker(int(block_size))
        self.steps: list[dict[str, Any]] = []  # what each forward pass computed (JSON-able)
        self.tokens: dict[int, dict[str, torch.Tensor]] = {}  # step -> kept rows' input_ids, positions (host)
        self.rows: dict[str, list[tuple[int, torch.Tensor]]] = {}  # HF name -> [(step, rows on the device)]
        self.kv: dict[int, list[tuple[np.ndarray, torch.Tensor]]] = {}  # layer -> [(positions, (r, keys+values))]
        self.logits: list[tuple[int, dict[str, int], np.ndarray, torch.Tensor]] = []  # (step, label->row, positions, rows)
        self.shapes: dict[str, list[dict[str, Any]]] = {}  # module -> {"step", "positions", "in", "out"}
        self.sources: dict[str, tuple[str, str]] = {}  # HF name -> (vLLM module, mapping line)
        self.checks: list[tuple[str, int, torch.Tensor]] = []  # (HF name, step, 0-dim bool: a later source differs)
        self.notes: list[str] = []
        self.kv_missing_why: str | None = None  # why kv_cache positions are missing, where a caller knows better
        self.tp = int(tp)
        self.tp_shards: dict[str, str] = {}  # HF name -> "columns" | "partial" (TP > 1; absent: every rank whole)
        self.logits_name: str | None = None  # the HF logits point the logits module maps onto (once it fired)
        self.traced_labels: set[str] = set()  # the followed requests whose activations are kept
        self.fired: set[str] = set()
        self.host_copies = 0  # device-to-host transfers made while the model ran (one per step)
        self._win_pos: dict[int, np.ndarray] = {}
        self._filled: dict[str, int] = {}
        super().__init__()
        self._cur: dict[str, Any] | None = None
        # the rules compiled per module, the hooked modules and their paths: the same for every run of
        # one model, reference layout and map, so computed once per process (a run creates a capture)
        self._key = (id(emap), tuple(ref.names.items()), self.tp)
        self._cache = _CACHE.setdefault(model, {}).setdefault(self._key, {"actions": {}})
        self._actions: dict[str, list[_Action]] = self._cache["actions"]

    # ---------------------------------------------------------------- requests

    def follow(self, label: str, prompt: list[int] | None, *, traced: bool = True) -> None:
        """Follow a request: ``traced`` ones have their activations, KV cache and logits kept;
        others only their logits rows (:meth:`logits_of`). ``prompt`` None: the first request of
        the next forward pass, whatever it holds (``tracer.capture(llm)``)."""
        self.tracker.follow(label, prompt, traced=traced, close_when_absent=prompt is None)

    def close(self, label: str) -> None:
        """The request finished (its label is never matched again)."""
        self.tracker.close(label)

    @property
    def _call(self) -> list[int] | None:
        """The traced positions ``[first, stop)`` of the current step (None: nothing traced), as
        :class:`tracer.execute.kernels.KernelRecorder` reads a capture's current call."""
        cur = self._cur
        if cur is None or not len(cur["win_pos"]):
            return None
        return [int(cur["win_pos"].min()), int(cur["win_pos"].max()) + 1]

    # ---------------------------------------------------------------- hooks

    def hooked(self) -> list[str]:
        """The vLLM module paths whose outputs map onto a capture point of the reference (in
        ``named_modules()`` order), the logits module included. A module shared by several layers
        (vLLM's ``rotary_emb``) and modules without a rule are not hooked."""
        if "hooked" not in self._cache:
            mods = [(n, m) for n, m in self.model.named_modules() if n]
            self._cache["modules"] = dict(mods)
            self._cache["hooked"] = [n for n, _m in mods if self._compile(n)]
        return list(self._cache["hooked"])

    def _compile(self, name: str) -> list[_Action]:
        if name in self._actions:
            return self._actions[name]
        layer, rel = locate(name)
        rules = (self.emap["layer"] if layer is not None else self.emap["model"]).get(rel) or []
        actions = []
        for rule in rules:
            hf = [hf_name(t, layer, self.ref) for t in (rule["hf"] if isinstance(rule["hf"], list) else [rule["hf"]])]
            if rule.get("rows") == "last":
                if any(h is not None and h in self.ref.names for h in hf):
                    actions.append(_Action("logits", (), tuple(h for h in hf if h is not None)))
                continue
            if rule.get("split") in ("qkv_groups",) or rule.get("identity"):
                raise TracerError(f"engine map rule for {rel!r} ({rule}) is not one for vLLM's in-process modules")
            if rule.get("split"):
                if not all(h is not None and h in self.ref.names for h in hf):
                    continue  # the reference did not capture the parts (e.g. layers granularity)
                sizes = tuple(self.ref.names[h][2][-1] if self.ref.names[h][2] else 1 for h in hf)
                if any(s % self.tp for s in sizes):
                    raise TracerError(f"{name}: the HF widths {list(sizes)} of {', '.join(hf)} do not split over "
                                      f"{self.tp} TP ranks; run this model with a tensor_parallel_size that divides them")
                actions.append(_Action("split", (rule.get("element"),), tuple(hf), tuple(s // self.tp for s in sizes),
                                       describe=f"fused {name.rsplit('.', 1)[-1]}, part {{i}} of {len(hf)}",
                                       shard=self._shard(name, rule)))
            elif "sum" in rule:
                if hf[0] is None or hf[0] not in self.ref.names:
                    continue
                dtype = _DTYPES.get(self.ref.names[hf[0]][3], torch.float32)
                actions.append(_Action("sum", tuple(rule["sum"]), (hf[0],), dtype=dtype,
                                       describe="(hidden, residual) summed in the HF dtype"))
            elif hf[0] is not None and hf[0] in self.ref.names:
                el = rule.get("element")
                actions.append(_Action("take", (el,), (hf[0],), describe=f"element {el} of a tuple" if el is not None else "",
                                       shard=self._shard(name, rule)))
        self._actions[name] = actions
        return actions

    def _shard(self, name: str, rule: dict[str, Any]) -> str | None:
        """What one TP rank holds of a module's mapped output (None: the whole tensor, or TP 1): the
        map's ``shard = "columns"``; ``partial`` for a row-parallel layer built without its
        all-reduce (vLLM's ``reduce_results=False``: each rank's partial sum)."""
        if self.tp == 1:
            return None
        if rule.get("shard") == "columns":
            return "columns"
        module = self._cache.get("modules", {}).get(name)
        return "partial" if getattr(module, "reduce_results", True) is False else None

    def install(self) -> None:
        """Hook the model's call (the step's tokens), every mapped module, the logits and the KV writes."""
        kv = self.emap.get("capture", {}).get("kv", {})
        hooked = self.hooked()
        modules = self._cache["modules"]
        self.hook(self.model, self._begin, pre=True, with_kwargs=True)
        for name in hooked:
            logits = any(a.how == "logits" for a in self._actions[name])
            self.hook(modules[name], self._logits_hook(name) if logits else self._hook(name))
        if self.kv_points and kv:
            for name in modules:
                layer, rel = locate(name)
                if layer is not None and rel == kv["module"] and layer in self.kv_points:
                    self.hook(modules[name], self._kv_hook(layer, int(kv.get("keys", 1)), int(kv.get("values", 2))))

    def _begin(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Root pre-hook: read the step, find the followed requests' rows, and what to keep of them."""
        step = read_step(args, kwargs, self.runner)
        self.host_copies += 1
        found, notes = self.tracker.assign(step)
        index = len(self.steps)
        pos, starts = step.positions, step.starts
        w0, w1 = self.window
        win, kvr, logit_rows, traced = [], [], {}, []
        for label, j in found.items():
            a, b = int(starts[j]), int(starts[j + 1])
            p0 = int(pos[a])
            logit_rows[label] = j
            if not self.tracker.followed[label].traced:
                continue
            self.traced_labels.add(label)
            hi = min(b, a + max(0, self.n - p0))  # rows at positions < N (decode rows beyond are not kept)
            if hi <= a:
                continue
            traced.append({"request": label, "positions": [p0, p0 + hi - a]})
            kvr.append((a, min(hi, a + max(0, self.kv_n - p0))))
            win.append((max(a, a + w0 - p0), min(hi, a + w1 - p0)))
        win = [(x, y) for x, y in win if y > x]
        kvr = [(x, y) for x, y in kvr if y > x]
        # tokens: the forward's rows (every GEMM's M); scheduled: the requests' tokens (fewer when vLLM pads the step)
        self.steps.append(SchedulerStep(index, int(len(step.ids)), int(step.n_requests),
                                        tuple(TracedPositions.from_dict(t) for t in traced),
                                        scheduled=int(step.starts[-1]) if len(step.starts) else None,
                                        boundaries=step.boundaries, order={k: int(v) for k, v in found.items()},
                                        notes=tuple(notes or ())).to_dict())
        if not found:
            self._cur = None
            return
        win_rows = np.concatenate([np.arange(x, y) for x, y in win]) if win else np.zeros(0, dtype=np.int64)
        kv_rows = np.concatenate([np.arange(x, y) for x, y in kvr]) if kvr else np.zeros(0, dtype=np.int64)
        self._cur = {"step": index, "win": self._selector(win), "win_pos": pos[win_rows], "kv": self._selector(kvr),
                     "kv_pos": pos[kv_rows], "logits": logit_rows, "starts": starts, "positions": pos}
        self._win_pos[index] = pos[win_rows]
        if len(win_rows):
            self.tokens[index] = {"input_ids": torch.from_numpy(step.ids[win_rows].copy()),
                                  "positions": torch.from_numpy(pos[win_rows].copy()), "file": f"vLLM forward pass {index}"}

    @staticmethod
    def _selector(spans: list[tuple[int, int]]) -> Any:
        """Rows to take: None (none), a ``slice`` (one contiguous span: a view, no index), or the
        row indices (numpy; moved to the device once per step, on first use)."""
        if not spans:
            return None
        if len(spans) == 1:
            return slice(*spans[0])
        return np.concatenate([np.arange(x, y) for x, y in spans])

    def _take(self, x: torch.Tensor, key: str) -> torch.Tensor:
        """The current step's rows ``key`` (``win``/``kv``) of ``x``: a view for a span, else a gather."""
        sel = self._cur[key]
        if isinstance(sel, slice):
            return x[sel]
        dev = self._cur.get(f"{key}_dev")
        if dev is None or dev.device != x.device:
            dev = self._cur[f"{key}_dev"] = torch.as_tensor(sel, device=x.device)
        return x.index_select(0, dev)

    def _note(self, name: str, args: tuple, out: Any) -> None:
        """Record the shapes a hooked module saw in this step and the traced positions kept."""
        cur = self._cur
        wp = cur["win_pos"]
        self.fired.add(name)
        self.shapes.setdefault(name, []).append({
            "step": cur["step"], "positions": [int(wp[0]), int(wp[-1]) + 1] if len(wp) else [],
            "in": _shapes(args), "out": _shapes(out[0] if isinstance(out, (tuple, list)) else out)})

    def _hook(self, name: str):
        actions = self._actions[name]

        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            cur = self._cur
            if cur is None or cur["win"] is None:
                return
            self._note(name, args, out)
            els = _elements(out)
            for act in actions:
                self._apply(name, act, els, cur["step"])

        return hook

    def _apply(self, name: str, act: _Action, els: dict[int | None, torch.Tensor], step: int) -> None:
        """One compiled rule on one module output: the mapped rows, kept per HF point (on the device)."""
        what = f"{name} (step {step})"
        if act.how == "sum":
            if set(els) == {None}:  # a layer returned as one tensor: already the residual stream
                parts = [els[None]]
            else:
                parts = [els.get(e) for e in act.elements]
                if any(p is None for p in parts):
                    return
            total = self._take(parts[0], "win").to(act.dtype)
            for p in parts[1:]:
                total = total + self._take(p, "win").to(act.dtype)  # HF: residual + hidden_states, model dtype
            if len(parts) == 1 and isinstance(self._cur["win"], slice) and total.dtype == parts[0].dtype:
                total = total.clone()  # a view of the module's output, which may change in place later
            self._keep(act.targets[0], total, step, name, act, 0)
            return
        t = _pick(els, act.elements[0], what)
        if t is None:
            return
        rows = self._take(t, "win")
        first = all(self._filled.get(x) != step for x in act.targets)  # else only compared with the first source
        if first and isinstance(self._cur["win"], slice):
            rows = rows.clone()  # the module's output may be changed in place later (a fused add + norm)
        if act.how == "take":
            self._keep(act.targets[0], rows, step, name, act, 0)
            return
        if sum(act.sizes) != rows.shape[-1]:
            raise TracerError(f"{what}: width {rows.shape[-1]} does not split into {list(act.sizes)} (the HF widths); "
                              "check the map's split or the model")
        for i, (target, part) in enumerate(zip(act.targets, torch.split(rows, list(act.sizes), dim=-1))):
            self._keep(target, part, step, name, act, i)

    def _keep(self, target: str, rows: torch.Tensor, step: int, module: str, act: _Action, part: int) -> None:
        """Keep ``rows`` as ``target``'s rows of ``step``; a second source in the same step is compared
        with the first on the device (the first is kept)."""
        if self._filled.get(target) == step:
            first = self.rows[target][-1][1]
            if first.shape != rows.shape or first.dtype != rows.dtype:
                self.notes.append(f"{target}: {module} gives {tuple(rows.shape)} {rows.dtype}, the first source "
                                  f"{tuple(first.shape)} {first.dtype}; the first is compared")
            else:
                iv = _INT[first.element_size()]
                self.checks.append((target, step, (first.view(iv) != rows.view(iv)).any()))
            return
        self._filled[target] = step
        self.rows.setdefault(target, []).append((step, rows))
        if act.shard:
            self.tp_shards[target] = act.shard
        if target not in self.sources:
            bits = act.describe.format(i=part + 1) if act.describe else ""
            self.sources[target] = (module, module + (f" ({bits})" if bits else ""))

    def _logits_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            cur = self._cur
            if cur is None or not cur["logits"] or not isinstance(out, torch.Tensor):
                return
            n_req = len(cur["starts"]) - 1
            if out.dim() != 2 or out.shape[0] != n_req:
                self.notes.append(f"{name} computed {out.shape[0]} rows in step {cur['step']} for its {n_req} requests "
                                  "(prompt logprobs or speculative decoding?); those logits are not captured")
                return
            self._note(name, args, out)
            target = next(t for a in self._actions[name] if a.how == "logits" for t in a.targets)
            self.sources.setdefault(target, (name, f"{name} (last position of each request)"))
            self.logits_name = target
            labels = list(cur["logits"])
            js = [cur["logits"][lb] for lb in labels]
            rows = out.index_select(0, torch.as_tensor(js, device=out.device)) if js != list(range(n_req)) else out.clone()
            last = np.array([int(cur["positions"][int(cur["starts"][j + 1]) - 1]) for j in js], dtype=np.int64)
            self.logits.append((cur["step"], {lb: i for i, lb in enumerate(labels)}, last, rows))

        return hook

    def _kv_hook(self, layer: int, k_at: int, v_at: int):
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            cur = self._cur
            if cur is None or cur["kv"] is None or len(args) <= max(k_at, v_at):
                return
            k, v = self._take(args[k_at], "kv"), self._take(args[v_at], "kv")
            r = k.shape[0]
            self.kv.setdefault(layer, []).append((cur["kv_pos"], torch.cat([k.reshape(r, -1), v.reshape(r, -1)], dim=1)))

        return hook

    # ---------------------------------------------------------------- results

    def logits_of(self, label: str) -> list[tuple[int, torch.Tensor]]:
        """Every logits row vLLM computed for a followed request: ``[(position of the token it
        follows, (vocab,) row on the device)]`` in step order."""
        out = []
        for _step, where, last, rows in self.logits:
            if label in where:
                i = where[label]
                out.append((int(last[i]), rows[i]))
        return out

    def state(self) -> dict[str, Any]:
        """What the hooks kept, as plain data: tensors and JSON-able step facts (to assemble
        :meth:`records` elsewhere with :meth:`load_state`)."""
        return {"steps": self.steps, "tokens": self.tokens, "rows": self.rows, "kv": self.kv, "logits": self.logits,
                "shapes": self.shapes, "sources": self.sources, "checks": self.checks, "notes": self.notes,
                "win_pos": self._win_pos, "fired": sorted(self.fired), "logits_name": self.logits_name,
                "traced_labels": sorted(self.traced_labels), "tp": self.tp, "tp_shards": self.tp_shards}

    def load_state(self, state: dict[str, Any]) -> None:
        """Take over what another capture's hooks kept (:meth:`state`)."""
        for key in ("steps", "tokens", "rows", "kv", "logits", "shapes", "sources", "checks", "notes", "logits_name"):
            setattr(self, key, state[key])
        self._win_pos, self.fired, self.traced_labels = state["win_pos"], set(state["fired"]), set(state["traced_labels"])
        self.tp, self.tp_shards = int(state.get("tp", 1)), dict(state.get("tp_shards", {}))

    def records(self, points: list[CapturePoint], engine: str) -> tuple[dict[str, CaptureRecord], dict[str, Any]]:
        """The run's captures under HF names, and what could not be captured:
        :func:`tracer.engines.vllm.assemble.records` of this capture (its returns and errors)."""
        from tracer.engines.vllm.assemble import records

        return records(self, points, engine)


def hooked_modules(model: nn.Module, emap: dict[str, Any], ref: RefLayout) -> list[str]:
    """The vLLM module paths whose outputs map (by ``emap``'s rules) onto a capture point of ``ref``,
    in ``named_modules()`` order (the logits module included)."""
    return VllmCapture(model, "", emap, ref, [], (0, 0), {}).hooked()


__all__ = ["VllmCapture", "read_step", "hooked_modules"]
