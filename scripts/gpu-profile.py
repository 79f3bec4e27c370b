"""Where tracer's time goes on a GPU: cProfile of `tracer.run(store="none")` next to the bare plans.

    python3 scripts/gpu-profile.py [MODEL] [N]      (default qwen3-0.6b-shape 4096)

Prints, for --kv-cache and --no-kv-cache, the median wall time of the bare plans and of the
traced run (CUDA-synchronised), then the top functions by own time of the traced runs.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import tracer  # noqa: E402
from tracer.load.models import load_model  # noqa: E402
from tracer.execute.runner import forward_chunks, model_device  # noqa: E402
from tracer.plan.scenarios import prefix_cache  # noqa: E402

model = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b-shape"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
lm = load_model(model, dtype="bfloat16", progress=False)
for kv in (False, True):
    kw = dict(loaded=lm, length=n, progress=False, store="none", kv_cache=kv)
    first = tracer.run(**kw)
    scen = prefix_cache(len(first.token_ids), block_size=16)
    ids = torch.tensor([first.token_ids], device=model_device(lm.model))

    def bare():
        with torch.inference_mode():
            forward_chunks(lm.model, ids, scen.plan_a)
            forward_chunks(lm.model, ids, scen.plan_b)

    def timed(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    a = [timed(bare) for _ in range(5)]
    b = [timed(lambda: tracer.run(**kw)) for _ in range(5)]
    print(f"kv_cache={kv}: bare {statistics.median(a):.4f} s, traced {statistics.median(b):.4f} s, "
          f"ratio {statistics.median(b) / statistics.median(a):.3f}")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        tracer.run(**kw)
    torch.cuda.synchronize()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)
