"""The distributed TP rendezvous: nothing listens beyond the loopback, ranks die with their parent,
and what a killed parent leaves (scratch folder, trace partial) is removed by the next run.

Oracles: the kernel's socket tables (``/proc/net/tcp``, ``/proc/net/tcp6``: every LISTEN socket,
mapped to its process through ``/proc/<pid>/fd``), and ``/proc`` for which processes are alive.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")

LOOPBACK = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def listening(pids: list[int]) -> list[tuple[str, str, int]]:
    """``(table, local address:port, pid)`` of every LISTEN socket the given processes hold."""
    owner = {inode: pid for pid in pids for inode in _socket_inodes(pid)}
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and int(f[9]) in owner:  # state 0A = LISTEN
                found.append((Path(table).name, f[1], owner[int(f[9])]))
    return found


def children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` and that are multiprocessing spawn children (the ranks)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"spawn_main" in cmd:
            out.append(int(d))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_store_listens_on_127_0_0_1_only():
    from tracer.engines.tp.dist import open_store

    store = open_store(30)
    try:
        mine = [s for s in listening([os.getpid()]) if int(s[1].rsplit(":", 1)[1], 16) == store.port]
        assert mine == [("tcp", f"{LOOPBACK}:{store.port:04X}", os.getpid())]
    finally:
        del store


def _tracer(args, env, cwd) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tracer", *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


TP2 = ["run", "tiny-llama", "--device", "cpu", "--scenario", "tensor-parallel", "--tp", "2", "--tp-mode",
       "distributed", "--length", "24"]


def test_no_socket_of_the_run_listens_beyond_the_loopback(cli_env, tmp_path):
    out = tmp_path / "tp.h5"
    proc = _tracer(TP2 + ["-o", str(out), "--format", "json"], cli_env, tmp_path)
    seen: set[tuple[str, str, str]] = set()
    ranks_seen: set[int] = set()
    while proc.poll() is None:
        ranks = children(proc.pid)
        ranks_seen.update(ranks)
        seen.update((t, addr, "parent" if pid == proc.pid else "rank") for t, addr, pid in listening([proc.pid, *ranks]))
        time.sleep(0.05)
    _, err = proc.communicate()
    assert proc.returncode == 0, err
    assert len(ranks_seen) == 2
    assert any(who == "parent" for _, _, who in seen), seen  # the store was seen listening
    assert all(table == "tcp" and addr.startswith(LOOPBACK + ":") for table, addr, _ in seen), seen
    import tracer

    with tracer.read_trace(out) as r:
        facts = r.header["tensor_parallel"]
        assert "127.0.0.1 only" in facts["rendezvous"] and facts["socket_ifname"] == "lo"


def _tp2_with_ranks(cli_env, tmp_path) -> tuple[Path, Path, subprocess.Popen, list[int]]:
    """A TP-2 run writing ``tmp_path/tp.h5`` with its scratch under ``tmp_path/tmp``, returned once its
    two ranks exist: ``(scratch root, trace path, the parent process, the ranks' PIDs)``."""
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    out = tmp_path / "tp.h5"
    proc = _tracer(TP2 + ["-o", str(out)], dict(cli_env, TMPDIR=str(scratch_root)), tmp_path)
    deadline = time.monotonic() + 240
    ranks: list[int] = []
    while proc.poll() is None and time.monotonic() < deadline:
        ranks = children(proc.pid)
        if len(ranks) == 2:
            break
        time.sleep(0.01)
    assert len(ranks) == 2, proc.communicate()[1]
    return scratch_root, out, proc, ranks


def test_kill_9_of_the_parent_while_ranks_start_leaves_no_orphan_and_the_next_run_cleans_up(cli_env, tmp_path):
    """The ranks' parent-death signal is armed before they import torch: after a SIGKILL of the
    parent at the moment its ranks appear, they are gone within seconds (35-60 s before), and the
    scratch folder and trace partial the parent left are removed by the next run."""
    scratch_root, out, proc, ranks = _tp2_with_ranks(cli_env, tmp_path)
    env = dict(cli_env, TMPDIR=str(scratch_root))
    os.kill(proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    proc.wait()
    while any(alive(r) for r in ranks) and time.monotonic() - killed < 30:
        time.sleep(0.05)
    lived = time.monotonic() - killed
    assert not any(alive(r) for r in ranks), f"ranks {ranks} outlived their parent by {lived:.1f} s"
    assert lived < 10, f"ranks outlived their parent by {lived:.1f} s"
    left = sorted(p.name for p in scratch_root.iterdir() if p.name.startswith("tracer-tp-"))
    partials = sorted(p.name for p in tmp_path.iterdir() if ".partial-" in p.name)
    assert left == [p for p in left if p.startswith(f"tracer-tp-{proc.pid}.")]  # only the killed run's
    # the next run: its scratch folder replaces the dead one's, its writer removes the dead partial
    code = (f"import sys, tempfile; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
            "from tracer.engines.tp.dist import scratch_dir\n"
            "from tracer.store.trace import TraceWriter\n"
            "import shutil, json\n"
            "d = scratch_dir(); shutil.rmtree(d)\n"
            f"w = TraceWriter({str(out)!r}, header={{}}); w.abort()\n")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in scratch_root.iterdir() if p.name.startswith("tracer-tp-")] == []
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []
    print(json.dumps({"orphans_lived_s": round(lived, 2), "scratch_left": left, "partials_left": partials}))


def test_sigterm_of_the_parent_removes_ranks_scratch_folder_and_partial(cli_env, tmp_path):
    """Every exit path cleans up: SIGTERM of the parent while its ranks run is handled like Ctrl-C
    (exit 143): the ranks are stopped, the scratch folder and the trace partial removed at once."""
    scratch_root, out, proc, ranks = _tp2_with_ranks(cli_env, tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    stopped = time.monotonic()
    while any(alive(r) for r in ranks) and time.monotonic() - stopped < 10:
        time.sleep(0.05)
    assert not any(alive(r) for r in ranks)
    assert [p.name for p in scratch_root.iterdir() if p.name.startswith("tracer-tp-")] == []
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []
