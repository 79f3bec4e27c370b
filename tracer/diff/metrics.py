"""Pure numeric functions of two aligned tensors: bit diffs, abs/rel error, ULPs, logits statistics.

Inputs are two torch tensors of the same shape and the same floating dtype (bfloat16, float16,
float32 or float64), compared element by element in the **storage dtype** (bit patterns) and in
float64 (differences). Work happens on the tensors' device, in flat chunks of
:data:`CHUNK_ELEMENTS` elements, so a ``(1000, 151936)`` bf16 logits tensor never materialises
whole in float64. Nothing here imports the rest of tracer.

Conventions, applied by every function:

- **Differing** means bitwise different in the storage dtype. NaN vs NaN with the same bits is
  equal; different NaN payloads differ; ``+0`` vs ``-0`` differ (abs diff 0, 1 ULP).
- **ULP distance** (:func:`ulp_distance`): the number of steps between the two bit patterns on the
  ordered line of every non-NaN bit pattern of the dtype::

      -inf < -max < ... < -min_subnormal < -0 < +0 < +min_subnormal < ... < +max < +inf

  ``-0`` and ``+0`` are distinct adjacent points (distance 1), so ULP 0 holds exactly when the
  bits are equal, and ``ulp_hist[0] == n_total - n_diff`` always. Crossing zero counts every
  pattern in between: ``-min_subnormal`` vs ``+min_subnormal`` is 3 (via ``-0`` and ``+0``).
  Any NaN with differing bits gives :data:`ULP_NAN`; a float64 distance too large for int64
  (only across zero between huge magnitudes) saturates at :data:`ULP_SATURATED`.
- **Non-finite values**: a position whose bits differ and where either side is NaN, or where the
  float64 difference is infinite (inf vs anything else), contributes ``inf`` to the abs diff;
  equal bits contribute 0. ``rel_error``, ``cosine`` and ``sqnr_db`` are computed over the
  positions where both sides are finite; non-finite mismatches show up in ``n_diff``,
  ``max_abs_diff = inf`` and the NaN/inf counts.
- **Empty tensors** compare as identical: counts and errors 0, ``cosine`` 1.0, ``sqnr_db`` inf,
  ``frac_rel_lt_*`` 1.0, top-k overlaps 1.0 (the values an identical pair gets, so an empty
  window never reads as a divergence).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from tracer.dtypes import FLOATS, INT_VIEW

#: dtype → the signed integer dtype of the same width, used to read bit patterns
_INT_VIEW = INT_VIEW
#: ULP distance reported when the bits differ and either side is NaN (lands in the ``>16`` bin)
ULP_NAN = torch.iinfo(torch.int64).max
#: ULP distance reported for a float64 pair whose true distance does not fit in int64
ULP_SATURATED = ULP_NAN - 1
#: labels of the bins of ``TensorDiff.ulp_hist`` (inclusive ULP ranges)
ULP_BINS = ("0", "1", "2", "3-4", "5-8", "9-16", ">16")
_ULP_EDGES = (0, 1, 2, 4, 8, 16)  # upper edges: bin i holds (edges[i-1], edges[i]], the last > 16
#: elements processed per chunk on the CPU (float64 temporaries of this size: 8 MiB each)
CHUNK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class TensorDiff:
    """Element-wise comparison of two same-shape, same-dtype tensors A (reference) and B.

    Attributes:
        n_total: number of elements compared.
        n_diff: elements whose bit patterns differ in the storage dtype.
        max_abs_diff, mean_abs_diff: of ``|a - b|`` in float64 over all elements (``inf`` where a
            NaN/inf mismatch sits; equal bits give 0); in the tensors' units.
        max_ulp: largest ULP distance in the storage dtype (see :func:`ulp_distance`).
        ulp_hist: element counts per ULP bin ``0, 1, 2, 3-4, 5-8, 9-16, >16`` (:data:`ULP_BINS`);
            sums to ``n_total``.
        rel_error: ``||a - b||_2 / ||a||_2`` over the positions where both are finite
            (0 if both are zero there; ``inf`` if ``a`` is zero and ``b`` is not).
        cosine: cosine similarity of the flattened finite positions (1.0 when identical, incl.
            both zero; 0.0 when exactly one side is all zero).
        sqnr_db: ``10 * log10(||a||^2 / ||a - b||^2)`` in dB over the finite positions
            (``inf`` when identical there; ``-inf`` when ``a`` is zero and ``b`` is not).
        frac_rel_lt_1e3, frac_rel_lt_5e3: share of all elements with ``|a - b| / |a|`` below
            1e-3 and 5e-3 (msprobe's 1‰/5‰ ratios); where ``a == 0`` an element counts only if
            ``b == 0`` too; equal bits always count.
        n_nan_a, n_nan_b, n_inf_a, n_inf_b: NaN and ±inf counts on each side.
        max_ulp_mag: the largest ``|a - b| / ulp(max(|a|, |b|))`` over differing elements: the
            difference measured in units of the spacing of the storage dtype at the larger
            magnitude (:func:`ulp_of`). Equals the ULP distance where both values share a binade,
            but stays proportionate where a value crosses zero (``-1e-5`` vs ``+1e-5`` in bf16:
            336, twice the magnitude's 168 ulps, not the 28241 steps of ``max_ulp``); ``inf`` for a NaN/inf mismatch, 0.0 when identical.
        n_nan_payload: differing elements that are NaN in both runs (only the payload bits
            differ); reported as "NaN in both runs (payload differs)".
    """

    n_total: int
    n_diff: int
    max_abs_diff: float
    mean_abs_diff: float
    max_ulp: int
    ulp_hist: tuple[int, ...]
    rel_error: float
    cosine: float
    sqnr_db: float
    frac_rel_lt_1e3: float
    frac_rel_lt_5e3: float
    n_nan_a: int
    n_nan_b: int
    n_inf_a: int
    n_inf_b: int
    max_ulp_mag: float = 0.0
    n_nan_payload: int = 0

    @property
    def identical(self) -> bool:
        """True when every element is bitwise equal."""
        return self.n_diff == 0

    @property
    def nan_payload_only(self) -> bool:
        """True when every differing element is NaN in both runs (only the NaN payload differs)."""
        return self.n_diff > 0 and self.n_nan_payload == self.n_diff

    @property
    def has_nan(self) -> bool:
        """True when either side holds a NaN."""
        return self.n_nan_a > 0 or self.n_nan_b > 0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (floats may be ``inf``/``nan``; tuples become lists)."""
        d = asdict(self)
        d["ulp_hist"] = list(self.ulp_hist)
        return d


@dataclass(frozen=True)
class ArgmaxFlip:
    """One position whose top-1 token differs between the runs.

    Attributes:
        position: index within the compared window (the caller adds the window's start).
        token_a, token_b: the argmax token id in run A and in run B.
        margin_a, margin_b: top-1 minus top-2 logit in that run (float64 of the stored values).
    """

    position: int
    token_a: int
    token_b: int
    margin_a: float
    margin_b: float

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict."""
        return asdict(self)


@dataclass(frozen=True)
class LogitsDiff:
    """Comparison of two logits tensors of shape ``(T, V)``.

    Attributes:
        tensor: the element-wise :class:`TensorDiff` of the whole ``(T, V)`` tensor.
        n_positions: ``T``.
        argmax_flips: positions whose argmax differs, in position order.
        kl_mean, kl_max: ``KL(softmax(a) || softmax(b))`` per position, in nats, computed in
            float64; mean and max over positions (NaN if a logit is NaN).
        top5_overlap, top10_overlap: mean over positions of ``|topk(a) ∩ topk(b)| / k``
            (``k`` capped at ``V``; ties at the k-th value are broken by ``torch.topk``).
        rank_of_a_top_in_b_max: worst over positions of the 0-based rank, in B, of A's argmax
            token (rank = number of B logits strictly greater than it).
    """

    tensor: TensorDiff
    n_positions: int
    argmax_flips: tuple[ArgmaxFlip, ...]
    kl_mean: float
    kl_max: float
    top5_overlap: float
    top10_overlap: float
    rank_of_a_top_in_b_max: int

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (nested records become dicts, tuples lists)."""
        return {
            "tensor": self.tensor.to_dict(),
            "n_positions": self.n_positions,
            "argmax_flips": [f.to_dict() for f in self.argmax_flips],
            "kl_mean": self.kl_mean,
            "kl_max": self.kl_max,
            "top5_overlap": self.top5_overlap,
            "top10_overlap": self.top10_overlap,
            "rank_of_a_top_in_b_max": self.rank_of_a_top_in_b_max,
        }


def _check_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Validate a pair and return ``b`` on ``a``'s device. Raises ValueError."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ValueError(f"expected two torch tensors, got {type(a).__name__} and {type(b).__name__}")
    if a.dtype != b.dtype:
        raise ValueError(f"dtype mismatch: {a.dtype} vs {b.dtype}; compare tensors of one storage dtype")
    if a.dtype not in _INT_VIEW:
        raise ValueError(f"unsupported dtype {a.dtype}; use bfloat16, float16, float32 or float64")
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs {tuple(b.shape)}; align the runs first")
    return b.to(a.device)


def _ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """Map the bit patterns of flat float tensor ``x`` to int64 points on the monotonic line.

    ``+0`` → 0, ``+v`` → its bit pattern, ``-0`` → -1, ``-v`` → ``-(magnitude bits) - 1``.
    """
    bits = x.view(_INT_VIEW[x.dtype]).to(torch.int64)  # sign-extended: negative iff sign bit set
    mag = bits & ((1 << (x.element_size() * 8 - 1)) - 1)  # the pattern without its sign bit
    return torch.where(bits >= 0, bits, -mag - 1)


def _ulp_flat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """ULP distance of two flat same-dtype tensors on one device → int64 tensor."""
    ka, kb = _ordered_keys(a), _ordered_keys(b)
    if a.dtype == torch.float64:
        # |ka - kb| can exceed int64 only across zero: split into the two sides of the line
        hi, lo = torch.maximum(ka, kb), torch.minimum(ka, kb)
        cross = (hi >= 0) & (lo < 0)
        p, q = hi, -(lo + 1)  # both in [0, 2**63 - 1] where cross; distance = p + q + 1
        overflow = cross & (p > ULP_SATURATED - q)
        dist = torch.where(cross, p + q + 1, hi - lo)  # may wrap where overflow: replaced below
        dist = torch.where(overflow, torch.full_like(dist, ULP_SATURATED), dist)
    else:
        dist = (ka - kb).abs()
    nan = (torch.isnan(a) | torch.isnan(b)) & (dist != 0)
    return torch.where(nan, torch.full_like(dist, ULP_NAN), dist)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-element ULP distance between ``a`` and ``b`` in their storage dtype.

    Args:
        a, b: same shape, same dtype (bfloat16/float16/float32/float64), any device.

    Returns:
        int64 tensor of ``a``'s shape on ``a``'s device: 0 iff the bits are equal; the number of
        steps between the patterns on the ordered line ``-inf ... -0 < +0 ... +inf`` (``-0`` and
        ``+0`` are 1 apart, subnormals are the small steps next to zero); :data:`ULP_NAN`
        (int64 max) when the bits differ and either side is NaN; :data:`ULP_SATURATED` for a
        float64 pair whose distance exceeds int64.

    Raises:
        ValueError: shapes or dtypes differ, or the dtype is not one of the four above.
    """
    b = _check_pair(a, b)
    return _ulp_flat(a.detach().reshape(-1), b.detach().reshape(-1)).reshape(a.shape)


#: dtype → (explicit mantissa bits, exponent of the smallest normal number)
_FLOAT_LAYOUT = {f.torch: (f.mantissa_bits, f.emin) for f in FLOATS.values()}


def ulp_of(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at magnitude ``|x|``: the gap from ``|x|`` to the next larger value.

    Args:
        x: any real tensor (read as float64).
        dtype: bfloat16, float16, float32 or float64.

    Returns:
        float64 tensor of ``x``'s shape: ``2**(e - p)`` for ``2**e <= |x| < 2**(e+1)`` with ``p``
        the dtype's explicit mantissa bits; the subnormal spacing ``2**(emin - p)`` below the
        smallest normal (and at 0); NaN/inf where ``x`` is.

    Raises:
        ValueError: unsupported dtype.
    """
    if dtype not in _FLOAT_LAYOUT:
        raise ValueError(f"unsupported dtype {dtype}; use bfloat16, float16, float32 or float64")
    p, emin = _FLOAT_LAYOUT[dtype]
    ax = x.to(torch.float64).abs()
    _, e = torch.frexp(ax)  # ax = m * 2**e, m in [0.5, 1): 2**(e-1) <= ax < 2**e
    e = torch.where(ax == 0, torch.full_like(ax, emin), torch.clamp(e.to(torch.float64) - 1, min=emin))
    spacing = torch.pow(torch.full_like(ax, 2.0), e - p)
    return torch.where(torch.isfinite(ax), spacing, ax)


def _abs_diff(a64: torch.Tensor, b64: torch.Tensor) -> torch.Tensor:
    """float64 ``|a - b|`` at positions whose bits differ: a NaN on either side gives inf."""
    d = (a64 - b64).abs()
    return torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)


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


#: dtype → the mask of its exponent bits (all set: inf or NaN), as the signed integer of its width
_EXP_MASK = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F800000,
             torch.float64: 0x7FF0000000000000}


#: elements per slice of the integer passes below (their temporaries stay in the CPU's caches)
_SLICE = 1 << 20


def has_nonfinite(x: torch.Tensor) -> bool:
    """True when the tensor ``x`` (bfloat16/float16/float32/float64) holds an inf or NaN, read
    from its bits: a positive one is an integer ``>=`` the exponent mask, a negative one an unsigned
    integer ``>=`` sign bit | mask. On the CPU two numpy maxima per slice, at memory speed."""
    mask = _EXP_MASK[x.dtype]
    bits = x.reshape(-1).view(_INT_VIEW[x.dtype])
    if bits.numel() == 0:
        return False
    if bits.device.type != "cpu":
        return bool(((bits & mask) == mask).any())
    signed = bits.numpy()
    unsigned = signed.view(f"u{signed.itemsize}")
    neg = (1 << (8 * signed.itemsize - 1)) | mask
    for i in range(0, signed.size, _SLICE):
        if int(signed[i:i + _SLICE].max()) >= mask or int(unsigned[i:i + _SLICE].max()) >= neg:
            return True
    return False


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two same-shape, same-dtype tensors hold the same bit patterns (NaN payloads, ±0
    included); on the CPU a numpy comparison of the raw integers, slice by slice, at memory speed."""
    view = _INT_VIEW[a.dtype]
    ia, ib = a.reshape(-1).view(view), b.reshape(-1).view(view)
    if ia.device.type != "cpu" or ib.device.type != "cpu":
        return bool(torch.equal(ia, ib))
    na, nb = ia.numpy(), ib.numpy()
    return all(np.array_equal(na[i:i + _SLICE], nb[i:i + _SLICE]) for i in range(0, na.size, _SLICE))


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


#: elements per block of the per-block partial reductions (a segment is padded to whole blocks)
BLOCK_ELEMENTS = 2048
#: a chunk's blocks holding a difference get the float64 pass on their differing elements alone
#: (gathered) when at most 1/SPARSE_RATIO of their elements differ, else on the whole blocks
SPARSE_RATIO = 4
_ULP_BIG = 1 << 40  # above any ULP distance of a <= 32-bit dtype
#: most elements per chunk on a CUDA device (float64 temporaries of this size: 512 MiB each);
#: fewer when the device has less than 256 bytes free per element
CUDA_CHUNK_ELEMENTS = 1 << 26

# columns of the per-block statistics (pass 1: every block; pass 2: blocks with a difference)
_P1 = ("n_diff", "n_nan_a", "n_nan_b", "n_inf_a", "n_inf_b", "n_nan_payload")  # int64
_P2_SUM = ("sum_abs", "sa", "sb", "sab", "sdd")  # float64 sums over the differing elements
_P2_MAX = ("max_abs", "max_ulp_mag")  # float64 maxima
_P2_CNT = ("rel3", "rel5", "tol") + tuple(f"ulp_gt_{e}" for e in _ULP_EDGES[1:])  # int64 counts


class DiffBatch:
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
       their differing elements alone when at most 1/:data:`SPARSE_RATIO` of them differ, else
       on the whole blocks.

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
        fa, fb = a.detach().reshape(-1), b.detach().reshape(-1)
        n = fa.numel()
        cuts = [0, n] if split is None else [0, min(max(int(split), 0), n), n]
        segs = []
        for lo, hi in zip(cuts, cuts[1:]):
            seg = len(self._seg_n)
            self._seg_n.append(hi - lo)
            segs.append(seg)
            self._queue(seg, fa[lo:hi], fb[lo:hi])
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
            row = np.array([[0, nan, nan, inf, inf, 0]], dtype=np.int64)
            self._fold_p1(np.array([seg]), row, np.zeros(1))
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
            chunk = CHUNK_ELEMENTS
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
            pa, pb = fa[start:start + take], fb[start:start + take]
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

    # -- the two passes ----------------------------------------------------------------------------
    def _run_chunk(self, key: tuple) -> None:
        device, dtype = key
        pieces = self._pending.pop(key)
        self._fill[key] = 0
        block, _ = self._sizes(device)
        parts_a, parts_b, seg_ids, seg_blocks = [], [], [], []
        for seg, pa, pb, take in pieces:
            pad = take - pa.numel()  # the segment's tail: zeros on both sides (equal, finite, 0)
            parts_a.append(pa)
            parts_b.append(pb)
            if pad:
                z = torch.zeros(pad, dtype=dtype, device=device)
                parts_a.append(z)
                parts_b.append(z)
            seg_ids.append(seg)
            seg_blocks.append(take // block)
        ca = torch.cat(parts_a) if len(parts_a) > 1 else parts_a[0]
        cb = torch.cat(parts_b) if len(parts_b) > 1 else parts_b[0]
        del pieces, parts_a, parts_b
        nb = ca.numel() // block
        view = _INT_VIEW[dtype]
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
            p1 = torch.stack([
                neq.view(nb, block).sum(1),
                torch.isnan(ca).view(nb, block).sum(1), torch.isnan(cb).view(nb, block).sum(1),
                torch.isinf(ca).view(nb, block).sum(1), torch.isinf(cb).view(nb, block).sum(1),
                (neq & torch.isnan(ca) & torch.isnan(cb)).view(nb, block).sum(1),
            ], dim=1)  # (nb, 6) int64
            # equal finite elements: |a - b| 0, ULP 0, relative error 0; they add a^2 to sa, sb, sab
            a_eq = torch.where(~neq & torch.isfinite(ca), ca, torch.zeros_like(ca)).to(torch.float64)
        sq_eq = (a_eq * a_eq).view(nb, block).sum(1)  # (nb,) float64
        del a_eq
        # the one synchronisation of this chunk (sq_eq travels as its bits, in the same transfer)
        both = torch.cat([p1, sq_eq.view(torch.int64).unsqueeze(1)], 1).cpu().numpy()
        p1_host = both[:, :6]
        segs = np.repeat(np.asarray(seg_ids, dtype=np.int64), seg_blocks)  # segment of each block
        self._fold_p1(segs, p1_host, both[:, 6].copy().view(np.float64))
        hot = np.flatnonzero(p1_host[:, 0])
        if hot.size == 0:
            return
        n_hot = p1_host[hot, 0]
        if dtype != torch.float64 and int(n_hot.sum()) * SPARSE_RATIO <= hot.size * block:
            # differences scattered thinly over many blocks: the float64 pass on them alone
            pos = torch.nonzero(neq).flatten()  # in order, so grouped by block
            stats = self._heavy(ca[pos], cb[pos], None, torch.from_numpy(n_hot).to(device))
        else:
            idx = torch.from_numpy(hot).to(device)
            da = ca.view(nb, block).index_select(0, idx).reshape(-1)  # (k * block,) storage dtype
            db = cb.view(nb, block).index_select(0, idx).reshape(-1)
            del ca, cb
            stats = self._heavy(da, db, neq.view(nb, block).index_select(0, idx).reshape(-1), (hot.size, block))
        if device.type == "cpu":
            self._fold_p2(segs[hot], *(t.numpy() for t in stats))
        else:  # stays on the device until results(): one transfer for the whole batch
            self._p2.append((segs[hot],) + stats)

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

    def _heavy(self, da: torch.Tensor, db: torch.Tensor, m: torch.Tensor | None,
               groups: tuple[int, int] | torch.Tensor):
        """Float64 statistics of differing elements → per-group ``(k, .)`` tensors.

        Dense form: ``da``/``db`` are ``k`` whole blocks (``groups = (k, block)``) and ``m`` marks
        the differing elements. Sparse form: ``da``/``db`` hold only differing elements
        (``m`` None), grouped by block, ``groups`` the ``(k,)`` element count of each block
        (reduced with ``torch.segment_reduce``: one thread per group and column, in order).
        """
        a64, b64 = da.to(torch.float64), db.to(torch.float64)
        zero = torch.zeros((), dtype=torch.float64, device=da.device)

        def masked(x: torch.Tensor) -> torch.Tensor:
            return x if m is None else torch.where(m, x, zero)

        def flag(x: torch.Tensor) -> torch.Tensor:
            return x if m is None else m & x

        d = masked(_abs_diff(a64, b64))  # inf for NaN/inf mismatches, 0 where equal
        ulp = _ulp_flat(da, db)  # 0 where the bits are equal
        mag = d / ulp_of(torch.maximum(a64.abs(), b64.abs()), da.dtype)  # inf/NaN where non-finite
        mag = masked(torch.where(torch.isnan(mag), torch.full_like(mag, math.inf), mag))
        # relative error per element: a == 0 counts only when b == 0 too (here: -0 vs +0)
        abs_a = a64.abs()
        zero_a = abs_a == 0
        rel = d / torch.where(zero_a, torch.ones_like(abs_a), abs_a)  # NaN/inf where non-finite
        both_zero = zero_a & (b64 == 0)
        counts = [flag(both_zero | (~zero_a & (rel < 1e-3))), flag(both_zero | (~zero_a & (rel < 5e-3)))]
        if self.tolerance is not None:
            atol, rtol = self.tolerance
            counts.append(flag(~(torch.isfinite(d) & (d <= atol + rtol * abs_a))))
        else:
            counts.append(torch.zeros_like(zero_a))
        counts += [ulp > e for e in _ULP_EDGES[1:]]  # equal bits have ULP 0: never counted
        del rel, both_zero, zero_a
        finite = flag(torch.isfinite(a64) & torch.isfinite(b64))
        fa = torch.where(finite, a64, zero)
        fb = torch.where(finite, b64, zero)
        if not isinstance(groups, tuple):  # sparse: segment reductions over the groups
            dd = fa - fb
            per_sum = torch.stack([d, fa * fa, fb * fb, fa * fb, dd * dd] + [c.to(torch.float64) for c in counts], 1)
            # ULP distances of <= 32-bit dtypes are below 2**33 (exact in float64); only the NaN
            # sentinel is larger: clamped here, restored below
            per_max = torch.stack([d, mag, ulp.clamp(max=_ULP_BIG).to(torch.float64)], 1)
            s = torch.segment_reduce(per_sum, "sum", lengths=groups, axis=0)
            x = torch.segment_reduce(per_max, "max", lengths=groups, axis=0)
            u = x[:, 2]
            max_ulp = torch.where(u >= _ULP_BIG, torch.full_like(u, ULP_NAN, dtype=torch.int64), u.to(torch.int64))
            return s[:, :5].contiguous(), x[:, :2].contiguous(), s[:, 5:].round().to(torch.int64), max_ulp
        k, block = groups
        x = torch.stack([fa, fb, fa - fb], dim=1).view(k, block, 3)
        del fa, fb
        gram = torch.bmm(x.transpose(1, 2), x)  # (k, 3, 3): per block a.a, b.b, a.b, (a-b).(a-b) in one GEMM
        sums = torch.stack([d.view(k, block).sum(1), gram[:, 0, 0], gram[:, 1, 1], gram[:, 0, 1], gram[:, 2, 2]], 1)
        maxes = torch.stack([d.view(k, block).amax(1), mag.view(k, block).amax(1)], 1)
        cnt = torch.stack([c.view(k, block).sum(1) for c in counts], 1)
        return sums, maxes, cnt, ulp.view(k, block).amax(1)

    # -- results -----------------------------------------------------------------------------------
    def results(self) -> list[TensorDiff]:
        """One :class:`TensorDiff` per :meth:`add`, in order (computes what is still queued)."""
        if self._done is not None:
            return self._done
        for index in sorted(self._open):
            self.close(index)
        self._flush()
        if self._p2:  # one transfer per kind of statistic
            segs = np.concatenate([p[0] for p in self._p2])
            self._fold_p2(segs, *(torch.cat([p[i] for p in self._p2]).cpu().numpy() for i in range(1, 5)))
            self._p2 = []
        acc = self._accumulators()
        p1, sq, sums, maxes, cnt, max_ulp = (acc[k] for k in ("p1", "sq", "sums", "maxes", "cnt", "max_ulp"))
        out, tol = [], []
        for segs in self._pairs:
            n = int(sum(self._seg_n[s] for s in segs))
            q1 = p1[segs].sum(0)
            q2 = sums[segs].sum(0)
            c = cnt[segs].sum(0)
            mx = maxes[segs].max(0)
            n_diff = int(q1[0])
            sa, sb, sab, sdd = (float(x) for x in q2[1:])
            s_eq = float(sq[segs].sum())
            sa, sb, sab = sa + s_eq, sb + s_eq, sab + s_eq
            if sdd == 0.0:
                rel_error, cosine, sqnr = 0.0, 1.0, math.inf
            else:
                rel_error = math.sqrt(sdd) / math.sqrt(sa) if sa > 0 else math.inf
                sqnr = 10.0 * math.log10(sa / sdd) if sa > 0 else -math.inf
                cosine = 0.0 if sa == 0.0 or sb == 0.0 else max(-1.0, min(1.0, sab / (math.sqrt(sa) * math.sqrt(sb))))
            above = [n_diff] + [int(x) for x in c[3:]]  # elements above each ULP edge
            hist = [n - n_diff] + [above[i - 1] - (above[i] if i < len(above) else 0) for i in range(1, len(ULP_BINS))]
            out.append(TensorDiff(
                n_total=n, n_diff=n_diff, max_abs_diff=float(mx[0]), mean_abs_diff=float(q2[0]) / n if n else 0.0,
                max_ulp=int(max_ulp[segs].max()) if segs else 0, ulp_hist=tuple(hist),
                rel_error=rel_error, cosine=cosine, sqnr_db=sqnr,
                frac_rel_lt_1e3=(n - n_diff + int(c[0])) / n if n else 1.0,
                frac_rel_lt_5e3=(n - n_diff + int(c[1])) / n if n else 1.0,
                n_nan_a=int(q1[1]), n_nan_b=int(q1[2]), n_inf_a=int(q1[3]), n_inf_b=int(q1[4]),
                max_ulp_mag=float(mx[1]), n_nan_payload=int(q1[5]),
            ))
            tol.append(int(c[2]))
        self._segment_diff = p1[:len(self._seg_n), 0].copy()
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
            about :data:`CHUNK_ELEMENTS` elements, in float64.

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
    b = _check_pair(a, b)
    if a.dim() != 2:
        raise ValueError(f"logits must be (T, V); got shape {tuple(a.shape)}")
    acc = LogitsAccumulator(a.shape[1])
    acc.add(a, b)
    return acc.result(tensor if tensor is not None else tensor_diff(a, b))


class LogitsAccumulator:
    """:func:`logits_diff`'s per-position statistics over rows given in blocks (a logits point
    streamed from disk), equal bit for bit to one call on the whole ``(T, V)`` pair: rows are
    processed in the same chunks of ``max(1, CHUNK_ELEMENTS // V)`` rows, a partial chunk waiting
    (copied) for the next block.

    Args:
        vocab: ``V``, the width of every row block.
    """

    def __init__(self, vocab: int) -> None:
        self.v = int(vocab)
        self.rows = max(1, CHUNK_ELEMENTS // self.v) if self.v else 1
        self.t = 0  # rows processed
        self.flips: list[ArgmaxFlip] = []
        self.kl_sum, self.kl_max, self.ov5, self.ov10, self.worst_rank = 0.0, 0.0, 0.0, 0.0, 0
        self._wait: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """The next rows: ``(r, V)`` logits of run A and run B (same dtype; ``b`` moved to ``a``'s device).

        Raises:
            ValueError: not 2-D ``(r, V)``, or dtypes differ or are not supported.
        """
        b = _check_pair(a, b)
        if a.dim() != 2 or a.shape[1] != self.v:
            raise ValueError(f"logits rows must be (r, {self.v}); got shape {tuple(a.shape)}")
        a, b = a.detach(), b.detach()
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
            ma, mb = top_va[flip_rows], top_vb[flip_rows]  # (f, k); V >= 2 when a flip exists
            ma, mb = ma[:, 0] - ma[:, 1], mb[:, 0] - mb[:, 1]  # top-1 minus top-2
            where = rows[flip_rows].tolist()
            for i, r in enumerate(flip_rows.tolist()):
                self.flips.append(ArgmaxFlip(position=start + where[i], token_a=int(top_a[r]), token_b=int(top_b[r]),
                                             margin_a=float(ma[i]), margin_b=float(mb[i])))

    def add_equal(self, rows: int) -> None:
        """The next ``rows`` rows, known to be bitwise equal in both runs and finite (checked by the
        caller): KL 0, overlaps 1, rank 0, no flip, exactly what :meth:`add` would add for them
        (the sums involved are of zeros and of whole row counts, exact in any grouping)."""
        if self._wait is not None:  # rows waiting for a chunk: processed as any (they may differ)
            wa, wb = self._wait
            self._wait = None
            self._chunk(wa, wb)
        self.t += rows
        if self.v and rows:
            self.kl_max = _nan_max(self.kl_max, 0.0)
            self.ov5 += float(rows)
            self.ov10 += float(rows)

    def result(self, tensor: TensorDiff) -> LogitsDiff:
        """The :class:`LogitsDiff` of every row given, with the element-wise ``tensor`` statistics."""
        if self._wait is not None:
            wa, wb = self._wait
            self._wait = None
            self._chunk(wa, wb)
        t = self.t
        if t == 0 or self.v == 0:
            return LogitsDiff(tensor, t, (), 0.0, 0.0, 1.0, 1.0, 0)
        return LogitsDiff(tensor=tensor, n_positions=t, argmax_flips=tuple(self.flips), kl_mean=self.kl_sum / t,
                          kl_max=self.kl_max, top5_overlap=self.ov5 / t, top10_overlap=self.ov10 / t,
                          rank_of_a_top_in_b_max=self.worst_rank)


def amplification(prev_max_abs: float, cur_max_abs: float) -> float | None:
    """Growth of the max abs diff from one capture point to the next: ``cur / prev``.

    Args:
        prev_max_abs: max abs diff at the previous capture point (tensor units).
        cur_max_abs: max abs diff at the current one.

    Returns:
        the ratio (``inf`` if ``cur`` is inf and ``prev`` finite), or None when ``prev`` is 0
        (no divergence yet to amplify).
    """
    if prev_max_abs == 0:
        return None
    return float(cur_max_abs) / float(prev_max_abs)
