"""Issue 24 item 7 (and the exit paths of item 5): nothing the user was told to keep is deleted, no
output overwrites an input of the same command, every partial tracer creates is cleaned up (hidden
sweep point files included), and SIGTERM cleans up like Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tracer.errors import TracerError
from tracer.execute.records import CaptureRecord, RunRecord
from tracer.store.trace import TraceWriter

DEAD = 2**22 + 12345  # above the default pid_max: no such process


def _run(name: str = "A") -> RunRecord:
    cap = CaptureRecord(name="model.layers.0", kind="layer", tensor=torch.zeros(2, 4), op="X",
                        calls=[{"positions": [0, 2], "in": [[1, 2, 4]], "out": [1, 2, 4]}])
    return RunRecord(name=name, token_ids=[1, 2], plan={}, window=(0, 2), captures={cap.name: cap}, meta={})


def test_the_loser_of_two_writers_keeps_its_trace_under_a_name_no_cleanup_touches(tmp_path):
    """It was told "the new trace is at t.h5.partial-PID; move it yourself", and the next --overwrite
    run of t.h5 deleted that complete trace as stale once the PID was gone."""
    import tracer

    out = tmp_path / "t.h5"
    w = TraceWriter(out, header={})
    w.add_run(_run())
    with TraceWriter(out, header={}) as other:  # the winner
        other.add_run(_run("B"))
    with pytest.raises(TracerError) as e:
        w.close()
    kept = tmp_path / f"t.new-{os.getpid()}.h5"
    assert f"kept as {kept}" in str(e.value) and "\n" not in str(e.value)
    assert kept.exists() and not list(tmp_path.glob("*.partial-*"))
    with tracer.read_trace(kept) as r:  # complete and readable
        assert r.runs == ["A"]
    with tracer.read_trace(out) as r:
        assert r.runs == ["B"]
    # the next --overwrite run of t.h5 (and any clean-up) leaves the kept trace alone
    with TraceWriter(out, header={}, overwrite=True) as again:
        again.add_run(_run("C"))
    assert kept.exists()


def test_stale_partials_and_hidden_sweep_points_are_removed_kept_files_are_not(tmp_path):
    """Every kill -9 of a --keep-tensors sweep leaked .NAME.point-PID.h5(.partial-PID)."""
    from tracer.store.sweepfile import SweepFile

    stale = [tmp_path / f".s.point-{DEAD}.h5", tmp_path / f".s.point-{DEAD}.h5.partial-{DEAD}",
             tmp_path / f"t.h5.partial-{DEAD}"]
    kept = [tmp_path / f"s.new-{DEAD}.h5", tmp_path / "notes.txt", tmp_path / f".s.point-{os.getppid()}.h5"]
    for p in stale + kept:
        p.write_bytes(b"x")
    sf = SweepFile(tmp_path / "s.h5", {"p": 1}, {})
    sf.close()
    assert [p for p in stale if p.exists()] == []
    assert all(p.exists() for p in kept)  # a live PID's point file (the parent test runner's) stays too


def test_import_onto_its_own_reference_is_refused(tmp_path):
    """`tracer import DUMP -o ref.h5 -r ref.h5:B --overwrite` replaced the reference with the import."""
    from tracer.diff.compare_dump import import_dump

    ref = tmp_path / "ref.h5"
    with TraceWriter(ref, header={}) as w:
        w.add_run(_run("B"))
    before = ref.read_bytes()
    for out in (ref, tmp_path / "." / "ref.h5"):
        with pytest.raises(TracerError, match="is the -r reference input"):
            import_dump(str(tmp_path / "dump"), (str(ref), "B"), str(out), overwrite=True)
    os.link(ref, tmp_path / "hard.h5")
    with pytest.raises(TracerError, match="is the -r reference input"):
        import_dump(str(tmp_path / "dump"), (str(ref), "B"), str(tmp_path / "hard.h5"), overwrite=True)
    assert ref.read_bytes() == before


def test_run_output_onto_its_prompt_file_is_refused(tmp_path):
    import tracer

    prompt = tmp_path / "p.txt"
    prompt.write_text("hello world " * 10)
    with pytest.raises(TracerError, match="--prompt-file input"):
        tracer.run("tiny-llama", prompt_file=str(prompt), output=str(prompt), overwrite=True, progress=False)
    assert prompt.read_text().startswith("hello world")


@pytest.mark.parametrize("sig, code, line", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_sigterm_cleans_up_like_ctrl_c(tmp_path, cli_env, sig, code, line):
    """SIGTERM of a run that writes a trace: exit 143, no partial file left, the line says so; SIGINT
    (what held before issue 24, kept as a regression test): exit 130, no partial."""
    proc = subprocess.Popen([sys.executable, "-m", "tracer", "run", "tiny-llama", "--device", "cpu", "--length", "600",
                             "--granularity", "sublayers", "-o", str(tmp_path / "t.h5")],
                            env=cli_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline and not list(tmp_path.glob("*.partial-*")):
        time.sleep(0.02)
    assert list(tmp_path.glob("*.partial-*")), "the run never started writing"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    if line is not None:
        assert err.strip().splitlines()[-1] == line
    assert list(tmp_path.iterdir()) == []


def test_kill_9_of_a_keep_tensors_sweep_then_resume_gives_the_same_rows(tmp_path, cli_env):
    """What held before issue 24, kept: a kill -9 of a --keep-tensors sweep, then a resume: rows
    bit-identical to an uninterrupted sweep; and now no hidden point file or partial is left. (The
    killed sweep runs in a child; the resume and the uninterrupted sweep in this process.)"""
    import tracer
    from tracer.load.models import load_model

    out = tmp_path / "s.h5"
    proc = subprocess.Popen([sys.executable, "-m", "tracer", "sweep", "tiny-llama", "--device", "cpu", "--dtype",
                             "float32", "--lengths", "17:18", "--block-size", "8", "--keep-tensors", "-o", str(out)],
                            env=cli_env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if len(tracer.read_sweep(out).rows) >= 1:
                break
        except TracerError:
            pass
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    loaded = load_model("tiny-llama", dtype="float32", device="cpu", progress=False)
    kw = dict(loaded=loaded, lengths="17:18", block_sizes=[8], keep_tensors=True, progress=False)
    resumed = tracer.sweep("tiny-llama", output=out, **kw)
    whole = tracer.sweep("tiny-llama", output=tmp_path / "full.h5", **kw)
    assert resumed.complete and resumed.rows == whole.rows and len(resumed.rows) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.h5", "s.h5"]  # no hidden point file, no partial
