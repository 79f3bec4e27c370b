"""The trace writer's own host time for a short-forward trace (no model, no GPU).

    PYTHONPATH=$PWD python3 scripts/writer-cost.py [--dir /dev/shm] [--reps 7]

Two synthetic runs shaped like ``tracer bench qwen3-0.6b-shape --no-kv-cache`` at a 16-position
window (28 layers and the final norm of 16 x 1024 bf16, logits 16 x 151936 bf16: an 11.8 MB trace),
laid out as ``host_copies`` leaves them (one buffer per dtype), written by ``TraceWriter`` on the
calling thread: milliseconds for the file's set-up and header, each run, the stored comparison and
the close (median of ``--reps``), then the profile's top entries by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tracer.execute.records import CaptureRecord, RunRecord  # noqa: E402
from tracer.store.trace import TraceWriter, collect_environment  # noqa: E402


def run(name: str) -> RunRecord:
    buf = torch.randn(29 * 16 * 1024 + 16 * 151936).bfloat16()  # one host buffer, points end to end
    calls = [{"positions": [0, 4096], "in": [[1, 4096, 1024]], "out": [[1, 4096, 1024]]}]
    caps, off = {}, 0
    for i in range(28):
        n = f"model.layers.{i}"
        caps[n] = CaptureRecord(n, "layer", buf[off:off + 16384].view(16, 1024), calls, "Qwen3DecoderLayer")
        off += 16384
    caps["model.norm"] = CaptureRecord("model.norm", "final_norm", buf[off:off + 16384].view(16, 1024), calls, "RMSNorm")
    caps["lm_head"] = CaptureRecord("lm_head", "logits", buf[off + 16384:].view(16, 151936), calls, "Linear")
    return RunRecord(name, list(range(4096)), {"chunks": [[0, 4096]]}, (4080, 4096), caps, {"wall_s": 0.08})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else "/tmp")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    header = collect_environment("cpu", {"model": {"name": "qwen3-0.6b-shape"}, "scenario": {"name": "prefix-cache"},
                                         "options": {f"option_{i}": i for i in range(60)}})
    comparison = {"points": [{"name": f"model.layers.{i}", "n_diff": i, "per_position": list(range(16))} for i in range(31)]}
    runs = [run("A"), run("B")]
    path = Path(a.dir) / "writer-cost.h5"

    def once() -> list[float]:
        t = [time.perf_counter()]
        w = TraceWriter(path, header=header, overwrite=True)
        t.append(time.perf_counter())
        for r in runs:
            w.add_run(r)
            t.append(time.perf_counter())
        w.add_comparison("A-vs-B", comparison)
        t.append(time.perf_counter())
        w.close()
        t.append(time.perf_counter())
        return [(y - x) * 1e3 for x, y in zip(t, t[1:])]

    once()
    times = [once() for _ in range(a.reps)]
    labels = ["set-up + header", "run A", "run B", "comparison", "close"]
    med = [statistics.median(col) for col in zip(*times)]
    print("ms (median of %d): " % a.reps + ", ".join(f"{k} {v:.1f}" for k, v in zip(labels, med)) + f"; total {sum(med):.1f}")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        once()
    pr.disable()
    pstats.Stats(pr).sort_stats("cumtime").print_stats(25)
    path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
