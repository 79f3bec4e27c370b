"""Issue 27: where tracer's ``--store none`` overhead goes on a GPU, phase by phase.

    PYTHONPATH=$PWD python3 scripts/gpu-phases.py [MODEL] [N ...]   (default qwen3-0.6b-shape 1024 4096)

Modes, interleaved, each timed from a synchronised GPU to a synchronised GPU, median and min of
15 after 3 warm-ups, prefix-cache, --no-kv-cache:

    bare     both plans, no hooks (``tracer bench``'s mode a)
    hf       both plans with HF's ``output_hidden_states=True`` (the bench's peer_hf, without its count)
    hooks    both plans with tracer's capture hooks, the captures kept on the GPU, no comparison
    compare  the comparison of those captures alone (``compare_records``), the GPU idle before it
    run      ``pipeline.run`` with ``--store none`` (the bench's mode b: hooks, comparison, report data)

Prints one JSON line per N.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tracer import pipeline  # noqa: E402
from tracer.config import RunConfig  # noqa: E402
from tracer.diff.compare import compare_records  # noqa: E402
from tracer.engines.door import execute_plan  # noqa: E402
from tracer.engines.door import run_bare  # noqa: E402
from tracer.validate import validate  # noqa: E402

model = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b-shape"
lengths = [int(x) for x in sys.argv[2:]] or [1024, 4096]
lm = None


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


for n in lengths:
    cfg = validate(RunConfig.from_options(model=model, length=n, device="cuda", kv_cache=False, store="none"))
    lm = lm or pipeline.load(cfg)
    prep = pipeline.prepare(cfg, lm)
    ids, scen = prep.token_ids, prep.scenario
    points = pipeline.capture_points(lm, cfg.capture)
    held: dict = {}

    def hooks() -> None:
        held["runs"] = [execute_plan(lm, ids, p, points, scen.window, keep_on_device=True)[0]
                        for p in (scen.plan_a, scen.plan_b)]

    hooks()

    def compare() -> None:
        a, b = held["runs"]
        compare_records(a, b, scenario=scen.name, model=lm.info.name)

    modes = {"bare": lambda: run_bare(lm, ids, scen),
             "hf": lambda: run_bare(lm, ids, scen, extra={"output_hidden_states": True}),
             "hooks": hooks, "compare": compare, "run": lambda: pipeline.run(cfg, lm)}
    times = {m: [] for m in modes}
    for i in range(18):
        for m, fn in modes.items():
            t = timed(fn)
            if i >= 3:
                times[m].append(t)
    med = {m: statistics.median(v) for m, v in times.items()}
    low = {m: min(v) for m, v in times.items()}
    print(json.dumps({"model": model, "n": n, "median_ms": {m: round(v * 1e3, 2) for m, v in med.items()},
                      "min_ms": {m: round(v * 1e3, 2) for m, v in low.items()},
                      "median_over_bare": {m: round(v / med["bare"], 3) for m, v in med.items()},
                      "min_over_bare": {m: round(v / low["bare"], 3) for m, v in low.items()},
                      "points": len(points), "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}),
          flush=True)
