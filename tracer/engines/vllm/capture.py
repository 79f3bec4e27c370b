"""Capture hooks inside vLLM's model, expressed as HF capture points.

vLLM (V1, engine core in this process) runs one forward pass per scheduler step over the tokens of
every scheduled request, flattened: each module sees ``[tokens, features]``, requests one after
the other (``query_start_loc`` of the step's attention metadata, in the model runner's
``input_batch.req_ids`` order). :class:`VllmCapture` owns ordinary forward hooks on vLLM's
``nn.Module``:

- a forward pre-hook on the root model reads each step's ``input_ids`` and ``positions`` and the
  request boundaries, and picks the rows of the traced prompt's requests (:attr:`VllmCapture.ours`:
  the prompt itself and, for a prefix-cache hit, the requests that put its prefix in the cache);
- a forward hook on every vLLM module that the engine map (``hooks/engine-llama.toml`` and
  ``hooks/engine-vllm.toml``) maps onto a capture point of the reference layout keeps those rows
  of its output, exactly as vLLM returned them (tuples too: a Linear's ``(output, None)``, a fused
  add + RMSNorm's ``(normed, residual)``, a decoder layer's ``(hidden, residual)``);
- the attention layer's inputs ``(query, key, value)`` give the ``kv_cache`` points: the post-RoPE
  keys and the values vLLM writes into its paged KV cache (``kv_cache_dtype`` ``auto``: stored
  without conversion; ``tests/engines/test_vllm_engine.py`` reads them back from the paged cache), for
  every prompt position the run's requests computed.

:meth:`VllmCapture.records` builds a :class:`~tracer.execute.records.RawDump` of the kept rows,
one step per forward pass, as :func:`tracer.engines.dumps.read.read_passes` would read a per-pass
dump of the same hooks, and maps it with :func:`tracer.engines.dumps.namemap.map_dump` (fused q/k/v and
gate/up split by the HF widths, ``(hidden, residual)`` summed in the HF dtype, tokens placed at the
positions vLLM passed to forward). Nothing is dropped silently: a capture point with no vLLM
counterpart, or without every compared position, is listed with the reason.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tracer.errors import TracerError
from tracer.execute.handles import Hooks
from tracer.execute.kinds import PointKind
from tracer.execute.points import CapturePoint
from tracer.engines.dumps.namemap import MappedDump, RefLayout, hf_name, locate, map_dump, pass_entries
from tracer.execute.records import CaptureRecord, DumpEntry, RawDump, SchedulerStep, TracedPositions


def _shapes(x: Any) -> list[list[int]]:
    if isinstance(x, torch.Tensor):
        return [list(x.shape)]
    if isinstance(x, (tuple, list)):
        return [s for item in x for s in _shapes(item)]
    return []


def _take(x: Any, rows: torch.Tensor) -> Any:
    """Rows ``rows`` of every tensor in ``x`` (a tensor or a tuple of tensors/None), as copies."""
    if isinstance(x, torch.Tensor):
        return x.index_select(0, rows.to(x.device)).detach().to("cpu")
    if isinstance(x, (tuple, list)):
        return [_take(v, rows) if isinstance(v, torch.Tensor) else None for v in x]
    return None


def hooked_modules(model: nn.Module, emap: dict[str, Any], ref: RefLayout) -> list[str]:
    """The vLLM module paths whose outputs map (by ``emap``'s rules) onto a capture point of ``ref``,
    in ``named_modules()`` order. A module shared by several layers (vLLM's ``rotary_emb``) and
    modules without a rule are not hooked."""
    out = []
    for name, _m in model.named_modules():
        if not name:
            continue
        layer, rel = locate(name)
        rules = (emap["layer"] if layer is not None else emap["model"]).get(rel)
        if rules is None:
            continue
        targets = []
        for rule in rules:
            hf = rule["hf"] if isinstance(rule["hf"], list) else [rule["hf"]]
            targets += [hf_name(t, layer, ref) for t in hf]
        if any(t is not None and t in ref.names for t in targets):
            out.append(name)
    return out


class VllmCapture(Hooks):
    """Context manager owning the hooks on vLLM's model for one run of one prompt.

    Args:
        model: vLLM's ``nn.Module`` (``LlamaForCausalLM`` of ``vllm.model_executor.models``).
        runner: vLLM's model runner (its ``input_batch.req_ids`` orders the step's requests).
        emap: the merged engine map (:func:`tracer.engines.dumps.rules.load_engine_map` with
            ``engine="vllm"``), whose ``capture`` table names the KV and logits modules.
        ref: the HF reference layout (capture names → kind, op, feature shape, dtype).
        token_ids: the traced prompt, N ints.
        window: the compared positions ``(start, stop)``; activation rows outside it are not kept.
        kv_points: decoder layer index → the HF name of its ``kv_cache`` point (empty: none).
        kv_positions: the positions 0..kv_positions-1 a ``kv_cache`` point holds (default N; a
            rollout's last sampled token is never computed, so its cache holds N - 1).

    Set :attr:`ours` (vLLM's internal request ids of the traced prompt's requests) as requests are
    added; rows of other requests (a batch's other rows) are never kept.

    Raises:
        TracerError: a step whose attention metadata has no request boundaries.
    """

    def __init__(self, model: nn.Module, runner: Any, emap: dict[str, Any], ref: RefLayout,
                 token_ids: list[int], window: tuple[int, int], kv_points: dict[int, str],
                 kv_positions: int | None = None) -> None:
        self.model, self.runner, self.emap, self.ref = model, runner, emap, ref
        self.token_ids = list(token_ids)
        self.n = len(token_ids)
        self.kv_n = self.n if kv_positions is None else int(kv_positions)  # positions 0..kv_n-1 the KV points hold
        self.window = (int(window[0]), int(window[1]))
        self.kv_points = dict(kv_points)
        self.ours: set[str] = set()
        self.follow_first = False  # True: the first request seen becomes the traced one (tracer.capture(llm))
        self.steps: list[dict[str, Any]] = []  # what each forward pass computed (JSON-able)
        self.entries: list[DumpEntry] = []
        self.tokens: dict[int, dict[str, Any]] = {}
        self.kv: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.shapes: dict[str, list[dict[str, Any]]] = {}  # module → {"step", "positions", "in", "out"}
        self.fired: set[str] = set()
        super().__init__()
        self._cur: dict[str, Any] | None = None

    # ---------------------------------------------------------------- hooks

    def install(self) -> None:
        """Hook the model's call (the step's tokens), every mapped module, the logits and the KV writes."""
        cap = self.emap.get("capture", {})
        kv = cap.get("kv", {})
        logits_module = cap.get("logits", "logits_processor")
        modules = dict(self.model.named_modules())
        self.hook(self.model, self._begin, pre=True, with_kwargs=True)
        for name in hooked_modules(self.model, self.emap, self.ref):
            self.hook(modules[name], self._logits_hook(name) if name == logits_module else self._hook(name))
        if self.kv_points and kv:
            for name in modules:
                layer, rel = locate(name)
                if layer is not None and rel == kv["module"] and layer in self.kv_points:
                    self.hook(modules[name], self._kv_hook(layer, int(kv.get("keys", 1)), int(kv.get("values", 2))))

    def _begin(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Root pre-hook: the step's tokens, positions and request boundaries; the rows to keep."""
        from vllm.forward_context import get_forward_context

        ids = kwargs.get("input_ids", args[0] if args else None)
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        if not isinstance(ids, torch.Tensor) or not isinstance(pos, torch.Tensor):
            self._cur = None
            return
        md = get_forward_context().attn_metadata
        md = next(iter(md.values())) if isinstance(md, dict) and md else md
        qsl = getattr(md, "query_start_loc", None)
        if qsl is None:
            raise TracerError("vLLM's attention metadata has no query_start_loc; this vLLM version's batches "
                              "cannot be split into requests (tracer was written against vllm 0.32)")
        qsl = [int(x) for x in qsl.tolist()]
        req_ids = list(self.runner.input_batch.req_ids)[:len(qsl) - 1]
        if self.follow_first and not self.ours and req_ids:
            self.ours.add(req_ids[0])
        pos_cpu, ids_cpu = pos.to("cpu").long(), ids.to("cpu").long()
        step = len(self.steps)
        kv_rows, win_rows, logit_rows, traced = [], [], [], []
        for j, rid in enumerate(req_ids):
            a, b = qsl[j], qsl[j + 1]
            if rid not in self.ours or b <= a:
                continue
            p = pos_cpu[a:b]
            prompt = (p < self.n).nonzero().flatten() + a
            if not len(prompt):
                continue  # a decode step of the traced prompt: beyond the compared positions
            first, last = int(pos_cpu[prompt[0]]), int(pos_cpu[prompt[-1]])
            traced.append({"request": rid, "positions": [first, last + 1]})
            kv_rows.append(prompt)
            w = prompt[(pos_cpu[prompt] >= self.window[0]) & (pos_cpu[prompt] < self.window[1])]
            win_rows.append(w)
            if int(pos_cpu[b - 1]) < self.n and self.window[0] <= int(pos_cpu[b - 1]) < self.window[1]:
                logit_rows.append(j)  # vLLM computes logits at each request's last scheduled token
        # tokens: the forward's rows (every GEMM's M); scheduled: the requests' tokens (fewer when vLLM pads the step)
        self.steps.append(SchedulerStep(step, len(ids_cpu), len(req_ids),
                                        tuple(TracedPositions.from_dict(t) for t in traced),
                                        scheduled=int(qsl[-1])).to_dict())
        cat = (lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long))
        kv_rows, win_rows = cat(kv_rows), cat(win_rows)
        self._cur = {"step": step, "kv": kv_rows, "win": win_rows, "logits": torch.tensor(logit_rows, dtype=torch.long),
                     "kv_pos": pos_cpu[kv_rows], "win_pos": pos_cpu[win_rows]}
        if len(win_rows):
            self.tokens[step] = {"input_ids": ids_cpu[win_rows], "positions": pos_cpu[win_rows],
                                 "file": f"vLLM forward pass {step}"}

    def _note(self, name: str, args: tuple, out: Any, positions: torch.Tensor) -> None:
        """Record the shapes a hooked module saw in this step and the traced positions kept."""
        cur = self._cur
        self.fired.add(name)
        self.shapes.setdefault(name, []).append({
            "step": cur["step"], "positions": [int(positions.min()), int(positions.max()) + 1] if len(positions) else [],
            "in": _shapes(args), "out": _shapes(out[0] if isinstance(out, (tuple, list)) else out)})

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            cur = self._cur
            if cur is None or not len(cur["win"]):
                return
            self._note(name, args, out, cur["win_pos"])
            self.entries += pass_entries(name, _take(out, cur["win"]), cur["step"], file=f"vLLM forward pass {cur['step']}")

        return hook

    def _logits_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            cur = self._cur
            if cur is None or not len(cur["logits"]) or not isinstance(out, torch.Tensor):
                return
            self._note(name, args, out, cur["win_pos"])
            self.entries += pass_entries(name, _take(out, cur["logits"]), cur["step"],
                                         file=f"vLLM forward pass {cur['step']}")

        return hook

    def _kv_hook(self, layer: int, k_at: int, v_at: int):
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            cur = self._cur
            if cur is None or not len(cur["kv"]) or len(args) <= max(k_at, v_at):
                return
            k, v = _take(args[k_at], cur["kv"]), _take(args[v_at], cur["kv"])
            self.kv.setdefault(layer, []).append((cur["kv_pos"], k.reshape(len(k), -1), v.reshape(len(v), -1)))

        return hook

    # ---------------------------------------------------------------- results

    def raw(self, engine: str) -> RawDump:
        """The kept rows as a per-pass :class:`RawDump` (one step per forward pass that computed a
        compared position of the traced prompt)."""
        return RawDump(path="vLLM (in-process hooks)", layout="vllm", engine=engine, entries=list(self.entries),
                       tokens=dict(self.tokens))

    def records(self, points: list[CapturePoint], engine: str) -> tuple[dict[str, CaptureRecord], dict[str, Any]]:
        """The run's captures under HF names, and what could not be captured.

        Returns:
            ``(captures, info)``: captures in the reference's execution order, each ``(T, *feature)``
            over the whole window (``kv_cache``: ``(N, keys + values)``), in vLLM's dtype;
            ``info`` = ``{"mapping": {hf: "vLLM source (what was split/summed)"}, "not_captured":
            {hf: reason}, "partial_logits": {hf: (positions, (k, vocab) tensor)}, "notes": [...]}``.

        Raises:
            TracerError: the hooks saw no compared position of the traced prompt (capture
                impossible: a compiled or graph-captured model, or a window vLLM served from its
                prefix cache), or a window position that no forward pass computed.
        """
        w0, w1 = self.window
        if not self.tokens:
            raise TracerError(f"the hooks inside vLLM saw no position {w0}..{w1 - 1} of the traced prompt "
                              f"({len(self.steps)} forward passes); torch.compile or CUDA graphs hide modules "
                              "from hooks, and a prefix-cache hit skips cached positions: run vLLM eager and check the plan")
        mapped = map_dump(self.raw(engine), self.ref, self.emap)
        lo, hi = mapped.positions
        if (lo, hi) != (w0, w1):
            computed = sorted({p for s in self.steps for t in s["traced"] for p in range(*t["positions"])})
            raise TracerError(f"vLLM computed positions {lo}..{hi - 1} of the compared {w0}..{w1 - 1} (the traced "
                              f"requests computed {len(computed)} prompt positions); it served the rest from its "
                              "prefix cache: reset it, or plan the cached prefix to end at the window")
        return self._assemble(points, mapped)

    def _assemble(self, points: list[CapturePoint], mapped: MappedDump) -> tuple[dict[str, CaptureRecord], dict[str, Any]]:
        by_name = {p.name: p for p in points}
        captures: dict[str, CaptureRecord] = {}
        not_captured: dict[str, str] = {}
        for name, (kind, op, _feat, _dtype) in self.ref.names.items():
            point = by_name.get(name)
            op = point.op if point is not None else op
            if kind == PointKind.KV_CACHE:
                rec, why = self._kv_record(point)
                if rec is None:
                    not_captured[name] = why
                else:
                    captures[name] = rec
                continue
            if name in mapped.tensors:
                captures[name] = CaptureRecord(name=name, kind=kind, tensor=mapped.tensors[name].contiguous(),
                                               calls=self._calls(mapped.mapping.get(name, "")), op=op,
                                               role=point.role if point is not None else "")
            elif name in mapped.partial_logits:
                ps = mapped.partial_logits[name][0]
                not_captured[name] = (f"vLLM computes logits only where it samples (each request's last scheduled "
                                      f"token): position(s) {', '.join(map(str, ps))} of the compared "
                                      f"{self.window[0]}..{self.window[1] - 1}; compared there on their own")
            else:
                not_captured[name] = "no vLLM module computes it (engine map: no rule maps a vLLM tensor here)"
        info = {"mapping": dict(mapped.mapping), "not_captured": not_captured, "notes": list(mapped.notes),
                "partial_logits": {n: (list(ps), t) for n, (ps, t, _src) in mapped.partial_logits.items()}}
        for n, (_ps, _t, src) in mapped.partial_logits.items():
            info["mapping"][n] = src
        return captures, info

    def _calls(self, mapping_line: str) -> list[dict[str, Any]]:
        """The forward calls of the vLLM module a mapped point came from (the first source named in
        its mapping line): positions of the traced prompt it computed, and the flattened shapes the
        module saw (all requests of the step: GEMM M = the step's tokens)."""
        source = mapping_line.split(" (")[0].split(" + ")[0].split("#")[0]
        return [{"positions": c["positions"], "in": c["in"], "out": c["out"]}  # shapes as HF capture records them
                for c in self.shapes.get(source, []) if c["positions"]]

    def _kv_record(self, point: CapturePoint | None) -> tuple[CaptureRecord | None, str]:
        """The ``kv_cache`` point of one layer: keys then values of positions 0..N-1, as vLLM wrote
        them into its paged cache (the attention layer's inputs), or None and the reason."""
        if point is None:
            return None, "not a capture point of this run"
        parts = self.kv.get(point.layer_index)
        if not parts:
            return None, "the attention layer's key/value inputs were not seen (no hook fired)"
        rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for pos, k, v in parts:
            for i, p in enumerate(pos.tolist()):
                rows.setdefault(int(p), (k[i], v[i]))  # the first computation of a position is the cached one
        missing = [p for p in range(self.kv_n) if p not in rows]
        if missing:
            return None, (f"positions {missing[0]}..{missing[-1]} came from vLLM's prefix cache, filled before this "
                          "run (reset the prefix cache first)")
        kv = torch.stack([torch.cat(rows[p]) for p in range(self.kv_n)])  # (N, kv_heads*head_dim*2): keys, values
        call = {"positions": [0, self.kv_n], "in": [], "out": [list(kv.shape)]}
        return CaptureRecord(name=point.name, kind=PointKind.KV_CACHE, tensor=kv, calls=[call], op=point.op, role=point.role), ""
