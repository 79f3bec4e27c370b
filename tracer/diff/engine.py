"""Two runs on engines: their numeric contracts side by side, what each scheduler did, and the logits
where an engine computes them only at some positions (where it samples).

Each run of a plan on another engine than the reference (and the reference run beside it) carries
``meta["engine"]``: the engine's numeric contract (:class:`~tracer.execute.records.EngineFacts`, the
same record for every engine, :func:`tracer.engines.door.facts`: version, attention backend, norm,
activation, GEMM, activation / logits / KV-cache dtypes, KV block size, chunked-prefill budget,
compilation and graphs off); a run whose engine schedules requests also carries ``meta["scheduler"]``
(:class:`~tracer.execute.records.SchedulerFacts`: each request's ``num_cached_tokens``, the steps
that computed the prompt), which the engine's own :func:`tracer.engines.door.scheduler_note` puts in
words. :func:`engine_facts` turns them into the comparison's facts and notes; :func:`sampled_logits`
compares the logits at the positions both runs have.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from tracer.engines.door import comparison_note, scheduler_note
from tracer.engines.table import is_reference, rows
from tracer.diff.batch import tensor_diff
from tracer.diff.crossdtype import CrossAccumulator, pair_dtypes
from tracer.diff.logits import logits_diff
from tracer.diff.metrics import amplification
from tracer.diff.origins import classify_origins
from tracer.diff.positions import one_device
from tracer.diff.result import SkipRecord
from tracer.execute.kinds import PointKind
from tracer.execute.records import EngineFacts, RunRecord

#: the contract fields compared between two engines, the label a difference is named by, and what
#: the field's 0 means (an engine without paged blocks or a per-step token budget), or None
CONTRACT = (("device", "device", None), ("attention_backend", "attention backend", None),
            ("batch_invariant", "batch-invariant mode", None), ("norm", "norm implementation", None),
            ("activation", "activation", None), ("gemm", "GEMM", None), ("activation_dtype", "activation dtype", None),
            ("logits_dtype", "logits dtype", None), ("kv_cache_dtype", "KV-cache dtype", None),
            ("block_size", "KV block size", "none (a contiguous KV cache)"),
            ("max_num_batched_tokens", "chunked-prefill budget", "none (each forward call computes what it is given)"),
            ("tensor_parallel", "tensor-parallel ranks", None), ("version", "version", None))



def _product(engine: Any) -> Any:
    """The software an engine's facts name (:mod:`tracer.engines.table`: ``product``), else the name as given."""
    return rows()[engine].product if engine in rows() else engine


def _short(v: Any, zero: str | None = None) -> str:
    if v == 0 and zero is not None and not isinstance(v, bool):
        return zero
    if isinstance(v, dict):
        vals = sorted({str(x) for x in v.values()})
        return vals[0] if len(vals) == 1 else "; ".join(f"{k}: {x}" for k, x in v.items())
    return str(v)


def _norm(key: str, value: Any) -> Any:
    """A contract value as compared: devices by type and index (``cuda`` is ``cuda:0``)."""
    if key == "device" and isinstance(value, str) and value in ("cuda", "xpu", "mps"):
        return f"{value}:0"
    return value


def engine_facts(run_a: str, meta_a: dict[str, Any], run_b: str, meta_b: dict[str, Any]) -> dict[str, Any]:
    """The facts of two engine runs: ``engine_a``/``engine_b`` (each run's contract, an
    :class:`~tracer.execute.records.EngineFacts` document), ``engine_differences`` (label →
    ``[A's, B's]`` for every contract field both state and that differs), ``cached_tokens_a``/``_b``
    (the engine's own ``num_cached_tokens`` of the traced prompt) and ``notes`` (one line per
    engine, per difference, per scheduler). Empty when neither run has ``meta["engine"]``."""
    if not isinstance(meta_a.get("engine"), dict) or not isinstance(meta_b.get("engine"), dict):
        return {}
    fa, fb = EngineFacts.from_dict(meta_a["engine"]), EngineFacts.from_dict(meta_b["engine"])
    out: dict[str, Any] = {"engine_a": fa.to_dict(), "engine_b": fb.to_dict()}
    same = fa.engine == fb.engine  # versions compare within one engine only
    shown = {label: (_short(getattr(fa, key), zero), _short(getattr(fb, key), zero), _norm(key, getattr(fa, key)),
                     _norm(key, getattr(fb, key))) for key, label, zero in CONTRACT
             if getattr(fa, key) is not None and getattr(fb, key) is not None and (same or key != "version")}
    # compared as shown (one GEMM for every Linear is one), and as the same device (cuda is cuda:0)
    diffs = {label: [va, vb] for label, (va, vb, na, nb) in shown.items() if va != vb and na != nb}
    out["engine_differences"] = diffs
    notes = [f"engine {run}: {_product(f.engine)} {f.version} on {f.device}"
             + (f" ({f.device_name})" if f.device_name else "")
             + f", attention {f.attention_backend}, "
             f"{f.activation_dtype} activations, logits {f.logits_dtype}, KV cache {f.kv_cache_dtype}"
             + (f" in blocks of {f.block_size}" if f.block_size else "")
             + ("" if is_reference(f.engine) else f", compilation mode {f.compilation_mode}, CUDA graphs {f.cudagraph_mode}")
             + (", batch-invariant mode" if f.batch_invariant else "")
             for run, f in ((run_a, fa), (run_b, fb))]
    notes += [f"engines differ in {label}: {run_a} {va} | {run_b} {vb}" for label, (va, vb) in diffs.items()]
    agree = [f"{label} ({va})" for label, (va, vb, na, nb) in shown.items() if label not in diffs]
    if agree:
        notes.append(f"same in both engines: {'; '.join(agree)}")
    for run, meta, key in ((run_a, meta_a, "cached_tokens_a"), (run_b, meta_b, "cached_tokens_b")):
        line = scheduler_note(run, meta)
        if line is not None:
            notes.append(line)
            out[key] = meta.get("cached_tokens")
    out["notes"] = notes
    return out


def engine_skips(c: Any, a: RunRecord, b: RunRecord) -> Any:
    """``c`` with every point missing in a run whose engine does not compute it (the run's
    ``meta["not_captured"]``: an engine without a module for HF's ``mlp.act_fn``, ...) skipped with that
    reason and not failing: the points both engines compute decide whether the runs agree."""
    why = {run.name: run.meta.get("not_captured") or {} for run in (a, b)}
    engines = {run.name: (run.meta.get("engine") or {}).get("engine", "?") for run in (a, b)}
    out = []
    for sk in c.skipped:
        run = sk.reason[len("missing in run "):] if sk.reason.startswith("missing in run ") else None
        reason = why.get(run, {}).get(sk.name) if run is not None else None
        out.append(SkipRecord(sk.name, sk.kind, f"not computed by {engines[run]} (run {run}): {reason}", fails=False)
                   if reason and sk.kind != PointKind.LOGITS else sk)
    return replace(c, skipped=tuple(out))


def engine_note(c: Any, a: RunRecord, b: RunRecord) -> Any:
    """``c`` with the line run B's engine adds about it (:func:`tracer.engines.door.comparison_note`:
    a KV hand-over's control that is not bit-identical, said why) under its notes."""
    line = comparison_note(c, a.meta, b.meta)
    if line is None:
        return c
    return replace(c, facts={**c.facts, "notes": [*(c.facts.get("notes") or []), line]})


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
    run has logits at some compared positions only (an engine that samples: each request's last
    scheduled token).
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
    where = f"position{'s' if len(common) != 1 else ''} {', '.join(map(str, common))}"
    note = (f"{name} (logits) compared at {where} only, of the compared "
            f"{w0}..{w1 - 1}: where both runs computed logits (an engine that samples computes them only "
            "there, each request's last scheduled token)")
    return logits_at(replace(c, facts={**facts, "notes": notes}), name, common, ta, tb, note,
                     {n: r.role for n, r in a.captures.items() if getattr(r, "role", "")})


def logits_at(c: Any, name: str, positions: list[int], ta: torch.Tensor, tb: torch.Tensor, note: str,
              roles: dict[str, str] | None = None) -> Any:
    """Comparison ``c`` with the logits ``name`` compared at ``positions`` only (absolute, sorted, inside
    ``c.positions``): ``ta``/``tb`` are both runs' ``(len(positions), vocab)`` rows there. They count
    like logits compared in full: in the verdict, the ``--fail-on`` check and every output format;
    flips keep their absolute positions, ``facts["logits_positions"]`` and the line ``note`` say
    where. Rows of two float dtypes are compared as :mod:`tracer.diff.crossdtype` says (values in the
    wider, ULPs in the coarser; ``logits_cross_dtype``).
    """
    cross = None
    if ta.dtype != tb.dtype and pair_dtypes(ta.dtype, tb.dtype) is not None:
        acc = CrossAccumulator(ta.dtype, tb.dtype)
        a, b, ra, rb = acc.views(ta, tb)
        merged, cross = acc.merge(tensor_diff(a, b), tensor_diff(ra, rb))
        d = logits_diff(a, b, tensor=merged)
    else:
        d = logits_diff(ta, tb)
    w0 = c.positions[0]
    d = replace(d, argmax_flips=tuple(replace(f, position=positions[f.position] - w0) for f in d.argmax_flips))
    facts = dict(c.facts)
    notes = [*facts.get("notes", []), note]
    first = next((p.diff.max_abs_diff for p in c.points if p.diff.n_diff), None)
    skipped = tuple(s for s in c.skipped if s.name != name)  # compared after all, at those positions
    out = replace(c, logits=d, logits_name=name, logits_cross_dtype=cross, skipped=skipped,
                  facts={**facts, "notes": notes, "logits_positions": list(positions)},
                  logits_amplification=amplification(first, d.tensor.max_abs_diff) if first is not None else None)
    return classify_origins(out, roles or {})


__all__ = ["engine_facts", "engine_skips", "engine_note", "sampled_logits", "logits_at", "CONTRACT"]
