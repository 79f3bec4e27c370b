"""How long tensor-parallel ranks outlive a ``kill -9`` of their parent (the README's numbers).

Starts ``python -m tracer run tiny-llama --scenario tensor-parallel --tp 2 --tp-mode distributed``
from the checkout ROOT, SIGKILLs it the moment both rank processes exist, and prints (JSON, one
line per repeat) the seconds until the last rank is gone and what the dead run left in its folder
(scratch folder, trace partial). Linux only (reads /proc).

    python scripts/tp-orphans.py [ROOT] [REPEATS]      # ROOT: a tracer checkout, default this one
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def ranks_of(pid: int) -> list[int]:
    """Live multiprocessing spawn children of ``pid``."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
        except OSError:
            continue
        if ppid == pid and b"spawn_main" in cmd:
            out.append(int(d))
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parent.parent)
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    for _ in range(repeats):
        folder = tempfile.mkdtemp()
        env = dict(os.environ, PYTHONPATH=root, TMPDIR=folder)
        proc = subprocess.Popen([sys.executable, "-m", "tracer", "run", "tiny-llama", "--device", "cpu", "--scenario",
                                 "tensor-parallel", "--tp", "2", "--tp-mode", "distributed", "--length", "24",
                                 "-o", f"{folder}/t.h5"], env=env, cwd=folder,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ranks: list[int] = []
        while proc.poll() is None and len(ranks) < 2:
            ranks = ranks_of(proc.pid)
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        proc.wait()
        while any(alive(r) for r in ranks) and time.monotonic() - killed < 120:
            time.sleep(0.05)
        left = sorted(p.name for p in Path(folder).iterdir() if p.name.startswith("tracer-tp-") or ".partial-" in p.name)
        print(json.dumps({"root": root, "ranks": len(ranks), "outlived_parent_s": round(time.monotonic() - killed, 2),
                          "left": left}), flush=True)


if __name__ == "__main__":
    main()
