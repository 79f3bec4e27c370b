"""Comparing in row blocks (points larger than memory) gives the numbers of comparing whole tensors.

The reference is the whole-tensor path (``DiffBatch.add`` / ``logits_diff`` / ``compare_records`` on
the in-memory runs); the streamed path must equal it bit for bit, for any block size, with NaN,
inf and ±0 planted, KV-cache splits, and buffers reused between blocks.
"""

from __future__ import annotations

import math

import pytest
import torch

from tracer.diff.core import compare_records, compare_trace
from tracer.diff.metrics import BLOCK_ELEMENTS, DiffBatch, LogitsAccumulator, logits_diff
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


def test_compare_of_a_streamed_trace_equals_compare_of_the_runs(tmp_path, monkeypatch):
    """Every point streamed in small row blocks (a KV cache with a prefix, logits, NaN): the
    stored comparison equals the in-memory one."""
    import tracer.diff.core as core

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
    ref = compare_records(runs[0], runs[1], scenario="?", model="?").to_dict()
    monkeypatch.setattr(core, "BLOCK_BYTES", 250)  # every point in blocks of a few rows
    got = compare_trace(str(path), device="cpu").to_dict()
    for k in ("trace", "facts", "scenario", "model"):
        got.pop(k), ref.pop(k)
    assert got == ref
    assert got["layers"][1]["n_diff_prefix"] == 1 and got["first_divergent"] == "model.layers.0.self_attn.kv_cache"
