"""Issue 27: tracing at the cost of the forward pass. The launch-bound mode's shortcuts give the
numbers of the plain computation, bit for bit: the batched comparison against each point compared
alone, captures kept by reference against copies, the trace's coalesced writes and parallel
CRC-32 against zlib; on a GPU, the online comparison against the one from a stored trace."""

from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
import torch

import tracer
from tracer.diff.batch import tensor_diff
from tracer.diff.compare import compare_trace
from tracer.execute.records import CaptureRecord, RunRecord
from tracer.load.models import load_model
from tracer.store import integrity
from tracer.store.trace import TraceReader, TraceWriter

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPT = "x" * 70 + " cache hit versus cache miss"


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-qwen3", dtype="bfloat16", device="cpu", progress=False)


def _same(a, b) -> bool:
    """Equal to the last bit, NaN included (JSON keeps every float's shortest exact repr)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_batched_comparison_equals_each_point_compared_alone(lm):
    """Every point of a real run (kv-quant, bf16: the runs differ from the first KV cache on) goes
    through one batch; each point's numbers equal a batch of that point alone."""
    kw = dict(loaded=lm, scenario="kv-quant", length=300, progress=False)
    res = tracer.run(**kw, store="none")
    out = tracer.run(**kw, store="tensors")  # no file: the runs keep their tensors
    rec_a, rec_b = out.runs
    assert rec_a.captures and out.comparison.to_dict()["layers"] == res.comparison.to_dict()["layers"]
    differing = 0
    for p in out.comparison.points:
        alone = tensor_diff(rec_a.captures[p.name].tensor, rec_b.captures[p.name].tensor)
        assert _same(p.diff.to_dict(), alone.to_dict()), p.name
        differing += p.diff.n_diff > 0
    assert differing >= 2
    logits = out.comparison.logits.tensor
    name = out.comparison.logits_name
    assert _same(logits.to_dict(), tensor_diff(rec_a.captures[name].tensor, rec_b.captures[name].tensor).to_dict())


def test_crc32_combine_and_parallel_crc_equal_zlib(monkeypatch):
    rng = np.random.default_rng(3)
    for la, lb in [(0, 5), (5, 0), (1, 1), (100, 7), (12345, (2 << 20) + 3)]:
        a, b = rng.bytes(la), rng.bytes(lb)
        assert integrity.crc32_combine(zlib.crc32(a), zlib.crc32(b), lb) == zlib.crc32(a + b)
    monkeypatch.setattr(integrity, "crc_threads", lambda: 4)
    monkeypatch.setattr(integrity, "PARALLEL_CRC_BYTES", 1 << 16)
    monkeypatch.setattr(integrity, "_CRC_PIECE", 1 << 14)
    data = np.frombuffer(rng.bytes((1 << 18) + 13), dtype=np.uint8)
    assert integrity.crc32_bytes(data, 77) == zlib.crc32(data.tobytes(), 77)
    assert integrity.crc32_bytes(data[5:].view(np.uint8)) == zlib.crc32(data[5:].tobytes())


def test_points_laid_end_to_end_are_written_together_and_read_back(tmp_path):
    """host_copies lays a run's points end to end in one buffer per dtype; the writer stores such
    neighbours with one write: what is read back is every point, bit for bit, with its CRC-32."""
    buf = torch.randn(5 * 48, generator=torch.Generator().manual_seed(1)).bfloat16()
    caps = {f"l{i}": CaptureRecord(f"l{i}", "layer", buf[i * 48:(i + 1) * 48].view(6, 8)) for i in range(4)}
    caps["other"] = CaptureRecord("other", "layer", torch.randn(6, 8).bfloat16())  # another buffer
    caps["norm"] = CaptureRecord("norm", "final_norm", torch.randn(6, 8))  # another dtype
    caps["l4"] = CaptureRecord("l4", "layer", buf[4 * 48:].view(6, 8))  # adjacent in memory, not in the file
    run = RunRecord("A", list(range(10)), {}, (0, 6), caps)
    with TraceWriter(tmp_path / "t.h5", header={}) as w:
        w.add_run(run)
    with TraceReader(tmp_path / "t.h5") as r:
        got = r.run("A")
    for name, c in caps.items():
        iv = torch.int16 if c.tensor.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.captures[name].tensor.view(iv), c.tensor.view(iv)), name


def test_background_writer_reports_a_failed_set_up_at_close(tmp_path):
    """The file's set-up runs on the writing thread; when it fails the error is one line at close
    and nothing is left on disk."""
    from tracer.errors import TracerError

    folder = tmp_path / "ro"
    folder.mkdir()
    w = TraceWriter(folder / "t.h5", header={}, background=True)
    os.chmod(folder, 0o500)
    try:
        if os.access(folder, os.W_OK):  # root: permissions do not stop the set-up; nothing to test
            w.abort()
            pytest.skip("running as root")
        with pytest.raises(TracerError, match="cannot create"):
            w.close()
    finally:
        os.chmod(folder, 0o700)
    assert list(folder.iterdir()) == []


# ---------------------------------------------------------------- on a GPU


@pytest.fixture(scope="module")
def lm_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return load_model("tiny-qwen3", dtype="bfloat16", device="cuda", progress=False)


def _doc(comparison) -> dict:
    d = comparison.to_dict()
    for k in ("trace", "facts"):
        d.pop(k, None)
    return d


@CUDA
def test_cuda_online_comparison_equals_the_stored_one_and_the_cpu_counts(tmp_path, lm_cuda):
    """On the GPU: captures by reference, dense logits chunks, one transfer per statistic; the
    online comparison equals the comparison of the stored tensors on the GPU, bit for bit, and its
    integer counts equal those computed on the CPU from the same tensors."""
    kw = dict(loaded=lm_cuda, scenario="kv-quant", length=300, progress=False)  # runs that differ
    online = tracer.run(**kw, store="none")
    stored = tracer.run(**kw, store="tensors", output=tmp_path / "t.h5")
    assert _same(_doc(online.comparison), _doc(stored.comparison))
    assert _same(_doc(online.comparison), _doc(compare_trace(str(tmp_path / "t.h5"), device="cuda")))
    on_cpu = compare_trace(str(tmp_path / "t.h5"), device="cpu")
    for p, q in zip(online.comparison.points, on_cpu.points):
        assert (p.name, p.diff.n_diff, p.diff.ulp_hist, p.diff.max_abs_diff) == (q.name, q.diff.n_diff, q.diff.ulp_hist,
                                                                                q.diff.max_abs_diff)
    assert [f.position for f in online.comparison.logits.argmax_flips] == [f.position for f in on_cpu.logits.argmax_flips]
    assert all(isinstance(r.meta["wall_s"], float) and r.meta["wall_s"] > 0 for r in stored.runs)
    with TraceReader(tmp_path / "t.h5") as r:
        assert r.run("A", load_tensors=False).meta["wall_s"] > 0


@CUDA
def test_cuda_captures_by_reference_equal_copies(lm_cuda):
    from tracer.execute.capture import Capture
    from tracer.execute.points import discover_points
    from tracer.execute.runner import forward_chunks
    from tracer.plan.scenarios import prefix_cache

    model = lm_cuda.model
    points = [p for p in discover_points(model, "sublayers") if p.kind != "kv_cache"]
    scen = prefix_cache(40, block_size=16)
    ids = torch.tensor([[(7 * i + 3) % 500 for i in range(40)]], device="cuda")
    for plan in (scen.plan_a, scen.plan_b):
        got = {}
        for reference in (None, False):  # None: the default on a GPU, by reference
            with torch.inference_mode(), Capture(model, points, scen.window, keep_on_device=True,
                                                 reference=reference) as cap:
                forward_chunks(model, ids, plan, cap)
            got[reference] = cap.records()
        for name, rec in got[False].items():
            assert torch.equal(got[None][name].tensor.view(torch.int16), rec.tensor.view(torch.int16)), name
