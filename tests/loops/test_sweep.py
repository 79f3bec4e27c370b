"""Sweeps: axis parsing, the sweep file, resuming after an interruption, bad input."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

from tests.helpers import cli_session, tracer_cli
from tracer.errors import TracerError
from tracer import sweep
from tracer.loops.sweep import MATRIX_FIELDS, ROW_FIELDS, compress_ranges, parse_int_list, read_sweep


@pytest.mark.parametrize("spec,expect", [
    ("17:20", [17, 18, 19, 20]),            # stop inclusive
    ("16:64:16", [16, 32, 48, 64]),
    ("16:70:16", [16, 32, 48, 64]),
    ("100,200", [100, 200]),
    ("17:19,18,40", [17, 18, 19, 40]),      # duplicates dropped, order kept
    (" 5 ", [5]),
])
def test_parse_int_list(spec, expect):
    assert parse_int_list(spec) == expect


@pytest.mark.parametrize("spec,match", [("20:17", "start <= stop"), ("1:5:0", "step >= 1"), ("a:b", "not an int"),
                                        ("1:2:3:4", "too many"), ("", "empty"), ("0:3", "positive")])
def test_parse_int_list_errors(spec, match):
    with pytest.raises(TracerError, match=match):
        parse_int_list(spec)


def test_compress_ranges():
    assert compress_ranges([40, 17, 18, 19, 33, 41]) == "17-19, 33, 40-41"


@pytest.fixture(scope="module")
def loaded():
    from tracer.load.models import load_model

    return load_model("tiny-llama", dtype="bfloat16", device="cpu", progress=False)


KW = dict(lengths="17:22", block_sizes=[8, 16], progress=False)


def _datasets(path):
    with h5py.File(path, "r") as f:
        g = f["sweep"]
        n = int(json.loads(g.attrs["index"])["n_done"])  # the commit record (format 2)
        data = {k: g[k][:n] for k in (*ROW_FIELDS, *MATRIX_FIELDS) if k != "wall_s"}
        return data, {k: g.attrs[k] for k in ("params", "points", "kinds")}, bool(f.attrs["complete"])


def test_resume_equals_uninterrupted(tmp_path, loaded):
    full = sweep("tiny-llama", loaded=loaded, output=tmp_path / "full.h5", **KW)
    assert full.complete and len(full.rows) == 12
    assert [(r.length, r.block_size) for r in full.rows][:3] == [(17, 8), (18, 8), (19, 8)]

    seen = []

    def stop_after_five(row):
        seen.append(row)
        if len(seen) == 5:
            raise KeyboardInterrupt

    part_path = tmp_path / "part.h5"
    with pytest.raises(KeyboardInterrupt):
        sweep("tiny-llama", loaded=loaded, output=part_path, on_point=stop_after_five, **KW)
    part = read_sweep(part_path)
    assert len(part.rows) == 5 and not part.complete

    again = []
    resumed = sweep("tiny-llama", loaded=loaded, output=part_path, on_point=again.append, **KW)
    assert len(again) == 7  # only the unfinished points ran
    assert resumed.complete and resumed.rows == full.rows and resumed.points == full.points

    d_full, a_full, c_full = _datasets(tmp_path / "full.h5")
    d_part, a_part, c_part = _datasets(part_path)
    assert a_full == a_part and c_full and c_part
    for k in d_full:
        assert np.array_equal(d_full[k], d_part[k]), k

    # every stored number equals an independent run of that point
    import tracer

    r = full.rows[4]
    res = tracer.run("tiny-llama", loaded=loaded, length=r.length, block_size=r.block_size, store=False, progress=False)
    assert r.n_diff == tuple([p.diff.n_diff for p in res.comparison.points] + [res.comparison.logits.tensor.n_diff])
    assert r.split_at == res.comparison.positions[0]
    assert r.argmax_flips == len(res.comparison.logits.argmax_flips)


def test_other_parameters_on_same_output_refused(tmp_path, loaded):
    out = tmp_path / "s.h5"
    sweep("tiny-llama", loaded=loaded, output=out, lengths="17:18", block_sizes=[16], progress=False)
    before = out.read_bytes()
    with pytest.raises(TracerError, match="other parameters.*lengths.*--overwrite"):
        sweep("tiny-llama", loaded=loaded, output=out, lengths="17:19", block_sizes=[16], progress=False)
    assert out.read_bytes() == before
    res = sweep("tiny-llama", loaded=loaded, output=out, lengths="17:19", block_sizes=[16], progress=False, overwrite=True)
    assert [r.length for r in res.rows] == [17, 18, 19]


def test_bad_input(tmp_path, loaded):
    with pytest.raises(TracerError, match="start the lengths at 17"):
        sweep("tiny-llama", loaded=loaded, lengths="10:20", block_sizes=[16], store=False, progress=False)
    with pytest.raises(TracerError, match="hold 3 tokens"):
        sweep("tiny-llama", loaded=loaded, lengths="17:20", token_ids=[1, 2, 3], store=False, progress=False)
    trace = tmp_path / "x.h5"
    with h5py.File(trace, "w") as f:
        f.attrs["format"] = "tracer-trace"
    with pytest.raises(TracerError, match="not a sweep file"):
        sweep("tiny-llama", loaded=loaded, lengths="17", output=trace, progress=False)


def test_a_scenario_without_kv_blocks_sweeps_short_lengths_and_refuses_block_sizes(loaded):
    """repeat and rollout-vs-train split no prompt into KV blocks: lengths below a block are theirs to run (they
    were refused with a cache-hit message), and a block size would change nothing (each length ran once per
    block size, rows labelled with a size the scenario ignored)."""
    res = sweep("tiny-llama", loaded=loaded, scenario="repeat", lengths="4,6", store=False, progress=False)
    assert [r.length for r in res.rows] == [4, 6] and not any(r.diverged for r in res.rows)
    for kw in (dict(block_sizes=[16, 32]), dict(block_size=32)):
        with pytest.raises(TracerError, match="do not apply to scenario repeat"):
            sweep("tiny-llama", loaded=loaded, scenario="repeat", lengths="20", store=False, progress=False, **kw)
    with pytest.raises(TracerError, match="at least 2 tokens"):
        sweep("tiny-llama", loaded=loaded, scenario="repeat", lengths="1:3", store=False, progress=False)
    res = sweep("tiny-llama", loaded=loaded, scenario="rollout-vs-train", lengths="8", new_tokens=2, rollouts=2,
                store=False, progress=False)
    assert [r.length for r in res.rows] == [8]
    for rl_only in ("mitigations", "is_cap", "mask_threshold"):  # its rows hold no RL metrics: refused, not ignored
        with pytest.raises(TracerError, match="unknown option"):
            sweep("tiny-llama", loaded=loaded, scenario="rollout-vs-train", lengths="8", store=False, progress=False,
                  **{rl_only: 2.0 if rl_only != "mitigations" else True})


def test_in_memory_and_token_ids_prefixes(loaded):
    ids = list(range(3, 40))
    res = sweep("tiny-llama", loaded=loaded, lengths=[17, 30], block_sizes=[16], token_ids=ids, store=False, progress=False)
    assert res.path is None and [r.length for r in res.rows] == [17, 30]
    assert [r.split_at for r in res.rows] == [16, 16]


def test_sweep_cli(tmp_path, cli_env):
    bads = ((["--lengths", "9:3"], "start <= stop"), (["--block-size", "8", "--block-sizes", "8,16"], "not both"),
            (["--lengths", "17:20", "-o", "s.h5"], "other parameters"))
    procs = cli_session([["sweep", "tiny-llama", "--lengths", "17:19", "--block-size", "16", "--device", "cpu",
                          "-o", "s.h5", "--plot", "s.png"],
                         ["plot", "s.h5", "-o", "map.svg"],
                         ["sweep", "tiny-llama", "--lengths", "17:19", "--device", "cpu", "-o", "s.h5", "--format", "csv"],
                         *(["sweep", "tiny-llama", "--device", "cpu", *bad] for bad, _ in bads)], cli_env, tmp_path)
    assert procs[0].returncode == 0, procs[0].stderr
    assert "block size 16:" in procs[0].stdout and (tmp_path / "s.png").exists()
    assert procs[1].returncode == 0, procs[1].stderr
    proc = procs[2]
    assert proc.returncode == 0 and proc.stdout.splitlines()[0].startswith("length,block_size")  # resumed: nothing left
    assert len(proc.stdout.splitlines()) == 4
    for proc, (_, msg) in zip(procs[3:], bads):
        assert proc.returncode == 2 and msg in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_keep_tensors(tmp_path, loaded):
    import tracer

    out = tmp_path / "k.h5"
    sweep("tiny-llama", loaded=loaded, output=out, lengths="17,30", block_sizes=[8], keep_tensors=True, progress=False)
    ref = tracer.run("tiny-llama", loaded=loaded, length=30, block_size=8, output=tmp_path / "ref.h5", progress=False)
    with h5py.File(out, "r") as f:
        assert sorted(f["tensors"]) == ["N17_b8", "N30_b8"]
        g = f["tensors/N30_b8"]
        assert sorted(g) == ["A", "B"]
        for run in ref.runs:  # laid out as a trace's runs (format version 2: index + data/<dtype>)
            index = {e["name"]: e for e in json.loads(g[run.name].attrs["index"])}
            for name, rec in run.captures.items():
                e = index[name]
                raw = g[run.name]["data"][e["dtype"]][e["offset"]:e["offset"] + rec.tensor.numel()]
                assert torch.equal(torch.from_numpy(raw.view(np.int16)), rec.tensor.reshape(-1).view(torch.int16))
    assert not list(tmp_path.glob(".k.point-*"))  # temporary traces removed


def test_a_piped_sweep_says_each_point_as_it_starts_and_the_summary_names_the_lengths(capsys):
    """Piped, a sweep printed nothing while a point ran (3 min 43 s at N = 250): each point now has a
    line when it starts (and a heartbeat while it runs), then one when it ends. The summary's first
    divergent points name the lengths they are first at, read back from the rows."""
    import re

    from tracer.load.models import load_model
    from tracer.report.sweep_lines import sweep_summary_lines

    lm = load_model("tiny-llama", dtype="float32", device="cpu", progress=False)  # float32 GEMMs diverge here
    res = sweep("tiny-llama", loaded=lm, lengths="40,65,90", block_sizes=[16], store=False, progress="lines")
    err = capsys.readouterr().err.splitlines()
    starts = [i for i, x in enumerate(err) if re.match(r"sweep: \d/3 .*running N=\d+ b=16 ", x)]
    ends = [i for i, x in enumerate(err) if re.match(r"sweep: \d/3 .*N=\d+ b=16 (diverges|bit-identical) ", x)]
    assert len(starts) == len(ends) == 3 and all(s < e for s, e in zip(starts, ends)) and ends[0] < starts[1]
    div = [r for r in res.rows if r.diverged]
    assert div, "float32 prefix caching diverges on this model at some of these lengths"
    line = next(x for x in sweep_summary_lines(res) if x.startswith("  first divergent at: "))
    for r in div:
        name = res.point_name(r.first_divergent)
        group = re.search(re.escape(name) + r" \(N=([^)]*)\)", line)
        assert group and str(r.length) in group.group(1).replace("-", ", ").split(", "), (line, name, r.length)
