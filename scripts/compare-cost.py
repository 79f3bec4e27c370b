"""What ``tracer compare`` of a freshly written trace costs, as ``tracer bench``'s mode (d) runs it: the
trace rewritten by a ``--store tensors`` run before each compare (so no validation is reused), then
``compare_trace`` timed in wall and CPU time (the process's, which other processes on a busy machine
inflate less).

    PYTHONPATH=$PWD python3 scripts/compare-cost.py [--model smollm2-135m] [--length 128] [--reps 12]

The tree measured is the one on ``PYTHONPATH``: run it with each of two trees in turn to pair them. Prints the medians (the first two
repetitions left out) and every repetition's CPU milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--reps", type=int, default=12)
    args = ap.parse_args()

    from tracer import pipeline
    from tracer.config import RunConfig
    from tracer.diff.compare import compare_trace
    from tracer.validate import validate

    cfg = validate(RunConfig.from_options(model=args.model, length=args.length, dtype="bfloat16", device="cpu",
                                          scenario="prefix-cache", granularity="layers", kv_cache=True, store="none"))
    lm = pipeline.load(cfg)
    trace = Path(tempfile.mkdtemp(prefix="compare-cost-")) / "t.h5"
    stored = cfg.with_options(store="tensors", output=str(trace), overwrite=True)
    wall, cpu = [], []
    for _ in range(args.reps):
        pipeline.run(stored, lm)  # rewritten: a new file for every compare, as (d) reads it
        t, c = time.perf_counter(), time.process_time()
        compare_trace(str(trace), device="cpu")
        wall.append((time.perf_counter() - t) * 1e3)
        cpu.append((time.process_time() - c) * 1e3)
    trace.unlink()
    keep = slice(2, None) if args.reps > 2 else slice(None)
    print(f"compare_trace of a rewritten trace ({args.model}, N={args.length}, layers, KV cache): "
          f"wall {statistics.median(wall[keep]):.1f} ms, cpu {statistics.median(cpu[keep]):.1f} ms (medians); "
          f"cpu each: {', '.join(f'{x:.1f}' for x in cpu)}")


if __name__ == "__main__":
    main()
