"""Pure numeric functions of two aligned tensors: bit diffs, abs/rel error, ULPs, logits statistics.

Inputs are two torch tensors of the same shape and the same floating dtype (bfloat16, float16,
float32 or float64), compared element by element in the **storage dtype** (bit patterns) and in
float64 (differences). Work happens on the tensors' device, in flat chunks of
:data:`CHUNK_ELEMENTS` elements, so a ``(1000, 151936)`` bf16 logits tensor never materialises
whole in float64. Nothing here imports the rest of tracer but its dtype table and the result schema.

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
from dataclasses import dataclass

import numpy as np
import torch

from tracer import schema
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
class TensorDiff(schema.Record):
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

    def schema_check(self) -> str | None:
        counts = (self.n_total, self.n_diff, self.n_nan_a, self.n_nan_b, self.n_inf_a, self.n_inf_b, self.n_nan_payload)
        if any(c < 0 for c in counts) or self.n_diff > self.n_total:
            return "counts out of range (0 <= n_diff <= n_total, counts >= 0)"
        if len(self.ulp_hist) != len(ULP_BINS) or any(c < 0 for c in self.ulp_hist) or sum(self.ulp_hist) != self.n_total:
            return f"ulp_hist is not {len(ULP_BINS)} counts >= 0 summing to n_total"
        if self.max_ulp < 0 or not (self.max_abs_diff >= 0) or not (self.mean_abs_diff >= 0):
            return "a negative (or NaN) difference"
        return None

    @property
    def nan_payload_only(self) -> bool:
        """True when every differing element is NaN in both runs (only the NaN payload differs)."""
        return self.n_diff > 0 and self.n_nan_payload == self.n_diff

    @property
    def has_nan(self) -> bool:
        """True when either side holds a NaN."""
        return self.n_nan_a > 0 or self.n_nan_b > 0


def flips_phrase(n: int | None) -> str:
    """``n`` argmax flips in words: ``no argmax flips``, ``1 argmax flip``, ``3 argmax flips``
    (``argmax flips not compared`` for None: no logits)."""
    if n is None:
        return "argmax flips not compared"
    return "no argmax flips" if n == 0 else f"{n} argmax flip{'s' if n != 1 else ''}"


@dataclass(frozen=True)
class ArgmaxFlip(schema.Record):
    """One position whose top-1 token differs between the runs.

    Attributes:
        position: index within the compared window (the caller adds the window's start); where logits
            exist at a few positions only (an engine's sampled positions), still the window index.
        token_a, token_b: the argmax token id in run A and in run B.
        margin_a, margin_b: top-1 minus top-2 logit in that run (float64 of the stored values).
        ulps_a, ulps_b: the same gap in ULPs of the stored dtype (representable values between the
            two: 0 a tie, broken by the lower token id; 1 adjacent values); None where not computed
            (a comparison stored before they were).
        text_a, text_b: the two tokens decoded by the model's tokenizer, as decoded (unescaped);
            None where no tokenizer was at hand (a stored trace compared, a run from token ids).
    """

    position: int
    token_a: int
    token_b: int
    margin_a: float
    margin_b: float
    ulps_a: int | None = None
    ulps_b: int | None = None
    text_a: str | None = None
    text_b: str | None = None


@dataclass(frozen=True)
class LogitsDiff(schema.Record):
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

    def schema_check(self) -> str | None:
        # a flip's position is its index in the compared window; where an engine computed logits at a
        # few positions only (where it samples), n_positions counts those, so a flip may lie
        # beyond n_positions: at most one flip per compared position, each at its own index
        positions = [f.position for f in self.argmax_flips]
        if self.n_positions < 0 or len(positions) > self.n_positions or any(p < 0 for p in positions) \
                or len(set(positions)) != len(positions):
            return "an argmax flip outside the compared positions"
        return None


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
    return b if b.device == a.device else b.to(a.device)


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



_ULP_BIG = 1 << 40  # above any ULP distance of a <= 32-bit dtype


def element_stats(da: torch.Tensor, db: torch.Tensor, m: torch.Tensor | None, groups: tuple[int, int] | torch.Tensor,
                  tolerance: tuple[float, float] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 statistics of differing elements → per-group ``(k, .)`` tensors (pass 2 of :class:`~tracer.diff.batch.DiffBatch`).

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
    if tolerance is not None:
        atol, rtol = tolerance
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
    # (k, 3, 3): per block a.a, b.b, a.b, (a-b).(a-b) in one GEMM; torch's own bmm, never a rebinding of
    # torch.bmm by another library (a batch-invariant mode's has no float64: tracer.diff.positions.torch_replaced)
    gram = torch._C._VariableFunctions.bmm(x.transpose(1, 2), x)
    sums = torch.stack([d.view(k, block).sum(1), gram[:, 0, 0], gram[:, 1, 1], gram[:, 0, 1], gram[:, 2, 2]], 1)
    maxes = torch.stack([d.view(k, block).amax(1), mag.view(k, block).amax(1)], 1)
    cnt = torch.stack([c.view(k, block).sum(1) for c in counts], 1)
    return sums, maxes, cnt, ulp.view(k, block).amax(1)


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
