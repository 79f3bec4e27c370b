"""Nothing silent: a status line for every phase that runs long (and none for a fast one), a heartbeat
while it runs, tqdm bars relayed into tracer's one display, weighed ETAs, TRACER_PROGRESS."""

from __future__ import annotations

import io
import re
import time

import pytest

from tracer.progress import ItemProgress, StatusProgress, phase, relay_tqdm, resolve_mode


def test_a_slow_phase_prints_a_line_and_a_fast_one_none():
    out = io.StringIO()
    status = StatusProgress("run", mode="lines", stream=out, delay_s=2.0, interval_s=10.0)  # not entered: no thread
    status("loading the model")
    t0 = status.since
    assert not status.tick(t0 + 1.9)  # a phase shorter than 2 s prints nothing ...
    status("run A: cache miss")
    t1 = status.since
    assert not status.tick(t1 + 1.0)
    assert status.tick(t1 + 2.0)  # ... a longer one its line after 2 s,
    assert not status.tick(t1 + 5.0)
    assert status.tick(t1 + 12.0) and not status.tick(t1 + 13.0)  # and again every 10 s while it runs
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(x.startswith("run: run A: cache miss · elapsed ") for x in lines)
    assert "loading the model" not in out.getvalue()
    out = io.StringIO()
    with StatusProgress("run", mode="lines", stream=out, delay_s=30.0) as status:  # the real thread
        status("comparing")  # the command ends long before: silent
    assert out.getvalue() == ""


def test_tqdm_bars_report_into_the_status_and_draw_nothing(capsys):
    tqdm = pytest.importorskip("tqdm")
    seen = []
    with relay_tqdm(seen.append):
        for _ in tqdm.tqdm(range(5), desc="Loading weights"):
            pass
        bar = tqdm.tqdm(total=3, desc="Converting")  # a subclass-style use, updated by hand
        bar.update(3)
        bar.close()
    assert capsys.readouterr().err == ""  # nothing drawn on stderr
    assert "Loading weights 5/5" in seen and "Converting 3/3" in seen
    list(tqdm.tqdm(range(2), desc="after", file=io.StringIO()))  # the class is restored afterwards
    assert tqdm.tqdm.display is not None and "after" not in " ".join(seen)


def test_relayed_detail_is_in_the_status_line():
    out = io.StringIO()
    with StatusProgress("run", mode="lines", stream=out, delay_s=0.0) as status:
        status("building the cache")
        status.report("Converting and de-quantizing GGUF tensors... 12/272")
        status._line(time.monotonic())  # what the heartbeat prints
    assert "building the cache · Converting and de-quantizing GGUF tensors... 12/272 · elapsed" in out.getvalue()


def test_phase_and_mode_from_the_environment(monkeypatch):
    out = io.StringIO()
    with phase("compare", "comparing t.h5", mode="lines", stream=out) as status:
        assert status.delay_s > 0  # a phase is silent unless it takes long
    assert out.getvalue() == ""
    monkeypatch.setenv("TRACER_PROGRESS", "off")
    assert resolve_mode("auto", io.StringIO()) == "off" and resolve_mode("lines") == "lines"
    monkeypatch.setenv("TRACER_PROGRESS", "lines")
    assert resolve_mode("auto", io.StringIO()) == "lines"


def test_weighed_eta_and_notes():
    out = io.StringIO()
    with ItemProgress("audit", 3, mode="lines", stream=out, weight_total=10.0) as bar:
        bar.note("audit: 3 checks")
        bar.advance("kept", weight=5.0, timed=False)  # from an earlier session: teaches the ETA nothing
        assert bar.eta_s() is None
        time.sleep(0.2)
        bar.advance("one", weight=1.0)
        eta = bar.eta_s()  # 4 units of weight left, at the pace of the 1 unit timed
        assert eta is not None and 3.5 * 0.2 <= eta <= 4 * (time.monotonic() - bar.t0) + 0.05
    lines = out.getvalue().splitlines()
    assert lines[0] == "audit: 3 checks"
    assert re.match(r"audit: 1/3 \(33%\) kept · elapsed \d+s · ETA \?$", lines[1])
    assert re.match(r"audit: 2/3 \(67%\) one · elapsed \d+s · ETA \d+s$", lines[2])


def test_an_item_that_runs_long_is_not_silent():
    out = io.StringIO()
    bar = ItemProgress("audit", 2, mode="lines", stream=out, interval_s=10.0)  # not entered: no thread
    bar.update(description="L6-compile (2 forward passes, 192 tokens + torch.compile)")
    bar.last_line -= 11  # 11 s without a line
    bar.tick(bar._running)
    bar.advance("L6-compile: diverges")
    assert bar._running is None  # finished: the heartbeat stops for it
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[0].split(" · elapsed")[0] == lines[1].split(" · elapsed")[0]  # the heartbeat
    assert all("running L6-compile" in x for x in lines[:2]) and "running" not in lines[2]


@pytest.mark.parametrize("width", [60, 80])
def test_the_bar_keeps_elapsed_and_eta_whole_in_a_narrow_terminal(monkeypatch, width):
    """At 80 columns the audit bar cut its elapsed time and ETA to ``0:03…`` and ``-:--…`` to make room
    for the check's description: now the description is the one shortened, and notes above the bar
    wrap at words under their first line."""
    from rich.cells import cell_len

    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich takes the stream for a terminal of COLUMNS
    monkeypatch.setenv("COLUMNS", str(width))
    out = io.StringIO()
    note = "L2-prefix-cache: diverges from model.layers.0.self_attn.kv_cache, 0 argmax flips (cache miss vs hit)"
    with ItemProgress("audit", 21, mode="bar", stream=out) as bar:
        bar.update(description="L2-generate-cache (18 forward passes, 1,004 tokens, greedy generation)")
        bar.note(note)
        bar.advance(note)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    lines = [x for x in re.split(r"[\r\n]", text) if x.strip()]
    assert max(cell_len(x) for x in lines) <= width
    last = [x for x in lines if x.startswith("audit ")][-1]
    assert re.search(r" 1/21 \d+:\d\d:\d\d ETA (\d+:\d\d:\d\d|-:--:--) ", last), last
    words = " ".join(x.strip() for x in lines if not x.startswith("audit "))
    assert note in words  # the note whole, its words in order


_SLOW_ERROR = """
import sys, time
sys.argv = ["tracer", "compare", sys.argv[1]]
import tracer.api as api
from tracer.cli import command
from tracer.errors import TracerError

def slow_then_bad(*args, **kwargs):  # a comparison that works for 2.5 s, then finds bad input
    time.sleep(2.5)
    raise TracerError("the dump is damaged; re-dump it")

api.compare_trace = slow_then_bad
command()
"""


@pytest.mark.parametrize("progress", [None, "off"])
def test_without_a_terminal_the_error_is_the_last_line(tmp_path, progress):
    """Issue 37 item 12: on a non-TTY stderr a phase over 2 s prints '<command>: ... · elapsed 2s' before
    an error. What a non-TTY gets (README, 'stderr without a terminal'): those lines, each starting
    with the command's name, and the error always last, on its own line; TRACER_PROGRESS=off: the
    error alone."""
    import subprocess
    import sys

    from tests.helpers import cli_env

    (tmp_path / "t.h5").write_bytes(b"")
    env = cli_env({} if progress is None else {"TRACER_PROGRESS": progress})
    if progress is None:  # the default: lines, stderr being a pipe
        env.pop("TRACER_PROGRESS", None)
    proc = subprocess.run([sys.executable, "-c", _SLOW_ERROR, str(tmp_path / "t.h5")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and lines[-1] == "error: the dump is damaged; re-dump it", proc.stderr
    if progress == "off":
        assert lines == ["error: the dump is damaged; re-dump it"]
    else:
        assert len(lines) >= 2 and all(re.match(r"compare: comparing .* · elapsed \d+s$", x) for x in lines[:-1]), lines


def test_the_status_line_in_a_terminal_keeps_its_elapsed_time_running(monkeypatch):
    """In a terminal the status line showed the elapsed time of its last message: a phase of minutes
    said ``· 3s`` throughout. The status is rendered anew at each of rich's refreshes: two renders
    of one phase, 1.1 s apart and with no message between, show two elapsed times."""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("COLUMNS", "100")
    out = io.StringIO()
    with StatusProgress("run", mode="bar", stream=out) as status:
        status("run A: cache miss")
        first = status.status.renderable  # what the next refresh draws
        from rich.console import Console

        def shown() -> str:
            c = Console(file=io.StringIO(), width=100)
            c.print(first)
            return c.file.getvalue()

        before = shown()
        status.t0 -= 61  # as if the command had run a minute longer, no message since
        after = shown()
    assert "run A: cache miss · " in before and before != after, (before, after)
    assert re.search(r"· 1m0[12]s", after), after


def test_a_counted_phase_s_eta_counts_from_its_own_start():
    """With --verdict the status printed ``verdict: re-run 2/2 ... · elapsed 5m10s · ETA 5m10s``: the
    ETA was the command's elapsed time (model load and the main run included), not the re-runs'.
    The sequence's own items time it: re-run 1 took 100 s, so at the start of re-run 2 of 2 about
    100 s are left, and 30 s into it about 70 s."""
    status = StatusProgress("run", mode="lines", stream=io.StringIO())
    t = status.t0
    status("loading the model")
    status("verdict: re-run 1/2 at float32: run A: cache miss")
    status._count = (status._count[0], 2, 1, t + 300.0, 1, t + 300.0)  # re-run 1 began 300 s in
    status.message = "verdict: re-run 2/2 at float64: run A: cache miss"
    status._count = (status._count[0], 2, 1, t + 300.0, 2, t + 400.0)  # re-run 2 began 100 s later
    assert status.eta_s(t + 400.0) == pytest.approx(100.0)
    assert status.eta_s(t + 430.0) == pytest.approx(70.0)
    assert "· elapsed 7m10s · ETA 1m10s" in status._text(t + 430.0, "elapsed ")
    fresh = StatusProgress("run", mode="lines", stream=io.StringIO())
    for k in (1, 2, 3):  # the real calls: each k's message when it comes
        fresh(f"repetition {k}/4")
    assert fresh.eta_s(time.monotonic()) is not None and fresh.eta_s(time.monotonic()) < 1.0
    fresh("comparing A with B")
    assert fresh.eta_s(time.monotonic()) is None and "ETA" not in fresh._text(time.monotonic())
