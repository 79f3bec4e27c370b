"""Two runs on engines: their numeric contracts side by side, what each scheduler did, and the logits
where an engine computes them only at some positions (vLLM: where it samples).

Each run of a non-HF plan (and the HF run beside it) carries ``meta["engine"]``: the engine's
numeric contract (:func:`tracer.engines.door.plan_contract`: version, attention backend, norm,
activation, GEMM, activation / logits / KV-cache dtypes, KV block size, chunked-prefill budget,
compilation and graphs off); a vLLM run also carries ``meta["vllm"]``, what its scheduler did
(each request's ``num_cached_tokens``, the steps that computed the prompt). :func:`engine_facts`
turns them into the comparison's facts and notes; :func:`sampled_logits` compares the logits at
the positions both runs have.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from tracer.diff.logits import logits_diff
from tracer.diff.metrics import amplification
from tracer.diff.origins import classify_origins
from tracer.diff.positions import one_device
from tracer.execute.kinds import PointKind
from tracer.execute.records import RunRecord

#: the contract keys compared between two engines, with the label a difference is named by
CONTRACT = (("device", "device"), ("attention_backend", "attention backend"), ("batch_invariant", "batch-invariant mode"),
            ("norm", "norm implementation"),
            ("activation", "activation"), ("gemm", "GEMM"), ("activation_dtype", "activation dtype"),
            ("logits_dtype", "logits dtype"), ("kv_cache_dtype", "KV-cache dtype"), ("block_size", "KV block size"),
            ("max_num_batched_tokens", "chunked-prefill budget"), ("version", "version"))


_PACKAGE = {"hf": "transformers", "vllm": "vLLM"}


def _short(v: Any) -> str:
    if isinstance(v, dict):
        vals = sorted({str(x) for x in v.values()})
        return vals[0] if len(vals) == 1 else "; ".join(f"{k}: {x}" for k, x in v.items())
    return str(v)


def _norm(key: str, value: Any) -> Any:
    """A contract value as compared: devices by type and index (``cuda`` is ``cuda:0``)."""
    if key == "device" and isinstance(value, str) and value in ("cuda", "xpu", "mps"):
        return f"{value}:0"
    return value


def scheduler_line(run: str, meta: dict[str, Any]) -> str | None:
    """What vLLM's scheduler did for a run's traced prompt (None for a run without ``meta["vllm"]``)."""
    v = meta.get("vllm")
    if not isinstance(v, dict):
        return None
    traced = [r for r in v.get("requests", []) if r.get("traced")]
    cached = [r.get("num_cached_tokens", 0) for r in traced]
    steps = v.get("steps", [])
    batched = max((s.get("requests", 1) for s in steps), default=1)
    chunks = v.get("chunks", [])
    return (f"run {run} (vLLM scheduler): {len(v.get('requests', []))} request(s), traced num_cached_tokens {cached}; "
            f"the prompt computed in {len(chunks)} step(s) at positions {chunks}"
            + (f", each step holding up to {batched} request(s)" if batched > 1 else "")
            + f" ({v.get('chunks_as', '?')})")


def engine_facts(run_a: str, meta_a: dict[str, Any], run_b: str, meta_b: dict[str, Any]) -> dict[str, Any]:
    """The facts of two engine runs: ``engine_a``/``engine_b`` (each run's contract),
    ``engine_differences`` (label → ``[A's, B's]`` for every contract key that differs),
    ``cached_tokens_a``/``_b`` (vLLM's own ``num_cached_tokens`` of the traced prompt) and
    ``notes`` (one line per engine, per difference, per scheduler). Empty when neither run has
    ``meta["engine"]``."""
    fa, fb = meta_a.get("engine"), meta_b.get("engine")
    if not isinstance(fa, dict) or not isinstance(fb, dict):
        return {}
    out: dict[str, Any] = {"engine_a": fa, "engine_b": fb}
    same = fa.get("engine") == fb.get("engine")  # versions compare within one engine only
    diffs = {label: [_short(fa.get(k)), _short(fb.get(k))] for k, label in CONTRACT
             if k in fa and k in fb and _norm(k, fa.get(k)) != _norm(k, fb.get(k)) and (same or k != "version")}
    out["engine_differences"] = diffs
    notes = [f"engine {run}: {_PACKAGE.get(f.get('engine'), f.get('engine'))} {f.get('version')} on {f.get('device')}"
             + (f" ({f['device_name']})" if f.get("device_name") else "") + ", "
             f"attention {f.get('attention_backend')}, "
             f"{f.get('activation_dtype')} activations, logits {f.get('logits_dtype')}, KV cache "
             f"{f.get('kv_cache_dtype')}" + (f" in blocks of {f['block_size']}" if isinstance(f.get("block_size"), int) else "")
             + ("" if f.get("engine") == "hf" else
                f", compilation mode {f.get('compilation_mode')}, CUDA graphs {f.get('cudagraph_mode')}"
                + (", batch-invariant mode" if f.get("batch_invariant") else ""))
             for run, f in ((run_a, fa), (run_b, fb))]
    notes += [f"engines differ in {label}: {run_a} {va} | {run_b} {vb}" for label, (va, vb) in diffs.items()]
    if fa.get("batch_invariant") or fb.get("batch_invariant"):
        notes.append("vLLM's batch-invariant mode was on in this process: on a GPU, torch's mm, softmax, log_softmax, "
                     "mean and bmm ran vLLM's batch-invariant kernels for every run after it started, an HF run's included")
    for run, meta, key in ((run_a, meta_a, "cached_tokens_a"), (run_b, meta_b, "cached_tokens_b")):
        line = scheduler_line(run, meta)
        if line is not None:
            notes.append(line)
            out[key] = meta.get("cached_tokens")
    out["notes"] = notes
    return out


def engine_skips(c: Any, a: RunRecord, b: RunRecord) -> Any:
    """``c`` with every point missing in a run whose engine does not compute it (the run's
    ``meta["not_captured"]``: vLLM has no module for HF's ``mlp.act_fn``, ...) skipped with that
    reason and not failing: the points both engines compute decide whether the runs agree."""
    from tracer.diff.result import SkipRecord

    why = {run.name: run.meta.get("not_captured") or {} for run in (a, b)}
    engines = {run.name: (run.meta.get("engine") or {}).get("engine", "?") for run in (a, b)}
    out = []
    for sk in c.skipped:
        run = sk.reason[len("missing in run "):] if sk.reason.startswith("missing in run ") else None
        reason = why.get(run, {}).get(sk.name) if run is not None else None
        out.append(SkipRecord(sk.name, sk.kind, f"not computed by {engines[run]} (run {run}): {reason}", fails=False)
                   if reason and sk.kind != PointKind.LOGITS else sk)
    return replace(c, skipped=tuple(out))


def _logit_rows(rec: RunRecord) -> dict[str, dict[int, torch.Tensor]]:
    """Logits name → {absolute position: ``(vocab,)`` row} of a run: a full ``logits`` capture over
    its window, or the positions an engine computed (``extras["partial_logits"]``)."""
    out: dict[str, dict[int, torch.Tensor]] = {}
    for name, c in rec.captures.items():
        if c.kind == PointKind.LOGITS and c.tensor.dim() == 2:
            out[name] = {rec.window[0] + i: c.tensor[i] for i in range(c.tensor.shape[0])}
    for name, (ps, t) in (rec.extras.get("partial_logits") or {}).items():
        out.setdefault(name, {}).update({int(p): t[i] for i, p in enumerate(ps)})
    return out


def sampled_logits(c: Any, a: RunRecord, b: RunRecord) -> Any:
    """``c`` with the logits compared at the positions both runs computed them, when at least one
    run has logits at some compared positions only (vLLM: each request's last scheduled token).
    Flips keep their absolute positions; ``facts["logits_positions"]`` and a note say which
    positions were compared. ``c`` unchanged when the logits were compared in full or no position
    is shared (then a note says so).
    """
    if c.logits is not None:
        return c
    rows_a, rows_b = _logit_rows(a), _logit_rows(b)
    names = [n for n in rows_a if n in rows_b]
    if not names:
        return c
    name = names[0]
    w0, w1 = c.positions
    common = sorted(p for p in rows_a[name] if p in rows_b[name] and w0 <= p < w1)
    facts = dict(c.facts)
    notes = list(facts.get("notes", []))
    if not common:
        notes.append(f"{name} (logits): no compared position has logits in both runs (run {c.run_a} at "
                     f"{sorted(rows_a[name])}, run {c.run_b} at {sorted(rows_b[name])}); logits not compared")
        return replace(c, facts={**facts, "notes": notes})
    ta, tb = one_device(torch.stack([rows_a[name][p] for p in common]), torch.stack([rows_b[name][p] for p in common]))
    if ta.dtype != tb.dtype:
        notes.append(f"{name} (logits): run {c.run_a} has {ta.dtype}, run {c.run_b} {tb.dtype}; compared in float32")
        ta, tb = ta.float(), tb.float()
    d = logits_diff(ta, tb)
    flips = tuple(replace(f, position=common[f.position] - w0) for f in d.argmax_flips)
    d = replace(d, argmax_flips=flips)
    notes.append(f"{name} (logits) compared at position(s) {', '.join(map(str, common))} only, of the compared "
                 f"{w0}..{w1 - 1}: where both runs computed logits (vLLM computes them only where it samples, "
                 "each request's last scheduled token)")
    first = next((p.diff.max_abs_diff for p in c.points if p.diff.n_diff), None)
    skipped = tuple(s for s in c.skipped if s.name != name)  # compared after all, at the shared positions
    out = replace(c, logits=d, logits_name=name, facts={**facts, "notes": notes, "logits_positions": common}, skipped=skipped,
                  logits_amplification=amplification(first, d.tensor.max_abs_diff) if first is not None else None)
    return classify_origins(out, {n: r.role for n, r in a.captures.items() if getattr(r, "role", "")})


__all__ = ["engine_facts", "engine_skips", "sampled_logits", "scheduler_line", "CONTRACT"]
