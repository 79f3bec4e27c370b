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
shape (the bench, sweeps, audits, a notebook's reruns) get the replay. The graphs' private memory
pools hold the passes' temporaries: at most :data:`MAX_GRAPHS` graphs are kept (least recently used
evicted), each of inputs of at most :data:`MAX_ELEMENTS` elements; larger inputs, CPU tensors, a
stream already capturing, inputs on more than one device and ``TRACER_COMPARE_GRAPHS=off`` in the environment run eagerly. A
function that cannot be recorded (a synchronisation inside) runs eagerly from then on.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable

import torch

#: most graphs kept at once (each holds its temporaries in a private memory pool)
MAX_GRAPHS = 8
#: inputs of more elements than this (summed over a call's inputs) always run eagerly
MAX_ELEMENTS = 1 << 23

_Fn = Callable[..., tuple[torch.Tensor, ...]]


class _Entry:
    """One key's state: seen once (``graph`` None), recorded, or refused (``failed``)."""

    __slots__ = ("graph", "inputs", "packed", "layout", "failed")

    def __init__(self) -> None:
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.packed: torch.Tensor | None = None
        self.layout: tuple[tuple[torch.dtype, tuple[int, ...], int], ...] = ()
        self.failed = False


_entries: OrderedDict[tuple, _Entry] = OrderedDict()
#: how many calls each path took in this process (``eager``, ``recorded``, ``replayed``): what the tests read
counts = {"eager": 0, "recorded": 0, "replayed": 0}


def enabled() -> bool:
    """Whether :func:`run` may record graphs (``TRACER_COMPARE_GRAPHS=off`` turns it off)."""
    return os.environ.get("TRACER_COMPARE_GRAPHS", "on") != "off"


def clear() -> None:
    """Drop every recorded graph (their memory pools are freed with them)."""
    _entries.clear()


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
    """Record ``fn`` on static copies of ``inputs``; the outputs of a replay, or None (recorded nothing)."""
    static = tuple(t.clone() for t in inputs)
    side = torch.cuda.Stream(device=static[0].device)
    side.wait_stream(torch.cuda.current_stream(static[0].device))
    with torch.cuda.stream(side):  # the warm-up the recording needs (lazy library set-up), off the recording
        outs = fn(*static)
    torch.cuda.current_stream(static[0].device).wait_stream(side)
    if any(o.element_size() != 8 for o in outs):
        return None  # packed as int64 words: every pass here returns 8-byte dtypes
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            packed, layout = _pack(fn(*static))
    except RuntimeError:  # a synchronisation inside, or an operation a graph cannot hold
        torch.cuda.synchronize(static[0].device)
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
        _entries[key] = _Entry()
        while len(_entries) > MAX_GRAPHS:
            _entries.popitem(last=False)
        return _eager(fn, inputs)
    _entries.move_to_end(key)
    if entry.failed:
        return _eager(fn, inputs)
    if entry.graph is None:
        outs = _record(entry, fn, inputs)
        if outs is None:
            entry.failed = True
            return _eager(fn, inputs)
        return outs
    for s, t in zip(entry.inputs, inputs):
        s.copy_(t)
    entry.graph.replay()
    counts["replayed"] += 1
    return _unpack(entry.packed.clone(), entry.layout)
