"""Comparing in row blocks (points larger than memory) gives the numbers of comparing whole tensors.

The reference is the whole-tensor path (``DiffBatch.add`` / ``logits_diff`` / ``compare_records`` on
the in-memory runs); the streamed path must equal it bit for bit, for any block size, with NaN,
inf and ±0 planted, KV-cache splits, and buffers reused between blocks.
"""

from __future__ import annotations

import math

import pytest
import torch

from tracer.diff.compare import compare_records, compare_trace
from tracer.diff.batch import BLOCK_ELEMENTS, DiffBatch
from tracer.diff.logits import LogitsAccumulator, logits_diff
from tracer.execute.records import CaptureRecord, RunRecord
from tracer.store.trace import TraceWriter


def _pair(shape, dtype, seed, frac=0.1):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(shape, generator=g).to(dtype)
    b = a.clone()
    flat = b.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[: int(flat.numel() * frac)]
    flat[idx] = torch.randn(idx.numel(), generator=g).to(dtype)
    a.view(-1)[:3] = torch.tensor([math.nan, math.inf, -0.0], dtype=dtype)
    b.view(-1)[:3] = torch.tensor([math.nan, -math.inf, 0.0], dtype=dtype)
    return a, b


def _same(x, y):
    assert x.to_dict().keys() == y.to_dict().keys()
    for k, v in x.to_dict().items():
        w = y.to_dict()[k]
        assert (v == w) or (isinstance(v, float) and math.isnan(v) and math.isnan(w)), (k, v, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [1, 3, 7, 64])
def test_streamed_pair_equals_whole_pair(dtype, rows):
    a, b = _pair((300, 1111), dtype, seed=rows)
    small_a, small_b = _pair((5, 17), dtype, seed=99)
    whole = DiffBatch(tolerance=(1e-3, 1e-2))
    whole.add(small_a, small_b)
    iw = whole.add(a, b, split=37 * 1111)
    whole.add(small_b, small_a)
    streamed = DiffBatch(tolerance=(1e-3, 1e-2))
    streamed.add(small_a, small_b)
    buf_a, buf_b = torch.empty(rows * 1111, dtype=dtype), torch.empty(rows * 1111, dtype=dtype)
    index = None
    for r0 in range(0, 300, rows):
        n = min(rows, 300 - r0) * 1111
        buf_a[:n].copy_(a[r0:r0 + rows].reshape(-1))  # a reused buffer, as the trace reader uses
        buf_b[:n].copy_(b[r0:r0 + rows].reshape(-1))
        if index is None:
            index = streamed.add(buf_a[:n], buf_b[:n], split=37 * 1111, more=True)
        else:
            streamed.extend(index, buf_a[:n], buf_b[:n])
        buf_a.fill_(7)  # overwritten before the batch computes: nothing of a block may be kept
        buf_b.fill_(-7)
    streamed.close(index)
    streamed.add(small_b, small_a)
    for x, y in zip(whole.results(), streamed.results()):
        _same(x, y)
    assert streamed.n_diff_before(index) == whole.n_diff_before(iw) > 0
    assert [streamed.outside_tolerance(i) for i in range(3)] == [whole.outside_tolerance(i) for i in range(3)]


@pytest.mark.parametrize("split", [0, 5 * BLOCK_ELEMENTS, 10**9])
def test_streamed_split_at_the_edges(split):
    a, b = _pair((40, 2 * BLOCK_ELEMENTS), torch.bfloat16, seed=3)
    whole = DiffBatch()
    iw = whole.add(a, b, split=split)
    streamed = DiffBatch()
    index = streamed.add(a[:9], b[:9], split=split, more=True)
    streamed.extend(index, a[9:], b[9:])
    _same(whole.results()[0], streamed.results()[0])  # results() closes an open pair
    assert streamed.n_diff_before(index) == whole.n_diff_before(iw)


@pytest.mark.parametrize("block", [1, 5, 32, 200])
def test_logits_in_row_blocks_equal_logits_diff(block):
    a, b = _pair((97, 4099), torch.bfloat16, seed=block, frac=0.3)
    a[:, :3] = 0  # no NaN/inf planted here: KL finite
    b[:, :3] = 0
    a[3, 5] = 100  # a planted argmax flip
    b[3, 6] = 101
    ref = logits_diff(a, b)
    acc = LogitsAccumulator(a.shape[1])
    for r0 in range(0, a.shape[0], block):
        acc.add(a[r0:r0 + block].clone(), b[r0:r0 + block].clone())
    got = acc.result(ref.tensor)
    assert got.to_dict() == ref.to_dict() and any(f.position == 3 for f in got.argmax_flips)
    assert math.isfinite(got.kl_mean) and got.kl_mean > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("hint", ["crc", "always equal"])
def test_compare_of_a_streamed_trace_equals_compare_of_the_runs(tmp_path, monkeypatch, hint, device):
    """Every point streamed in small row blocks (a KV cache with a prefix, logits, NaN): the
    stored comparison equals the in-memory one. "always equal": every point is hinted equal (as
    if all CRC-32s collided), so the differing ones take the fall-back full comparison."""
    import tracer.store.stream as stream
    import tracer.store.trace as trace

    if hint == "always equal":
        monkeypatch.setattr(trace, "stored_crc", lambda handle: 0)

    g = torch.Generator().manual_seed(5)
    caps_a = {
        "model.embed_tokens": torch.randn(12, 40, generator=g).bfloat16(),
        "model.layers.0.self_attn.kv_cache": torch.randn(20, 24, generator=g).bfloat16(),
        "model.layers.0": torch.randn(12, 40, generator=g).bfloat16(),
        "model.norm": torch.randn(12, 40, generator=g),
        "lm_head": torch.randn(12, 300, generator=g).bfloat16(),
    }
    caps_b = {k: v.clone() for k, v in caps_a.items()}
    caps_b["model.layers.0.self_attn.kv_cache"][3, 2] += 1  # before the window (prefix rows 0..7)
    caps_b["model.layers.0"].view(torch.int16)[::3] += 1
    caps_b["model.norm"][5, 5] = math.nan
    caps_b["lm_head"].view(torch.int16)[::2] += 1
    kinds = {"model.embed_tokens": "embedding", "model.layers.0.self_attn.kv_cache": "kv_cache",
             "model.layers.0": "layer", "model.norm": "final_norm", "lm_head": "logits"}
    calls = [{"positions": [0, 20], "in": [], "out": [1, 20, 24]}]
    runs = [RunRecord(n, list(range(20)), {}, (8, 20), {k: CaptureRecord(k, kinds[k], v, calls=calls if "kv" in k else [])
                                                       for k, v in caps.items()})
            for n, caps in (("A", caps_a), ("B", caps_b))]
    path = tmp_path / "t.h5"
    with TraceWriter(path, header={}) as w:
        for r in runs:
            w.add_run(r)
    on = [RunRecord(r.name, r.token_ids, r.plan, r.window,
                    {k: CaptureRecord(k, c.kind, c.tensor.to(device), calls=c.calls) for k, c in r.captures.items()})
          for r in runs]  # the reference computed on the same device (CUDA: the pinned ring, device copies)
    ref = compare_records(on[0], on[1], scenario="?", model="?").to_dict()
    monkeypatch.setattr(stream, "BLOCK_BYTES", 250)  # every point in blocks of a few rows
    got = compare_trace(str(path), device=device).to_dict()
    for k in ("trace", "facts", "scenario", "model"):
        got.pop(k), ref.pop(k)
    assert got == ref
    assert got["layers"][1]["n_diff_prefix"] == 1 and got["first_divergent"] == "model.layers.0.self_attn.kv_cache"


def _reference_logits(a, b):
    """logits_diff as tracer computed it before the identical-row shortcut: every row in float64."""
    from tracer.diff.logits import _kl_rows, _overlap
    from tracer.diff.metrics import CHUNK_ELEMENTS

    t, v = a.shape
    rows = max(1, CHUNK_ELEMENTS // v)
    flips, kl_sum, kl_max, ov5, ov10, worst = [], 0.0, 0.0, 0.0, 0.0, 0
    for start in range(0, t, rows):
        a64, b64 = a[start:start + rows].double(), b[start:start + rows].double()
        top_a, top_b = a64.argmax(1), b64.argmax(1)
        kl = _kl_rows(a64, b64)
        kl_sum += float(kl.sum())
        kl_max = math.nan if math.isnan(kl_max) or math.isnan(float(kl.max())) else max(kl_max, float(kl.max()))
        va, ia = torch.topk(a64, min(10, v), dim=1)
        vb, ib = torch.topk(b64, min(10, v), dim=1)
        ov5 += float(_overlap(ia, ib, min(5, v)).sum())
        ov10 += float(_overlap(ia, ib, min(10, v)).sum())
        worst = max(worst, int((b64 > b64.gather(1, top_a.unsqueeze(1))).sum(1).max()))
        for r in torch.nonzero(top_a != top_b).flatten().tolist():
            flips.append((start + r, int(top_a[r]), int(top_b[r]), float(va[r, 0] - va[r, 1]), float(vb[r, 0] - vb[r, 1])))
    return flips, kl_sum / t, kl_max, ov5 / t, ov10 / t, worst


@pytest.mark.parametrize("case", ["mixed", "identical", "nan row"])
def test_identical_rows_shortcut_gives_the_full_computation(case):
    g = torch.Generator().manual_seed(11)
    a = torch.randn(300, 5000, generator=g).bfloat16()  # 209 rows per chunk: chunks of both kinds
    b = a.clone()
    if case != "identical":
        b[::7].view(torch.int16)[:, ::3] += 1
        b[250:].view(torch.int16)[:] += 2  # a whole chunk of differing rows
        b[5, 10] = 50  # a flip
    if case == "nan row":
        a[17, 3] = math.nan
        b[17, 3] = math.nan
    got = logits_diff(a, b)
    flips, kl_mean, kl_max, ov5, ov10, worst = _reference_logits(a, b)
    assert [(f.position, f.token_a, f.token_b, f.margin_a, f.margin_b) for f in got.argmax_flips] == flips
    for x, y in ((got.kl_mean, kl_mean), (got.kl_max, kl_max), (got.top5_overlap, ov5), (got.top10_overlap, ov10)):
        assert x == y or (math.isnan(x) and math.isnan(y))
    assert got.rank_of_a_top_in_b_max == worst
    if case == "identical":
        assert got.kl_mean == 0.0 and got.top5_overlap == 1.0 and not got.argmax_flips


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_bit_level_checks(dtype):
    from tracer.diff.metrics import bits_equal, has_nonfinite

    x = torch.randn(3_000_000, generator=torch.Generator().manual_seed(1)).to(dtype)  # several slices
    x[7], x[8] = torch.finfo(dtype).max, -torch.finfo(dtype).max  # the largest finite values
    assert not has_nonfinite(x) and bits_equal(x, x.clone())
    for v in (math.inf, -math.inf, math.nan, -math.nan):
        y = x.clone()
        y[2_500_000] = v
        assert has_nonfinite(y) and not bits_equal(x, y)
    z = x.clone()
    z[2_999_999] = -z[2_999_999]
    assert not bits_equal(x, z)
    zero, neg_zero = torch.zeros(4, dtype=dtype), torch.tensor([0.0, 0.0, 0.0, -0.0], dtype=dtype)
    assert not bits_equal(zero, neg_zero) and not has_nonfinite(neg_zero)
