"""Capture hooks inside vLLM's model, expressed as HF capture points, kept on vLLM's device.

vLLM runs one forward pass per scheduler step over the tokens of every scheduled request,
flattened: each module sees ``[tokens, features]``. :class:`VllmCapture` owns ordinary forward
hooks on vLLM's ``nn.Module`` and reads nothing of the model runner (whose internals differ
between the V1 and V2 runners and between releases):

- a forward pre-hook on the root model reads the step from what the forward receives
  (:func:`tracer.engines.vllm.forward.read_step`: ``input_ids``, ``positions``, the forward
  context's ``query_start_loc`` and ``slot_mapping``; one host copy per step) and finds the rows of
  the requests it follows by their content and positions
  (:class:`tracer.engines.vllm.requests.Tracker`), whatever the order the runner put them in;
- a forward hook on every vLLM module that the engine map (``hooks/engine-llama.toml`` and
  ``hooks/engine-vllm.toml``; its rules compiled per module by
  :func:`tracer.engines.vllm.actions.compile_actions`) maps onto a capture point keeps those rows
  **on the device**, mapped as they are taken: a fused q/k/v or gate/up output split by the HF
  widths, a ``(hidden, residual)`` pair summed in the HF dtype, a Linear's ``(output, None)`` read
  as its output (one copy per point and step, no host synchronisation). A second module mapped
  onto a point already taken in the step (a fused add + RMSNorm's residual is the previous layer's
  output) is compared with it on the device; a difference is named in the notes, the first source
  is kept;
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
assembled in another. ``read_step`` stays importable from here.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch
from torch import nn

from tracer.errors import TracerError
from tracer.execute.handles import Hooks
from tracer.execute.points import CapturePoint
from tracer.engines.dumps.namemap import RefLayout, locate
from tracer.engines.vllm.actions import Action, compile_actions, elements, pick
from tracer.engines.vllm.forward import read_step, runner_name
from tracer.engines.vllm.requests import Tracker
from tracer.execute.records import CaptureRecord, SchedulerStep, TracedPositions

_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}


def _shapes(x: Any) -> list[list[int]]:
    if isinstance(x, torch.Tensor):
        return [list(x.shape)]
    if isinstance(x, (tuple, list)):
        return [s for item in x for s in _shapes(item)]
    return []



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
            all-reduce its output), for :func:`tracer.engines.vllm.ranks.gather_ranks` to join.

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
        self.model, self.runner, self.emap, self.ref = model, runner_name(runner), emap, ref
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
        self._actions: dict[str, list[Action]] = self._cache["actions"]

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

    def _compile(self, name: str) -> list[Action]:
        """The module's compiled rules (:func:`tracer.engines.vllm.actions.compile_actions`), once
        per model, reference layout and map."""
        if name not in self._actions:
            self._actions[name] = compile_actions(name, self.emap, self.ref, self.tp,
                                                  self._cache.get("modules", {}).get(name))
        return self._actions[name]

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
            els = elements(out)
            for act in actions:
                self._apply(name, act, els, cur["step"])

        return hook

    def _apply(self, name: str, act: Action, els: dict[int | None, torch.Tensor], step: int) -> None:
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
        t = pick(els, act.elements[0], what)
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

    def _keep(self, target: str, rows: torch.Tensor, step: int, module: str, act: Action, part: int) -> None:
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
