"""tracer.diff.metrics against independent numpy oracles.

Tensors are built from bit patterns in numpy; expected values come from numpy float64 formulas,
from enumerating every 16-bit pattern in value order, or from stepping with ``np.nextafter``,
never from numbers produced by the code under test.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from tracer.diff import batch as batch_module
from tracer.diff import metrics, passes
from tracer.diff.batch import tensor_diff
from tracer.diff.logits import logits_diff
from tracer.diff.metrics import ULP_NAN, ULP_SATURATED, amplification, ulp_distance

# dtype name → (torch dtype, unsigned numpy bits type, signed numpy view type, numpy float type or None)
DTYPES = {
    "bfloat16": (torch.bfloat16, np.uint16, np.int16, None),
    "float16": (torch.float16, np.uint16, np.int16, np.float16),
    "float32": (torch.float32, np.uint32, np.int32, np.float32),
    "float64": (torch.float64, np.uint64, np.int64, np.float64),
}
NAMES = list(DTYPES)
SIXTEEN = ["bfloat16", "float16"]


# ---------------------------------------------------------------- bit-pattern helpers (numpy only)


def values64(bits: np.ndarray, name: str) -> np.ndarray:
    """float64 values of the bit patterns ``bits`` of dtype ``name``."""
    bits = np.asarray(bits, dtype=DTYPES[name][1])
    with np.errstate(invalid="ignore"):  # NaN patterns
        if name == "bfloat16":
            return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return bits.view(DTYPES[name][3]).astype(np.float64)


def to_torch(bits: np.ndarray, name: str) -> torch.Tensor:
    """A torch tensor of dtype ``name`` with exactly the bit patterns ``bits``."""
    tdtype, ubits, sbits, _ = DTYPES[name]
    arr = np.ascontiguousarray(np.asarray(bits, dtype=ubits)).view(sbits)
    return torch.from_numpy(arr.copy()).view(tdtype)


def bits_of(values, name: str) -> np.ndarray:
    """Bit patterns of ``values`` rounded to dtype ``name`` (bf16 by truncating float32)."""
    if name == "bfloat16":
        return (np.asarray(values, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return np.asarray(values, dtype=DTYPES[name][3]).view(DTYPES[name][1])


def nan_bits(name: str, payload: int = 1) -> int:
    """A quiet NaN pattern with the given low mantissa payload."""
    return {"bfloat16": 0x7FC0, "float16": 0x7E00, "float32": 0x7FC00000, "float64": 0x7FF8000000000000}[name] + payload


def _rank_table(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Every non-NaN 16-bit pattern sorted by value (-0 just before +0): (rank of pattern, pattern at rank)."""
    pats = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    vals = values64(pats, name)
    ok = ~np.isnan(vals)
    sign = (pats >> 15).astype(np.int64)
    order = np.lexsort((1 - sign[ok], vals[ok]))  # primary: value; ties (only ±0): negative first
    at_rank = pats[ok][order]
    rank = np.full(1 << 16, -1, dtype=np.int64)
    rank[at_rank] = np.arange(at_rank.size)
    return rank, at_rank


RANKS = {name: _rank_table(name) for name in SIXTEEN}


def _step(x, name: str):
    """The next representable value above numpy scalar ``x`` of dtype name (float32/float64), -0 → +0."""
    ftype = DTYPES[name][3]
    if x == 0 and np.signbit(x):
        return ftype(0.0)
    with np.errstate(over="ignore"):  # max → inf
        return np.nextafter(ftype(x), ftype(np.inf))


def step_up(bits: int, k: int, name: str) -> int:
    """The pattern k representable values above pattern ``bits``."""
    if name in SIXTEEN:
        rank, at_rank = RANKS[name]
        return int(at_rank[rank[bits] + k])
    ftype, ubits = DTYPES[name][3], DTYPES[name][1]
    x = np.array([bits], dtype=ubits).view(ftype)[0]
    for _ in range(k):
        x = _step(x, name)
    return int(np.array([x], dtype=ftype).view(ubits)[0])


def oracle_ulp(xb: int, yb: int, name: str, limit: int = 64) -> int:
    """ULP distance by enumeration (16-bit) or by stepping with nextafter (capped at ``limit``)."""
    if xb == yb:
        return 0
    vx, vy = values64([xb], name)[0], values64([yb], name)[0]
    if np.isnan(vx) or np.isnan(vy):
        return ULP_NAN
    if name in SIXTEEN:
        rank = RANKS[name][0]
        return abs(int(rank[xb]) - int(rank[yb]))
    ftype, ubits = DTYPES[name][3], DTYPES[name][1]
    lo_b, hi_b = (xb, yb) if (vx, -int(np.signbit(vx))) < (vy, -int(np.signbit(vy))) else (yb, xb)
    x = np.array([lo_b], dtype=ubits).view(ftype)[0]
    for n in range(1, limit + 1):
        x = _step(x, name)
        if int(np.array([x], dtype=ftype).view(ubits)[0]) == hi_b:
            return n
    return limit + 1  # "more than limit": enough for the >16 bin


def ulp_bin(u: int) -> int:
    """Index of the histogram bin 0, 1, 2, 3-4, 5-8, 9-16, >16."""
    for i, top in enumerate((0, 1, 2, 4, 8, 16)):
        if u <= top:
            return i
    return 6


def oracle_diff(ab: np.ndarray, bb: np.ndarray, name: str) -> dict:
    """Every TensorDiff field computed with numpy from the bit patterns (ULPs via oracle_ulp)."""
    ab, bb = ab.ravel(), bb.ravel()
    a, b = values64(ab, name), values64(bb, name)
    n = a.size
    equal = ab == bb
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        d = np.abs(a - b)
        d[np.isnan(a) | np.isnan(b)] = np.inf
        d[equal] = 0.0
        rel = d / np.abs(a)
    ulps = [oracle_ulp(int(x), int(y), name) for x, y in zip(ab, bb)]
    hist = [0] * 7
    for u in ulps:
        hist[ulp_bin(u)] += 1
    fin = np.isfinite(a) & np.isfinite(b)
    fa, fb = a[fin], b[fin]
    na, nb, ndd = np.sum(fa * fa), np.sum(fb * fb), np.sum((fa - fb) ** 2)
    if ndd == 0:
        rel_error, cosine, sqnr = 0.0, 1.0, math.inf
    else:
        rel_error = math.sqrt(ndd) / math.sqrt(na) if na > 0 else math.inf
        sqnr = 10 * math.log10(na / ndd) if na > 0 else -math.inf
        cosine = float(np.dot(fa, fb) / (np.linalg.norm(fa) * np.linalg.norm(fb))) if na > 0 and nb > 0 else 0.0

    def frac(thr):
        if n == 0:
            return 0.0
        zero_a = a == 0
        ok = equal | (zero_a & (b == 0)) | (~zero_a & (rel < thr))
        return float(np.sum(ok)) / n

    return dict(
        n_total=n,
        n_diff=int(np.sum(~equal)),
        max_abs_diff=float(d.max()) if n else 0.0,
        mean_abs_diff=float(d.mean()) if n else 0.0,
        max_ulp=max(ulps) if ulps else 0,
        ulp_hist=tuple(hist),
        rel_error=rel_error,
        cosine=cosine,
        sqnr_db=sqnr,
        frac_rel_lt_1e3=frac(1e-3),
        frac_rel_lt_5e3=frac(5e-3),
        n_nan_a=int(np.isnan(a).sum()),
        n_nan_b=int(np.isnan(b).sum()),
        n_inf_a=int(np.isinf(a).sum()),
        n_inf_b=int(np.isinf(b).sum()),
    )


EXACT = {"n_total", "n_diff", "max_ulp", "ulp_hist", "n_nan_a", "n_nan_b", "n_inf_a", "n_inf_b",
         "frac_rel_lt_1e3", "frac_rel_lt_5e3", "max_abs_diff"}


def assert_matches(got, want: dict, check_max_ulp: bool = True) -> None:
    got = got.to_dict()
    for key, w in want.items():
        g = got[key]
        if key == "max_ulp" and not check_max_ulp:
            assert (g > 16) == (w > 16), key
        elif key == "ulp_hist":
            assert tuple(g) == w, (key, g, w)
        elif key in EXACT or isinstance(w, int) or (isinstance(w, float) and math.isinf(w)):
            assert g == w, (key, g, w)
        else:
            assert g == pytest.approx(w, rel=1e-9, abs=1e-12), (key, g, w)


def random_bits(name: str, shape, rng, scale=10.0) -> np.ndarray:
    return bits_of(rng.standard_normal(shape) * scale, name).reshape(shape)


# ---------------------------------------------------------------- tensor_diff


@pytest.mark.parametrize("chunk", [None, 7, 256])
@pytest.mark.parametrize("name", NAMES)
def test_planted_ulp_perturbations(name, chunk, monkeypatch):
    if chunk:
        monkeypatch.setattr(metrics, "CHUNK_ELEMENTS", chunk)
    rng = np.random.default_rng(1)
    ab = random_bits(name, (40, 50), rng)
    bb = ab.copy()
    flat_a, flat_b = ab.reshape(-1), bb.reshape(-1)
    planted = {0: 1, 1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 2, 7: 3, 8: 4, 9: 6, 10: 12, 11: 16, 12: 17}
    positions = rng.choice(flat_a.size, size=len(planted) + 3, replace=False)
    for pos, k in zip(positions, planted.values()):
        if name in ("float32", "float64"):
            # nextafter, as a user would perturb by k ULPs
            ftype = DTYPES[name][3]
            x = flat_a[pos : pos + 1].view(ftype)[0]
            for _ in range(k):
                x = np.nextafter(x, ftype(np.inf))
            flat_b[pos] = np.array([x], dtype=ftype).view(DTYPES[name][1])[0]
        elif k == 1:
            flat_b[pos] = flat_a[pos] + 1  # raw pattern + 1: one step away from zero
        else:
            flat_b[pos] = step_up(int(flat_a[pos]), k, name)
    for pos in positions[len(planted):]:  # large changes: sign flip and 3x
        flat_b[pos] = bits_of(values64(flat_a[pos : pos + 1], name) * -3.0, name)[0]
    want = oracle_diff(ab, bb, name)
    assert want["n_diff"] == len(positions)
    assert want["ulp_hist"][1] == 5 and want["ulp_hist"][6] == 4  # 1 planted at 17, 3 large
    got = tensor_diff(to_torch(ab, name), to_torch(bb, name))
    assert_matches(got, want, check_max_ulp=name in SIXTEEN)
    assert sum(got.ulp_hist) == got.n_total
    assert got.ulp_hist[0] == got.n_total - got.n_diff


@pytest.mark.parametrize("name", NAMES)
def test_identical_tensors(name):
    rng = np.random.default_rng(2)
    ab = random_bits(name, (3, 5, 7), rng)
    got = tensor_diff(to_torch(ab, name), to_torch(ab.copy(), name))
    assert got.n_diff == 0 and got.identical
    assert got.max_abs_diff == 0.0 and got.mean_abs_diff == 0.0 and got.max_ulp == 0
    assert got.ulp_hist == (105, 0, 0, 0, 0, 0, 0)
    assert got.cosine == 1.0 and got.sqnr_db == math.inf and got.rel_error == 0.0
    assert got.frac_rel_lt_1e3 == 1.0 and got.frac_rel_lt_5e3 == 1.0


@pytest.mark.parametrize("name", NAMES)
def test_nan_inf_and_signed_zero(name):
    rng = np.random.default_rng(3)
    ab = random_bits(name, (20,), rng)
    bb = ab.copy()
    inf, ninf = bits_of(np.inf, name), bits_of(-np.inf, name)
    big = bits_of(np.finfo(np.float16).max if name == "float16" else
                  (3.3895313892515355e38 if name == "bfloat16" else np.finfo(DTYPES[name][3]).max), name)
    ab[0] = nan_bits(name)            # NaN on A only
    bb[1] = nan_bits(name)            # NaN on B only
    ab[2] = bb[2] = nan_bits(name, 3)  # same NaN bits: equal
    ab[3], bb[3] = nan_bits(name, 1), nan_bits(name, 2)  # different payloads
    ab[4] = bb[4] = inf               # same inf: equal
    ab[5], bb[5] = inf, ninf          # +inf vs -inf
    ab[6], bb[6] = inf, big           # inf vs the largest finite: 1 ULP
    ab[7], bb[7] = bits_of(-0.0, name), bits_of(0.0, name)  # -0 vs +0
    ab[8] = bb[8] = bits_of(0.0, name)  # +0 vs +0
    want = oracle_diff(ab, bb, name)
    got = tensor_diff(to_torch(ab, name), to_torch(bb, name))
    assert_matches(got, want, check_max_ulp=False)
    assert got.n_diff == 6
    assert got.n_nan_a == 3 and got.n_nan_b == 3 and got.n_inf_a == 3 and got.n_inf_b == 2
    assert got.max_abs_diff == math.inf and got.mean_abs_diff == math.inf
    assert got.max_ulp == ULP_NAN
    ulp = ulp_distance(to_torch(ab, name), to_torch(bb, name))
    assert ulp.dtype == torch.int64
    assert ulp[:9].tolist()[:5] == [ULP_NAN, ULP_NAN, 0, ULP_NAN, 0]
    assert ulp[6].item() == 1 and ulp[7].item() == 1 and ulp[8].item() == 0
    if name in SIXTEEN:  # +inf vs -inf: every non-NaN pattern lies between
        assert ulp[5].item() == oracle_ulp(int(inf), int(ninf), name) == len(RANKS[name][1]) - 1


@pytest.mark.parametrize("name", NAMES)
def test_signed_zero_counts_as_differing_but_not_numerically(name):
    ab = bits_of([-0.0, 1.0], name)
    bb = bits_of([0.0, 1.0], name)
    got = tensor_diff(to_torch(ab, name), to_torch(bb, name))
    assert got.n_diff == 1 and got.max_abs_diff == 0.0 and got.max_ulp == 1
    assert got.ulp_hist == (1, 1, 0, 0, 0, 0, 0)
    assert got.frac_rel_lt_1e3 == 1.0  # |a| == 0 and |b| == 0 counts as within
    assert got.cosine == 1.0 and got.sqnr_db == math.inf


@pytest.mark.parametrize("name", NAMES)
def test_subnormals_and_crossing_zero(name):
    sign = 1 << (np.dtype(DTYPES[name][1]).itemsize * 8 - 1)
    pos_min, neg_min = 1, sign | 1  # smallest positive / negative subnormal
    pairs = [
        (pos_min, 2),              # min vs 2*min: adjacent
        (neg_min, pos_min),        # crossing zero: -min, -0, +0, +min
        (sign | 2, 3),             # -2*min vs 3*min
        (0, pos_min),              # +0 vs min
        (sign, pos_min),           # -0 vs +min
    ]
    ab = np.array([p[0] for p in pairs], dtype=DTYPES[name][1])
    bb = np.array([p[1] for p in pairs], dtype=DTYPES[name][1])
    want = [oracle_ulp(int(x), int(y), name) for x, y in zip(ab, bb)]
    assert want == [1, 3, 6, 1, 2]  # the documented rule: -0 and +0 are two points on the line
    got = ulp_distance(to_torch(ab, name), to_torch(bb, name))
    assert got.tolist() == want
    assert ulp_distance(to_torch(bb, name), to_torch(ab, name)).tolist() == want  # symmetric
    assert_matches(tensor_diff(to_torch(ab, name), to_torch(bb, name)), oracle_diff(ab, bb, name))


@pytest.mark.parametrize("name", SIXTEEN)
def test_ulp_distance_exhaustive_16bit(name):
    """Every non-NaN pattern vs its successor in value order is 1 ULP; random pairs match ranks."""
    rank, at_rank = RANKS[name]
    a, b = at_rank[:-1], at_rank[1:]
    assert ulp_distance(to_torch(a, name), to_torch(b, name)).eq(1).all()
    rng = np.random.default_rng(4)
    x = rng.integers(0, 1 << 16, size=20000).astype(np.uint16)
    y = rng.integers(0, 1 << 16, size=20000).astype(np.uint16)
    got = ulp_distance(to_torch(x, name), to_torch(y, name)).numpy()
    nan = (rank[x] < 0) | (rank[y] < 0)
    want = np.where(nan & (x != y), ULP_NAN, np.abs(rank[x] - rank[y]))
    want[x == y] = 0
    np.testing.assert_array_equal(got, want)


def test_ulp_distance_float64_saturates():
    big = np.finfo(np.float64).max
    a = torch.tensor([-big, -np.inf, 1.0], dtype=torch.float64)
    b = torch.tensor([big, np.inf, -1.0], dtype=torch.float64)
    got = ulp_distance(a, b).tolist()
    assert got[0] == ULP_SATURATED and got[1] == ULP_SATURATED
    # 1.0 and -1.0: twice the count of patterns in (0, 1.0], plus the +0/-0 pair
    one = int(np.array([1.0]).view(np.uint64)[0])
    assert got[2] == 2 * one + 1


@pytest.mark.parametrize("name", NAMES)
def test_empty_tensors(name):
    e = torch.empty((0, 4), dtype=DTYPES[name][0])
    got = tensor_diff(e, e.clone())
    assert got.n_total == 0 and got.n_diff == 0 and got.max_abs_diff == 0.0 and got.mean_abs_diff == 0.0
    assert got.ulp_hist == (0,) * 7 and got.max_ulp == 0 and got.rel_error == 0.0
    assert got.cosine == 1.0 and got.sqnr_db == math.inf and got.frac_rel_lt_1e3 == 1.0
    assert ulp_distance(e, e).shape == (0, 4)


@pytest.mark.parametrize("name", NAMES)
def test_zero_reference(name):
    """a all zero, b not: rel error inf, cosine 0, sqnr -inf; nothing counts as within 1e-3."""
    ab = bits_of([0.0, 0.0, 0.0], name)
    bb = bits_of([0.0, 0.5, -2.0], name)
    got = tensor_diff(to_torch(ab, name), to_torch(bb, name))
    assert_matches(got, oracle_diff(ab, bb, name), check_max_ulp=name in SIXTEEN)
    assert got.rel_error == math.inf and got.cosine == 0.0 and got.sqnr_db == -math.inf


def test_relative_thresholds():
    a = np.array([1000.0, 1000.0, 1000.0, 1000.0])
    b = np.array([1000.5, 1002.0, 1004.0, 1010.0])  # rel 5e-4, 2e-3, 4e-3, 1e-2
    got = tensor_diff(torch.from_numpy(a), torch.from_numpy(b))
    assert got.frac_rel_lt_1e3 == 0.25 and got.frac_rel_lt_5e3 == 0.75
    assert got.max_abs_diff == 10.0 and got.mean_abs_diff == pytest.approx(16.5 / 4)


def test_non_contiguous_and_validation():
    rng = np.random.default_rng(5)
    ab = random_bits("float32", (6, 9), rng)
    bb = ab.copy()
    bb[2, 3] += 1
    ta, tb = to_torch(ab, "float32"), to_torch(bb, "float32")
    got = tensor_diff(ta.t(), tb.t())
    assert got.n_diff == 1 and got.max_ulp == 1
    assert ulp_distance(ta.t(), tb.t())[3, 2].item() == 1
    with pytest.raises(ValueError, match="shape"):
        tensor_diff(ta, tb[:3])
    with pytest.raises(ValueError, match="dtype"):
        tensor_diff(ta, tb.double())
    with pytest.raises(ValueError, match="unsupported"):
        tensor_diff(torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))


def test_to_dict_is_json():
    d = tensor_diff(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])).to_dict()
    assert json.loads(json.dumps(d))["ulp_hist"] == [1, 0, 0, 0, 0, 0, 1]


# ---------------------------------------------------------------- logits_diff


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def np_kl(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    p, q = np_softmax(a), np_softmax(b)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0)
    return terms.sum(axis=1)


def planted_logits(rng, t=12, v=40):
    """float64 logits (multiples of 1/4, exact in every dtype) with known flips and margins."""
    a = rng.integers(-12, 12, size=(t, v)) / 4.0  # rest in [-3, 2.75]
    tops = rng.permutation(v)[: 3 * t].reshape(t, 3)  # per row: top1, top2, challenger tokens
    for i, (t1, t2, _) in enumerate(tops):
        a[i, t1], a[i, t2] = 5.0, 4.25  # margin 0.75
    b = a.copy()
    b[:, 0] += 0.25 * (a[:, 0] < 2)  # a small change that moves no top-2 entry
    flips = {2: 6.0, 7: 5.5, 11: 7.25}  # position → the challenger's new logit in B
    for pos, val in flips.items():
        b[pos, tops[pos, 2]] = val
    return a, b, tops, flips


@pytest.mark.parametrize("chunk", [None, 80])
@pytest.mark.parametrize("name", NAMES)
def test_logits_planted_flips(name, chunk, monkeypatch):
    if chunk:
        monkeypatch.setattr(metrics, "CHUNK_ELEMENTS", chunk)  # 2 rows per chunk
    rng = np.random.default_rng(6)
    a, b, tops, flips = planted_logits(rng)
    ta, tb = torch.from_numpy(a).to(DTYPES[name][0]), torch.from_numpy(b).to(DTYPES[name][0])
    got = logits_diff(ta, tb)
    assert got.n_positions == 12
    assert [f.position for f in got.argmax_flips] == sorted(flips)
    for f in got.argmax_flips:
        assert f.token_a == tops[f.position, 0] and f.token_b == tops[f.position, 2]
        assert f.margin_a == 0.75 and f.margin_b == flips[f.position] - 5.0
    kl = np_kl(a, b)
    assert got.kl_mean == pytest.approx(kl.mean(), rel=1e-9)
    assert got.kl_max == pytest.approx(kl.max(), rel=1e-9)
    assert got.rank_of_a_top_in_b_max == 1  # only the challenger beats A's top token
    assert got.tensor.n_diff == int(np.sum(a != b))
    assert got.tensor.max_abs_diff == float(np.abs(a - b).max())


@pytest.mark.parametrize("chunk", [None, 80])
@pytest.mark.parametrize("name", NAMES)
def test_logits_dense_rows_equal_busy_rows(name, chunk, monkeypatch):
    """The GPU's way (every row of a chunk gets the float64 work, one transfer) gives the CPU's
    numbers (only rows whose bits differ or hold a NaN/inf), bit for bit: planted flips, equal
    rows, rows with inf and NaN."""
    from tracer.diff.logits import LogitsAccumulator

    if chunk:
        monkeypatch.setattr(metrics, "CHUNK_ELEMENTS", chunk)  # 2 rows per chunk
    rng = np.random.default_rng(11)
    a, b, _, _ = planted_logits(rng, t=16, v=64)
    b[5] = a[5]  # an equal row between differing ones
    a[9, 3] = b[9, 3] = -np.inf  # equal bits, infinite: a busy row
    b[13, 1] = np.nan
    ta, tb = torch.from_numpy(a).to(DTYPES[name][0]), torch.from_numpy(b).to(DTYPES[name][0])
    whole = tensor_diff(ta, tb)
    got = {}
    for dense in (False, True):
        acc = LogitsAccumulator(ta.shape[1], dense=dense)
        acc.add(ta[:7], tb[:7])  # rows in two blocks, as a point streamed from a trace
        acc.add(ta[7:], tb[7:])
        got[dense] = acc.result(whole)
    assert json.dumps(got[True].to_dict()) == json.dumps(got[False].to_dict())  # NaN-aware, bit for bit (repr)
    assert len(got[True].argmax_flips) >= 3 and math.isnan(got[True].kl_max)


@pytest.mark.parametrize("name", NAMES)
def test_topk_overlap_hand_made(name):
    v = 20
    a = np.tile(np.arange(v, dtype=np.float64), (2, 1))  # distinct; top-5 = 15..19, top-10 = 10..19
    b = a.copy()
    b[0, 19], b[0, 0] = 0.0, 19.0  # row 0: token 19 leaves, token 0 enters the top
    b[1, 10], b[1, 9] = 9.0, 10.0  # row 1: the 10th and 11th swap
    got = logits_diff(torch.from_numpy(a).to(DTYPES[name][0]), torch.from_numpy(b).to(DTYPES[name][0]))
    # row 0: top5 4/5, top10 9/10; row 1: top5 5/5, top10 9/10
    assert got.top5_overlap == pytest.approx((4 / 5 + 1) / 2)
    assert got.top10_overlap == pytest.approx(9 / 10)
    assert len(got.argmax_flips) == 1 and got.argmax_flips[0].position == 0
    f = got.argmax_flips[0]
    assert (f.token_a, f.token_b, f.margin_a, f.margin_b) == (19, 0, 1.0, 1.0)
    assert got.rank_of_a_top_in_b_max == 19  # A's top (19) is last in B's row 0


def test_kl_with_masked_logits_and_identical():
    a = np.array([[0.0, 1.0, -np.inf, 2.0], [3.0, -1.0, 0.5, -np.inf]])
    b = np.array([[0.5, 1.0, -np.inf, 2.0], [3.0, -1.0, 0.5, -np.inf]])
    got = logits_diff(torch.from_numpy(a), torch.from_numpy(b))
    kl = np_kl(a, b)
    assert np.isfinite(kl).all()
    assert got.kl_mean == pytest.approx(kl.mean(), rel=1e-12)
    assert got.kl_max == pytest.approx(kl.max(), rel=1e-12)
    same = logits_diff(torch.from_numpy(a), torch.from_numpy(a.copy()))
    assert same.kl_max == 0.0 and same.kl_mean == 0.0 and same.argmax_flips == ()
    assert same.top5_overlap == 1.0 and same.top10_overlap == 1.0 and same.tensor.n_diff == 0
    # B masks a token that A gives probability: infinite KL
    c = b.copy()
    c[0, 3] = -np.inf
    assert logits_diff(torch.from_numpy(a), torch.from_numpy(c)).kl_max == math.inf


def test_logits_empty_and_validation():
    e = torch.empty((0, 7), dtype=torch.bfloat16)
    got = logits_diff(e, e)
    assert got.n_positions == 0 and got.argmax_flips == () and got.kl_mean == 0.0
    assert got.top5_overlap == 1.0 and got.tensor.cosine == 1.0
    with pytest.raises(ValueError, match="T, V"):
        logits_diff(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))
    d = logits_diff(torch.tensor([[1.0, 2.0]]), torch.tensor([[2.0, 1.0]])).to_dict()
    assert json.loads(json.dumps(d))["argmax_flips"][0]["token_b"] == 0


def test_amplification():
    assert amplification(0.0, 3.0) is None
    assert amplification(0.008, 0.5) == pytest.approx(62.5)
    assert amplification(2.0, math.inf) == math.inf


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    rng = np.random.default_rng(7)
    for name in NAMES:
        ab = random_bits(name, (64, 300), rng)
        bb = ab.copy()
        bb.reshape(-1)[::17] += 1
        bb[0, 0] = nan_bits(name)
        ta, tb = to_torch(ab, name), to_torch(bb, name)
        dc, dg = tensor_diff(ta, tb).to_dict(), tensor_diff(ta.cuda(), tb.cuda()).to_dict()
        assert dg == pytest.approx(dc, rel=1e-12)
        assert torch.equal(ulp_distance(ta.cuda(), tb.cuda()).cpu(), ulp_distance(ta, tb))
        la, lb = torch.from_numpy(values64(ab, name)).to(ta.dtype), torch.from_numpy(values64(bb, name)).to(ta.dtype)
        la, lb = torch.nan_to_num(la), torch.nan_to_num(lb)
        gc, gg = logits_diff(la, lb), logits_diff(la.cuda(), lb.cuda())
        assert gc.argmax_flips == gg.argmax_flips and gc.tensor.n_diff == gg.tensor.n_diff
        assert gg.kl_mean == pytest.approx(gc.kl_mean, rel=1e-9)


# ---------------------------------------------------------------- DiffBatch


@pytest.mark.parametrize("sparse_ratio", [0, 10**9])  # float64 pass: whole blocks / differing elements only
@pytest.mark.parametrize("chunk", [None, 7, 256])
def test_batch_of_pairs_matches_numpy_per_pair(chunk, sparse_ratio, monkeypatch):
    """Many pairs of mixed dtypes and sizes in one batch (sharing chunks, padded to blocks, one
    spread over several chunks, one empty): each result equals the numpy oracle of that pair,
    the per-pair split count and tolerance counts equal numpy counts; for both forms of the
    float64 pass (dense blocks and gathered differing elements)."""
    monkeypatch.setattr(passes, "SPARSE_RATIO", sparse_ratio)
    if chunk:
        monkeypatch.setattr(metrics, "CHUNK_ELEMENTS", chunk)
        monkeypatch.setattr(batch_module, "BLOCK_ELEMENTS", 4 if chunk == 7 else 64)
    rng = np.random.default_rng(11)
    pairs = []
    for i, (name, shape) in enumerate([("bfloat16", (3, 5)), ("float32", (40, 9)), ("bfloat16", (0, 4)),
                                       ("float16", (17,)), ("bfloat16", (31, 33)), ("float64", (6, 7))]):
        ab = random_bits(name, shape, rng)
        bb = ab.copy()
        flat = bb.reshape(-1)
        if flat.size and i != 3:  # pair 3 stays identical
            hit = rng.choice(flat.size, size=max(1, flat.size // 5), replace=False)
            flat[hit] = bits_of(values64(flat[hit], name) * (1 + rng.uniform(-0.01, 0.01, hit.size)), name)
        pairs.append((name, ab, bb))
    atol, rtol = 1e-3, 2e-3
    batch = batch_module.DiffBatch(tolerance=(atol, rtol))
    splits = {}
    for i, (name, ab, bb) in enumerate(pairs):
        split = ab.size // 3 if i in (1, 4) else None
        splits[i] = split
        assert batch.add(to_torch(ab, name), to_torch(bb, name), split=split) == i
    got = batch.results()
    for i, (name, ab, bb) in enumerate(pairs):
        if ab.size:  # (the empty pair: the documented identical values, checked below)
            assert_matches(got[i], oracle_diff(ab, bb, name), check_max_ulp=name in SIXTEEN)
        a, b = values64(ab.ravel(), name), values64(bb.ravel(), name)
        equal = ab.ravel() == bb.ravel()
        with np.errstate(invalid="ignore"):
            want_tol = int(np.sum(~equal & ~(np.abs(a - b) <= atol + rtol * np.abs(a))))
        assert batch.outside_tolerance(i) == want_tol
        want_before = int(np.sum(~equal[: splits[i]])) if splits[i] is not None else 0
        assert batch.n_diff_before(i) == want_before
    assert got[3].n_diff == 0 and got[2].n_total == 0
    assert (got[2].frac_rel_lt_1e3, got[2].cosine, got[2].sqnr_db) == (1.0, 1.0, math.inf)
    assert got[1].n_diff > 0 and batch.n_diff_before(1) > 0


def test_equal_pairs_recorded_by_count_match_the_oracle():
    """Pairs known to be bitwise equal, recorded with ``add_equal`` (counts only, no data: how a
    stored trace's points with equal CRC-32s are compared), interleaved with differing pairs given
    in full: every result equals the numpy oracle of the same pair, NaN/inf counts and a split
    included, and the differing pairs around them are unaffected."""
    rng = np.random.default_rng(5)
    name = "bfloat16"
    ab = random_bits(name, (9, 8), rng)
    flat = ab.reshape(-1)
    flat[[3, 40]] = bits_of(np.array([np.nan, np.inf]), name)  # one NaN, one +inf on both sides
    differ = random_bits(name, (5, 6), rng)
    moved = differ.copy()
    moved.reshape(-1)[[0, 7]] ^= 1  # two elements 1 ULP apart (the low mantissa bit)
    batch = batch_module.DiffBatch()
    assert batch.add(to_torch(differ, name), to_torch(moved, name)) == 0
    assert batch.add_equal(ab.size, 1, 1) == 1
    assert batch.add_equal(ab.size, 1, 1, split=ab.size // 2) == 2
    assert batch.add(to_torch(moved, name), to_torch(differ, name), split=10) == 3
    got = batch.results()
    for i, (a, b) in enumerate([(differ, moved), (ab, ab), (ab, ab), (moved, differ)]):
        assert_matches(got[i], oracle_diff(a, b, name), check_max_ulp=True)
    assert (got[1].n_nan_a, got[1].n_nan_b, got[1].n_inf_a, got[1].n_inf_b) == (1, 1, 1, 1)
    assert got[2] == got[1] and batch.n_diff_before(2) == 0
    assert got[0].n_diff == 2 and batch.n_diff_before(3) == int(np.sum(moved.ravel()[:10] != differ.ravel()[:10]))


def test_batch_refuses_bad_pairs_and_reuse():
    batch = batch_module.DiffBatch()
    with pytest.raises(ValueError, match="shape mismatch"):
        batch.add(torch.zeros(3), torch.zeros(4))
    batch.add(torch.zeros(3), torch.ones(3))
    assert batch.results()[0].n_diff == 3
    with pytest.raises(RuntimeError, match="already"):
        batch.add(torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="tolerances"):
        batch_module.DiffBatch(tolerance=(-1.0, 0.0))


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_flip_margins_in_ulps_name_ties_and_neighbours(name, dense):
    """A flip whose top two logits tie (the lower token id wins) or lie one representable value apart
    is rounding's coin toss: each flip carries its top-1 − top-2 gap in ULPs of the stored dtype,
    planted with numpy's own nextafter in that dtype (the CPU's and the GPU's way alike)."""
    from tracer.diff.logits import LogitsAccumulator

    np_dtype = {"float16": np.float16, "float32": np.float32, "float64": np.float64}.get(name)
    v = 8
    a = np.zeros((3, v))
    b = np.zeros((3, v))
    a[0, 2] = a[0, 5] = 1.5  # row 0: a tie in A (token 2 wins), B picks 5 by a wide margin
    b[0, 5], b[0, 2] = 3.0, 1.0
    a[1, 1], a[1, 6] = 2.0, 1.0  # row 1: A far apart; B's top two one ULP apart (6 just above 2.0)
    b[1, 1] = 2.0
    if np_dtype is not None:
        b[1, 6] = float(np.nextafter(np_dtype(2.0), np_dtype(3.0)))
    else:  # bfloat16: 8 bits of significand, the next value above 2 is 2 + 2**-6
        b[1, 6] = 2.0 + 2.0 ** -6
    a[2, 0] = b[2, 0] = 4.0  # row 2: no flip
    ta, tb = torch.from_numpy(a).to(DTYPES[name][0]), torch.from_numpy(b).to(DTYPES[name][0])
    acc = LogitsAccumulator(v, dense=dense)
    acc.add(ta, tb)
    got = acc.result(tensor_diff(ta, tb))
    assert [(f.position, f.token_a, f.token_b) for f in got.argmax_flips] == [(0, 2, 5), (1, 1, 6)]
    f0, f1 = got.argmax_flips
    assert f0.ulps_a == 0 and f0.ulps_b > 1 and f1.ulps_a > 1 and f1.ulps_b == 1
