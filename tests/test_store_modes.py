"""--store tensors | stats | none give the same report (issue 6: online comparison)."""

from __future__ import annotations

import json

import pytest

import tracer
from tracer.compare import compare_trace
from tracer.errors import TracerError
from tracer.models import load_model
from tracer.report import to_json
from tracer.store import TraceReader


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama", dtype="bfloat16", device="cpu", progress=False)


def _doc(comparison):
    d = json.loads(to_json(comparison))
    d.pop("trace")
    return d


def test_stored_and_online_reports_are_identical(tmp_path, lm):
    kw = dict(loaded=lm, prompt="x" * 70 + " cache hit versus cache miss", progress=False)
    stored = tracer.run(**kw, store="tensors", output=tmp_path / "t.h5")
    online = tracer.run(**kw, store="stats", output=tmp_path / "s.h5")
    nofile = tracer.run(**kw, store="none")
    from_file = compare_trace(str(tmp_path / "t.h5"))
    assert _doc(stored.comparison) == _doc(online.comparison) == _doc(nofile.comparison)
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
