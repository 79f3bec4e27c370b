"""SIGTERM in the middle of every command that reads or writes files ends it within 10 s, exit 143, the
last stderr line ``terminated``, and no partial file left (issue 37); and a command stuck in native code
that holds the GIL (where no Python signal handler can run) is ended by the watchdog (:mod:`tracer.watchdog`).

The seven commands run at once, one process each, on small inputs built here: a trace of 1,500 points
per run (no stored comparison, so compare, report and plot compare it point by point: seconds of
work), a named-tensors dump of its run A (import maps and writes 1,500 points), and tiny-llama for
run, sweep and audit. Each is signalled when it is visibly at work: it holds its input open
(``/proc/PID/fd``), or its partial output exists.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, cli_env as _env

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc (Linux)")

N_POINTS = 1500


def _holds(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has ``path`` open."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                return True
        except OSError:
            continue
    return False


def _partials(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if ".partial-" in p.name or ".point-" in p.name)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A trace of two runs of N_POINTS points (no stored comparison) and a dump of its run A."""
    from safetensors.torch import save_file

    from tracer.execute.records import CaptureRecord, RunRecord
    from tracer.store.trace import TraceWriter

    d = tmp_path_factory.mktemp("signal-inputs")

    def run(name: str) -> RunRecord:
        caps = {f"model.layers.{i}": CaptureRecord(f"model.layers.{i}", "layer",
                                                   torch.full((2, 4), 1.0 + (name == "B") * (i % 7 == 0)), op="X")
                for i in range(N_POINTS)}
        caps["model.embed_tokens"] = CaptureRecord("model.embed_tokens", "embedding", torch.ones(2, 4), op="E")
        return RunRecord(name=name, token_ids=[1, 2], plan={}, window=(0, 2), captures=caps, meta={})

    trace = d / "many.h5"
    with TraceWriter(trace, header={"model": {"name": "planted", "family": "llama"}}) as w:
        a = run("A")
        w.add_run(a)
        w.add_run(run("B"))
    dump = d / "dump.safetensors"
    save_file({"input_ids": torch.tensor([1, 2]), **{n: c.tensor.contiguous() for n, c in a.captures.items()}}, str(dump))
    return {"trace": trace, "dump": dump}


def _commands(inputs: dict[str, Path], root: Path) -> dict[str, tuple[list[str], Path, object]]:
    """name → (arguments, its folder, marker(pid, folder) -> bool: it is at work)."""
    trace, dump = inputs["trace"], inputs["dump"]
    reading = lambda pid, folder: _holds(pid, trace)  # noqa: E731 - the input is open: past start-up, at work
    writing = lambda pid, folder: bool(_partials(folder))  # noqa: E731
    model = ["tiny-llama", "--device", "cpu"]
    cases = {
        "compare": (["compare", str(trace)], reading),
        "report": (["report", str(trace), "-o", "{dir}/r.html"], reading),
        "plot": (["plot", str(trace), "-o", "{dir}/p.png"], reading),
        "import": (["import", str(dump), "-r", f"{trace}:A", "-o", "{dir}/i.h5"], writing),
        "run": (["run", *model, "--length", "600", "--granularity", "sublayers", "-o", "{dir}/t.h5"], writing),
        "sweep": (["sweep", *model, "--lengths", "17:60", "--block-size", "8", "--keep-tensors", "-o", "{dir}/s.h5"],
                  writing),
        "audit": (["audit", *model, "--length", "40", "-o", "{dir}/a.h5"], writing),
    }
    out = {}
    for name, (args, marker) in cases.items():
        folder = root / name
        folder.mkdir()
        out[name] = ([a.replace("{dir}", str(folder)) for a in args], folder, marker)
    return out


def test_sigterm_in_the_middle_of_each_command_exits_143_and_leaves_no_partial(inputs, tmp_path):
    env = _env({"TRACER_PROGRESS": "lines"})
    cmds = _commands(inputs, tmp_path)
    procs = {name: subprocess.Popen([sys.executable, "-m", "tracer", *args], env=env, cwd=folder,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for name, (args, folder, _m) in cmds.items()}
    sent: dict[str, float] = {}
    ended: dict[str, float] = {}
    deadline = time.monotonic() + 400
    try:
        while len(ended) < len(procs) and time.monotonic() < deadline:
            for name, proc in procs.items():
                if name in ended:
                    continue
                if proc.poll() is not None:
                    ended[name] = time.monotonic()
                elif name not in sent and cmds[name][2](proc.pid, cmds[name][1]):
                    proc.send_signal(signal.SIGTERM)
                    sent[name] = time.monotonic()
            time.sleep(0.02)
        results = {}
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=60)
            results[name] = (proc.returncode, err, ended.get(name, time.monotonic()) - sent.get(name, 0.0))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    bad = []
    for name, (code, err, took) in results.items():
        lines = err.strip().splitlines()
        if name not in sent:
            bad.append(f"{name}: finished (exit {code}) before it was seen at work: {err[-300:]}")
        elif code != 143 or not lines or lines[-1] != "terminated" or took > 10:
            bad.append(f"{name}: exit {code} {took:.1f} s after SIGTERM: {err[-600:]}")
        elif _partials(cmds[name][1]):
            bad.append(f"{name}: left {_partials(cmds[name][1])}")
    assert not bad, "\n\n".join(bad)


_STUCK = """
import os, sys
sys.argv = ["tracer", "report", "v1bad.h5"]
import tracer.api as api
from tracer.cli import command

def stuck(*args, **kwargs):  # what a command does when HDF5 loops on a damaged file: native code holding the GIL
    import h5py
    partial = open(f"r.html.partial-{os.getpid()}", "w")
    f = h5py.File("v1bad.h5", "r")
    print("stuck", flush=True)
    f["sweep"].attrs["params"]

api.report_file = stuck
command()
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_command_stuck_in_native_code_is_ended_by_the_watchdog(tmp_path, sig):
    """HDF5 looping on a damaged global heap holds the GIL: no Python handler runs (SIGTERM was ignored
    forever, only SIGKILL ended it). The watchdog kills it 3 s after the signal, removes the partial file
    it held open, and says so in one line (exit status 137: the clean 143 needs Python to run)."""
    from tests.helpers import write_sweep_v1, zero_heap_free_space
    from tests.store.test_sweepfile_fuzz import KINDS, POINTS, _V1_PARAMS, _rows

    zero_heap_free_space(write_sweep_v1(tmp_path / "v1bad.h5", _rows(), _V1_PARAMS, POINTS, KINDS))
    (tmp_path / "stuck.py").write_text(_STUCK)
    proc = subprocess.Popen([sys.executable, "stuck.py"], cwd=tmp_path, env=_env({"TRACER_PROGRESS": "off"}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "stuck", proc.stderr.read()
        time.sleep(0.5)  # well inside HDF5's loop
        t0 = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL and took < 10, (proc.returncode, took, err)
    assert err.strip().splitlines() == [f"terminated: tracer did not stop within 3 s of {signal.Signals(sig).name} "
                                        "(inside native code that does not return to Python, e.g. HDF5 on a damaged "
                                        "file); killed it and removed 1 partial file(s)"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stuck.py", "v1bad.h5"]


_CRASH = """
import sys
sys.argv = ["tracer", "show", "t.h5"]
import tracer.api as api
from tracer.cli import command

def crash_in_native_code(*args, **kwargs):  # what a segfault in HDF5 or torch looks like to Python
    import ctypes
    ctypes.string_at(0)

api.trace_info = crash_in_native_code
command()
"""


def test_a_crash_in_native_code_leaves_the_python_stacks(tmp_path):
    """A run once ended with SIGSEGV (-11) instead of exit 130 after Ctrl-C, and did not recur: the
    command now prints every thread's Python stack on such a crash (faulthandler), so the next one
    names where it happened; the exit status is still the signal's."""
    (tmp_path / "t.h5").write_bytes(b"x")
    (tmp_path / "crash.py").write_text(_CRASH)
    proc = subprocess.run([sys.executable, "crash.py"], cwd=tmp_path, env=_env({"TRACER_PROGRESS": "off"}),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr)
    assert "Fatal Python error: Segmentation fault" in proc.stderr, proc.stderr
    assert "in crash_in_native_code" in proc.stderr and "in show_cmd" in proc.stderr, proc.stderr
    assert "in _beat" in proc.stderr, proc.stderr  # every thread's stack: the watchdog's heartbeat too


# ---------------------------------------------------------------- an engine's start (vLLM's engine core)


def _engine_proc(title: str = "VLLM::EngineCore") -> subprocess.Popen:
    """A stand-in for an engine's process: it sleeps for a minute, its command line holds ``title``."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", title])


@pytest.mark.parametrize("how", ["dies", "bound", "signal"])
def test_the_start_guard_ends_a_start_that_waits_on_the_engines_processes(how):
    """Issue 37: vLLM's start waited ~10 minutes on an engine core whose workers failed to start, and a
    SIGTERM was acted on only then. The guard of the start (tracer.watchdog.guard_start) tracks the
    processes the start creates (by their title), and kills them when one dies, when the start runs
    past its bound, or after a signal: the start, waiting on them, ends. The block here waits on the
    stand-in as vLLM waits on its engine core (no timing asserted: each wait is capped far above)."""
    from tracer import watchdog

    seen: list[int] = []
    other = _engine_proc()  # already running before the start: an earlier engine's, never touched
    try:
        with watchdog.guard_start("vLLM", "VLLM::", seen, bound_s=1.0 if how == "bound" else 0) as guard:
            core = _engine_proc()
            worker = _engine_proc("VLLM::Worker_TP1")
            deadline = time.monotonic() + 30  # let the guard see both first
            while len(guard.tracked) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert set(guard.tracked) == {core.pid, worker.pid}
            if how == "dies":
                worker.kill()  # a worker fails to start
            elif how == "signal":
                seen.append(signal.SIGTERM)  # what signals_seen records when a SIGTERM arrives
            code = core.wait(timeout=50)  # the engine core would have waited its 60 s
        assert code == -signal.SIGKILL and core.pid in guard.killed
        assert other.poll() is None and other.pid not in guard.killed
        if how == "dies":
            assert guard.reason == f"vLLM's VLLM::Worker_TP1 (pid {worker.pid}) exited while the engine started"
        elif how == "bound":
            assert guard.reason == "vLLM's engine did not start within 1 s"
        else:
            assert guard.reason is None  # a signal is the command's own exit (143), not a start failure
    finally:
        for p in (other, locals().get("core"), locals().get("worker")):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


_STUCK_START = """
import os, select, signal, subprocess, sys, time
from tracer import watchdog
watchdog.LEAVE_S = 1.0
partial = open(sys.argv[1] + ".partial-%d" % os.getpid(), "w")
seen = []
with watchdog.guard_start("vLLM", "VLLM::", seen, bound_s=0) as guard:
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "VLLM::EngineCore"])
    print(core.pid, flush=True)
    while len(guard.tracked) < 1:
        time.sleep(0.05)
    if sys.argv[2] == "signal":
        seen.append(signal.SIGTERM)
    else:
        core.kill()
    select.select([], [], [], 60)  # vLLM's ready wait: a poll that lets go of the GIL and never returns
print("the block returned", flush=True)
"""


@pytest.mark.parametrize("how", ["signal", "dies"])
def test_a_start_stuck_after_the_guard_killed_its_processes_ends_the_command(tmp_path, how):
    """Issue 37 (this stop's trial): SIGTERM during a vLLM start with the engine core in its own process
    hung for minutes: vLLM waits for its engine core's ready message in a zmq poll that watches no
    process, and pyzmq retries the poll after running the signal handler, dropping its exception. So
    a start still running LEAVE_S after the guard killed its processes is ended from the guard's
    thread: one line, the partial files it holds open removed, exit 143 after a SIGTERM, else 2."""
    proc = subprocess.run([sys.executable, "-c", _STUCK_START, str(tmp_path / "trace.h5"), how],
                          capture_output=True, text=True, timeout=55, env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == (128 + signal.SIGTERM if how == "signal" else 2), proc.stderr
    assert "the block returned" not in proc.stdout and len(lines) == 1
    if how == "signal":
        assert lines[0].startswith("terminated: vLLM's start did not return") and "SIGTERM" in lines[0]
    else:
        assert lines[0].startswith("error: vLLM's VLLM::EngineCore (pid ") and "exited while the engine started" in lines[0]
    assert "removed 1 partial file(s)" in lines[0] and not list(tmp_path.glob("*.partial-*"))
    core = int(proc.stdout.split()[0])
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(core, os.WNOHANG)
    assert not os.path.exists(f"/proc/{core}") or open(f"/proc/{core}/stat").read().rsplit(")", 1)[1].split()[0] in "ZX"


def test_a_bad_engine_start_bound_is_refused_in_one_line(monkeypatch):
    from tracer import watchdog
    from tracer.errors import TracerError

    for bad in ("-5", "nan", "inf", "text"):
        monkeypatch.setenv("TRACER_ENGINE_START_S", bad)
        with pytest.raises(TracerError, match="TRACER_ENGINE_START_S") as e:
            watchdog.start_bound()
        assert "\n" not in str(e.value)
    for good, want in (("0", 0.0), (" 2 ", 2.0), ("1e9", 1e9)):
        monkeypatch.setenv("TRACER_ENGINE_START_S", good)
        assert watchdog.start_bound() == want
    monkeypatch.delenv("TRACER_ENGINE_START_S")
    assert watchdog.start_bound() == watchdog.START_S


def test_a_start_the_guard_ended_is_one_line_naming_the_log_and_what_to_do():
    from tracer.engines.vllm.environment import start_failure

    line = start_failure("vLLM's VLLM::Worker_TP2 (pid 7) exited while the engine started", "/tmp/v.log", 3)
    assert "\n" not in line and line.startswith("vLLM's VLLM::Worker_TP2 (pid 7) exited")
    assert "vLLM's log /tmp/v.log" in line and "fewer TP ranks (--tp)" in line and "TRACER_ENGINE_START_S" in line
    assert "fewer TP ranks" not in start_failure("x", None, 1) and "output above" in start_failure("x", None, 1)


_FINALIZER = r"""
import os, signal, sys, time
from tracer.errors import Terminated, raise_on_termination
raise_on_termination(on_signal=(lambda: None) if sys.argv[2] == "ack" else None)
class Bomb:
    def __del__(self):
        os.kill(os.getpid(), int(sys.argv[1]))
        time.sleep(0.05)  # the handler raises in here, in a finalizer: Python prints and drops it
t0 = time.monotonic()
try:
    Bomb()
    while time.monotonic() - t0 < 5:
        sum(range(1000))
    print("not delivered", flush=True)
except (Terminated, KeyboardInterrupt) as e:
    print(type(e).__name__, f"{time.monotonic() - t0:.2f}", flush=True)
"""


@pytest.mark.parametrize(("sig", "ack", "expected"), [(signal.SIGTERM, "", "Terminated"),
                                                      (signal.SIGINT, "", "KeyboardInterrupt"),
                                                      (signal.SIGINT, "ack", "KeyboardInterrupt")])
def test_a_signal_whose_handler_raised_in_a_finalizer_reaches_the_main_code(sig, ack, expected):
    """A signal that arrives while the main thread runs a finalizer (``__del__``): the handler's
    exception there is dropped by Python, so tracer delivers the signal again once the unraisable hook
    has returned; the main code gets it within the second, and nothing is printed as "ignored"
    (delivered inside the hook, it was dropped a second time and the command went on)."""
    out = subprocess.run([sys.executable, "-c", _FINALIZER, str(int(sig)), ack], capture_output=True, text=True,
                         env=_env(), cwd=ROOT, timeout=60)
    name, _, took = out.stdout.strip().partition(" ")
    assert name == expected, out.stdout + out.stderr[-600:]
    assert float(took) < 1.0 and "Exception ignored" not in out.stderr, out.stderr[-600:]


_AT_EXIT = r"""
import atexit, os, signal, sys, time
from tracer.cli_exit import exit_interrupted
from tracer.errors import raise_on_termination
raise_on_termination(on_signal=lambda: None)
def step(i):
    def f():
        if i == 0:
            os.kill(os.getpid(), int(sys.argv[1]))  # a second signal while the first one's exit hooks run
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.2:
            sum(range(1000))
        print("hook", i, flush=True)
    return f
for i in reversed(range(4)):  # atexit runs the last registered first: 0, 1, 2, 3
    atexit.register(step(i))
try:
    raise KeyboardInterrupt  # the first Ctrl-C: the command cleans up and exits 130 after its exit hooks
except KeyboardInterrupt:
    exit_interrupted(True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_exit_hooks_ends_that_hook_alone(sig):
    """A second signal while an interrupted command runs its exit hooks (``exit_interrupted``: the
    engine's shutdown, the writer process, the partial files) ends the hook it struck, as Python's
    atexit does; every later hook still runs (the partial files are removed), the command exits 130
    with ``interrupted`` last. Redelivered as a finalizer's, it struck every later hook in turn (each
    one's exception is printed and dropped by atexit too) and none ran."""
    out = subprocess.run([sys.executable, "-c", _AT_EXIT, str(int(sig))], capture_output=True, text=True,
                         env=_env(), cwd=ROOT, timeout=60)
    assert out.returncode == 130, out.stdout + out.stderr[-600:]
    assert [line for line in out.stdout.splitlines() if line.startswith("hook")] == ["hook 1", "hook 2", "hook 3"], \
        out.stdout + out.stderr[-600:]
    assert out.stderr.strip().splitlines()[-1] == "interrupted", out.stderr[-600:]


@pytest.mark.parametrize("command", ["show", "compare"])
def test_a_reader_that_goes_away_ends_the_command_quietly_with_141(inputs, command):
    """`tracer show T | head -1`: the reader of stdout closes the pipe after one line; the command ends
    with 141 (128 + SIGPIPE, as a shell tool's), no error on stderr (its progress lines only), never 1
    ("diverged": rich's own handling of a broken pipe exits 1)."""
    proc = subprocess.Popen([sys.executable, "-m", "tracer", command, str(inputs["trace"])], env=_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # the reader goes away, as head does
    err = proc.stderr.read()
    code = proc.wait(timeout=120)
    assert first and code == 141, (code, err[-600:])
    assert not any(w in err for w in (b"rror", b"Traceback", b"Exception", b"Broken")), err[-600:]  # progress only


@pytest.mark.parametrize("args", [["show", "TRACE", "--format", "json"], ["show", "TRACE"], ["--help"],
                                  ["compare", "--help"]])
def test_a_reader_gone_before_the_output_ends_any_command_quietly_with_141(inputs, args):
    """`tracer show T --format json | head -c 10`, `tracer --help | head -1`: output that is not rich's
    (print, click's help) met a closed pipe; click turned the BrokenPipeError into exit 1 ("diverged").
    The reader is gone before the command writes (closed at once: the interpreter takes longer to start),
    so every write fails; the command ends with 141 and no error."""
    argv = [str(inputs["trace"]) if a == "TRACE" else a for a in args]
    proc = subprocess.Popen([sys.executable, "-m", "tracer", *argv], env=_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader goes away before any output
    err = proc.stderr.read()
    code = proc.wait(timeout=120)
    assert code == 141, (code, err[-600:])
    assert not any(w in err for w in (b"rror", b"Traceback", b"Exception", b"Broken")), err[-600:]
