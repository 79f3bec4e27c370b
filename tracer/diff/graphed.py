"""The comparison's fixed-shape device passes replayed from CUDA graphs.

On a GPU the online comparison of a run's window is launch-bound: its passes are about 230 small
kernels (the dense chunk of :class:`~tracer.diff.batch.DiffBatch`, the logits rows of
:class:`~tracer.diff.logits.LogitsAccumulator`, the per-position maxima of
:class:`~tracer.diff.positions.PositionStats`), each a Python call and a launch, while the GPU
computes each in microseconds. Each of those passes is a pure function of its input tensors (no
host synchronisation inside: the comparison reads the device once, at the end). :func:`run` calls
such a function eagerly the first time it sees its input shapes; the second time it records the
function into a CUDA graph (static copies of the inputs; outputs packed into one buffer); every
later call with those shapes copies its inputs into the graph's, replays it and clones the packed
outputs: a few launches instead of dozens, and none of the pass's Python.

The numbers are those of the eager call: the graph replays the same kernels on the same shapes
(checked bit for bit on an H200 by ``tests/diff/test_graphed.py``). A one-off run never pays
for a recording (only shapes seen twice in a process are recorded); repeated comparisons of one
shape (the bench, sweeps, audits, a notebook's reruns) get the replay. A recording costs, once per
shape, a device synchronisation, a garbage collection and the release of PyTorch's cached blocks
(``torch.cuda.graph``'s set-up).

Memory: each graph keeps static copies of its inputs and, in a private pool, the pass's float64
temporaries, which the eager passes hand back to PyTorch's cache. Measured on the H200: the three
graphs of a ``qwen3-0.6b-shape`` comparison (a 16-token window, a 152k vocabulary) hold about
700 MiB. At most :data:`MAX_GRAPHS` graphs are kept (least recently used evicted, its pool freed
with it), each of inputs of at most :data:`MAX_ELEMENTS` elements, recorded only while
:data:`MIN_FREE` of the device's memory is free; :func:`clear` frees them all. These run eagerly:
larger inputs, CPU tensors, inputs on more than one device, a stream already capturing, a
crowded device, and every call when ``TRACER_COMPARE_GRAPHS=off`` is in the environment. A
function that cannot be recorded (out of memory, a synchronisation inside) runs eagerly from then
on.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable

import torch

#: most graphs kept at once (each holds its temporaries in a private memory pool)
MAX_GRAPHS = 8
#: most keys remembered as seen once (a shape is recorded the second time it is seen)
MAX_SEEN = 64
#: a shape is recorded only while at least this share of the device's memory is free (else eager)
MIN_FREE = 0.25
#: inputs of more elements than this (summed over a call's inputs) always run eagerly
MAX_ELEMENTS = 1 << 23

_Fn = Callable[..., tuple[torch.Tensor, ...]]


class _Entry:
    """A recorded key's graph, or its refusal (``failed``: it runs eagerly from then on)."""

    __slots__ = ("graph", "inputs", "packed", "layout")

    def __init__(self) -> None:
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.packed: torch.Tensor | None = None
        self.layout: tuple[tuple[torch.dtype, tuple[int, ...], int], ...] = ()

    @property
    def failed(self) -> bool:
        """Whether the recording was refused (an entry exists only once recorded or refused)."""
        return self.graph is None


_entries: OrderedDict[tuple, _Entry] = OrderedDict()
#: keys seen once and not recorded yet (at most MAX_SEEN, oldest dropped first)
_seen: OrderedDict[tuple, None] = OrderedDict()
#: how many calls each path took in this process (``eager``, ``recorded``, ``replayed``): what the tests read
counts = {"eager": 0, "recorded": 0, "replayed": 0}


def enabled() -> bool:
    """Whether :func:`run` may record graphs (``TRACER_COMPARE_GRAPHS=off`` turns it off)."""
    return os.environ.get("TRACER_COMPARE_GRAPHS", "on") != "off"


def clear() -> None:
    """Drop every recorded graph (their memory pools are freed with them) and forget the shapes seen."""
    _entries.clear()
    _seen.clear()


def _eager(fn: _Fn, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    counts["eager"] += 1
    return fn(*inputs)


def _pack(outs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, tuple]:
    """The outputs as one flat int64 tensor (each an 8-byte dtype), and how to cut it back."""
    layout = tuple((o.dtype, tuple(o.shape), o.numel()) for o in outs)
    return torch.cat([o.reshape(-1).view(torch.int64) for o in outs]), layout


def _unpack(flat: torch.Tensor, layout: tuple) -> tuple[torch.Tensor, ...]:
    out, at = [], 0
    for dtype, shape, n in layout:
        out.append(flat[at:at + n].view(dtype).view(shape))
        at += n
    return tuple(out)


def _record(entry: _Entry, fn: _Fn, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
    """Record ``fn`` on static copies of ``inputs``; the outputs of a replay, or None (recorded nothing:
    the caller runs it eagerly). Any error of the recording (out of memory, a synchronisation inside)
    leaves the caller's stream current and nothing held."""
    device = inputs[0].device
    stream = torch.cuda.current_stream(device)
    try:
        static = tuple(t.clone() for t in inputs)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(stream)
        with torch.cuda.stream(side):  # the warm-up the recording needs (lazy library set-up), off the recording
            outs = fn(*static)
        stream.wait_stream(side)
        if any(o.element_size() != 8 for o in outs):
            return None  # packed as int64 words: every pass here returns 8-byte dtypes
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            packed, layout = _pack(fn(*static))
        torch.cuda.set_stream(stream)
    except RuntimeError:  # out of memory, a synchronisation inside, an operation a graph cannot hold
        torch.cuda.set_stream(stream)  # a failed capture can leave its own stream current
        torch.cuda.synchronize(device)
        return None
    entry.graph, entry.inputs, entry.packed, entry.layout = graph, static, packed, layout
    graph.replay()
    counts["recorded"] += 1
    return _unpack(packed.clone(), layout)


def run(name: str, fn: _Fn, inputs: tuple[torch.Tensor, ...], params: tuple = ()) -> tuple[torch.Tensor, ...]:
    """``fn(*inputs)``, replayed from a CUDA graph when this key was seen before (module docstring).

    Args:
        name: the pass's name, part of the key.
        fn: a pure function of ``inputs`` returning a tuple of tensors (8-byte dtypes to be recorded);
            it may read only ``inputs`` and the constants in ``params``, and must not synchronise.
        inputs: its tensors, on one device.
        params: every other value ``fn`` depends on (hashable), part of the key.

    Returns:
        ``fn``'s outputs, on the inputs' device (fresh tensors the caller owns).
    """
    first = inputs[0]
    if (first.device.type != "cuda" or not enabled() or any(t.device != first.device for t in inputs)
            or sum(t.numel() for t in inputs) > MAX_ELEMENTS or torch.cuda.is_current_stream_capturing()):
        return _eager(fn, inputs)
    key = (name, params, first.device.index,
           tuple((tuple(t.shape), t.stride(), t.dtype) for t in inputs))
    entry = _entries.get(key)
    if entry is None:
        if key not in _seen:  # the first time: eager, and remembered (a bounded set apart from the graphs)
            _seen[key] = None
            while len(_seen) > MAX_SEEN:
                _seen.popitem(last=False)
            return _eager(fn, inputs)
        del _seen[key]
        entry = _entries[key] = _Entry()
        while len(_entries) > MAX_GRAPHS:  # least recently used first (its pool is freed with it)
            _entries.popitem(last=False)
        free, total = torch.cuda.mem_get_info(first.device)
        outs = _record(entry, fn, inputs) if free >= MIN_FREE * total else None  # a crowded device: eager
        return _eager(fn, inputs) if outs is None else outs
    _entries.move_to_end(key)
    if entry.failed:
        return _eager(fn, inputs)
    for s, t in zip(entry.inputs, inputs):
        s.copy_(t)
    entry.graph.replay()
    counts["replayed"] += 1
    return _unpack(entry.packed.clone(), entry.layout)
