"""Cost of --kernels: one run plan executed with and without kernel recording, interleaved, in one
process. Usage: PYTHONPATH=$PWD python3 scripts/kernels-cost.py [MODEL] [N] [GRANULARITY] [REPS] [DEVICE]
(default smollm2-135m 250 sublayers 5 cpu). Prints the median wall time of each and their ratio."""

import statistics
import sys
import time

import torch

import tracer
from tracer.api import tokenize
from tracer.load.prompts import DEFAULT_PROMPT
from tracer.execute.points import discover_points
from tracer.engines.hf.run import execute
from tracer.plan.build import build

model, n, gran, reps, device = (sys.argv[1:] + ["smollm2-135m", "250", "sublayers", "5", "cpu"][len(sys.argv) - 1:])[:5]
n, reps = int(n), int(reps)
lm = tracer.load_model(model, device=device, progress=False)
ids = tokenize(lm.tokenizer, DEFAULT_PROMPT, None, chat=False,
                          vocab_size=lm.info.vocab_size, length=n)
scen = build("prefix-cache", n, block_size=16)
points = discover_points(lm.model, gran)


def once(kernels: bool) -> tuple[float, float]:
    """(wall s, CPU s of this process, all threads) of both runs."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    for plan in (scen.plan_a, scen.plan_b):
        execute(lm.model, ids, plan, points, scen.window, kernels=kernels)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0


once(False), once(True)  # warm-up
times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
for rep in range(reps):
    for k in ((False, True) if rep % 2 == 0 else (True, False)):
        times[k].append(once(k))
print(f"{model} N={n} {gran} {device} torch {torch.__version__} threads {torch.get_num_threads()}: both runs, median of {reps}")
for i, what in enumerate(("wall", "process CPU")):
    off, on = (statistics.median(t[i] for t in times[k]) for k in (False, True))
    print(f"  {what}: without --kernels {off:.3f} s, with {on:.3f} s: {100 * (on / off - 1):+.1f} %")
    print("    without:", " ".join(f"{t[i]:.3f}" for t in times[False]))
    print("    with:   ", " ".join(f"{t[i]:.3f}" for t in times[True]))
