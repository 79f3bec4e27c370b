"""HF vs vLLM and the hierarchy inside vLLM on smollm2-135m, plus the capture overhead (run in the vLLM venv).

    /work/venv-vllm/bin/python scripts/vllm-explore.py [N] [--overhead REPS]

Prints: HF vs vLLM at layers and sublayers granularity (first divergent point, origin, growth,
the logits at the one position vLLM computes them, argmax flip), then vLLM vs vLLM for
prefix-cache (block 32 and 64), chunked prefill (chunks of 32), batch of 4 (equal and ragged
lengths) and block size 32 vs 64, each with what vLLM's scheduler reported (requests' tokens and
num_cached_tokens, the traced prompt's chunks, tokens per step). With --overhead: the wall time of
vLLM's bare ``generate`` against tracer's captured run (layers, sublayers) of one prompt, in
turn, REPS times each, in this process (median and minimum; on a shared CPU the minimum is the
less disturbed number).
"""

from __future__ import annotations

import statistics
import sys
import time

from tracer.diff.compare_dump import partial_logits_line
from tracer.diff.compare import compare_records
from tracer.engines.vllm import engine as ve
from tracer.execute.points import discover_points
from tracer.engines.hf.run import execute
from tracer.load.models import load_model
from tracer.load.prompts import DEFAULT_PROMPT, tokenize
from tracer.plan import scenarios as S
from tracer.plan.scenarios import RunPlan
from tracer.report.summary import headline


def summary(c) -> str:
    div = [p for p in c.points if p.diff.n_diff]
    last = next((p for p in reversed(c.points) if p.kind == "layer"), None)
    return (f"first divergent {div[0].name if div else None}; origins {[p.name for p in c.origins][:3]}; "
            f"{len(div)} of {len(c.points)} points differ; last layer {last.diff.n_diff}/{last.diff.n_total} "
            f"max |Δ| {last.diff.max_abs_diff:.3g}")


def hf_vs_vllm(loaded, ids: list[int], n: int) -> None:
    for gran in ("layers", "sublayers"):
        pts = discover_points(loaded.model, gran)
        scen = S.repeat(n)
        hf = execute(loaded.model, ids, scen.plan_a, pts, scen.window)
        vr, _ = ve.execute_loaded(loaded, ids, scen.plan_a, pts, scen.window, meta={"scenario": "engine"})
        c = compare_records(hf, vr, scenario="engine", model=loaded.info.name)
        print(f"== HF vs vLLM, {gran}, N={n}: {summary(c)}")
        for label, text in headline(c):
            print("  ", f"{label}: {text}")
        shown = c.points if gran == "layers" else [p for p in c.points if p.name.startswith("model.layers.0.") or p.name == "model.embed_tokens"]
        for p in shown:
            print(f"   {p.name:45s} {p.diff.n_diff:6d}/{p.diff.n_total:<6d} max |Δ| {p.diff.max_abs_diff:.3g}")
        ps, rows = vr.extras["partial_logits"]["lm_head"]
        rows_hf = hf.captures["lm_head"].tensor[[p - scen.window[0] for p in ps]]
        print("  ", partial_logits_line("lm_head", ps, rows_hf, rows, "vLLM logits_processor"))


def inside_vllm(loaded, ids: list[int], n: int) -> None:
    pts = discover_points(loaded.model, "layers")
    cases = [("prefix-cache b32", S.prefix_cache(n, block_size=32), {}),
             ("prefix-cache b64", S.prefix_cache(n, block_size=64), {"settings": {"block_size": 64}}),
             ("chunked-prefill c32", S.chunked_prefill(n, chunk_size=32), {}),
             ("batch 4", S.batch(n, batch_size=4), {}),
             ("batch 4 ragged", S.batch(n, batch_size=4, padding="left"), {}),
             ("block-size 32 vs 64", S.block_size_scenario(n, block_sizes=(32, 64)), None)]
    for name, scen, opts in cases:
        recs = []
        for i, plan in enumerate((scen.plan_a, scen.plan_b)):
            o = dict(opts) if opts is not None else {"settings": {"block_size": (32, 64)[i]}}
            recs.append(ve.execute_loaded(loaded, ids, plan, pts, scen.window, meta={"scenario": scen.name},
                                          engine_options=o)[0])
        c = compare_records(recs[0], recs[1], scenario=scen.name, model=loaded.info.name)
        sched = [([(r["tokens"], r["num_cached_tokens"]) for r in x.meta["scheduler"]["requests"]], x.meta["scheduler"]["chunks"],
                  x.meta["gemm_m"]) for x in recs]
        print(f"== vLLM {name}, N={n}, window {scen.window}: {summary(c)}")
        print(f"   A (tokens, cached) per request {sched[0][0]}, chunks {sched[0][1]}, tokens per step {sched[0][2]}")
        print(f"   B (tokens, cached) per request {sched[1][0]}, chunks {sched[1][1]}, tokens per step {sched[1][2]}")
        la, lb = recs[0].extras["partial_logits"].get("lm_head"), recs[1].extras["partial_logits"].get("lm_head")
        if la and lb and la[0] == lb[0]:
            print("  ", partial_logits_line("lm_head", la[0], la[1], lb[1], "vLLM"))


def overhead(loaded, ids: list[int], n: int, reps: int) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    eng = ve.engine_for(loaded, ve.VllmSettings())
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    plan = RunPlan("A", ((0, n),), "one pass", engine="vllm")
    pts = {g: discover_points(loaded.model, g) for g in ("layers", "sublayers")}
    for g in pts:  # warm: the HF layout is computed once per point list
        ve.execute_loaded(loaded, ids, plan, pts[g], (0, n))
    times: dict[str, list[float]] = {"bare": [], "layers": [], "sublayers": []}
    for _ in range(reps):
        for k in times:
            t = time.perf_counter()
            if k == "bare":
                eng.reset_prefix_cache()
                eng.llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
            else:
                ve.execute_loaded(loaded, ids, plan, pts[k], (0, n))
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    print(f"== capture overhead, N={n}, {reps} reps in turn: bare generate median {med['bare']:.3f} s (min {low['bare']:.3f}); "
          f"layers x{med['layers'] / med['bare']:.2f} (min/min x{low['layers'] / low['bare']:.2f}); "
          f"sublayers x{med['sublayers'] / med['bare']:.2f} (min/min x{low['sublayers'] / low['bare']:.2f})")
    print("  ", {k: [round(x, 3) for x in v] for k, v in times.items()})


def main() -> None:
    args = sys.argv[1:]
    reps = int(args[args.index("--overhead") + 1]) if "--overhead" in args else 0
    n = int(args[0]) if args and args[0].isdigit() else 100
    loaded = load_model("smollm2-135m", progress=False)
    ids = tokenize(loaded.tokenizer, DEFAULT_PROMPT, None, chat=False, vocab_size=loaded.info.vocab_size, length=n)
    hf_vs_vllm(loaded, ids, n)
    inside_vllm(loaded, ids, n)
    if reps:
        overhead(loaded, ids, n, reps)


if __name__ == "__main__":
    main()
