"""How reading and comparing a trace scales with its number of capture points (issue 24 item 8).

    python benchmarks/many_points.py [N ...]      # default: 25000 50000 100000 200000

Writes, for each N, a trace whose run B holds N empty points (a valid trace, as the spec allows)
beside a run A of 3 points, then times ``tracer.compare_trace`` on it (validation, index, every
point reported as not compared). Prints one JSON line per N and the time ratios between
successive sizes: about 2 for each doubling is linear; 4 would be quadratic. Before issue 24 a
200,000-point run B did not finish in 120 s.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def make(path: Path, n: int) -> None:
    import torch

    from tracer.execute.records import CaptureRecord, RunRecord
    from tracer.store.trace import TraceWriter

    calls = [{"positions": [0, 2], "in": [[1, 2, 4]], "out": [[1, 2, 4]]}]

    def run(name: str, k: int) -> RunRecord:
        caps = {f"model.layers.{i}": CaptureRecord(name=f"model.layers.{i}", kind="layer", tensor=torch.zeros(0, 4),
                                                   op="X", calls=calls) for i in range(k)}
        caps["model.embed_tokens"] = CaptureRecord(name="model.embed_tokens", kind="embedding", tensor=torch.ones(2, 4),
                                                   op="E", calls=calls)
        return RunRecord(name=name, token_ids=[1, 2], plan={}, window=(0, 2), captures=caps, meta={})

    with TraceWriter(path, header={}, overwrite=True) as w:
        w.add_run(run("A", 3))
        w.add_run(run("B", n))


def main(sizes: list[int]) -> None:
    import tracer

    tracer.compare_trace  # noqa: B018 - imports done before timing
    times = []
    with tempfile.TemporaryDirectory() as d:
        for n in sizes:
            path = Path(d) / f"t{n}.h5"
            make(path, n)
            t0 = time.perf_counter()
            c = tracer.compare_trace(str(path), device="cpu")
            dt = time.perf_counter() - t0
            times.append(dt)
            print(json.dumps({"points": n, "compare_s": round(dt, 2), "not_compared": len(c.skipped),
                              "trace_mb": round(path.stat().st_size / 2**20, 1)}), flush=True)
    ratios = [round(b / a, 2) for a, b in zip(times, times[1:])]
    print(json.dumps({"time_ratio_per_doubling": ratios}))


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [25000, 50000, 100000, 200000])
