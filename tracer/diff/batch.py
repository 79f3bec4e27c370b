"""The batched comparison of many tensor pairs: :class:`DiffBatch`, and the one-pair uses of it.

:func:`tensor_diff` and :func:`count_outside_tolerance` are one-pair batches; the numbers and
their conventions are those of :mod:`tracer.diff.metrics` (whose pure functions this uses).
This module owns the pairs: their segments (a split, a pair streamed in blocks), their queueing
into chunks, and each pair's :class:`~tracer.diff.metrics.TensorDiff` from the summed statistics;
the two passes over a chunk and the accumulators they fold into are :mod:`tracer.diff.passes`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tracer.diff import metrics as _metrics
from tracer.diff.fetch import fetch_together
from tracer.diff.metrics import ULP_BINS, TensorDiff, _check_pair
from tracer.diff.passes import _P2_MAX, _P2_SUM, ChunkPasses


def tensor_diff(a: torch.Tensor, b: torch.Tensor) -> TensorDiff:
    """Compare ``b`` against the reference ``a`` element by element.

    Args:
        a, b: same shape, same dtype (bfloat16/float16/float32/float64). Computed on ``a``'s
            device (``b`` is moved there) by a one-pair :class:`DiffBatch`: bit comparisons
            in the storage dtype, differences in float64.

    Returns:
        a :class:`TensorDiff`; see the module docstring for NaN/inf, ±0 and empty-tensor rules.

    Raises:
        ValueError: shapes or dtypes differ, or the dtype is not supported.
    """
    batch = DiffBatch()
    batch.add(a, b)
    return batch.results()[0]


def count_outside_tolerance(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> int:
    """Elements where ``b`` is not within ``atol + rtol * |a|`` of the reference ``a``.

    Args:
        a, b: same shape and dtype (as :func:`tensor_diff`); compared in float64.
        atol, rtol: absolute (tensor units) and relative tolerance, both >= 0.

    Returns:
        the count of elements with ``|a - b| > atol + rtol * |a|``; bitwise-equal elements always
        pass (NaN with the same bits too), any other NaN/inf mismatch always fails.

    Raises:
        ValueError: shapes/dtypes differ, or a tolerance is negative or NaN.
    """
    batch = DiffBatch(tolerance=(atol, rtol))
    batch.add(a, b)
    batch.results()
    return batch.outside_tolerance(0)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``x`` flattened (a view when it can be), without autograd history; one view op at most."""
    x = x.detach() if x.requires_grad else x
    return x if x.dim() == 1 else x.reshape(-1)


#: elements per block of the per-block partial reductions (a segment is padded to whole blocks)
BLOCK_ELEMENTS = 2048
#: most elements per chunk on a CUDA device (float64 temporaries of this size: 512 MiB each);
#: fewer when the device has less than 256 bytes free per element
CUDA_CHUNK_ELEMENTS = 1 << 26


class DiffBatch(ChunkPasses):
    """:func:`tensor_diff` for many pairs at once: batched kernels, few host synchronisations.

    The pairs are laid end to end (each padded with zeros to whole blocks of
    :data:`BLOCK_ELEMENTS`) and processed in chunks (:data:`CHUNK_ELEMENTS` elements on the
    CPU, :data:`CUDA_CHUNK_ELEMENTS` on a GPU), so the number of kernel launches does not grow
    with the number of capture points. Per chunk:

    1. every element, in the storage dtype: differing bits, NaN/inf counts and ``sum a²`` over
       the equal finite elements, reduced per block;
    2. one host synchronisation to learn which blocks hold a difference; only those get the
       float64 work (abs diff, ULP distance and histogram, ULPs at the larger magnitude,
       relative-error shares, the sums behind rel. error/cosine/SQNR, tolerance counts): on
       their differing elements alone when at most 1/:data:`~tracer.diff.passes.SPARSE_RATIO`
       of them differ, else on the whole blocks (:class:`~tracer.diff.passes.ChunkPasses`).

    Per-block results are summed per pair on the host in a fixed order, so the numbers do not
    depend on thread scheduling (no atomics). Memory: a few chunk-sized float64 temporaries,
    whatever the number and size of the pairs; a pair's tensors are released once its last
    chunk is processed.

    Args:
        tolerance: ``(atol, rtol)`` to also count the elements outside ``atol + rtol * |a|``
            (:meth:`outside_tolerance`), or None.

    Raises:
        ValueError: (from :meth:`add`) shapes/dtypes differ or unsupported dtype; a negative or
            NaN tolerance.
    """

    def __init__(self, tolerance: tuple[float, float] | None = None) -> None:
        if tolerance is not None:
            atol, rtol = tolerance
            if not (atol >= 0 and rtol >= 0):
                raise ValueError(f"tolerances must be >= 0, got atol={atol}, rtol={rtol}")
            tolerance = (float(atol), float(rtol))
        self.tolerance = tolerance
        self._pairs: list[list[int]] = []  # pair index -> its segment ids
        self._seg_n: list[int] = []  # segment id -> number of elements
        self._pending: dict[tuple, list] = {}  # (device, dtype) -> [(segment, flat a, flat b, padded length)]
        self._fill: dict[tuple, int] = {}  # (device, dtype) -> elements pending, padding included
        # per-segment accumulators, folded chunk by chunk (no per-chunk host arrays kept alive: on
        # the CPU, small long-lived allocations between big freed ones keep glibc from returning
        # memory to the OS)
        self._acc: dict[str, np.ndarray] = {}
        self._p2: list[tuple[np.ndarray, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # GPU, pending
        self._p1: list[tuple[np.ndarray, torch.Tensor, torch.Tensor]] = []  # dense chunks' pass 1, pending
        self._done: list[TensorDiff] | None = None
        self._chunk: dict[torch.device, int] = {}
        self._tol_counts: list[int] = []
        self._open: dict[int, list] = {}  # pair index -> [split or None, elements fed] (streamed pairs)
        self._carry: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # segment -> its last < 1 block (copies)

    # -- queueing ----------------------------------------------------------------------------------
    def add(self, a: torch.Tensor, b: torch.Tensor, *, split: int | None = None, more: bool = False) -> int:
        """Queue the pair ``(a, b)``; returns its index in :meth:`results`.

        Args:
            a, b: as :func:`tensor_diff` (``b`` is moved to ``a``'s device).
            split: optional element offset into the flattened pair: the elements before it get
                their own differing count (:meth:`n_diff_before`), e.g. the rows of a KV cache
                before the compared window.
            more: ``a``/``b`` are only the first elements of the pair (flattened in C order, e.g.
                the first row block of a point streamed from disk): give the rest, in order, with
                :meth:`extend` and end the pair with :meth:`close`. The results equal those of
                one ``add`` of the whole pair, bit for bit, whatever the block sizes, and nothing
                of the caller's blocks is kept (pending elements are copied), so the caller may
                reuse its buffers.

        Raises:
            ValueError: shapes or dtypes differ, or the dtype is not supported.
        """
        if self._done is not None:
            raise RuntimeError("DiffBatch.results() was already called; start a new batch")
        if more:
            index = len(self._pairs)
            seg = len(self._seg_n)
            self._seg_n.append(0)
            self._pairs.append([seg])
            self._open[index] = [None if split is None else max(int(split), 0), 0]
            if split is not None and split <= 0:  # the part before the split is empty
                self._pairs[index].append(len(self._seg_n))
                self._seg_n.append(0)
            self.extend(index, a, b)
            return index
        b = _check_pair(a, b)
        fa, fb = _flat(a), _flat(b)
        n = fa.numel()
        cuts = [0, n] if split is None else [0, min(max(int(split), 0), n), n]
        segs = []
        for lo, hi in zip(cuts, cuts[1:]):
            seg = len(self._seg_n)
            self._seg_n.append(hi - lo)
            segs.append(seg)
            self._queue(seg, *((fa, fb) if (lo, hi) == (0, n) else (fa[lo:hi], fb[lo:hi])))
        self._pairs.append(segs)
        return len(self._pairs) - 1

    def add_equal(self, n: int, n_nan: int, n_inf: int, *, split: int | None = None) -> int:
        """Record a pair of ``n`` elements known to be bitwise equal (checked by the caller), with
        ``n_nan``/``n_inf`` NaN and ±inf elements on each side, without its data; returns its index.

        Its result is what :meth:`add` gives for such a pair: nothing differs, so no float64 work
        is needed (``sum a²``, which only scales a non-zero difference, is left out).
        """
        if self._done is not None:
            raise RuntimeError("DiffBatch.results() was already called; start a new batch")
        cut = n if split is None else min(max(int(split), 0), n)
        counts = [(cut, 0, 0)] if split is None else [(cut, 0, 0), (n - cut, 0, 0)]
        counts[-1] = (counts[-1][0], n_nan, n_inf)  # the counts go to one segment: only sums are used
        segs = []
        for size, nan, inf in counts:
            seg = len(self._seg_n)
            self._seg_n.append(size)
            segs.append(seg)
            if nan or inf:  # pass 1's row of an equal pair: what _fold_p1 adds (its other columns and sum a² are 0)
                self._accumulators()["p1"][seg, 1:5] += (nan, nan, inf, inf)
        self._pairs.append(segs)
        return len(self._pairs) - 1

    def extend(self, index: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """The next elements of pair ``index`` (opened by ``add(..., more=True)``), flattened in C order.

        Raises:
            ValueError: dtypes differ or are not supported, or ``a`` and ``b`` differ in shape.
            RuntimeError: the pair is not open.
        """
        state = self._open.get(index)
        if state is None:
            raise RuntimeError(f"pair {index} is not open; start it with add(..., more=True)")
        b = _check_pair(a, b)
        fa, fb = a.detach().reshape(-1), b.detach().reshape(-1)
        split, fed = state
        segs = self._pairs[index]
        if split is not None and len(segs) == 1:  # still before the split
            k = min(split - fed, fa.numel())
            self._feed(segs[0], fa[:k], fb[:k])
            fa, fb, fed = fa[k:], fb[k:], fed + k
            if fed == split:  # the part before the split ends here: the rest is its own segment
                self._end_segment(segs[0])
                segs.append(len(self._seg_n))
                self._seg_n.append(0)
        if fa.numel():
            self._feed(segs[-1], fa, fb)
            fed += fa.numel()
        state[1] = fed

    def close(self, index: int) -> None:
        """End the streamed pair ``index``: its last elements are queued (idempotent)."""
        state = self._open.pop(index, None)
        if state is None:
            return
        segs = self._pairs[index]
        self._end_segment(segs[-1])
        if state[0] is not None and len(segs) == 1:  # the split lies at or past the end
            segs.append(len(self._seg_n))
            self._seg_n.append(0)

    def _feed(self, seg: int, fa: torch.Tensor, fb: torch.Tensor) -> None:
        """Queue elements of segment ``seg`` in whole blocks; a shorter tail waits (copied) for the
        next elements, so block boundaries fall where one ``add`` of the whole pair puts them."""
        block, _ = self._sizes(fa.device)
        self._seg_n[seg] += fa.numel()
        carry = self._carry.pop(seg, None)
        if carry is not None:
            need = block - carry[0].numel()
            ha, hb = torch.cat([carry[0], fa[:need]]), torch.cat([carry[1], fb[:need]])
            fa, fb = fa[need:], fb[need:]
            if ha.numel() < block:
                self._carry[seg] = (ha, hb)
                return
            self._queue(seg, ha, hb, copy=True)
        k = fa.numel() // block * block
        if k:
            self._queue(seg, fa[:k], fb[:k], copy=True)
        if k < fa.numel():
            self._carry[seg] = (fa[k:].clone(), fb[k:].clone())

    def _end_segment(self, seg: int) -> None:
        carry = self._carry.pop(seg, None)
        if carry is not None:
            self._queue(seg, carry[0], carry[1], copy=True)

    def _sizes(self, device: torch.device) -> tuple[int, int]:
        if device not in self._chunk:
            chunk = _metrics.CHUNK_ELEMENTS
            if device.type == "cuda":  # big chunks: fewer kernel launches; bounded by free memory
                free, _ = torch.cuda.mem_get_info(device)
                chunk = int(min(CUDA_CHUNK_ELEMENTS, max(1 << 20, free // 256)))
            self._chunk[device] = chunk
        chunk = self._chunk[device]
        block = max(1, min(BLOCK_ELEMENTS, chunk))
        return block, max(block, chunk // block * block)

    def _queue(self, seg: int, fa: torch.Tensor, fb: torch.Tensor, copy: bool = False) -> None:
        key = (fa.device, fa.dtype)
        block, chunk = self._sizes(fa.device)
        n = fa.numel()
        padded = -(-n // block) * block
        start = 0
        while start < padded:
            fill = self._fill.get(key, 0)
            take = min(padded - start, chunk - fill)
            pa, pb = (fa, fb) if start == 0 and take >= n else (fa[start:start + take], fb[start:start + take])
            if fill + take < chunk and (copy or pa.numel() < n):  # a tail left pending: copy it, so the
                pa, pb = pa.clone(), pb.clone()  # whole tensor can be freed (or reused) before the next chunk
            self._pending.setdefault(key, []).append((seg, pa, pb, take))
            self._fill[key] = fill + take
            start += take
            if self._fill[key] == chunk:
                self._run_chunk(key)

    def _flush(self) -> None:
        for key in list(self._pending):
            if self._pending[key]:
                self._run_chunk(key)

    # -- results -----------------------------------------------------------------------------------
    def pending_words(self) -> list[torch.Tensor]:
        """What :meth:`results` still has to read from the device (the queued chunks run first), as
        flat int64 tensors: dense chunks' both passes and the deferred float64 passes, every statistic
        as 64-bit words side by side; give the host arrays to :meth:`take_words` (:func:`fetch_together`)."""
        for index in sorted(self._open):
            self.close(index)
        self._flush()
        words = [torch.cat([p1, sq.view(torch.int64).unsqueeze(1)], 1).reshape(-1) for _, p1, sq in self._p1]
        if self._p2:
            parts = [torch.cat([p[i] for p in self._p2]) for i in range(1, 5)]  # (k, 5) f64, (k, 2) f64, (k, c) i64, (k,) i64
            words.append(torch.cat([parts[0].view(torch.int64), parts[1].view(torch.int64), parts[2],
                                    parts[3].unsqueeze(1)], 1).reshape(-1))
        return words

    def take_words(self, host: list[np.ndarray]) -> None:
        """Fold the host copies of :meth:`pending_words` (same order): each dense chunk's pass 1 in
        chunk order, as :meth:`_run_chunk` folds it on the host, then the float64 passes."""
        for (segs, p1, _), rows in zip(self._p1, host):
            rows = rows.reshape(-1, 7)
            self._fold_p1(segs, rows[:, :6], rows[:, 6].copy().view(np.float64))
        if self._p2:
            segs = np.concatenate([p[0] for p in self._p2])
            w = host[len(self._p1)].reshape(len(segs), -1)
            c0, c1 = len(_P2_SUM), len(_P2_SUM) + len(_P2_MAX)
            self._fold_p2(segs, w[:, :c0].copy().view(np.float64), w[:, c0:c1].copy().view(np.float64),
                          w[:, c1:-1].copy(), w[:, -1].copy())
        self._p1, self._p2 = [], []

    def _per_pair(self, acc: dict[str, np.ndarray]) -> list[tuple]:
        """Per pair, as Python numbers: ``(n, pass-1 counts, float64 sums, counts, maxima, sum a² of the
        equal elements, max ULP)`` summed over its segments (a pair of one segment: its row as it is)."""
        p1, sq, sums, maxes, cnt, max_ulp = (acc[k] for k in ("p1", "sq", "sums", "maxes", "cnt", "max_ulp"))
        first = np.fromiter((segs[0] for segs in self._pairs), np.int64, len(self._pairs))
        rows = [x[first].tolist() for x in (p1, sums, cnt, maxes, sq, max_ulp)]  # one conversion per statistic
        out, per_pair = [], list(zip(*rows))  # no generator per pair (a run compares hundreds)
        for i, segs in enumerate(self._pairs):
            if len(segs) == 1:
                q1, q2, c, mx, s_eq, mu = per_pair[i]
            else:
                q1, q2, c = p1[segs].sum(0).tolist(), sums[segs].sum(0).tolist(), cnt[segs].sum(0).tolist()
                mx, s_eq, mu = maxes[segs].max(0).tolist(), float(sq[segs].sum()), int(max_ulp[segs].max())
            out.append((sum(map(self._seg_n.__getitem__, segs)), q1, q2, c, mx, s_eq, mu))
        return out

    def results(self) -> list[TensorDiff]:
        """One :class:`TensorDiff` per :meth:`add`, in order (computes what is still queued)."""
        if self._done is not None:
            return self._done
        fetch_together(self)
        acc = self._accumulators()
        out, tol = [], []
        for n, q1, q2, c, mx, s_eq, mu in self._per_pair(acc):
            n_diff = q1[0]
            sa, sb, sab, sdd = q2[1:]
            sa, sb, sab = sa + s_eq, sb + s_eq, sab + s_eq
            if sdd == 0.0:
                rel_error, cosine, sqnr = 0.0, 1.0, math.inf
            else:
                rel_error = math.sqrt(sdd) / math.sqrt(sa) if sa > 0 else math.inf
                sqnr = 10.0 * math.log10(sa / sdd) if sa > 0 else -math.inf
                cosine = 0.0 if sa == 0.0 or sb == 0.0 else max(-1.0, min(1.0, sab / (math.sqrt(sa) * math.sqrt(sb))))
            above = [n_diff] + c[3:]  # elements above each ULP edge
            hist = [n - n_diff] + [above[i - 1] - (above[i] if i < len(above) else 0) for i in range(1, len(ULP_BINS))]
            out.append(TensorDiff(
                n_total=n, n_diff=n_diff, max_abs_diff=mx[0], mean_abs_diff=q2[0] / n if n else 0.0,
                max_ulp=mu, ulp_hist=tuple(hist),
                rel_error=rel_error, cosine=cosine, sqnr_db=sqnr,
                frac_rel_lt_1e3=(n - n_diff + c[0]) / n if n else 1.0,
                frac_rel_lt_5e3=(n - n_diff + c[1]) / n if n else 1.0,
                n_nan_a=q1[1], n_nan_b=q1[2], n_inf_a=q1[3], n_inf_b=q1[4],
                max_ulp_mag=mx[1], n_nan_payload=q1[5],
            ))
            tol.append(c[2])
        self._segment_diff = acc["p1"][:len(self._seg_n), 0].copy()
        self._acc = {}
        self._done, self._tol_counts = out, tol
        return out

    def outside_tolerance(self, index: int) -> int:
        """Elements of pair ``index`` outside the batch's tolerance (after :meth:`results`).

        Raises:
            RuntimeError: no tolerance was given, or :meth:`results` was not called yet.
        """
        if self.tolerance is None or self._done is None:
            raise RuntimeError("outside_tolerance() needs a tolerance and results() first")
        return self._tol_counts[index]

    def n_diff_before(self, index: int) -> int:
        """Differing elements of pair ``index`` before its ``split`` (after :meth:`results`; 0 without a split)."""
        if self._done is None:
            raise RuntimeError("n_diff_before() needs results() first")
        segs = self._pairs[index]
        return int(self._segment_diff[segs[0]]) if len(segs) > 1 else 0
