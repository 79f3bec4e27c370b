"""Where tracer's fixed host cost goes on a GPU (issue 11): side-by-side medians, cProfile, and
the CUDA runtime calls (launches, copies, synchronisations) per traced run versus the bare plans.

    PYTHONPATH=$PWD python3 scripts/gpu-hostcost.py [MODEL] [N ...]   (default qwen3-0.6b-shape 1024 4096)

Modes, interleaved, median of 7 after 2 warm-ups: bare (both plans, no hooks), none (tracer
--store none), auto (--store auto into /tmp), tensors (--store tensors into /tmp); each with
--no-kv-cache. Prints one JSON line per N, then the profiles of the ``none`` mode.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import tracer  # noqa: E402
from tracer.engines.door import run_bare  # noqa: E402

model = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b-shape"
lengths = [int(x) for x in sys.argv[2:]] or [1024, 4096]
lm = tracer.load_model(model, dtype="bfloat16")


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


for n in lengths:
    kw = dict(loaded=lm, length=n, progress=False, kv_cache=False)
    first = tracer.run(**kw, store="none")
    ids, scen = first.token_ids, first.scenario
    modes = {
        "bare": lambda: run_bare(lm, ids, scen),
        "none": lambda: tracer.run(**kw, store="none"),
        "auto": lambda: tracer.run(**kw, store="auto", output="/tmp/hc-auto.h5", overwrite=True),
        "tensors": lambda: tracer.run(**kw, store="tensors", output="/tmp/hc-tensors.h5", overwrite=True),
    }
    times = {m: [] for m in modes}
    for i in range(9):
        for m, fn in modes.items():
            t = timed(fn)
            if i >= 2:
                times[m].append(t)
    med = {m: statistics.median(v) for m, v in times.items()}
    print(json.dumps({"model": model, "n": n, "median_s": med,
                      "ratio": {m: med[m] / med["bare"] for m in med},
                      "bytes": {m: Path(f"/tmp/hc-{m}.h5").stat().st_size for m in ("auto", "tensors")},
                      "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}), flush=True)

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5):
        tracer.run(**kw, store="none")
    torch.cuda.synchronize()
    pr.disable()
    print(f"--- cProfile, 5 x tracer.run(store='none'), N={n}, by own time")
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)
    print(f"--- cProfile, by cumulative time")
    pstats.Stats(pr).sort_stats("cumtime").print_stats(40)
    print(f"--- cProfile, tracer's own functions by cumulative time")
    pstats.Stats(pr).sort_stats("cumtime").print_stats("tracer/", 60)

    from torch.profiler import ProfilerActivity, profile

    counts: dict[str, dict[str, int]] = {}
    for label, fn in (("bare", modes["bare"]), ("none", modes["none"])):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        rows = [e for e in prof.key_averages() if e.key.startswith("cuda") or e.key.startswith("aten::")]
        counts[label] = {e.key: e.count for e in rows}
        rows.sort(key=lambda e: -e.count)
        print(f"--- runtime calls / aten ops, one {label} run, N={n} (count, self CPU ms)")
        for e in rows[:30]:
            print(f"{e.count:7d} {e.self_cpu_time_total / 1000:9.2f}  {e.key}")
    extra = {k: v - counts["bare"].get(k, 0) for k, v in counts["none"].items()}
    print(f"--- calls a none run makes beyond the bare run, N={n}")
    for k, v in sorted(extra.items(), key=lambda kv: -kv[1])[:30]:
        print(f"{v:7d}  {k}")
