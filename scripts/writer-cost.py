"""The trace writer's own host time for a short-forward trace (no model, no GPU).

    PYTHONPATH=$PWD python3 scripts/writer-cost.py [--dir /dev/shm] [--reps 7] [--background]

Two synthetic runs shaped like ``tracer bench qwen3-0.6b-shape --no-kv-cache`` at a 16-position
window (28 layers and the final norm of 16 x 1024 bf16, logits 16 x 151936 bf16: an 11.8 MB trace),
laid out as ``host_copies`` leaves them (one buffer per dtype), written by ``TraceWriter`` on the
calling thread: milliseconds for the file's set-up and header, each run, the stored comparison and
the close (median of ``--reps``), then the profile's top entries by cumulative time.

``--background`` times instead the two background writers against each other, interleaved, the
same trace each repetition (``TraceWriter(background="thread")`` and ``"process"``): the CPU time
the writer spends in the calling process outside the calling thread (the writer thread's: the time
in which it can hold the GIL the launching thread needs), the calling thread's own CPU time, and
the wall time until the trace is complete (medians and minima of ``--reps``).
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


def background(runs: list[RunRecord], header: dict, comparison: dict, folder: Path, reps: int) -> None:
    """Thread against process writer, interleaved: CPU outside the calling thread, the calling
    thread's CPU, wall (ms per trace)."""
    res: dict[str, dict[str, list[float]]] = {m: {"writer CPU here": [], "caller CPU": [], "wall": []}
                                              for m in ("thread", "process")}
    for i in range(reps + 2):
        for mode in ("thread", "process") if i % 2 else ("process", "thread"):
            p0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
            with TraceWriter(folder / f"writer-cost-{mode}.h5", header=header, overwrite=True, background=mode) as w:
                for r in runs:
                    w.add_run(r)
                w.add_comparison("A-vs-B", comparison)
            p1, t1, w1 = time.process_time(), time.thread_time(), time.perf_counter()
            if i >= 2:  # the first two: the writer process starting, the files' first creation
                for key, v in zip(res[mode], (p1 - p0 - (t1 - t0), t1 - t0, w1 - w0)):
                    res[mode][key].append(v * 1e3)
    for mode, r in res.items():
        print(f"{mode:8} " + "; ".join(f"{k} {statistics.median(v):.1f} (min {min(v):.1f})" for k, v in r.items())
              + f" ms, median of {reps}")
    for mode in res:
        (folder / f"writer-cost-{mode}.h5").unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else "/tmp",
                    help="folder of the trace (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=7, help="repetitions (default: %(default)s)")
    ap.add_argument("--background", action="store_true",
                    help="time the background thread against the writer process instead (see the docstring)")
    a = ap.parse_args()
    header = collect_environment("cpu", {"model": {"name": "qwen3-0.6b-shape"}, "scenario": {"name": "prefix-cache"},
                                         "options": {f"option_{i}": i for i in range(60)}})
    comparison = {"points": [{"name": f"model.layers.{i}", "n_diff": i, "per_position": list(range(16))} for i in range(31)]}
    runs = [run("A"), run("B")]
    path = Path(a.dir) / "writer-cost.h5"
    if a.background:
        background(runs, header, comparison, Path(a.dir), a.reps)
        return

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
