"""A comparison stored in a trace and read back says what the live comparison said (issue 22, item 1).

The bug: the stored copy dropped ``skipped``, ``n_nan_payload``, ``op_replay``, ``logits_calls`` and
``logits_amplification``, so a comparison that live said "NOT comparable" came back "bit-identical",
and a NaN-payload divergence lost its explanation.
"""

from __future__ import annotations

import torch

from tests.helpers import run_record as _run
from tracer.diff.compare import compare_records
from tracer.diff.stored import stored_comparison
from tracer.store.trace import TraceWriter, json_safe


def _stored(tmp_path, c, a, b):
    """``c`` written the way ``tracer run`` writes it (pipeline.execute_scenario), read back."""
    path = tmp_path / "t.h5"
    with TraceWriter(path, header={"scenario": {"name": "s"}, "model": {"name": "m"}}) as w:
        w.add_run(a)
        w.add_run(b)
        w.add_comparison("s", json_safe(c.to_dict()))
    return stored_comparison(path)


def test_a_skipped_point_read_back_is_not_comparable(tmp_path):
    x = torch.arange(16, dtype=torch.float32).reshape(2, 8)
    a = _run("A", [("emb", "embedding", x), ("l0", "layer", x + 1)])
    b = _run("B", [("emb", "embedding", x.clone())])  # l0 missing in run B
    live = compare_records(a, b, scenario="s", model="m")
    assert live.verdict().startswith("NOT comparable: 1 capture point(s) missing or empty in one run")
    back = _stored(tmp_path, live, a, b)
    assert back.verdict() == live.verdict()
    assert not back.identical and back.skipped == live.skipped
    assert back.check("any") == live.check("any") and back.check("any")[0] is True


def test_a_nan_payload_divergence_keeps_its_explanation(tmp_path):
    x = torch.zeros(2, 4, dtype=torch.float32)
    xa, xb = x.clone(), x.clone()
    xa.view(torch.int32)[0, 1] = 0x7FC00001  # a quiet NaN, payload 1
    xb.view(torch.int32)[0, 1] = 0x7FC00002  # the same position, payload 2
    a, b = _run("A", [("l0", "layer", xa)]), _run("B", [("l0", "layer", xb)])
    live = compare_records(a, b, scenario="s", model="m")
    assert live.points[0].diff.n_nan_payload == 1 and "payload differs" in live.verdict()
    back = _stored(tmp_path, live, a, b)
    assert back.points[0].diff.n_nan_payload == 1
    assert back.verdict() == live.verdict() and back.origin_lines() == live.origin_lines()
