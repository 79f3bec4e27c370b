"""The writer process (tracer.store.writer_process): a background writer's h5py work in a child.

The oracle of every file it writes is the synchronous writer's file of the same runs (itself
checked against numpy round trips in test_trace.py): the same runs, plans, metas, index entries
(their CRC-32s included), comparisons and bytes. The failure tests plant what users meet: a child
killed mid-trace, a parent that dies mid-trace, Ctrl-C, a full disk, bad settings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tracer.errors import TracerError
from tracer.execute.records import CaptureRecord, RunRecord
from tracer.store import writer_process as wp
from tracer.store.trace import TraceReader
from tracer.store.writer import TraceWriter

ROOT = Path(__file__).resolve().parents[2]


def _run(name: str, seed: int, packed: bool = False) -> RunRecord:
    """Four points of four dtypes (and an empty one); ``packed``: points of one dtype lie end to end
    in one buffer, as tracer.execute.capture.host_copies lays them out."""
    g = torch.Generator().manual_seed(seed)
    tensors = {f"model.layers.{i}": torch.randn(16, 48, generator=g).to(dt)
               for i, dt in enumerate((torch.bfloat16, torch.bfloat16, torch.float16, torch.float32))}
    if packed:
        for dt in {t.dtype for t in tensors.values()}:
            names = [n for n, t in tensors.items() if t.dtype == dt]
            buf = torch.cat([tensors[n].reshape(-1) for n in names])
            off = 0
            for n in names:
                k = tensors[n].numel()
                tensors[n] = buf[off:off + k].view(16, 48)
                off += k
    caps = {n: CaptureRecord(name=n, kind="layer", tensor=t, calls=[{"positions": [0, 16], "out": [[16, 48]]}],
                             op="Block", role="layer") for n, t in tensors.items()}
    caps["model.norm"] = CaptureRecord(name="model.norm", kind="final_norm", tensor=torch.empty(0, 48), op="RMSNorm")
    return RunRecord(name=name, token_ids=list(range(16)), plan={"chunks": [[0, 16]]}, window=(0, 16), captures=caps,
                     meta={"wall_s": 0.5})


def _contents(path: Path) -> dict:
    """Everything a reader sees in a trace, tensors as raw bytes."""
    with TraceReader(path) as r:
        out = {"runs": r.runs, "header": r.header, "comparisons": r.comparisons()}
        for run in r.runs:
            rec = r.run(run)
            out[run] = {"plan": rec.plan, "meta": rec.meta, "window": list(rec.window), "ids": rec.token_ids,
                        "names": list(rec.captures),
                        "points": {n: (c.kind, c.op, c.role, c.calls, str(c.tensor.dtype), tuple(c.tensor.shape),
                                       c.tensor.contiguous().view(torch.uint8).flatten().tolist())
                                   for n, c in rec.captures.items()}}
        return out


def _write(path: Path, background, runs, **kw) -> None:
    with TraceWriter(path, header={"x": 1}, background=background, **kw) as w:
        for r in runs:
            w.add_run(r)
        w.add_comparison("c", {"verdict": "diverges", "n": 3})


@pytest.mark.parametrize("packed", [False, True])
def test_the_process_writes_what_the_synchronous_writer_writes(tmp_path, packed):
    runs = [_run("A", 1, packed), _run("B", 2, packed)]
    _write(tmp_path / "sync.h5", False, runs)
    _write(tmp_path / "proc.h5", "process", runs)
    assert _contents(tmp_path / "proc.h5") == _contents(tmp_path / "sync.h5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proc.h5", "sync.h5"]


def test_points_end_to_end_travel_as_one_buffer_per_dtype():
    message, buffers = wp.run_message(_run("A", 1, packed=True))
    assert len(buffers) == 3  # bf16 (two consecutive points), fp16, fp32; the empty point sends nothing
    assert [b.nbytes for b in buffers] == [2 * 16 * 48 * 2, 16 * 48 * 2, 16 * 48 * 4]
    loose_message, loose = wp.run_message(_run("A", 1))
    assert len(loose) == 4 and loose_message["layout"][-1][-2:] == (-1, 0)


def test_the_environment_chooses_the_mode_of_background_true(tmp_path, monkeypatch):
    monkeypatch.delenv(wp.ENV, raising=False)
    assert wp.writer_mode(True) == "thread" and wp.writer_mode(False) is None
    monkeypatch.setenv(wp.ENV, "Process")
    assert wp.writer_mode(True) == "process"
    w = TraceWriter(tmp_path / "t.h5", header={}, background=True)
    assert w.mode == "process"
    w.add_run(_run("A", 3))
    w.close()
    assert _contents(tmp_path / "t.h5")["runs"] == ["A"]
    monkeypatch.setenv(wp.ENV, "fork")
    with pytest.raises(TracerError, match=r"^TRACER_WRITER='fork' is not a writer mode; set it to thread or process"):
        TraceWriter(tmp_path / "u.h5", header={}, background=True)
    with pytest.raises(TracerError, match="background='yes' is not a writer mode"):
        TraceWriter(tmp_path / "u.h5", header={}, background="yes")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.h5"]


def test_an_error_in_the_child_is_the_same_one_line_error_and_no_file(tmp_path):
    bad = _run("A", 4)
    bad.captures["model.layers.0"].calls = [{"positions": [0, 16], "note": float("nan")}]  # JSON takes it
    bad.captures["x/y"] = CaptureRecord(name="x/y", kind="layer", tensor=torch.ones(16, 4))
    with pytest.raises(TracerError) as sync:
        _write(tmp_path / "s.h5", False, [bad])
    with pytest.raises(TracerError) as proc:
        _write(tmp_path / "p.h5", "process", [bad])
    assert str(proc.value) == str(sync.value) and "is not a valid trace name" in str(proc.value)
    assert list(tmp_path.iterdir()) == []


def test_a_call_pickle_cannot_send_is_refused_in_one_line(tmp_path):
    bad = _run("A", 5)
    bad.captures["model.layers.1"].calls = [{"positions": [0, 16], "f": lambda: 0}]
    with pytest.raises(TracerError, match=r"run A: its plan, meta or calls hold a value that cannot be sent"):
        _write(tmp_path / "p.h5", "process", [bad])
    assert list(tmp_path.iterdir()) == []


def test_a_killed_child_is_one_line_and_the_next_writer_starts_another(tmp_path):
    w = TraceWriter(tmp_path / "t.h5", header={}, background="process")
    w.add_run(_run("A", 6))
    w._futures[-1].result()  # run A is written: the child is the one this writer uses
    child = wp._child()
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.wait(timeout=30)
    w.add_run(_run("B", 7))
    with pytest.raises(TracerError, match=r"^the trace writer process \(PID \d+\) ended \(signal 9\); the trace was "
                                          r"not written: run again, or write from a thread \(TRACER_WRITER=thread\)$"):
        w.close()
    assert list(tmp_path.iterdir()) == []
    _write(tmp_path / "again.h5", "process", [_run("A", 6)])
    assert wp._child().proc.pid != child.proc.pid
    assert _contents(tmp_path / "again.h5")["runs"] == ["A"]


def test_ctrl_c_reaches_the_writer_not_its_child(tmp_path):
    _write(tmp_path / "warm.h5", "process", [_run("A", 8)])  # the child is up
    child = wp._child()
    os.kill(child.proc.pid, signal.SIGINT)
    time.sleep(0.2)
    assert child.proc.poll() is None
    _write(tmp_path / "t.h5", "process", [_run("A", 8)])
    assert wp._child() is child and _contents(tmp_path / "t.h5")["runs"] == ["A"]


def _script(body: str) -> str:
    return (f"import os, sys, json; sys.path.insert(0, {str(ROOT)!r}); import torch\n"
            "from tracer.store.writer import TraceWriter\n"
            "from tracer.store import writer_process as wp\n"
            "from tracer.execute.records import RunRecord, CaptureRecord\n"
            "from tracer.errors import TracerError\n"
            "caps = {f'p{i}': CaptureRecord(f'p{i}', 'layer', torch.ones(8, 1000)) for i in range(20)}\n"
            "run = RunRecord('A', list(range(8)), {}, (0, 8), caps)\n" + body)


def test_a_parent_that_dies_mid_trace_leaves_no_partial_file(tmp_path):
    body = (f"w = TraceWriter({str(tmp_path / 't.h5')!r}, header={{}}, background='process')\n"
            "w.add_run(run)\n"
            "w._futures[-1].result()\n"  # the run is in the partial file
            "print(wp._child().proc.pid, flush=True)\n"
            "os.kill(os.getpid(), 9)\n")
    proc = subprocess.run([sys.executable, "-c", _script(body)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    pid = int(proc.stdout.split()[0])
    for _ in range(300):  # the child sees its socket close, deletes the partial file and exits
        if not list(tmp_path.iterdir()) and not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.05)
    assert list(tmp_path.iterdir()) == []
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_full_disk_in_the_child_is_one_line_and_leaves_no_partial_file(tmp_path):
    body = ("import resource\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"  # the child inherits it
            "try:\n"
            f"    with TraceWriter({str(tmp_path / 'full.h5')!r}, header={{}}, background='process') as w:\n"
            "        w.add_run(run)\n"
            "except TracerError as e:\n"
            "    print(e); sys.exit(2)\n")
    proc = subprocess.run([sys.executable, "-c", _script(body)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "file size limit" in proc.stdout and proc.stdout.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_a_forked_process_starts_its_own_child(tmp_path):
    _write(tmp_path / "before.h5", "process", [_run("A", 9)])
    parent_child = wp._child()
    pid = os.fork()
    if pid == 0:  # the fork: the inherited socket is its parent's; it must use a child of its own
        code = 1
        try:
            _write(tmp_path / "forked.h5", "process", [_run("A", 9)])
            code = 0 if wp._child() is not parent_child and wp._child().owner == os.getpid() else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    _write(tmp_path / "after.h5", "process", [_run("A", 9)])
    assert wp._child() is parent_child
    assert _contents(tmp_path / "forked.h5") == _contents(tmp_path / "after.h5") == _contents(tmp_path / "before.h5")


def test_a_relative_path_is_this_process_working_folder_not_the_child_s(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(Path("first.h5"), "process", [_run("A", 10)])  # the child may start here
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    _write(Path("t.h5"), "process", [_run("A", 10)])
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["t.h5"]
    assert _contents(tmp_path / "sub" / "t.h5") == _contents(tmp_path / "first.h5")


# ---------------------------------------------------------------- Ctrl-C, odd values, a working folder, forks


def test_ctrl_c_while_close_waits_for_the_child_leaves_no_reply_for_the_next_call(tmp_path):
    """Ctrl-C between a request and its reply: the reply must never be read as the next call's
    (every later reply would belong to the call before it: a trace renamed into place before the
    child finished it, an error raised at the wrong call or not at all)."""
    _write(tmp_path / "warm.h5", "process", [_run("A", 11)])
    child = wp._child()
    w = TraceWriter(tmp_path / "t.h5", header={}, background="process")
    w.add_run(_run("A", 11))
    w._futures[-1].result()

    def interrupt(*_):
        raise KeyboardInterrupt

    def cont() -> None:
        try:
            os.kill(child.proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    old = signal.signal(signal.SIGALRM, interrupt)
    os.kill(child.proc.pid, signal.SIGSTOP)  # a slow finish (a slow disk)
    resume = threading.Timer(1.0, cont)
    resume.start()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            w.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        resume.join()
        cont()
    time.sleep(1.0)  # whatever the old child still says has arrived by now
    assert sorted(p.name for p in tmp_path.iterdir()) == ["warm.h5"]
    bad = _run("B", 12)
    bad.captures["x/y"] = CaptureRecord(name="x/y", kind="layer", tensor=torch.ones(16, 4))
    w2 = TraceWriter(tmp_path / "u.h5", header={}, background="process")
    w2.add_run(bad)
    assert isinstance(w2._futures[-1].exception(timeout=60), TracerError)  # this run's own answer
    with pytest.raises(TracerError, match="is not a valid trace name"):
        w2.close()
    _write(tmp_path / "v.h5", "process", [_run("A", 11)])
    assert _contents(tmp_path / "v.h5") == _contents(tmp_path / "warm.h5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.h5", "warm.h5"]


def test_what_the_child_cannot_load_is_one_line_and_the_child_lives_on(tmp_path, monkeypatch):
    """torch's multiprocessing pickler sends a tensor as a shared-memory handle the child cannot
    open, and a class of a module made at run time cannot be found there: neither may end the
    child (every open trace with it). A tensor is data the synchronous writer writes."""
    import types

    _write(tmp_path / "warm.h5", "process", [_run("A", 13)])
    child = wp._child()
    other = TraceWriter(tmp_path / "other.h5", header={}, background="process")  # open meanwhile
    other.add_run(_run("A", 13))
    ids = _run("A", 14)
    ids.token_ids = torch.arange(16)  # the synchronous writer takes any int64 array-like
    _write(tmp_path / "ids-sync.h5", False, [ids])
    _write(tmp_path / "ids-proc.h5", "process", [ids])
    assert _contents(tmp_path / "ids-proc.h5") == _contents(tmp_path / "ids-sync.h5")
    tensor_calls = _run("A", 15)
    tensor_calls.captures["model.layers.0"].calls = [{"positions": torch.tensor([0, 16])}]
    with pytest.raises(TracerError) as sync:
        _write(tmp_path / "c-sync.h5", False, [tensor_calls])
    with pytest.raises(TracerError) as proc:
        _write(tmp_path / "c-proc.h5", "process", [tensor_calls])
    assert str(proc.value) == str(sync.value) and "is not JSON-serialisable" in str(sync.value)
    module = types.ModuleType("made_at_run_time")
    cls = type("Note", (str,), {"__module__": "made_at_run_time"})
    module.Note = cls
    monkeypatch.setitem(sys.modules, "made_at_run_time", module)
    with TraceWriter(tmp_path / "h-sync.h5", header={"note": cls("x")}) as w:
        w.add_run(_run("A", 16))
    with TraceWriter(tmp_path / "h-proc.h5", header={"note": cls("x")}, background="process") as w:
        w.add_run(_run("A", 16))
    assert _contents(tmp_path / "h-proc.h5") == _contents(tmp_path / "h-sync.h5")
    meta = _run("A", 17)
    meta.captures["model.layers.0"].calls = [{"positions": [0, 16], "note": cls("x")}]
    with pytest.raises(TracerError, match=r"^the trace writer process cannot read the run A that was sent"):
        _write(tmp_path / "m.h5", "process", [meta])
    other.close()
    assert wp._child() is child and _contents(tmp_path / "other.h5")["A"] == _contents(tmp_path / "warm.h5")["A"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h-proc.h5", "h-sync.h5", "ids-proc.h5", "ids-sync.h5",
                                                          "other.h5", "warm.h5"]


def test_negative_views_are_written_as_their_values(tmp_path):
    """A view with the negative bit (the imaginary part of a conjugate) holds the negated bits of its
    storage: the trace holds its values, in either writer."""
    z = torch.randn(1, dtype=torch.complex64, generator=torch.Generator().manual_seed(18))
    point = z.conj().imag  # contiguous, negative bit set
    assert point.is_neg() and point.is_contiguous()
    expected = torch.tensor([-z.imag.item()], dtype=torch.float32).view(torch.int32).tolist()
    for mode in (False, "process"):
        run = RunRecord(name="A", token_ids=[1], plan={}, window=(0, 1),
                        captures={"p": CaptureRecord(name="p", kind="layer", tensor=point)}, meta={})
        with TraceWriter(tmp_path / f"{mode}.h5", header={}, background=mode) as w:
            w.add_run(run)
        with TraceReader(tmp_path / f"{mode}.h5") as r:
            assert r.run("A").captures["p"].tensor.view(torch.int32).tolist() == expected, mode


def _script_file(tmp_path: Path, body: str) -> Path:
    folder = tmp_path / "script"
    folder.mkdir(exist_ok=True)
    path = folder / "s.py"
    path.write_text(_script(body))
    return path


def test_a_module_in_the_working_folder_does_not_shadow_the_childs_imports(tmp_path):
    """python -c puts the working folder first on the child's path; a user's json.py there must not
    break the writer process when it does not break the calling script."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "json.py").write_text("raise ImportError('the user json.py')\n")
    script = _script_file(tmp_path, "with TraceWriter('t.h5', header={}, background='process') as w:\n"
                                    "    w.add_run(run)\n"
                                    "print('written')\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=work, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "written\n", proc.stderr[-2000:]
    assert sorted(p.name for p in work.iterdir()) == ["json.py", "t.h5"]


@pytest.mark.parametrize("mode", ["False", "'process'"])
def test_a_fork_that_exits_keeps_its_parents_trace(tmp_path, mode):
    """A forked helper that ends normally (sys.exit) runs the exit handlers it inherited: they must
    not delete the partial files of its parent's open writers."""
    body = (f"w = TraceWriter({str(tmp_path / 't.h5')!r}, header={{}}, background={mode})\n"
            "w.add_run(run)\n"
            "if w._futures: w._futures[-1].result()\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    sys.exit(0)\n"
            "os.waitpid(pid, 0)\n"
            "w.close()\n"
            "print('closed')\n")
    proc = subprocess.run([sys.executable, "-c", _script(body)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "closed\n", proc.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.h5"]


def test_a_fork_alive_when_the_parent_dies_does_not_keep_the_partial_file(tmp_path):
    """A forked worker (a data loader's, an engine's) holds a copy of the socket: the child must
    still see its parent go, and delete the partial file, while the fork lives on."""
    body = (f"w = TraceWriter({str(tmp_path / 't.h5')!r}, header={{}}, background='process')\n"
            "w.add_run(run)\n"
            "w._futures[-1].result()\n"
            "import time\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    quiet = os.open(os.devnull, os.O_RDWR); os.dup2(quiet, 1); os.dup2(quiet, 2)\n"  # not our pipes
            "    time.sleep(60); os._exit(0)\n"
            "print(pid, flush=True)\n"
            "os.kill(os.getpid(), 9)\n")
    with open(tmp_path.parent / f"{tmp_path.name}.stderr", "w") as err:  # the child keeps its stderr
        proc = subprocess.run([sys.executable, "-c", _script(body)], stdout=subprocess.PIPE, stderr=err, text=True,
                              timeout=120)
    fork = int(proc.stdout)
    try:
        for _ in range(200):
            if not list(tmp_path.iterdir()):
                break
            time.sleep(0.05)
        assert list(tmp_path.iterdir()) == []
    finally:
        os.kill(fork, signal.SIGKILL)


def test_a_parent_gone_while_the_child_writes_leaves_no_traceback(tmp_path):
    """The child answers a parent that died meanwhile: it deletes the partial file and ends quietly
    (its stderr is the user's terminal)."""
    err = tmp_path / "stderr"
    body = (f"w = TraceWriter({str(tmp_path / 'out' / 't.h5')!r}, header={{}}, background='process')\n"
            "w._futures[-1].result()\n"
            "child = wp._child().proc.pid\n"
            "print(child, flush=True)\n"
            "os.kill(child, 19)\n"  # SIGSTOP: the run below is in the socket, its answer not yet sent
            "small = {'p': CaptureRecord('p', 'layer', torch.ones(8, 4))}\n"  # its message fits the socket's buffer
            "w.add_run(RunRecord('A', list(range(8)), {}, (0, 8), small))\n"
            "import time; time.sleep(0.5)\n"
            "os.kill(os.getpid(), 9)\n")
    with open(err, "w") as stderr:
        parent = subprocess.Popen([sys.executable, "-c", _script(body)], stdout=subprocess.PIPE, stderr=stderr,
                                  text=True)
        child = int(parent.stdout.readline())
        parent.wait(timeout=120)
        parent.stdout.close()
    os.kill(child, signal.SIGCONT)
    for _ in range(200):
        if not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]:
            break
        time.sleep(0.05)
    assert "Traceback" not in err.read_text(), err.read_text()[-2000:]
    assert list((tmp_path / "out").iterdir()) == []
