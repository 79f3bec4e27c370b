"""Logits statistics per position: argmax flips with their margins, KL, top-k overlap, rank.

:func:`logits_diff` compares two ``(T, V)`` logits tensors; :class:`LogitsAccumulator` gives the
same numbers, bit for bit, over rows given in blocks (a logits point streamed from disk).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import numpy as np
import torch

from tracer.diff.batch import tensor_diff
from tracer.diff.fetch import fetch_together
from tracer.diff import graphed
from tracer.diff import metrics as _metrics
from tracer.diff.metrics import _EXP_MASK, _INT_VIEW, ArgmaxFlip, LogitsDiff, TensorDiff, _check_pair


def _nan_max(x: float, y: float) -> float:
    """max that propagates NaN."""
    return math.nan if math.isnan(x) or math.isnan(y) else max(x, y)


def _kl_rows(a64: torch.Tensor, b64: torch.Tensor) -> torch.Tensor:
    """``KL(softmax(a) || softmax(b))`` per row of float64 ``(rows, V)`` logits → ``(rows,)`` nats.

    ``sum_v p_v (log p_v - log q_v)``; terms with ``p_v == 0`` are 0, ``q_v == 0 < p_v`` gives
    inf, a NaN logit gives NaN. Tiny negative values from rounding are clamped to 0.
    """
    lp, lq = torch.log_softmax(a64, dim=1), torch.log_softmax(b64, dim=1)  # (rows, V)
    p = lp.exp()
    terms = p * (lp - lq)
    terms = torch.where(p == 0, torch.zeros_like(terms), terms)  # 0 * (-inf - x) is 0, not NaN
    kl = terms.sum(dim=1)
    return torch.where(kl < 0, torch.zeros_like(kl), kl)


def _ulp_gap(top: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Top-1 minus top-2 of float64 ``(rows, k >= 2)`` values sorted descending (each exactly a value of
    ``dtype``, the stored one) in ULPs of ``dtype``: the steps between the two on its number line
    → int64 ``(rows,)`` (0: a tie)."""
    keys = _metrics._ordered_keys(top[:, :2].to(dtype).contiguous().reshape(-1)).reshape(-1, 2)  # (rows, 2)
    return keys[:, 0] - keys[:, 1]


def with_token_texts(logits: LogitsDiff, decode: Callable[[int], str]) -> LogitsDiff:
    """``logits`` with each argmax flip's two tokens decoded (``decode``: one token id → its text,
    e.g. a tokenizer's ``decode([id])``), at most 200 characters each; a token ``decode`` cannot
    decode (an id beyond the vocabulary) keeps None."""
    def text(token: int) -> str | None:
        try:
            return str(decode(token))[:200]
        except Exception:  # noqa: BLE001 - a tokenizer's own error for one id: the id alone is shown
            return None

    flips = tuple(replace(f, text_a=text(f.token_a), text_b=text(f.token_b)) for f in logits.argmax_flips)
    return replace(logits, argmax_flips=flips)


def _overlap(ia: torch.Tensor, ib: torch.Tensor, k: int) -> torch.Tensor:
    """Per-row ``|ia[:, :k] ∩ ib[:, :k]| / k`` of sorted top-k index tensors → float64 ``(rows,)``."""
    ia, ib = ia[:, :k], ib[:, :k]  # (rows, k)
    hits = (ia.unsqueeze(2) == ib.unsqueeze(1)).any(dim=2).sum(dim=1)  # (rows,)
    return hits.to(torch.float64) / k


def logits_diff(a: torch.Tensor, b: torch.Tensor, *, tensor: TensorDiff | None = None) -> LogitsDiff:
    """Compare two logits tensors position by position.

    Args:
        a, b: ``(T, V)`` logits of run A (reference) and run B, same dtype
            (bfloat16/float16/float32/float64), any device. Rows are processed in chunks of
            about :data:`tracer.diff.metrics.CHUNK_ELEMENTS` elements, in float64.

    ``tensor``: the element-wise :class:`TensorDiff` of ``a``/``b`` when the caller already
    computed it (e.g. in a :class:`DiffBatch` with the other capture points).

    Returns:
        a :class:`LogitsDiff`: the element-wise :class:`TensorDiff`, argmax flips with their
        top-2 margins, KL(A||B) mean/max in nats, top-5/top-10 overlap and the worst rank in B of
        A's top token. ``T == 0`` or ``V == 0`` gives an identical-looking result (no flips,
        KL 0, overlaps 1.0).

    Raises:
        ValueError: not 2-D, shapes or dtypes differ, or the dtype is not supported.
    """
    acc = logits_accumulator(a, b)
    return acc.result(tensor if tensor is not None else tensor_diff(a, b))


def logits_accumulator(a: torch.Tensor, b: torch.Tensor) -> LogitsAccumulator:
    """A :class:`LogitsAccumulator` given every row of ``a``/``b`` (as :func:`logits_diff`); its
    :meth:`~LogitsAccumulator.result` gives :func:`logits_diff`'s numbers.

    Raises:
        ValueError: not 2-D, shapes or dtypes differ, or the dtype is not supported.
    """
    b = _check_pair(a, b)
    if a.dim() != 2:
        raise ValueError(f"logits must be (T, V); got shape {tuple(a.shape)}")
    acc = LogitsAccumulator(a.shape[1])
    acc.add(a, b)
    return acc


#: elements of one chunk of logits rows on a CUDA device (float64 temporaries of this size: 128 MiB
#: each); a fixed number, so a comparison online and one from the trace chunk the rows alike
CUDA_CHUNK_ELEMENTS = 1 << 24


def _dense_words(a: torch.Tensor, b: torch.Tensor, v: int) -> torch.Tensor:
    """The float64 statistics of every row of a logits chunk ``a``/``b`` (``(r, v)``, one storage
    dtype), a pure function of them: ``[kl sum, kl max, top-5 sum, top-10 sum, worst rank]`` then
    the ``r`` rows' argmax of A, of B, both top-1 − top-2 margins and both margins in ULPs
    (:meth:`LogitsAccumulator._settle` reads them), float64 ``(5 + 6 r,)``."""
    r = a.shape[0]
    a64, b64 = a.to(torch.float64), b.to(torch.float64)  # (r, V)
    top_a, top_b = a64.argmax(dim=1), b64.argmax(dim=1)  # (r,) first index among ties
    kl = _kl_rows(a64, b64)  # (r,); 0 on rows with equal finite bits
    top_va, top_ia = torch.topk(a64, min(10, v), dim=1)  # (r, k) sorted descending
    top_vb, top_ib = torch.topk(b64, min(10, v), dim=1)
    o5, o10 = _overlap(top_ia, top_ib, min(5, v)), _overlap(top_ia, top_ib, min(10, v))
    rank = (b64 > b64.gather(1, top_a.unsqueeze(1))).sum(dim=1)  # (r,)
    del a64, b64
    if v >= 2:
        ma, mb = top_va[:, 0] - top_va[:, 1], top_vb[:, 0] - top_vb[:, 1]
        ua, ub = _ulp_gap(top_va, a.dtype).to(torch.float64), _ulp_gap(top_vb, a.dtype).to(torch.float64)
    else:  # no flip can exist
        ma = mb = ua = ub = torch.zeros(r, dtype=torch.float64, device=a.device)
    scalars = torch.stack([kl.sum(), kl.max(), o5.sum(), o10.sum(), rank.max().to(torch.float64)])
    # token ids and the ULP gaps of the flips that matter (< 2^53): exact in float64
    rows = torch.stack([top_a.to(torch.float64), top_b.to(torch.float64), ma, mb, ua, ub])
    return torch.cat([scalars, rows.reshape(-1)])


class LogitsAccumulator:
    """:func:`logits_diff`'s per-position statistics over rows given in blocks (a logits point
    streamed from disk), equal bit for bit to one call on the whole ``(T, V)`` pair: rows are
    processed in the same chunks of ``max(1, E // V)`` rows (``E``: ``metrics.CHUNK_ELEMENTS``
    on the CPU, :data:`CUDA_CHUNK_ELEMENTS` on a GPU), a partial chunk waiting (copied) for the
    next block.

    On the CPU only the rows whose bits differ (or hold a NaN/inf) get the float64 work; on a GPU
    every row of a chunk does (equal rows give exactly what is recorded for them elsewhere: KL 0,
    overlaps 1, rank 0, no flip), so a chunk costs a fixed number of kernel launches, whatever its
    data, and its results stay on the device until :meth:`result` (or the comparison's one
    transfer, :func:`~tracer.diff.fetch.fetch_together`) reads them.

    Args:
        vocab: ``V``, the width of every row block.
        dense: every row gets the float64 work (default: on a GPU only).
    """

    def __init__(self, vocab: int, *, dense: bool | None = None) -> None:
        self.v = int(vocab)
        self.dense = dense
        self.rows = 0  # rows per chunk: set by the device of the first rows given
        self.t = 0  # rows processed
        self.flips: list[ArgmaxFlip] = []
        self.kl_sum, self.kl_max, self.ov5, self.ov10, self.worst_rank = 0.0, 0.0, 0.0, 0.0, 0
        self._wait: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending: list[tuple[int, int, torch.Tensor]] = []  # dense chunks: (first row, rows, float64 words)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """The next rows: ``(r, V)`` logits of run A and run B (same dtype; ``b`` moved to ``a``'s device).

        Raises:
            ValueError: not 2-D ``(r, V)``, or dtypes differ or are not supported.
        """
        b = _check_pair(a, b)
        if a.dim() != 2 or a.shape[1] != self.v:
            raise ValueError(f"logits rows must be (r, {self.v}); got shape {tuple(a.shape)}")
        a, b = a.detach(), b.detach()
        if not self.rows:
            per_chunk = CUDA_CHUNK_ELEMENTS if a.device.type == "cuda" else _metrics.CHUNK_ELEMENTS
            self.rows = max(1, per_chunk // self.v) if self.v else 1
        if self._wait is not None:
            wa, wb = self._wait
            self._wait = None
            need = self.rows - wa.shape[0]
            ha, hb = torch.cat([wa, a[:need]]), torch.cat([wb, b[:need]])
            a, b = a[need:], b[need:]
            if ha.shape[0] < self.rows:
                self._wait = (ha, hb)
                return
            self._chunk(ha, hb)
        start = 0
        while a.shape[0] - start >= self.rows:
            self._chunk(a[start:start + self.rows], b[start:start + self.rows])
            start += self.rows
        if start < a.shape[0]:
            self._wait = (a[start:].clone(), b[start:].clone())

    def _chunk(self, a: torch.Tensor, b: torch.Tensor) -> None:
        v, start, r = self.v, self.t, a.shape[0]
        self.t += r
        if v == 0:
            return
        if self.dense or (self.dense is None and a.device.type == "cuda"):
            self._dense(a, b, start)
            return
        # rows whose bits are equal and finite contribute KL 0, overlaps 1, rank 0 and no flip:
        # the float64 work runs on the other rows only, its results scattered into full-length
        # vectors so every sum adds the same values in the same order as over all rows
        view = _INT_VIEW[a.dtype]
        mask = _EXP_MASK[a.dtype]
        if a.device.type == "cpu":  # numpy's integer passes run at memory speed
            ia, ib = a.view(view).numpy(), b.view(view).numpy()
            busy = torch.from_numpy((ia != ib).any(axis=1) | (np.bitwise_and(ia, mask) == mask).any(axis=1))
        else:
            busy = (a.view(view) != b.view(view)).any(dim=1) | ((a.view(view) & mask) == mask).any(dim=1)
        rows = torch.nonzero(busy).flatten()
        kl = torch.zeros(r, dtype=torch.float64, device=a.device)
        o5 = torch.ones(r, dtype=torch.float64, device=a.device)
        o10 = torch.ones(r, dtype=torch.float64, device=a.device)
        if rows.numel():
            self._rows(a.index_select(0, rows), b.index_select(0, rows), rows, start, kl, o5, o10)
        self.kl_sum += float(kl.sum())
        self.kl_max = _nan_max(self.kl_max, float(kl.max()))
        self.ov5 += float(o5.sum())
        self.ov10 += float(o10.sum())

    def _rows(self, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, start: int, kl: torch.Tensor,
              o5: torch.Tensor, o10: torch.Tensor) -> None:
        """The float64 statistics of the rows ``rows`` (of the chunk starting at ``start``), given as ``a``/``b``."""
        v = self.v
        a64 = a.to(torch.float64)  # (r, V)
        b64 = b.to(torch.float64)  # (r, V)
        top_a, top_b = a64.argmax(dim=1), b64.argmax(dim=1)  # (r,) first index among ties
        kl[rows] = _kl_rows(a64, b64)  # (r,)
        top_va, top_ia = torch.topk(a64, min(10, v), dim=1)  # (r, k) sorted descending
        top_vb, top_ib = torch.topk(b64, min(10, v), dim=1)  # ties broken by torch.topk
        o5[rows] = _overlap(top_ia, top_ib, min(5, v))
        o10[rows] = _overlap(top_ia, top_ib, min(10, v))
        b_at_a_top = b64.gather(1, top_a.unsqueeze(1))  # (r, 1)
        rank = (b64 > b_at_a_top).sum(dim=1)  # (r,)
        self.worst_rank = max(self.worst_rank, int(rank.max()))
        flip_rows = torch.nonzero(top_a != top_b).flatten()
        if flip_rows.numel():
            ta, tb = top_va[flip_rows], top_vb[flip_rows]  # (f, k); V >= 2 when a flip exists
            ma, mb = ta[:, 0] - ta[:, 1], tb[:, 0] - tb[:, 1]  # top-1 minus top-2
            ua, ub = _ulp_gap(ta, a.dtype).tolist(), _ulp_gap(tb, a.dtype).tolist()
            where = rows[flip_rows].tolist()
            for i, r in enumerate(flip_rows.tolist()):
                self.flips.append(ArgmaxFlip(position=start + where[i], token_a=int(top_a[r]), token_b=int(top_b[r]),
                                             margin_a=float(ma[i]), margin_b=float(mb[i]), ulps_a=ua[i], ulps_b=ub[i]))

    def _dense(self, a: torch.Tensor, b: torch.Tensor, start: int) -> None:
        """:meth:`_chunk` on a GPU: the float64 statistics of every row, kept on the device
        (:meth:`pending_words`); replayed from a CUDA graph once this chunk's shape has been seen
        before (:func:`tracer.diff.graphed.run`)."""
        v = self.v
        (words,) = graphed.run("logits_rows", lambda xa, xb: (_dense_words(xa, xb, v),), (a, b), (v,))
        # read on the host with the rest of the comparison (fetch_together), in chunk order
        self._pending.append((start, a.shape[0], words))

    def pending_words(self) -> list[torch.Tensor]:
        """The dense chunks' statistics still on the device (the rows waiting for a chunk are
        processed first), as flat int64 tensors; their host copies go to :meth:`take_words`."""
        self._finish_wait()
        return [words.view(torch.int64) for _, _, words in self._pending]

    def take_words(self, host: list[np.ndarray]) -> None:
        """Add the host copies of :meth:`pending_words` (same order), chunk by chunk."""
        for (start, r, _), words in zip(self._pending, host):
            self._settle(start, r, words.view(np.float64).tolist())
        self._pending = []

    def _finish_wait(self) -> None:
        if self._wait is not None:
            wa, wb = self._wait
            self._wait = None
            self._chunk(wa, wb)

    def _settle(self, start: int, r: int, host: list[float]) -> None:
        """One dense chunk's statistics, read on the host: ``[kl sum, kl max, top-5 sum, top-10 sum,
        worst rank]`` then the ``r`` rows' argmax of A, of B, both top-1 − top-2 margins and both
        margins in ULPs."""
        kl_sum, kl_max, ov5, ov10, worst = host[:5]
        self.kl_sum += kl_sum
        self.kl_max = _nan_max(self.kl_max, kl_max)
        self.ov5 += ov5
        self.ov10 += ov10
        self.worst_rank = max(self.worst_rank, int(worst))
        ta, tb, mas, mbs, uas, ubs = (host[5 + i * r:5 + (i + 1) * r] for i in range(6))
        for i in range(r):
            if ta[i] != tb[i]:
                self.flips.append(ArgmaxFlip(position=start + i, token_a=int(ta[i]), token_b=int(tb[i]),
                                             margin_a=mas[i], margin_b=mbs[i], ulps_a=int(uas[i]), ulps_b=int(ubs[i])))

    def add_equal(self, rows: int) -> None:
        """The next ``rows`` rows, known to be bitwise equal in both runs and finite (checked by the
        caller): KL 0, overlaps 1, rank 0, no flip, exactly what :meth:`add` would add for them
        (the sums involved are of zeros and of whole row counts, exact in any grouping)."""
        # rows waiting for a chunk: processed as any (they may differ); the chunks before these rows
        # are added first, so the sums add the same values in the same order as one call would
        fetch_together(self)
        self.t += rows
        if self.v and rows:
            self.kl_max = _nan_max(self.kl_max, 0.0)
            self.ov5 += float(rows)
            self.ov10 += float(rows)

    def result(self, tensor: TensorDiff) -> LogitsDiff:
        """The :class:`LogitsDiff` of every row given, with the element-wise ``tensor`` statistics
        (what is still on the device is read first, unless :func:`~tracer.diff.fetch.fetch_together` did)."""
        fetch_together(self)
        t = self.t
        if t == 0 or self.v == 0:
            return LogitsDiff(tensor, t, (), 0.0, 0.0, 1.0, 1.0, 0)
        return LogitsDiff(tensor=tensor, n_positions=t, argmax_flips=tuple(self.flips), kl_mean=self.kl_sum / t,
                          kl_max=self.kl_max, top5_overlap=self.ov5 / t, top10_overlap=self.ov10 / t,
                          rank_of_a_top_in_b_max=self.worst_rank)
