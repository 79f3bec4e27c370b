"""What capturing costs inside a CUDA-graph replay.

    PYTHONPATH=$PWD python3 scripts/gpu-graph-replay.py [MODEL] [N ...]   (default qwen3-0.6b-shape 1024 4096)

For each N: the model's prefill of N tokens (no KV cache) recorded three times in CUDA graphs:
bare, inside ``tracer.capture(..., cuda_graphs=True)`` at ``layers`` and at ``sublayers``
granularity (the hooks' copies recorded into the graph). The replays are timed interleaved with
CUDA events (median of 50 after 5 warm-ups), beside the eager forward pass, and each capture is
checked against the bare replay's logits (bit for bit) so the replays did the same work. Prints
one JSON line per N.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import tracer  # noqa: E402

model_name = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b-shape"
lengths = [int(x) for x in sys.argv[2:]] or [1024, 4096]
lm = tracer.load_model(model_name, dtype="bfloat16", device="cuda", progress=False)
model = lm.model


def record(static: torch.Tensor, granularity: str | None):
    """A CUDA graph of one prefill of ``static``; the capture (or None) and the graph's output."""
    with torch.inference_mode():
        model(input_ids=static, use_cache=False)  # warm-up outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        if granularity is None:
            with torch.cuda.graph(graph):
                out = model(input_ids=static, use_cache=False)
            return graph, None, out
        with tracer.capture(lm, granularity, cuda_graphs=True) as cap:
            with torch.cuda.graph(graph):
                out = model(input_ids=static, use_cache=False)
        return graph, cap, out


def timed(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


for n in lengths:
    static = torch.randint(0, lm.info.vocab_size, (1, n), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    graphs = {name: record(static, g) for name, g in (("bare", None), ("layers", "layers"), ("sublayers", "sublayers"))}

    def eager() -> None:
        with torch.inference_mode():
            model(input_ids=static, use_cache=False)

    modes = {"eager": eager, **{k: v[0].replay for k, v in graphs.items()}}
    times = {k: [] for k in modes}
    for i in range(55):
        for k, fn in modes.items():
            t = timed(fn)
            if i >= 5:
                times[k].append(t)
    for k in ("bare", "layers", "sublayers"):
        graphs[k][0].replay()
    torch.cuda.synchronize()
    ref = graphs["bare"][2].logits[0]
    checks = {}
    for k in ("layers", "sublayers"):
        cap = graphs[k][1]
        logits = next(r.tensor for r in cap.records().values() if r.kind == "logits")
        checks[k] = {"points": len(cap.keys()),
                     "logits_equal_bare_replay": bool(torch.equal(logits.view(torch.int16), ref.view(torch.int16)))}
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"model": model_name, "n": n, "median_s": med,
                      "ratio_to_bare_replay": {k: med[k] / med["bare"] for k in med},
                      "checks": checks, "reps": len(times["bare"]),
                      "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}), flush=True)
