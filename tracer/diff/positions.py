"""Per-position statistics of a comparison: for every capture point and compared position, the
max |A − B| and the number of bitwise-differing elements (the data of the position heat map).

Computed while comparing (:func:`tracer.diff.compare.compare_pairs` feeds every pair to a
:class:`PositionStats`), kept on the device until the end (one transfer), carried by the
:class:`~tracer.diff.result.Comparison` and stored with it, so figures never re-read a trace. Beyond
:data:`MAX_COLUMNS` compared positions, consecutive positions are binned (max and sum per bin).
"""

from __future__ import annotations

from typing import TypedDict

import numpy as np
import torch

from tracer.diff import graphed
from tracer.diff.fetch import fetch_together
from tracer.execute.kinds import PointKind

#: at most this many position columns are kept; longer windows are binned
MAX_COLUMNS = 2048
#: elements per chunk of the pass (bounded temporary memory)
CHUNK_ELEMENTS = 1 << 21
#: the same on a CUDA device, where each chunk's launches, not its bytes, dominate small windows
#: (the numbers do not depend on the chunking: per-row maxima and counts)
CUDA_CHUNK_ELEMENTS = 1 << 25
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
             torch.float64: torch.int64}


def torch_replaced() -> bool:
    """Whether a library replaced torch's own operators in this process: a batch-invariant mode
    (an engine's, turned on by its own option) re-registers the accelerator's matmul, bmm,
    softmax and mean for every caller, some of them in float32 only, and rebinds ``torch.bmm``
    (the sign read here). tracer's float64 comparison math must not run through them."""
    return torch.bmm is not torch._C._VariableFunctions.bmm


def one_device(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` on one device, for every kernel that reads both: where they are when they
    share one; else the accelerator's (a GPU run against a CPU run is compared on the GPU: the
    CPU side is the one copied); two different accelerators: ``a``'s. When the accelerator's
    operators were replaced in this process (:func:`torch_replaced`), the CPU's: there torch's own
    kernels compute the float64 statistics."""
    if a.device.type != "cpu" or b.device.type != "cpu":
        if torch_replaced():
            return a.cpu(), b.cpu()
    if a.device == b.device:
        return a, b
    dev = a.device if a.device.type != "cpu" else b.device
    return a.to(dev), b.to(dev)


def position_reduce(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (first axis): max |a − b| over the differing elements and the differing count.

    Args:
        a, b: ``(T, *feature)`` tensors of one shape and a float dtype, on one device.

    Returns:
        ``(max_abs float64 (T,), n_diff int64 (T,))`` on the tensors' device; equal bits count 0
        (also ``-0`` vs ``+0``: they differ in bits, the |Δ| is 0); a NaN or infinite difference
        counts ``inf``. The difference is taken in float32 for 16-bit dtypes (exact up to an
        exponent gap of 16 between the two values; a relative 2⁻²⁴ beyond) and float64 otherwise.
    """
    a, b = one_device(a, b)
    t = a.shape[0] if a.dim() else 1
    a2, b2 = a.reshape(t, -1), b.reshape(t, -1)
    work = torch.float32 if a.element_size() == 2 else torch.float64
    per_chunk = CUDA_CHUNK_ELEMENTS if a.device.type == "cuda" else CHUNK_ELEMENTS
    step = max(1, per_chunk // max(1, a2.shape[1]))
    mx = torch.zeros(t, dtype=torch.float64, device=a.device)
    nd = torch.zeros(t, dtype=torch.int64, device=a.device)
    if a2.shape[1] == 0:
        return mx, nd
    iv = _INT_VIEW[a.dtype]
    for s in range(0, t, step):
        xa, xb = a2[s:s + step], b2[s:s + step]
        differ = xa.view(iv) != xb.view(iv)  # (rows, F) bool
        d = (xa.to(work) - xb.to(work)).abs_()
        d = torch.where(differ, torch.nan_to_num(d, nan=float("inf")), torch.zeros((), dtype=work, device=a.device))
        mx[s:s + step] = d.amax(dim=1).to(torch.float64)
        nd[s:s + step] = differ.sum(dim=1)
    return mx, nd


class PerPosition(TypedDict):
    """:meth:`PositionStats.result`: per capture point (C of them) and compared position (T / bin columns).

    Keys: ``start``, ``stop`` (the compared absolute positions), ``bin`` (positions per column),
    ``names``, ``kinds`` (the C points), ``max_abs_diff`` (C × columns, float64, ``inf`` for a
    NaN/inf mismatch) and ``n_diff`` (C × columns, differing elements).
    """

    start: int
    stop: int
    bin: int
    names: list[str]
    kinds: list[PointKind]
    max_abs_diff: list[list[float]]
    n_diff: list[list[int]]


#: pairs smaller than this (elements) are reduced together, concatenated by feature size and
#: dtype (one set of kernel launches for many points instead of one per point)
SMALL_ELEMENTS = 1 << 20


class PositionStats:
    """Accumulates :func:`position_reduce` of the compared window's rows, point by point.

    Small pairs (under :data:`SMALL_ELEMENTS` elements) wait in a queue of at most
    ``4 * SMALL_ELEMENTS`` elements and are reduced together, one concatenation per feature size
    and dtype (on a GPU the per-point kernel launches, not the bytes, dominate small pairs);
    larger pairs are reduced at once. The results are identical either way (the reduction is per
    row).

    Args:
        positions: ``(start, stop)`` absolute compared positions. A pair with ``stop - start``
            rows is taken whole; one with ``stop`` rows (a KV cache over all positions) is cut to
            its window rows; other pairs (no position axis) are left out.
    """

    def __init__(self, positions: tuple[int, int]) -> None:
        self.start, self.stop = int(positions[0]), int(positions[1])
        t = self.stop - self.start
        self.bin = max(1, -(-t // MAX_COLUMNS))
        self.names: list[str] = []
        self.kinds: list[str] = []
        self.max: list[torch.Tensor | None] = []
        self.n: list[torch.Tensor | None] = []
        self._queue: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._queued = 0
        self._host: torch.Tensor | None = None  # the table's host copy, (2, C, columns) int64 words
        self._shape: tuple[int, ...] = ()

    def add(self, name: str, kind: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Reduce one pair (the window rows; see the class docstring); float dtypes only."""
        t = self.stop - self.start
        if a.dim() == 0 or a.shape != b.shape or a.dtype not in _INT_VIEW or a.numel() == 0:
            return
        a, b = one_device(a, b)
        if a.shape[0] != t:
            if a.shape[0] != self.stop:
                return
            a, b = a[self.start:], b[self.start:]
        index = self._slot(name, kind)
        if a.numel() >= SMALL_ELEMENTS:
            self._store(index, *position_reduce(a, b))
            return
        if a.dim() != 2:
            a, b = a.reshape(t, -1), b.reshape(t, -1)
        self._queue.append((index, a, b))
        self._queued += a.numel()
        if self._queued >= 4 * SMALL_ELEMENTS:
            self._flush()

    def rows(self, name: str, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> RowStats | None:
        """For a pair given in row blocks (``shape``/``dtype`` of each side): a :class:`RowStats`
        taking the blocks, whose :meth:`RowStats.finish` stores the same numbers :meth:`add`
        would for the whole pair (in this pair's place among the points); None when :meth:`add`
        would leave the pair out."""
        t = self.stop - self.start
        if len(shape) == 0 or dtype not in _INT_VIEW or 0 in shape:
            return None
        if shape[0] != t and shape[0] != self.stop:
            return None
        return RowStats(self, self._slot(name, kind), 0 if shape[0] == t else self.start)

    def _slot(self, name: str, kind: str) -> int:
        """A place for the next point's statistics, filled by :meth:`_store`; its index."""
        self.names.append(name)
        self.kinds.append(kind)
        self.max.append(None)
        self.n.append(None)
        return len(self.names) - 1

    def _store(self, index: int, mx: torch.Tensor, nd: torch.Tensor) -> None:
        if self.bin > 1:  # bins of `bin` consecutive positions, the last one short
            pad = (-mx.shape[0]) % self.bin
            mx = torch.nn.functional.pad(mx, (0, pad)).reshape(-1, self.bin).amax(dim=1)
            nd = torch.nn.functional.pad(nd, (0, pad)).reshape(-1, self.bin).sum(dim=1)
        self.max[index], self.n[index] = mx, nd

    def _flush(self) -> None:
        """Reduce the queued small pairs: one concatenation and reduction per (features, dtype, device)."""
        groups: dict[tuple, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for item in self._queue:
            groups.setdefault((item[1].shape[1], item[1].dtype, item[1].device), []).append(item)
        self._queue, self._queued = [], 0
        for items in groups.values():
            if len(items) == 1:
                index, a, b = items[0]
                self._store(index, *graphed.run("positions", position_reduce, (a, b)))
                continue
            # on a GPU replayed from a CUDA graph once this group's shape has been seen (tracer.diff.graphed)
            mx, nd = graphed.run("positions", position_reduce, (torch.cat([a for _, a, _ in items]),
                                                             torch.cat([b for _, _, b in items])))
            rows = [a.shape[0] for _, a, _ in items]
            for (index, _, _), m, n in zip(items, mx.split(rows), nd.split(rows)):
                self._store(index, m, n)

    def pending_words(self) -> list[torch.Tensor]:
        """The table still on the device, as one flat int64 tensor (the counts travel as the bits of
        float64 words beside the maxima); its host copy goes to :meth:`take_words` (:func:`~tracer.diff.fetch.fetch_together`)."""
        self._flush()
        if not self.names or self._host is not None:
            return []
        both = torch.stack([torch.stack(self.max), torch.stack(self.n).view(torch.float64)])  # (2, C, columns)
        self._shape = tuple(both.shape)
        return [both.view(torch.int64).reshape(-1)]

    def take_words(self, host: list[np.ndarray]) -> None:
        """The host copy of :meth:`pending_words`."""
        if host:
            self._host = torch.from_numpy(host[0].reshape(self._shape))

    def result(self) -> PerPosition | None:
        """The :class:`PerPosition` table (one host transfer, unless :func:`~tracer.diff.fetch.fetch_together`
        made it), or None when no pair had positions."""
        fetch_together(self)
        if not self.names:
            return None
        both = self._host.view(torch.float64)
        mx, nd = both[0], both[1].view(torch.int64)
        return PerPosition(start=self.start, stop=self.stop, bin=self.bin, names=list(self.names),
                           kinds=list(self.kinds), max_abs_diff=mx.tolist(), n_diff=nd.tolist())


class RowStats:
    """:func:`position_reduce` of one pair given in row blocks (see :meth:`PositionStats.rows`).

    Args:
        stats: the :class:`PositionStats` to store into.
        index: the pair's place among its points.
        offset: the tensor row of the first compared position (0; ``start`` for a KV cache).
    """

    def __init__(self, stats: PositionStats, index: int, offset: int) -> None:
        self.stats, self.index, self.offset = stats, index, offset
        self.mx: torch.Tensor | None = None
        self.nd: torch.Tensor | None = None

    def add(self, row0: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Rows ``row0 .. row0 + len(a)`` of the pair (``(rows, *feature)`` each)."""
        a, b = one_device(a, b)
        t = self.stats.stop - self.stats.start
        if self.mx is None:
            self.mx = torch.zeros(t, dtype=torch.float64, device=a.device)
            self.nd = torch.zeros(t, dtype=torch.int64, device=a.device)
        lo, hi = max(row0, self.offset), min(row0 + a.shape[0], self.offset + t)
        if lo >= hi:
            return
        mx, nd = position_reduce(a[lo - row0:hi - row0], b[lo - row0:hi - row0])
        self.mx[lo - self.offset:hi - self.offset] = mx
        self.nd[lo - self.offset:hi - self.offset] = nd

    def equal(self, device: torch.device) -> None:
        """The pair is bitwise equal throughout: every position 0 (what :meth:`add` would give)."""
        t = self.stats.stop - self.stats.start
        self.mx = torch.zeros(t, dtype=torch.float64, device=device)
        self.nd = torch.zeros(t, dtype=torch.int64, device=device)

    def finish(self) -> None:
        """Record the pair's per-position statistics (after its last block)."""
        if self.mx is not None:
            self.stats._store(self.index, self.mx, self.nd)
