"""--store tensors | stats | none give the same report (issue 6: online comparison)."""

from __future__ import annotations

import json

import pytest

import tracer
from tracer.diff.compare import compare_trace
from tracer.errors import TracerError
from tracer.load.models import load_model
from tracer.report.tables import to_json
from tracer.store.trace import TraceReader


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama", dtype="bfloat16", device="cpu", progress=False)


def _doc(comparison):
    d = json.loads(to_json(comparison))
    d.pop("trace")
    # what a --granularity sublayers run with the same --store would write: the one fact that depends on --store
    (d.get("facts") or {}).pop("sublayers_bytes", None)
    return d


def test_stored_and_online_reports_are_identical(tmp_path, lm):
    kw = dict(loaded=lm, prompt="x" * 70 + " cache hit versus cache miss", progress=False)
    stored = tracer.run(**kw, store="tensors", output=tmp_path / "t.h5")
    online = tracer.run(**kw, store="stats", output=tmp_path / "s.h5")
    nofile = tracer.run(**kw, store="none")
    auto = tracer.run(**kw, output=tmp_path / "a.h5")  # the default: --store auto, the whole fits
    from_file = compare_trace(str(tmp_path / "t.h5"))
    assert _doc(stored.comparison) == _doc(online.comparison) == _doc(nofile.comparison) == _doc(auto.comparison)
    assert compare_trace(str(tmp_path / "a.h5")).to_dict()["layers"] == from_file.to_dict()["layers"]
    assert _doc(from_file.comparison if hasattr(from_file, "comparison") else from_file) == _doc(online.comparison)
    assert nofile.trace is None
    # the stats trace holds no tensors, only the comparison
    with TraceReader(tmp_path / "s.h5") as r:
        assert r.runs == ["A", "B"] and r.capture_names("A") == []
        assert r.comparisons()["A-vs-B"]["verdict"] == online.comparison.verdict()
    with pytest.raises(TracerError, match="holds no tensors"):
        compare_trace(str(tmp_path / "s.h5"))


def test_unknown_store_mode(lm):
    with pytest.raises(TracerError, match="--store"):
        tracer.run(loaded=lm, store="everything", progress=False)


def test_no_kv_cache_leaves_out_only_the_kv_points(tmp_path, lm):
    """--no-kv-cache drops the kv_cache points and nothing else: every other point's statistics
    equal those of the run that captured the caches (capturing does not change the forward)."""
    kw = dict(loaded=lm, prompt="x" * 70 + " cache hit versus cache miss", progress=False)
    full = tracer.run(**kw, store="none")
    lean = tracer.run(**kw, kv_cache=False, output=tmp_path / "lean.h5")
    kinds = [p.kind for p in full.comparison.points]
    assert "kv_cache" in kinds and "kv_cache" not in [p.kind for p in lean.comparison.points]
    want = {p.name: p.diff for p in full.comparison.points if p.kind != "kv_cache"}
    assert {p.name: p.diff for p in lean.comparison.points} == want
    assert lean.comparison.logits == full.comparison.logits
    with TraceReader(tmp_path / "lean.h5") as r:
        assert r.header["kv_cache"] is False
        assert not [n for n in r.capture_names("A") if n.endswith(".kv_cache")]


def test_comparing_a_tensor_trace_with_a_stats_trace_is_a_one_line_error(tmp_path, lm):
    kw = dict(loaded=lm, prompt="x" * 70 + " cache hit versus cache miss", progress=False)
    tracer.run(**kw, output=tmp_path / "t.h5")
    tracer.run(**kw, store="stats", output=tmp_path / "s.h5")
    from tracer.diff.compare import compare_runs

    for a, b in ((tmp_path / "t.h5", tmp_path / "s.h5"), (tmp_path / "s.h5", tmp_path / "t.h5")):
        with pytest.raises(TracerError, match="holds no tensors"):
            compare_runs((str(a), "A"), (str(b), "A"))
