"""The scripts a GPU lease runs, run here on tiny-llama first, so that a lease is never spent on one
that no longer fits the code it measures (``scripts/host-work.py`` once timed a TraceWriter method
that had moved to ``TraceFile``). Each script in a process of its own, as on the GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str, *args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def test_bench_h200_on_the_cpu_counts_host_work(tmp_path):
    out = tmp_path / "bench"
    _script("bench-h200.py", str(out), "--device", "cpu", "--model", "tiny-llama", "--lengths", "48",
            "--reps", "1", "--no-tests", tmp_path=tmp_path)
    log = (out / "log.txt").read_text()
    assert "host work: exit 0" in log, log
    tables = (out / "tables.txt").read_text()
    assert "(b) none" in tables and "(c) tensors" in tables
    work = (out / "host-work.json").read_text()
    assert '"store tensors"' in work and "writer ms" in work, work[:500]


def test_run_phases_times_both_writers(tmp_path):
    _script("run-phases.py", str(tmp_path), "--device", "cpu", "--model", "tiny-llama", "--length", "48",
            "--reps", "1", "--writer-process", tmp_path=tmp_path)
    text = (tmp_path / "run-phases-48.txt").read_text()
    rows = {line.split()[0] for line in text.splitlines() if "wall median" in line}
    assert rows == {"plain", "none", "tensors", "auto", "tensors-p", "auto-p"}, text
    assert "phases of tensors" in text and "execute_plan" in text


def test_host_work_counts_each_sync_once():
    """scripts/host-work.py counted each .item() twice: as a wrapped Tensor.item call and as the
    aten::_local_scalar_dense it dispatches."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("host_work", ROOT / "scripts" / "host-work.py")
    hw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hw)
    t = torch.tensor([1.5, 2.0])
    for read in (lambda: t[0].item(), lambda: int(t[0]), lambda: float(t[0]), lambda: t.tolist(), lambda: t.numpy()):
        with hw._Ops() as ops, hw._Counts() as counts:
            read()
        assert hw.sync_count(counts, ops) == 1, (counts.syncs, ops.scalar_reads)
    with hw._Ops() as ops, hw._Counts() as counts:
        t.add(1)
    assert hw.sync_count(counts, ops) == 0
