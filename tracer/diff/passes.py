"""The two passes over a chunk of a :class:`~tracer.diff.batch.DiffBatch`, and the sums they fold into.

A chunk is pairs' segments laid end to end in whole blocks (:class:`~tracer.diff.batch.DiffBatch`
queues them); :class:`ChunkPasses` runs both passes on it: pass 1 on every element in the storage
dtype (differing bits, NaN/inf counts, ``sum a²`` of the equal finite elements, per block), then
the float64 pass (:func:`tracer.diff.metrics.element_stats`) on the blocks that differ, their
differing elements alone when few differ (:data:`SPARSE_RATIO`) or, on a GPU, on every block of a
small chunk with no synchronisation between the passes (:func:`_dense`); per-block results are
folded into per-segment accumulators on the host in a fixed order (:func:`_fold`), or kept on the
device for one transfer (:func:`_defer`). The device decisions are module functions, looked up here.
"""

from __future__ import annotations

import numpy as np
import torch

from tracer.diff import graphed
from tracer.diff.metrics import _INT_VIEW, _ULP_EDGES, bits_equal, element_stats, has_nonfinite

#: most elements of a chunk that gets both passes on every block with no synchronisation between them
#: (:meth:`ChunkPasses._dense_chunk`; float64 temporaries of this size: 32 MiB each): on a GPU, the
#: online comparison of a run's compared window, where launches and synchronisations, not bytes, count
DENSE_ELEMENTS = 1 << 22


def _dense(device: torch.device, elements: int) -> bool:
    """Whether a chunk of ``elements`` on ``device`` gets :meth:`ChunkPasses._dense_chunk` (a GPU, a small chunk)."""
    return device.type != "cpu" and elements <= DENSE_ELEMENTS


def _defer(device: torch.device) -> bool:
    """Whether the float64 pass's per-block results stay on ``device`` until the batch's results
    (:meth:`~tracer.diff.batch.DiffBatch.results`: one transfer for the whole batch; on a GPU) instead
    of being folded chunk by chunk (the CPU)."""
    return device.type != "cpu"


def _block_counts(neq: torch.Tensor, ca: torch.Tensor, cb: torch.Tensor, nb: int, block: int) -> torch.Tensor:
    """Per-block counts of the first pass, ``(nb, 6)`` int64 on the chunk's device: differing bits,
    NaN in A, NaN in B, ±inf in A, ±inf in B, and differing bits where both are NaN. ``neq``,
    ``ca`` and ``cb`` are flat tensors of ``nb * block`` elements."""
    return torch.stack([
        neq.view(nb, block).sum(1),
        torch.isnan(ca).view(nb, block).sum(1), torch.isnan(cb).view(nb, block).sum(1),
        torch.isinf(ca).view(nb, block).sum(1), torch.isinf(cb).view(nb, block).sum(1),
        (neq & torch.isnan(ca) & torch.isnan(cb)).view(nb, block).sum(1),
    ], dim=1)


def _fold(acc: np.ndarray, segs: np.ndarray, values: np.ndarray, op: np.ufunc) -> None:
    """``acc[s] = op(acc[s], op-reduce of values[segs == s])`` for every segment ``s``, in a fixed order.

    ``segs`` (per-row segment ids) is sorted first when it is not already (a stable sort, so the
    reduction order stays the order of the rows).
    """
    if segs.size == 0:
        return
    if np.any(segs[1:] < segs[:-1]):
        order = np.argsort(segs, kind="stable")
        segs, values = segs[order], values[order]
    starts = np.flatnonzero(np.concatenate(([True], segs[1:] != segs[:-1])))
    reduced = op.reduceat(values, starts, axis=0)
    owners = segs[starts]
    acc[owners] = op(acc[owners], reduced)


#: a chunk's blocks holding a difference get the float64 pass on their differing elements alone
#: (gathered) when at most 1/SPARSE_RATIO of their elements differ, else on the whole blocks
SPARSE_RATIO = 4

# columns of the per-block statistics (pass 1: every block; pass 2: blocks with a difference)
_P1 = ("n_diff", "n_nan_a", "n_nan_b", "n_inf_a", "n_inf_b", "n_nan_payload")  # int64
_P2_SUM = ("sum_abs", "sa", "sb", "sab", "sdd")  # float64 sums over the differing elements
_P2_MAX = ("max_abs", "max_ulp_mag")  # float64 maxima
_P2_CNT = ("rel3", "rel5", "tol") + tuple(f"ulp_gt_{e}" for e in _ULP_EDGES[1:])  # int64 counts


def _dense_passes(ca: torch.Tensor, cb: torch.Tensor, nb: int, block: int,
                  tolerance: tuple[float, float] | None) -> tuple[torch.Tensor, ...]:
    """Both passes over every block of a chunk (:meth:`ChunkPasses._dense_chunk`), a pure function of
    the chunk ``ca``/``cb`` (flat, ``nb * block`` elements, one storage dtype): ``(p1 (nb, 6) int64,
    sum a² of the equal finite elements (nb,) float64, *element_stats)``."""
    view = _INT_VIEW[ca.dtype]
    neq = ca.view(view) != cb.view(view)  # (C,)
    p1 = _block_counts(neq, ca, cb, nb, block)
    a_eq = torch.where(~neq & torch.isfinite(ca), ca, torch.zeros_like(ca)).to(torch.float64)
    sq_eq = (a_eq * a_eq).view(nb, block).sum(1)  # (nb,) float64
    del a_eq
    return (p1, sq_eq) + element_stats(ca, cb, neq, (nb, block), tolerance)


class ChunkPasses:
    """The passes over one chunk and the per-segment accumulators, a base of :class:`~tracer.diff.batch.DiffBatch`
    (a base, not a part: no call is added per chunk or per pair). The batch sets what these read:
    ``tolerance``, ``_seg_n`` (elements per segment id), ``_pending``/``_fill`` (the queued chunks per
    ``(device, dtype)``), ``_sizes(device)``; and these write: ``_acc`` (the accumulators), ``_p1``
    and ``_p2`` (the passes' per-block results kept on the device until the batch's ``take_words``)."""

    def _run_chunk(self, key: tuple) -> None:
        device, dtype = key
        pieces = self._pending.pop(key)
        self._fill[key] = 0
        block, _ = self._sizes(device)
        parts_a, parts_b, seg_ids, seg_blocks = [], [], [], []
        # the segments' tails: zeros on both sides (equal, finite, 0), views of one zero tensor
        zeros = torch.zeros(max(take - pa.numel() for _, pa, _, take in pieces), dtype=dtype, device=device)
        for seg, pa, pb, take in pieces:
            pad = take - pa.numel()
            parts_a.append(pa)
            parts_b.append(pb)
            if pad:
                parts_a.append(zeros[:pad])
                parts_b.append(zeros[:pad])
            seg_ids.append(seg)
            seg_blocks.append(take // block)
        ca = torch.cat(parts_a) if len(parts_a) > 1 else parts_a[0]
        cb = torch.cat(parts_b) if len(parts_b) > 1 else parts_b[0]
        del pieces, parts_a, parts_b, zeros
        nb = ca.numel() // block
        view = _INT_VIEW[dtype]
        segs = np.repeat(np.asarray(seg_ids, dtype=np.int64), seg_blocks)  # segment of each block
        if _dense(device, ca.numel()):
            self._dense_chunk(ca, cb, segs, nb, block)
            return
        differ = True
        if device.type == "cpu":  # bits compared as integers first (numpy, at memory speed)
            differ = not bits_equal(ca, cb)
        neq = ca.view(view) != cb.view(view) if differ else None  # (C,)
        if device.type == "cpu" and not has_nonfinite(ca) and not (differ and has_nonfinite(cb)):
            # the common case on the CPU, where every pass over the chunk counts: no NaN/inf on
            # either side, so those counts are 0 and every element is finite (the same numbers as
            # the general pass below, with a fraction of its work)
            p1 = torch.zeros((nb, 6), dtype=torch.int64)
            if differ:
                p1[:, 0] = neq.view(nb, block).sum(1)
            a_eq = (torch.where(~neq, ca, torch.zeros_like(ca)) if differ else ca).to(torch.float64)
        else:
            if neq is None:
                neq = torch.zeros(ca.shape, dtype=torch.bool)
            p1 = _block_counts(neq, ca, cb, nb, block)
            # equal finite elements: |a - b| 0, ULP 0, relative error 0; they add a^2 to sa, sb, sab
            a_eq = torch.where(~neq & torch.isfinite(ca), ca, torch.zeros_like(ca)).to(torch.float64)
        sq_eq = (a_eq * a_eq).view(nb, block).sum(1)  # (nb,) float64
        del a_eq
        # the one synchronisation of this chunk (sq_eq travels as its bits, in the same transfer)
        both = torch.cat([p1, sq_eq.view(torch.int64).unsqueeze(1)], 1).cpu().numpy()
        p1_host = both[:, :6]
        self._fold_p1(segs, p1_host, both[:, 6].copy().view(np.float64))
        hot = np.flatnonzero(p1_host[:, 0])
        if hot.size == 0:
            return
        n_hot = p1_host[hot, 0]
        if dtype != torch.float64 and int(n_hot.sum()) * SPARSE_RATIO <= hot.size * block:
            # differences scattered thinly over many blocks: the float64 pass on them alone
            pos = torch.nonzero(neq).flatten()  # in order, so grouped by block
            stats = element_stats(ca[pos], cb[pos], None, torch.from_numpy(n_hot).to(device), self.tolerance)
        else:
            idx = torch.from_numpy(hot).to(device)
            da = ca.view(nb, block).index_select(0, idx).reshape(-1)  # (k * block,) storage dtype
            db = cb.view(nb, block).index_select(0, idx).reshape(-1)
            del ca, cb
            stats = element_stats(da, db, neq.view(nb, block).index_select(0, idx).reshape(-1), (hot.size, block),
                                  self.tolerance)
        if not _defer(device):
            self._fold_p2(segs[hot], *(t.numpy() for t in stats))
        else:  # stays on the device until results(): one transfer for the whole batch
            self._p2.append((segs[hot],) + stats)

    def _dense_chunk(self, ca: torch.Tensor, cb: torch.Tensor, segs: np.ndarray, nb: int, block: int) -> None:
        """A chunk small enough for the float64 pass on every block at once (:func:`_dense`): both
        passes with no host synchronisation between them, their per-block results kept on the device
        until :meth:`results` (one transfer for the whole batch). A block whose bits are all equal
        adds zeros to every sum, count and maximum, so the numbers are those of the pass on the
        blocks that differ, computed on whole blocks. On a GPU the passes replay from a CUDA graph
        once this chunk's shape has been seen before (:func:`tracer.diff.graphed.run`)."""
        tol = self.tolerance

        def passes(xa: torch.Tensor, xb: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return _dense_passes(xa, xb, nb, block, tol)

        p1, sq_eq, *p2 = graphed.run("dense_chunk", passes, (ca, cb), (nb, block, tol))
        self._p1.append((segs, p1, sq_eq))
        self._p2.append((segs, *p2))

    def _accumulators(self) -> dict[str, np.ndarray]:
        ns = len(self._seg_n)
        have = len(self._acc["p1"]) if self._acc else 0
        if have < ns or not self._acc:  # grow geometrically, zero-filled
            size = max(ns, 2 * have, 16)
            new = {"p1": np.zeros((size, len(_P1)), np.int64), "sq": np.zeros(size, np.float64),
                   "sums": np.zeros((size, len(_P2_SUM)), np.float64),
                   "maxes": np.zeros((size, len(_P2_MAX)), np.float64),
                   "cnt": np.zeros((size, len(_P2_CNT)), np.int64), "max_ulp": np.zeros(size, np.int64)}
            for k, v in self._acc.items():
                new[k][:have] = v
            self._acc = new
        return self._acc

    def _fold_p1(self, segs: np.ndarray, p1: np.ndarray, sq_eq: np.ndarray) -> None:
        acc = self._accumulators()
        _fold(acc["p1"], segs, p1, np.add)
        _fold(acc["sq"], segs, sq_eq, np.add)

    def _fold_p2(self, segs: np.ndarray, sums: np.ndarray, maxes: np.ndarray, cnt: np.ndarray,
                 max_ulp: np.ndarray) -> None:
        acc = self._accumulators()
        _fold(acc["sums"], segs, sums, np.add)
        _fold(acc["maxes"], segs, maxes, np.maximum)
        _fold(acc["cnt"], segs, cnt, np.add)
        _fold(acc["max_ulp"], segs, max_ulp, np.maximum)
