"""A comparison stored in a trace and read back says what the live comparison said (issue 22, item 1).

The bug: the stored copy dropped ``skipped``, ``n_nan_payload``, ``op_replay``, ``logits_calls`` and
``logits_amplification``, so a comparison that live said "NOT comparable" came back "bit-identical",
and a NaN-payload divergence lost its explanation.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tests.helpers import run_record as _run
from tracer.diff.compare import compare_records
from tracer.diff.stored import stored_comparison
from tracer.report.origins import origin_lines
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
    assert back.verdict() == live.verdict() and origin_lines(back) == origin_lines(live)


def _sampled_runs():
    """Runs A and B whose logits exist only at position 5 (an engine that computes them where it
    samples, as vLLM does): in ``extras`` and the meta, not among the captures; B's row planted so
    that its argmax differs from A's."""
    from tests.helpers import make_runs

    a, b = make_runs()
    row_a = torch.zeros(1, 16)
    row_a[0, 3] = 2.0
    row_b = row_a.clone()
    row_b[0, 9] = 3.0  # argmax 3 in A, 9 in B: one flip at position 5
    for run, row in ((a, row_a), (b, row_b)):
        del run.captures["lm_head"]
        run.meta["logits"] = {"lm_head": {"positions": [5], "dtype": "float32"}}
        run.extras["partial_logits"] = {"lm_head": ([5], row)}
    return a, b


def test_logits_an_engine_held_only_where_it_sampled_come_back_from_the_stored_comparison(tmp_path):
    """A vLLM trace: the run compared the logits at the sampled position, the file holds no logits
    rows; `tracer compare` of the trace said "logits: not captured". Now it gives the run-time
    comparison (the planted flip at position 5 included) with a note saying why."""
    import tracer
    from tracer.diff.engine import sampled_logits

    a, b = _sampled_runs()
    live = sampled_logits(compare_records(a, b, scenario="s", model="m"), a, b)
    assert live.logits is not None and len(live.logits.argmax_flips) == 1  # argmax 3 vs 9, planted above
    path = tmp_path / "t.h5"
    with TraceWriter(path, header={"scenario": {"name": "s"}, "model": {"name": "m"}}) as w:
        w.add_run(a)
        w.add_run(b)
        w.add_comparison("A-vs-B", json_safe(live.to_dict()))
    back = tracer.compare_trace(str(path))
    assert back.logits is not None and len(back.logits.argmax_flips) == 1 and back.verdict() == live.verdict()
    assert any("lm_head (logits) exists only at position(s) 5, where the engine sampled" in n
               for n in back.facts["notes"])


def test_logits_missing_across_traces_say_why(tmp_path):
    """HF's trace against a vLLM trace: the logits row is "not compared" (it still fails --fail-on any),
    and the reason says the engine held them only where it sampled, not a bare "missing"."""
    import tracer
    from tests.helpers import make_runs, write_trace

    hf, _ = make_runs()
    a, _ = _sampled_runs()
    write_trace(tmp_path / "hf.h5", [hf])
    write_trace(tmp_path / "vl.h5", [a])
    c = tracer.compare_trace(f"{tmp_path / 'hf.h5'}:A", f"{tmp_path / 'vl.h5'}:A")
    [skip] = [sk for sk in c.skipped if sk.name == "lm_head"]
    assert skip.fails and skip.reason.startswith("not stored: ") and "computed logits only at position(s) 5" in skip.reason
    assert c.check("any")[0] is True


def test_logits_held_only_where_sampled_with_a_tolerance_say_why(tmp_path):
    """One vLLM trace compared with --atol: the stored comparison is not used (it has no tolerance), the
    file holds no logits rows, and the logits read "missing in run B" as if the run had not captured
    them (the run-time comparison's argmax flip silently gone). The reason now says they are not stored
    and that the comparison without a tolerance has them."""
    import tracer
    from tracer.diff.engine import sampled_logits

    from tests.helpers import make_runs

    hf, _ = make_runs()  # A: HF, its logits captured at every position of the window
    _, b = _sampled_runs()  # B: logits only where it sampled
    live = sampled_logits(compare_records(hf, b, scenario="s", model="m"), hf, b)
    path = tmp_path / "t.h5"
    with TraceWriter(path, header={"scenario": {"name": "s"}, "model": {"name": "m"}}) as w:
        w.add_run(hf)
        w.add_run(b)
        w.add_comparison("A-vs-B", json_safe(live.to_dict()))
    assert tracer.compare_trace(str(path)).logits is not None  # without a tolerance: the stored comparison
    c = tracer.compare_trace(str(path), atol=0.1)
    [skip] = [sk for sk in c.skipped if sk.name == "lm_head"]
    assert skip.fails and skip.reason.startswith("not stored: ") and "only at position(s) 5" in skip.reason, skip
    assert "without --atol/--rtol" in skip.reason, skip.reason
    # and what the run-time comparison found there is said, not silently gone: B's planted row has its
    # argmax at token 9; A's row at position 5 (window index 3) is HF's own
    flips = int(int(hf.captures["lm_head"].tensor[3].argmax()) != 9)
    note = [n for n in c.facts["notes"] if n.startswith("when the trace was written (no tolerance)")]
    assert note and ("1 argmax flip at position 5" if flips else "no argmax flips") in note[0], c.facts["notes"]


def _written(tmp_path, live, a, b, name="t.h5"):
    path = tmp_path / name
    with TraceWriter(path, header={"scenario": {"name": "s"}, "model": {"name": "m"}}) as w:
        w.add_run(a)
        w.add_run(b)
        w.add_comparison("A-vs-B", json_safe(live.to_dict()))
    return path


def test_what_only_the_run_computed_comes_back_with_the_recomputed_comparison(tmp_path):
    """One result, live or stored: a comparison of a trace's runs recomputed from their tensors keeps
    what only the run could compute (tracer.diff.stored.RUN_TIME_ONLY: here the noise verdict of its
    re-runs at higher precision), from the comparison stored when the trace was written."""
    import tracer
    from tests.helpers import make_runs
    from tracer.diff.stored import RUN_TIME_ONLY
    from tracer.diff.verdict import Level, NoiseVerdict

    a, b = make_runs()
    live = compare_records(a, b, scenario="s", model="m")
    noise = NoiseVerdict("noise", "planted for the test", "model.layers.1",
                         (Level("float32", 2.0**-23, 0.5, 0.25, False), Level("float64", 2.0**-52, 1e-9, 1e-10, False)))
    live = replace(live, noise=noise)
    back = tracer.compare_trace(str(_written(tmp_path, live, a, b)))
    assert "noise" in RUN_TIME_ONLY and back.noise == noise
    assert [p.diff for p in back.points] == [p.diff for p in live.points] and back.verdict() == live.verdict()


def test_a_store_auto_trace_gives_the_run_time_comparison_itself(tmp_path):
    """--store auto kept some tensors only: the comparison read back is the one made at run time
    (every point, not only those the file holds), and a note in it says why."""
    import tracer
    from tests.helpers import make_runs

    a, b = make_runs()
    live = compare_records(a, b, scenario="s", model="m")
    keep = ["model.embed_tokens"]
    for run in (a, b):
        dropped = [n for n in run.captures if n not in keep]
        run.meta["store_auto"] = {"kept": keep, "dropped": dropped, "kept_bytes": 1, "total_bytes": 2, "budget": 1,
                                  "logits": "lm_head", "kinds": {n: run.captures[n].kind for n in dropped}}
        run.captures = {n: c for n, c in run.captures.items() if n in keep}
    back = tracer.compare_trace(str(_written(tmp_path, live, a, b)))
    assert [p.name for p in back.points] == [p.name for p in live.points] and back.logits == live.logits
    assert back.verdict() == live.verdict()
    assert any(n.startswith("from the comparison made when the trace was written: --store auto kept full tensors of 1 of")
               for n in back.facts["notes"])


def test_a_run_is_not_compared_with_itself(tmp_path):
    """Runs A and B differ by one ULP from model.layers.1 on (planted); 'tracer compare t.h5 A A',
    't.h5:A t.h5:A' or 't.h5:A LINK' (LINK a symlink to t.h5, its run resolved to A) printed
    'bit-identical' for a run read against itself. Each is refused; a copy of the file on another
    path is a trace from another machine and still compares."""
    import os
    import shutil

    import pytest

    import tracer
    from tests.helpers import make_runs, write_trace
    from tracer.errors import TracerError

    path = write_trace(tmp_path / "t.h5", make_runs())
    assert not tracer.compare_trace(str(path)).identical  # A vs B: the planted ULP
    link = tmp_path / "link.h5"
    os.symlink(path, link)
    for a, b in ((f"{path}:A", f"{path}:A"), (f"{path}:B", f"{link}:B")):
        with pytest.raises(TracerError, match="compared with itself"):
            tracer.compare(a, b)
    for args in ((str(path), "A", "A"), (f"{path}:A", str(link))):  # the CLI's: LINK takes the other side's run
        with pytest.raises(TracerError, match="compared with itself"):
            tracer.compare_trace(*args)
    copy = tmp_path / "copy.h5"
    shutil.copy(path, copy)
    assert tracer.compare_trace(f"{path}:A", str(copy)).identical  # two files: A here against A there


def test_a_tampered_stored_comparison_is_refused_by_report_and_show(tmp_path, capsys):
    """Issue 37 (this stop's trial): a stored comparison whose positions hold NaN made ``tracer report``
    exit 3 (``int(nan)`` before the check), and ``tracer show --format json`` printed any tampered
    document as it was, with bare NaN (not JSON). Both now check it as a comparison document."""
    import json

    import pytest

    from tracer.errors import TracerError
    from tracer.report.show import print_trace_info
    from tracer.store.trace import describe

    x = torch.arange(16, dtype=torch.float32).reshape(2, 8)
    a, b = _run("A", [("emb", "embedding", x)]), _run("B", [("emb", "embedding", x + 1)])
    good = json_safe(compare_records(a, b, scenario="s", model="m").to_dict())
    for edit, needle in ((lambda d: d.update(positions=[float("nan"), 1]), "positions"),
                         (lambda d: d["layers"][0].update(max_abs_diff=float("nan")), "negative (or NaN)")):
        doc = json.loads(json.dumps(good))
        edit(doc)
        path = tmp_path / f"t{len(needle)}.h5"
        with TraceWriter(path, header={"scenario": {"name": "s"}, "model": {"name": "m"}}) as w:
            w.add_run(a)
            w.add_run(b)
            w.add_comparison("s", doc)
        with pytest.raises(TracerError, match="not a stored comparison document") as e:
            stored_comparison(path)
        assert needle in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(TracerError, match="not a stored comparison document"):
            print_trace_info(describe(path), str(path), "json")
    path = tmp_path / "ok.h5"
    with TraceWriter(path, header={"scenario": {"name": "s"}, "model": {"name": "m"}, "note": float("inf")}) as w:
        w.add_run(a)
        w.add_run(b)
        w.add_comparison("s", good)
    print_trace_info(describe(path), str(path), "json")
    json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
