"""Capture hooks on the real, unmodified Hugging Face model.

:class:`Capture` is the context manager that owns the forward hooks on the capture points
(:mod:`tracer.execute.points`): it keeps only the compared window of each output, on the CPU, in
the model's dtype, and records the shapes every module saw. Every hook is removed on exit,
whatever happened inside. :func:`host_copies` moves captures kept on a GPU to the host without
blocking. The notebook form (every forward inside a ``with`` block) is
:class:`~tracer.execute.captured.Captured`.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch
from torch import nn

from tracer.errors import TracerError
from tracer.execute.graphs import graph_chunks, recording as _recording
from tracer.execute.handles import Hooks
from tracer.execute.kinds import PointKind
from tracer.execute.points import CapturePoint
from tracer.execute.records import CaptureRecord
from tracer.load.hf_cache import cached_state

#: kinds whose module output is a fresh tensor nothing modifies afterwards (the residual stream and
#: the logits: what HF's ``output_hidden_states`` keeps references to), captured by reference
REFERENCE_KINDS = frozenset({PointKind.EMBEDDING, PointKind.LAYER, PointKind.FINAL_NORM, PointKind.LOGITS})
#: most bytes of module outputs one run keeps alive by reference (beyond it, windows are copied)
REFERENCE_BYTES = 512 << 20


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for item in x:
            t = _first_tensor(item)
            if t is not None:
                return t
        return None
    if hasattr(x, "to_tuple"):
        return _first_tensor(x.to_tuple())
    return None


def _shapes(x: Any) -> list[list[int]]:
    if isinstance(x, torch.Tensor):
        return [list(x.shape)]
    if isinstance(x, (tuple, list)):
        return [s for item in x for s in _shapes(item)]
    return []


def _submodule(model: nn.Module, path: str) -> nn.Module:
    """``model.get_submodule(path)``, read from the registered children's dicts (a few dict lookups
    where ``get_submodule`` costs about 14 µs a path in ``Module.__getattr__``; 31 paths a run).

    Raises:
        AttributeError: no such submodule (as ``get_submodule``).
    """
    mod = model
    for atom in path.split(".") if path else ():
        child = mod._modules.get(atom)
        if child is None:
            return model.get_submodule(path)  # its own error (or a module it finds another way)
        mod = child
    return mod


class Capture(Hooks):
    """Context manager owning the forward hooks for one run.

    Usage (the runner does this)::

        with Capture(model, points, window=(P, N)) as cap:
            with cap.forward_call(0, P):
                model(ids[:, :P], ...)
            with cap.forward_call(P, N):
                model(ids[:, P:N], cache=cache, ...)
        records = cap.records()

    Each hook slices its tensor ``(B, T, *feature)`` to batch row ``row`` and the part of the
    call's positions inside ``window``, copies that slice to the CPU (same dtype; from a GPU a
    non-blocking copy into pinned memory, synchronised once in :meth:`records`) or keeps it on
    the device (``keep_on_device=True``, for online comparison), and records the input/output
    shapes the module saw. Memory is therefore proportional to the
    compared window, not to the prompt (except for points with ``full=True``).

    **By reference** (``reference``; default: on a CUDA device with ``keep_on_device``): the
    window of a module output of a :data:`REFERENCE_KINDS` point is kept as a view of the output
    itself, no copy kernel (a forward is launch-bound below N ≈ 8k on a large GPU: every launch
    counts). Those outputs are fresh tensors that nothing modifies afterwards, as HF's own
    ``output_hidden_states`` relies on; every other point (sublayer outputs and inputs, which
    in-place ops may overwrite, and KV-cache views) is copied. A view keeps the whole output
    alive, so at most :data:`REFERENCE_BYTES` of outputs per run are held this way; beyond that,
    windows are copied.

    ``wrap_forward``: the points' hooks run from wrappers of their modules' ``forward`` instead of
    forward hooks (:class:`~tracer.execute.handles.WrappedForward`: PyTorch's fast call path, the
    same tensors), for a model no ``torch.compile`` traces; the runner's eager plans use it.

    Raises:
        TracerError: a module output whose sequence dimension does not match the call.
    """

    def __init__(self, model: nn.Module, points: list[CapturePoint], window: tuple[int, int] | None,
                 *, keep_on_device: bool = False, reference: bool | None = None, wrap_forward: bool = False) -> None:
        self.model = model
        self.keep_on_device = keep_on_device
        #: the points' hooks as wrappers of their modules' forward (:class:`~tracer.execute.handles.WrappedForward`)
        self.wrap_forward = wrap_forward
        #: None: decided per tensor (CUDA and keep_on_device)
        self.reference = reference
        self._held: dict[int, int] = {}  # data_ptr of an output's storage kept alive by reference -> bytes
        self._held_bytes = 0  # their sum
        self.points = list(points)
        #: window None: every forward of the model inside the block is a call of its own (positions
        #: continue from the KV cache it is given, else from 0) and every position is kept
        self.auto = window is None
        self.window = (0, 1 << 62) if window is None else (int(window[0]), int(window[1]))
        # auto: row 0's input ids of every call, in call order (a call recorded in a CUDA graph: a
        # device tensor, read when asked for, so it holds the latest replay's)
        self._ids: list[list[int] | torch.Tensor] = []
        super().__init__()
        self._call: tuple[int, int, int, int] | None = None  # (start, stop, row, col_offset)
        self._chunks: dict[str, list[torch.Tensor]] = {p.name: [] for p in self.points}
        self._calls: dict[str, list[dict[str, Any]]] = {p.name: [] for p in self.points}
        # per chunk and per call: made inside a CUDA-graph recording (a buffer replays refresh)
        self._recorded: dict[str, list[bool]] = {p.name: [] for p in self.points}
        self._calls_recorded: dict[str, list[bool]] = {p.name: [] for p in self.points}
        self._graph_tokens = 0  # auto mode: positions of the calls recorded in CUDA graphs
        self._fired: dict[str, int] = {}  # capture name -> index of its first firing
        self._pending_sync: set[torch.device] = set()  # devices with non-blocking copies in flight
        self._seq_axis: dict[str, int] = {}  # 4-D outputs: 2 where heads come first (B, H, S, D)
        self._n_tokens = 0  # the end of the last declared call: N after a run

    @property
    def token_ids(self) -> list[int]:
        """Auto mode: row 0's input ids of every call, in call order; when calls were recorded in CUDA
        graphs, those calls' (device tensors that hold the latest replay's ids)."""
        parts = [x for x in self._ids if isinstance(x, torch.Tensor)] or self._ids
        return [int(i) for part in parts for i in (part.tolist() if isinstance(part, torch.Tensor) else part)]

    def install(self) -> None:
        """Hook every capture point's module (and, auto mode, the model's call)."""
        by_module: dict[str, list[CapturePoint]] = {}
        for p in self.points:
            if p.which == "cache":
                continue  # filled from the KV cache by add_cache(), no hook
            by_module.setdefault(p.module, []).append(p)
        modules = {}
        for path in by_module:  # the registered children's dicts, not a walk of the whole module tree
            try:
                modules[path] = _submodule(self.model, path)
            except AttributeError:
                raise TracerError(f"capture point {by_module[path][0].name}: module '{path}' not found in the model") from None
        if self.auto:
            self.hook(self.model, self._auto_begin, pre=True, with_kwargs=True)
        for path, pts in by_module.items():
            self.hook(modules[path], self._make_hook(pts), with_kwargs=True, wrap=self.wrap_forward)
        if self.auto:  # registered last: runs after every module hook of the call
            self.hook(self.model, self._auto_end, with_kwargs=True)

    @contextlib.contextmanager
    def forward_call(self, start: int, stop: int, row: int = 0, col_offset: int = 0) -> Iterator[None]:
        """Declare that the next forward computes absolute positions ``[start, stop)``.

        ``row`` is the batch row holding the traced prompt, ``col_offset`` the column of the
        input where position ``start`` sits (non-zero with left padding).
        """
        self._call = (int(start), int(stop), int(row), int(col_offset))
        self._n_tokens = max(self._n_tokens, int(stop))
        try:
            yield
        finally:
            self._call = None

    def _auto_begin(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Auto mode: declare the call from the model's own inputs (row 0)."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        seq = ids if isinstance(ids, torch.Tensor) else embeds
        if not isinstance(seq, torch.Tensor) or seq.dim() < 2:
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers >= 5.24 / before
        n = int(seq.shape[1])
        if _recording(seq):  # recording a CUDA graph: nothing read back to the host; positions continue
            # from the calls recorded before (not the eager warm-ups); the ids kept on the device (every replay's)
            start = self._graph_tokens
            self._graph_tokens += n
            if isinstance(ids, torch.Tensor):
                self._ids.append(ids[0].clone())
        else:
            try:
                start = int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else 0
            except ValueError:  # a cache of recurrent states only (Mamba): positions continue in call order
                start = self._n_tokens
            if isinstance(ids, torch.Tensor):
                self._ids.append([int(i) for i in ids[0].tolist()])
        self._call = (start, start + n, 0, 0)
        self._n_tokens = max(self._n_tokens, start + n)

    def _auto_end(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self._call = None

    def _make_hook(self, pts: list[CapturePoint]):
        # per point, decided once: its name's lists, whether it reads the module's input, and
        # whether its window may be kept by reference (see _by_reference)
        plan = [(p, p.which == "input", self._calls[p.name], self._chunks[p.name],
                 p.kind in REFERENCE_KINDS and p.which != "input" and not p.full,
                 self._calls_recorded[p.name], self._recorded[p.name]) for p in pts]
        fired = self._fired

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._call is None:
                return  # a forward outside a declared call (e.g. a warm-up): ignore
            start, stop, row, col = self._call
            # the common call, one tensor in and out, without the recursive walks (93 hooks a run)
            one = args[0] if len(args) == 1 else None
            ins = ([list(one.shape)] if type(one) is torch.Tensor else
                   _shapes(args) or _shapes(kwargs.get("hidden_states")) or _shapes(kwargs.get("input")))
            out = output if type(output) is torch.Tensor else _first_tensor(output)
            call = {"positions": [start, stop], "in": ins, "out": [] if out is None else [list(out.shape)]}
            for p, reads_input, calls, chunks, referable, calls_recorded, recorded in plan:
                if reads_input:
                    t = _first_tensor(args) if args else _first_tensor(kwargs.get("hidden_states"))
                else:
                    t = out
                if t is None:
                    continue
                calls.append(call)
                recording = _recording(t)  # inside a CUDA graph's recording: kept apart (graph_chunks)
                calls_recorded.append(recording)
                if p.name not in fired:
                    fired[p.name] = len(fired)
                kept = self._slice(p, t, start, stop, row, col, referable, recording)
                if kept is not None:
                    chunks.append(kept)
                    recorded.append(recording)

        return hook

    def _axis(self, name: str, t: torch.Tensor, need: int) -> int:
        """The sequence axis (1 or 2) of a 4-D output ``t``: the one long enough for the call
        (``need`` positions) when only one is, else what this point showed before, else the one
        with the larger stride (in both layouts HF produces, ``(B, S, H, D)`` and ``(B, H, S, D)``
        from a transpose, the sequence lies outside the heads in memory); remembered per point."""
        fits = [axis for axis in (1, 2) if t.shape[axis] >= need]
        if len(fits) == 1:
            axis = fits[0]
        elif name in self._seq_axis:
            return self._seq_axis[name]
        else:
            axis = 2 if t.shape[1] > 1 and t.shape[2] > 1 and t.stride(2) > t.stride(1) else 1
        self._seq_axis.setdefault(name, axis)
        return axis

    def _slice(self, p: CapturePoint, t: torch.Tensor, start: int, stop: int, row: int, col: int,
               referable: bool, recording: bool):
        """The window of batch row ``row`` of ``t`` (``(B, T, *feature)``, the call's positions
        ``[start, stop)`` from column ``col``) as this capture keeps it (a view, a device copy or
        a host copy), or None when the call computes none of the window; ``referable``: the point's
        kind may be kept by reference (:meth:`_by_reference`); ``recording``: whether ``t`` is made
        inside a CUDA-graph recording (the hook asks once per call)."""
        dims = t.dim()
        if dims < 2:
            raise TracerError(f"capture point {p.name}: output has shape {list(t.shape)}, expected (batch, seq, ...)")
        n = stop - start
        if dims == 4 and self._axis(p.name, t, col + n) == 2:
            t = t.transpose(1, 2)  # (B, H, S, D), e.g. Gemma 3's q/k norms after the head transpose → (B, S, H, D)
        if t.shape[1] < col + n:
            raise TracerError(
                f"capture point {p.name}: output has {t.shape[1]} positions but the call computed {n}; "
                "is logits_to_keep or a similar option trimming the output?"
            )
        if not 0 <= row < t.shape[0]:
            raise TracerError(f"capture point {p.name}: output has batch {t.shape[0]}, the traced prompt is row {row}")
        lo, hi = start, stop
        if not p.full:  # the window's part of the call (comparisons, not max/min: a call each)
            w0, w1 = self.window
            lo, hi = (w0 if w0 > start else start), (w1 if w1 < stop else stop)
        if lo >= hi:
            return None
        # (T, *feature): the window of batch row `row`, one view op (select + narrow in one)
        stride = t.stride()
        piece = t.as_strided((hi - lo, *t.shape[2:]), stride[1:],
                             t.storage_offset() + row * stride[0] + (col + lo - start) * stride[1])
        if piece.requires_grad:
            piece = piece.detach()
        if self.keep_on_device and referable and self._by_reference(t, recording):
            return piece
        if self.keep_on_device or piece.device.type == "cpu":
            return piece.clone()
        # GPU: copy into pinned host memory without blocking the host, so the GPU never waits
        # for the hook; the copy is ordered on the current stream after the kernel that made
        # `piece`, and records() synchronises once at the end of the run.
        host = torch.empty(piece.shape, dtype=piece.dtype, pin_memory=True)
        host.copy_(piece, non_blocking=True)
        self._pending_sync.add(piece.device)
        return host

    def _by_reference(self, t: torch.Tensor, recording: bool) -> bool:
        """Whether the window of ``t``, the output of a point whose kind may be kept by reference,
        is kept as a view (see the class docstring); ``recording`` as :meth:`_slice`'s."""
        if not (self.reference if self.reference is not None else t.device.type == "cuda"):
            return False
        if recording:
            return False  # recording a CUDA graph: the copy into a buffer of our own becomes a node of the graph
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._held:
            return True
        size = storage.nbytes()
        if self._held_bytes + size > REFERENCE_BYTES:
            return False
        self._held[key] = size
        self._held_bytes += size
        return True

    def add_cache(self, cache: Any, row: int = 0, col: int = 0) -> None:
        """Record the cache points (``kv_cache``, ``state``) from the run's final cache.

        Args:
            cache: an HF cache (``DynamicCache``: ``cache.layers[i].keys``/``.values``, or the
                older ``key_cache``/``value_cache`` lists), each ``(B, kv_heads, S, head_dim)``;
                a hybrid model's linear-attention layers hold ``conv_states``/``recurrent_states``
                instead (:func:`tracer.load.hf_cache.cached_state`).
            row: the batch row of the traced prompt.
            col: the cache column of its first token (non-zero with left padding); columns
                outside ``[col, col + N)`` (padding) are dropped.

        Each ``kv_cache`` point gets ``(S, kv_heads * head_dim_k + kv_heads * head_dim_v)``: keys
        then values of the last ``S`` positions (all N, unless a sliding-window layer dropped older
        ones); each ``state`` point ``(1, F)``, the state after position N-1
        (:func:`tracer.load.hf_cache.cached_state`).

        Raises:
            TracerError: the cache has no layer (or no state) for a point's ``layer_index``.
        """
        n = self._n_tokens
        for p in self.points:
            if p.which != "cache":
                continue
            if p.kind == PointKind.STATE:
                flat, shapes = cached_state(cache, p.layer_index, row, p.name)
                self._chunks[p.name] = [flat if self.keep_on_device else flat.to("cpu")]
                self._calls[p.name] = [{"positions": [n - 1, n], "in": [], "out": shapes}]
                continue
            try:
                if hasattr(cache, "layers"):
                    k, v = cache.layers[p.layer_index].keys, cache.layers[p.layer_index].values
                else:
                    k, v = cache.key_cache[p.layer_index], cache.value_cache[p.layer_index]
            except (IndexError, AttributeError, TypeError):
                raise TracerError(f"capture point {p.name}: the KV cache has no layer {p.layer_index}; "
                                  "is this a decoder with a standard HF cache?") from None
            if k is None or v is None or k.dim() != 4:
                continue
            if col or k.shape[2] > n:  # a padded batch: keep the traced prompt's own columns
                k, v = k[:, :, col:col + n], v[:, :, col:col + n]
            s = k.shape[2]
            kk = k[row].transpose(0, 1).reshape(s, -1)  # (S, kv_heads * head_dim)
            vv = v[row].transpose(0, 1).reshape(s, -1)
            kv = torch.cat([kk, vv], dim=1).detach()  # a new tensor, on the cache's device
            self._chunks[p.name] = [kv if self.keep_on_device else kv.to("cpu")]
            self._calls[p.name] = [{"positions": [n - s, n], "in": [], "out": [list(k.shape), list(v.shape)]}]

    def records(self, graphs: bool = False) -> dict[str, CaptureRecord]:
        """Capture name → :class:`CaptureRecord`, in execution order.

        Execution order is the order in which the hooks first fired; a ``kv_cache`` point sits
        right before the next point in discovery order that fired (its attention core, or its
        layer); points that never fired come last, in discovery order. Tensors are the kept
        slices concatenated along positions: ``(T, *feature)``. ``graphs``: CUDA graphs recorded in
        the block replay later: a point recorded there is that buffer itself (:func:`graph_chunks`;
        TracerError when recorded twice).
        """
        for device in self._pending_sync:
            torch.cuda.synchronize(device)
        self._pending_sync.clear()
        out: dict[str, CaptureRecord] = {}
        never = len(self.points)
        keys: dict[int, tuple[float, int]] = {}
        for i, p in enumerate(self.points):
            if p.name in self._fired:
                keys[i] = (self._fired[p.name], i)
        for i, p in enumerate(self.points):
            if i in keys:
                continue
            nxt = next((keys[j][0] for j in range(i + 1, len(self.points)) if j in keys), None)
            keys[i] = (nxt - 0.5, i) if p.which == "cache" and nxt is not None else (never, i)
        order = sorted(range(len(self.points)), key=lambda i: keys[i])
        for p in (self.points[i] for i in order):
            chunks, calls = self._chunks[p.name], self._calls[p.name]
            if graphs:
                chunks, calls = graph_chunks(p.name, chunks, self._recorded[p.name], calls, self._calls_recorded[p.name])
            if chunks:
                tensor = torch.cat(chunks, dim=0) if len(chunks) > 1 else chunks[0]
            else:
                tensor = torch.empty(0)
            out[p.name] = CaptureRecord(name=p.name, kind=p.kind, tensor=tensor, calls=calls, op=p.op, role=p.role)
        return out


def host_copies(captures: dict[str, CaptureRecord]) -> tuple[dict[str, CaptureRecord], Callable[[], None]]:
    """Copies of ``captures`` in pinned host memory, made without blocking the host or the GPU.

    Used when a run's captures stay on the GPU for the comparison while the trace writer needs
    them on the host: for each CUDA device a side stream waits for the work queued so far, then
    copies every tensor into a pinned buffer with non-blocking copies, so the copies overlap
    whatever the GPU runs next (the next run plan). CPU tensors are passed through.

    Args:
        captures: capture name → record; tensors ``(T, *feature)`` on any devices.

    Returns:
        ``(records, wait)``: records with host tensors (same names, kinds, calls), and a function
        that blocks until every copy has landed; call it before reading the host tensors.
    """
    streams: dict[torch.device, Any] = {}
    out: dict[str, CaptureRecord] = {}
    # one pinned buffer per device and dtype, the points end to end in order: the trace's layout
    # (tracer.store.packed), so the writer stores each dtype with one write
    totals: dict[tuple[torch.device, torch.dtype], int] = {}
    for rec in captures.values():
        t = rec.tensor
        if t.device.type == "cuda":
            totals[(t.device, t.dtype)] = totals.get((t.device, t.dtype), 0) + t.numel()
    buffers = {key: torch.empty(n, dtype=key[1], pin_memory=True) for key, n in totals.items()}
    filled = dict.fromkeys(totals, 0)
    for name, rec in captures.items():
        t = rec.tensor
        if t.device.type != "cuda":
            out[name] = rec
            continue
        if t.device not in streams:
            streams[t.device] = torch.cuda.Stream(t.device)
            streams[t.device].wait_stream(torch.cuda.current_stream(t.device))
        key = (t.device, t.dtype)
        host = buffers[key][filled[key]:filled[key] + t.numel()].view(t.shape)
        filled[key] += t.numel()
        with torch.cuda.stream(streams[t.device]):
            host.copy_(t, non_blocking=True)
        t.record_stream(streams[t.device])  # the caching allocator must not reuse t before the copy
        out[name] = replace(rec, tensor=host)
    events = []
    for stream in streams.values():
        event = torch.cuda.Event()
        event.record(stream)
        events.append(event)

    def wait() -> None:
        for event in events:
            event.synchronize()

    return out, wait
