"""``--store auto``: full tensors of the logits and the points around a planted origin, within
``--max-trace-size``; every point compared; nothing silently dropped."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import tracer
from tracer.errors import TracerError
from tracer.store.budget import choose, parse_size
from tracer.store.trace import TraceReader

N, BLOCK = 40, 16  # P = 32: run B's suffix pass computes 8 tokens


# ---------------------------------------------------------------- the choice, by hand


def test_parse_size_units():
    assert parse_size("300MB") == 300_000_000
    assert parse_size("2GiB") == 2 * 1024**3
    assert parse_size("1.5G") == 1_500_000_000
    assert parse_size("512") == 512
    assert parse_size(4096) == 4096
    for bad in ("", "12 parsecs", "-5MB", "0", "MB", True):
        with pytest.raises(TracerError):
            parse_size(bad)


def test_choose_keeps_logits_origin_its_input_then_outward():
    pts = [(f"p{i}", 10) for i in range(10)] + [("logits", 10)]
    kept = choose(pts, 45, origins=("p5",), logits="logits")
    # logits 10 + origin p5 10 + its input p4 10 + outward: p6 (40); p3 would make 50 > 45, p7 too
    assert kept.names == ("p4", "p5", "p6", "logits")
    assert kept.kept_bytes == 40 and kept.total_bytes == 110
    assert kept.dropped == ("p0", "p1", "p2", "p3", "p7", "p8", "p9")
    assert kept.reasons["p5"] == "origin" and kept.reasons["logits"] == "logits"


def test_choose_whole_trace_within_budget_and_no_origin():
    pts = [("a", 5), ("b", 5), ("logits", 5)]
    assert choose(pts, 15, logits="logits").names == ("a", "b", "logits")
    # nothing diverges: the logits, then the deepest layers, within the budget
    assert choose(pts, 10, logits="logits").names == ("b", "logits")
    # a point bigger than the budget is never written
    assert choose([("huge", 100), ("logits", 5)], 50, origins=("huge",), logits="logits").names == ("logits",)


# ---------------------------------------------------------------- end to end, planted origin


def _suffix_shift(delta: float):
    """Forward hook on a decoder layer: shifts every feature of the first token of run B's suffix
    pass (the only call of 8 tokens), so that layer is the one origin."""
    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.shape[1] != N - 32:
            return None
        hidden = hidden.clone()
        hidden[0, 0] += delta
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
    return hook


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    lm = tracer.load_model("tiny-llama", dtype="bfloat16")
    handle = lm.model.get_submodule("model.layers.1").register_forward_hook(_suffix_shift(0.5))
    folder = tmp_path_factory.mktemp("auto")
    opts = dict(loaded=lm, length=N, block_size=BLOCK, kv_cache=False, progress=False)
    try:
        full = tracer.run(output=str(folder / "full.h5"), store="tensors", **opts)
        with TraceReader(folder / "full.h5") as r:
            size = {n: int(ds.nbytes) for n, (_, ds) in r.captures("A").items()}
        # room for the logits and three decoder-layer outputs (both runs)
        budget = 2 * (size["lm_head"] + 3 * size["model.layers.1"])
        auto = tracer.run(output=str(folder / "auto.h5"), max_trace_size=budget, **opts)
    finally:
        handle.remove()
    return full, auto, folder, budget, size


def test_auto_keeps_the_origin_neighbourhood_and_logits(planted):
    full, auto, folder, budget, size = planted
    assert [o.name for o in full.comparison.origins] == ["model.layers.1"]  # the planted op
    with TraceReader(folder / "auto.h5") as ra, TraceReader(folder / "full.h5") as rf:
        assert ra.header["store"] == "auto"
        for run in ("A", "B"):
            kept = ra.capture_names(run)
            # the origin, its input (layers.0), the next layer outward, and the logits
            assert sorted(kept) == sorted(["model.layers.0", "model.layers.1", "model.layers.2", "lm_head"])
            for name in kept:  # bit-exact against the --store tensors trace of the same runs
                assert torch.equal(ra.tensor(run, name).view(torch.int16), rf.tensor(run, name).view(torch.int16))
            meta = ra.run(run, load_tensors=False).meta["store_auto"]
            assert sorted(meta["kept"] + meta["dropped"]) == sorted(size)  # nothing silently dropped
            assert meta["kept_bytes"] <= budget
        stored = ra.comparisons()["A-vs-B"]
    # every point was compared, with the same counts as the full trace's comparison
    assert [p["name"] for p in stored["layers"]] == [p.name for p in full.comparison.points]
    assert [p["n_diff"] for p in stored["layers"]] == [p.diff.n_diff for p in full.comparison.points]
    assert any("--store auto kept full tensors of 4 of 7 points" in n for n in auto.comparison.facts["notes"])


def test_compare_of_an_auto_trace_never_reports_dropped_points_as_identical(planted):
    full, _, folder, _, _ = planted
    # default: the comparison made at run time, every point, with a note saying why
    c = tracer.compare_trace(str(folder / "auto.h5"))
    assert [p.name for p in c.points] == [p.name for p in full.comparison.points]
    assert [p.diff.n_diff for p in c.points] == [p.diff.n_diff for p in full.comparison.points]
    assert c.first_divergent == "model.layers.1" and not c.identical
    assert any("kept full tensors of 4 of 7 points" in n for n in c.facts["notes"])
    # recomputed from the file (a tolerance asks for it): the dropped points are "not compared", never identical
    r = tracer.compare_trace(str(folder / "auto.h5"), atol=0.0)
    assert [p.name for p in r.points] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert sorted(s.name for s in r.not_compared) == ["model.embed_tokens", "model.layers.3", "model.norm"]
    assert not r.identical


@pytest.mark.parametrize("args, message", [
    (["--store", "tensors", "--max-trace-size", "1GB"], "--max-trace-size applies to --store auto"),
    (["--max-trace-size", "lots"], "is not a size"),
    (["--no-store", "--store", "auto"], "contradict"),
])
def test_cli_refuses_bad_store_options(cli_env, tmp_path, args, message):
    p = subprocess.run([sys.executable, "-m", "tracer", "run", "tiny-llama", "--length", "40", "-o",
                        str(tmp_path / "t.h5"), *args], capture_output=True, text=True, env=cli_env, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "t.h5").exists()


def test_huge_and_fractional_sizes_are_one_line_errors():
    for text in ("9" * 400, 10**30, "99999999999999999999TiB"):
        with pytest.raises(TracerError, match="more than"):
            parse_size(text)
    with pytest.raises(TracerError, match="under 1 byte"):
        parse_size("0.5")
