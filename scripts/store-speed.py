"""Trace store speed: write v1 vs v2 vs raw, ``compare`` vs raw sequential read, peak RSS.

    PYTHONPATH=. python scripts/store-speed.py --dir /tmp/store-speed [--points 16 --rows 4096 --cols 4096
        --vocab 32768 --reps 3 --diverge 0.5 --device cpu|cuda] [--json OUT.json]

Builds two synthetic runs (bf16 ``(rows, cols)`` decoder-layer outputs and a bf16 ``(rows, vocab)``
logits point; run B differs by one ULP in every 10th row from point ``diverge * points`` on, as a
real divergence propagates), then, in one process and interleaved, median of ``--reps``:

- write: the same runs through ``TraceWriter`` format v1, format v2, and the raw bytes with plain
  ``write`` calls (all into the page cache, no fsync; each file deleted and the page cache's dirty
  pages synced before its timed write, the writers' order rotated from rep to rep);
- compare: ``compare_trace`` on the v2 trace vs a raw sequential read (``readinto`` a reused
  64 MiB buffer) of the same file, both warm (the page cache cannot be dropped without root);
- peak RSS of ``compare_trace`` in a fresh process (``VmHWM`` of ``/proc/self/status``: unlike
  ``ru_maxrss``, not inherited from this parent, which holds the runs).

The files are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tracer.execute.records import CaptureRecord, RunRecord  # noqa: E402
from tracer.store.trace import TraceWriter  # noqa: E402


def make_runs(points: int, rows: int, cols: int, vocab: int, diverge: float) -> list[RunRecord]:
    g = torch.Generator().manual_seed(0)
    runs = []
    first = int(points * diverge)
    for name in ("A", "B"):
        caps = {}
        for i in range(points):
            n = f"model.layers.{i}"
            t = runs[0].captures[n].tensor.clone() if runs else torch.randn(rows, cols, generator=g).to(torch.bfloat16)
            if runs and i >= first:
                t.view(torch.int16)[::10] += 1  # one ULP in every 10th row
            caps[n] = CaptureRecord(n, "layer", t, op="Block")
        lg = runs[0].captures["lm_head"].tensor.clone() if runs else torch.randn(rows, vocab, generator=g).to(torch.bfloat16)
        if runs and first < points:
            lg.view(torch.int16)[::10] += 1
        caps["lm_head"] = CaptureRecord("lm_head", "logits", lg, op="Linear")
        runs.append(RunRecord(name, list(range(rows)), {}, (0, rows), caps))
    return runs


def write_trace(path: Path, runs: list[RunRecord], version: int) -> None:
    with TraceWriter(path, header={"scenario": {"name": "synthetic"}, "model": {"name": "none"}},
                     overwrite=True, format_version=version) as w:
        for r in runs:
            w.add_run(r)


def write_raw(path: Path, runs: list[RunRecord]) -> None:
    with open(path, "wb", buffering=0) as f:
        for r in runs:
            for c in r.captures.values():
                f.write(memoryview(c.tensor.view(torch.int16).numpy()).cast("B"))


def read_raw(path: Path, buf: bytearray) -> int:
    n = 0
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            n += k
    return n


def timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/store-speed")
    ap.add_argument("--points", type=int, default=16)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--diverge", type=float, default=0.5, help="share of points before the divergence (1: identical runs)")
    ap.add_argument("--skip-write", action="store_true")
    ap.add_argument("--skip-v1-compare", action="store_true")
    ap.add_argument("--device", default="cpu", help="where compare computes the metrics (cpu, cuda)")
    ap.add_argument("--json")
    a = ap.parse_args()
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    runs = make_runs(a.points, a.rows, a.cols, a.vocab, a.diverge)
    nbytes = sum(c.tensor.numel() * c.tensor.element_size() for r in runs for c in r.captures.values())
    out: dict = {"tensor_bytes": nbytes, "points_per_run": a.points + 1, "torch_threads": torch.get_num_threads(),
                 "cpu_count": os.cpu_count(), "device": a.device}
    paths = {"v1": d / "v1.h5", "v2": d / "v2.h5", "raw": d / "raw.bin"}
    writes: dict[str, list[float]] = {k: [] for k in paths}
    if a.skip_v1_compare:
        del writes["v1"]
    order = ["raw", "v2"] if a.skip_v1_compare else ["raw", "v1", "v2"]  # no v1 file when it is not compared
    for rep in range(a.reps if not a.skip_write else 1):
        for k in order[rep % len(order):] + order[:rep % len(order)]:  # each writer first, second and last in turn
            paths[k].unlink(missing_ok=True)  # outside the timing: freeing the old file's pages costs too
            os.sync()  # ... and so does the kernel's write-back of the previous writer's dirty pages
            writes[k].append(timed(write_raw, paths[k], runs) if k == "raw" else
                             timed(write_trace, paths[k], runs, int(k[1])))
    out["write_s"] = {k: statistics.median(v) for k, v in writes.items()}
    out["write_GiB_s"] = {k: nbytes / 2**30 / v for k, v in out["write_s"].items()}
    out["trace_bytes"] = paths["v2"].stat().st_size
    del runs
    from tracer.diff.compare import compare_trace

    buf = bytearray(64 << 20)
    reads: dict[str, list[float]] = {"raw_read": [], "compare_v2": [], "compare_v1": []}
    verdict = None
    for _ in range(a.reps):
        reads["raw_read"].append(timed(read_raw, paths["v2"], buf))
        t = time.perf_counter()
        verdict = compare_trace(str(paths["v2"]), device=a.device).verdict()
        reads["compare_v2"].append(time.perf_counter() - t)
        if not a.skip_v1_compare:
            reads["compare_v1"].append(timed(lambda: compare_trace(str(paths["v1"]), device=a.device)))
    out["read_s"] = {k: statistics.median(v) for k, v in reads.items() if v}
    size = out["trace_bytes"]
    out["read_GiB_s"] = {k: size / 2**30 / v for k, v in out["read_s"].items()}
    out["compare_v2_over_raw_read"] = out["read_s"]["raw_read"] / out["read_s"]["compare_v2"]
    out["verdict"] = verdict
    code = ("import json, resource, sys; sys.path.insert(0, %r); from tracer.diff.compare import compare_trace\n"
            "c = compare_trace(%r, device=%r)\n"
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
            "print(json.dumps(int(hwm.split()[1]) / 1024))\n"
            % (str(Path(__file__).resolve().parent.parent), str(paths["v2"]), a.device))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    out["compare_peak_rss_MiB"] = float(proc.stdout.strip().splitlines()[-1])
    out["this_process_peak_rss_MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for p in paths.values():
        p.unlink(missing_ok=True)
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)


if __name__ == "__main__":
    main()
