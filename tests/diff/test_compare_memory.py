"""compare streams a trace one capture point at a time: peak memory does not grow with trace size.

A synthetic 2 GiB trace (2 runs × 16 capture points × 64 MiB float32) is written without ever
holding it in memory, then `tracer compare` runs in a subprocess whose peak RSS is read from the
OS. Bound (generous): 1 GiB, i.e. well under half the trace; one point pair is 128 MiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from tracer.execute.records import CaptureRecord, RunRecord
from tracer.store.trace import TraceWriter

ROWS, COLS, POINTS = 4096, 4096, 16  # 64 MiB float32 per capture point


class LazyCaptures(Mapping):
    """Capture records made on demand (deterministic per name), so writing holds one at a time."""

    def __init__(self, run: str):
        self.run = run
        self.names = [f"model.layers.{i}" for i in range(POINTS)]

    def __getitem__(self, name):
        i = self.names.index(name)
        g = torch.Generator().manual_seed(i)
        t = torch.randn(ROWS, COLS, generator=g)
        if self.run == "B" and i >= POINTS // 2:  # second half diverges in every 10th row
            t[::10] += 1e-3
        return CaptureRecord(name=name, kind="layer", tensor=t, calls=[], op="Block")

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


@pytest.mark.skipif(os.environ.get("TRACER_SKIP_BIG") == "1", reason="TRACER_SKIP_BIG=1")
def test_compare_peak_memory_is_bounded(tmp_path):
    path = tmp_path / "big.h5"
    with TraceWriter(path, header={"scenario": {"name": "synthetic"}, "model": {"name": "none"}}) as w:
        for run in ("A", "B"):
            w.add_run(RunRecord(name=run, token_ids=list(range(ROWS)), plan={}, window=(0, ROWS),
                                captures=LazyCaptures(run)))
    size = path.stat().st_size
    assert size > 2 * POINTS * ROWS * COLS * 4 * 0.99  # the trace really is ~2 GiB
    code = (
        "import json, resource, sys; from tracer.diff.compare import compare_trace\n"
        f"c = compare_trace({str(path)!r})\n"
        "print(json.dumps({'rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,"
        " 'diverged': [p.name for p in c.points if p.diverged]}))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # correctness: exactly the planted second half diverges
    assert out["diverged"] == [f"model.layers.{i}" for i in range(POINTS // 2, POINTS)]
    print(f"compare peak RSS {out['rss_mb']:.0f} MiB on a {size / 2**30:.2f} GiB trace")
    assert out["rss_mb"] < 1024, f"compare peaked at {out['rss_mb']:.0f} MiB on a {size / 2**30:.1f} GiB trace"
