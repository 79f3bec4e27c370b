"""compare_records / compare_trace on hand-made runs with planted differences."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import planted_pair
from tracer.diff.compare import compare_records, compare_trace
from tracer.errors import TracerError
from tracer.store.trace import TraceWriter


def _pair():
    return planted_pair()


def test_planted_differences():
    a, b, (l0, l0b, l1, l1b) = _pair()
    c = compare_records(a, b, scenario="s", model="m")
    rows = {p.name: p for p in c.points}
    assert rows["emb"].diff.n_diff == 0
    assert rows["l0"].diff.n_diff == 1 and rows["l0"].diff.max_ulp == 1
    assert rows["l0"].diff.max_abs_diff == pytest.approx(float((l0.double() - l0b.double()).abs().max()))
    assert rows["l1"].diff.n_diff == 2
    # amplification: relative to the first divergent row (l0)
    expect = float((l1.double() - l1b.double()).abs().max()) / float((l0.double() - l0b.double()).abs().max())
    assert rows["l1"].amplification == pytest.approx(expect)
    assert rows["emb"].amplification is None
    assert c.first_divergent == "l0"
    flips = c.logits.argmax_flips
    assert [(f.position, f.token_a, f.token_b) for f in flips] == [(1, 0, 3)]
    d = c.to_dict()
    assert d["logits"]["flips"][0]["position"] == 3  # absolute: window start 2 + 1
    assert "diverges from l0, 1 argmax flip in 2 positions" == c.verdict()


def test_identical_runs():
    a, _, _ = _pair()
    c = compare_records(a, a, scenario="s", model="m")
    assert c.identical and c.first_divergent is None and c.verdict().startswith("bit-identical")


def test_different_prompts_refused():
    a, b, _ = _pair()
    b.token_ids[0] = 9
    with pytest.raises(TracerError, match="different token ids"):
        compare_records(a, b, scenario="s", model="m")


def test_stored_comparison_equals_in_memory(tmp_path):
    a, b, _ = _pair()
    path = tmp_path / "t.h5"
    with TraceWriter(path, header={"scenario": {"name": "s"}, "model": {"name": "m"}}) as w:
        w.add_run(a)
        w.add_run(b)
    stored = compare_trace(str(path))
    mem = compare_records(a, b, scenario="s", model="m")
    assert [p.diff for p in stored.points] == [p.diff for p in mem.points]
    assert stored.logits == mem.logits
    assert stored.scenario == "s" and stored.model == "m"


def test_compare_trace_on_an_explicit_device_and_a_missing_one(tmp_path):
    a, b, _ = _pair()
    path = tmp_path / "t.h5"
    with TraceWriter(path, header={"scenario": {"name": "x"}, "model": {"name": "m"}}) as w:
        w.add_run(a)
        w.add_run(b)
    on_cpu = compare_trace(str(path), device="cpu")
    assert on_cpu.first_divergent == "l0"
    assert [p.diff for p in on_cpu.points] == [p.diff for p in compare_trace(str(path)).points]
    if not torch.cuda.is_available():
        with pytest.raises(TracerError, match="CUDA was requested"):
            compare_trace(str(path), device="cuda")
    else:
        on_gpu = compare_trace(str(path), device="cuda")
        assert [p.diff.n_diff for p in on_gpu.points] == [p.diff.n_diff for p in on_cpu.points]


def test_a_trace_given_where_a_run_name_belongs_is_not_called_missing(tmp_path):
    """`tracer compare t.h5:A t.h5:B C` said "trace file t.h5 not found" of a trace that is there."""
    from tracer.diff.refs import resolve_refs

    t = tmp_path / "t.h5"
    t.write_bytes(b"")  # only its existence is looked at
    for refs in ([f"{t}:A", f"{t}:B", "C"], [str(t), "A", f"{t}:B"]):
        with pytest.raises(TracerError) as e:
            resolve_refs(refs)
        msg = str(e.value)
        assert "not found" not in msg and "among 3 arguments" in msg and "TRACE RUN_A RUN_B" in msg, msg
    with pytest.raises(TracerError, match="trace file .*nope.h5 not found"):  # a missing one still is
        resolve_refs([str(t), str(tmp_path / "nope.h5")])
