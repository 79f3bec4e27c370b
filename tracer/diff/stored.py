"""A :class:`~tracer.diff.result.Comparison` rebuilt from its stored JSON document (no recomputation).

``tracer run`` and ``tracer audit`` store every comparison's :meth:`Comparison.to_dict` in the
trace (``/comparisons/<name>``); :func:`comparison_from_dict` turns that document back into the
result object (:meth:`Comparison.from_dict`: every field is in the document, :mod:`tracer.schema`),
so reports and figures are drawn from the stored numbers without re-reading any tensor (and from
``--store stats`` traces, which hold no tensors). Documents written before a field existed give
that field its default.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Any

from tracer.diff.result import Comparison
from tracer.errors import TracerError
from tracer.store.trace import TraceReader


def comparison_from_dict(doc: dict[str, Any]) -> Comparison:
    """The :class:`Comparison` whose :meth:`~Comparison.to_dict` is ``doc``.

    Raises:
        TracerError: ``doc`` is not a comparison document (a key is missing or malformed).
    """
    try:
        return Comparison.from_dict(doc)
    except TracerError as e:
        raise TracerError(f"not a stored comparison document ({e}); "
                          "was the trace written by this version of tracer?") from None


def stored_comparison(path: str | os.PathLike, name: str | None = None) -> Comparison | None:
    """The comparison stored in trace ``path`` (``name``, or the only/first one), None when it stores none.

    Raises:
        TracerError: unreadable trace, or an unknown ``name`` (the message lists the stored ones).
    """
    with TraceReader(path) as r:
        stored = r.comparisons()
    if not stored:
        return None
    if name is None:
        name = next(iter(stored))
    if name not in stored:
        raise TracerError(f"trace {path} stores no comparison {name!r}; stored: {', '.join(stored)}")
    return comparison_from_dict(stored[name])


def auto_comparison(path: str | os.PathLike, run_a: str | None, run_b: str | None) -> Comparison | None:
    """The comparison stored at run time of the two runs asked for (default: its first two), with a
    note, when the tensors in the file cannot give it: a ``--store auto`` trace that dropped tensors,
    or runs that hold a capture point in two dtypes (``rollout-vs-train`` with ``--train-dtype`` or
    ``--lm-head-fp32``: the run compared those points in the wider dtype). None otherwise, or when
    the trace stores no comparison of exactly these runs.

    Raises:
        TracerError: unreadable trace.
    """
    with TraceReader(path) as r:
        a, b = _pair(r, run_a, run_b)
        if a not in r.runs or b not in r.runs:
            return None
        run_metas = [r.run(n, load_tensors=False).meta for n in (a, b)]
        metas = [m.get("store_auto") for m in run_metas]
        dropped = any(isinstance(m, dict) and m.get("dropped") for m in metas)
        caps_a, caps_b = r.captures(a), r.captures(b)
        mixed = [n for n, (info, _) in caps_a.items() if n in caps_b and info.get("dtype") != caps_b[n][0].get("dtype")
                 and all(math.prod(i.get("shape") or [0]) for i in (info, caps_b[n][0]))]  # an empty point has no dtype
        sampled = sampled_only(run_metas, (caps_a, caps_b))
        if not dropped and not mixed and not sampled:
            return None
        stored = r.comparisons()
    c = _stored_of(stored, a, b)
    if c is None:
        return None
    if sampled:
        name, positions = sampled
        note = (f"from the comparison made when the trace was written: {name} (logits) exists only at position(s) "
                f"{_positions(positions)}, where the engine sampled; the run compared them there, and the trace does not store them")
    elif dropped:
        kept = metas[0] if isinstance(metas[0], dict) else {}
        note = (f"from the comparison made when the trace was written: --store auto kept full tensors of "
                f"{len(kept.get('kept', []))} of {len(kept.get('kept', [])) + len(kept.get('dropped', []))} "
                "points, so the others cannot be recomputed from the file")
    else:
        da, db = caps_a[mixed[0]][0].get("dtype"), caps_b[mixed[0]][0].get("dtype")
        note = (f"from the comparison made when the trace was written: {len(mixed)} capture point(s) hold "
                f"{da} in run {a} but {db} in run {b} (e.g. {mixed[0]}); the run compared them in the wider dtype")
    return replace(c, facts={**c.facts, "notes": list(c.facts.get("notes", [])) + [note]})


def sampled_only(metas: list[dict[str, Any]], captures: tuple[dict[str, Any], dict[str, Any]]
                 ) -> tuple[str, list[int]] | None:
    """``(logits name, positions)`` when a run's meta says its logits exist at some positions only
    (an engine that computes them where it samples: vLLM's ``meta["logits"]``) and the trace holds
    no logits capture of that name in one of the runs; else None."""
    for meta in metas:
        logits = meta.get("logits") if isinstance(meta, dict) else None
        if not isinstance(logits, dict):
            continue
        for name, info in logits.items():
            ps = info.get("positions") if isinstance(info, dict) else None
            if not isinstance(ps, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in ps):
                continue
            if any(name not in caps or not math.prod(caps[name][0].get("shape") or [0]) for caps in captures):
                return str(name), ps
    return None


def stored_rl(path: str | os.PathLike, run_a: str | None, run_b: str | None) -> Any:
    """The RL metrics (:class:`tracer.diff.rl.RLComparison`) stored with the run-time comparison of
    runs ``run_a`` and ``run_b`` (default: the first two) of a ``rollout-vs-train`` trace; None when
    there are none. They come from every sequence's logits, which only the run held in memory, so a
    comparison recomputed from the file takes them from here.

    Raises:
        TracerError: unreadable trace.
    """
    with TraceReader(path) as r:
        c = _stored_of(r.comparisons(), *_pair(r, run_a, run_b))
    return None if c is None else c.rl


def _pair(r: TraceReader, run_a: str | None, run_b: str | None) -> tuple[str | None, str | None]:
    """The runs a comparison of trace ``r`` takes: those asked for, by default its first two."""
    a = run_a or (r.runs[0] if r.runs else None)
    return a, run_b or next((n for n in r.runs if n != a), None)


def _positions(ps: list[int]) -> str:
    """``"5, 6, 7"``: at most 8 positions, then ``...``."""
    return ", ".join(map(str, ps[:8])) + (", ..." if len(ps) > 8 else "")


def _stored_of(stored: dict[str, Any], a: str | None, b: str | None) -> Comparison | None:
    """The stored comparison of exactly runs ``a`` then ``b`` (None when there is none)."""
    for doc in stored.values():
        if isinstance(doc, dict) and list(doc.get("runs") or []) == [a, b]:
            return comparison_from_dict(doc)
    return None


def mark_unverified(c: Comparison, paths: list[str | os.PathLike]) -> Comparison:
    """``c`` with :attr:`~tracer.diff.result.Comparison.unverified` naming every trace in ``paths``
    (those it was read from) that carries no checksums (:func:`tracer.store.integrity.is_checksummed`).

    Raises:
        TracerError: an unreadable trace.
    """
    from tracer.store.integrity import is_checksummed

    seen = [p for p in dict.fromkeys(str(p) for p in paths) if p not in c.unverified]
    bare = tuple(p for p in seen if not is_checksummed(p))
    return replace(c, unverified=c.unverified + bare) if bare else c


def explain_sampled(c: Comparison, ref_a: tuple[str, str | None], ref_b: tuple[str, str | None]) -> Comparison:
    """``c`` (a comparison of stored runs made now: runs of two traces, or of one trace with
    tolerances) with the reason of a logits point skipped because one side's engine computed logits
    only where it sampled (vLLM) said as such, instead of a bare "missing in run ...": the trace does
    not store those rows. The point still fails ``--fail-on any`` (it was not compared).

    Raises:
        TracerError: unreadable trace.
    """
    said: dict[str, str] = {}
    # one trace: its run-time comparison (shown when no tolerance is asked) compared them
    advice = ("tracer compare without --atol/--rtol shows the comparison made when the trace was written"
              if ref_a[0] == ref_b[0] else "compare them in one run (--scenario engine)")
    for side, (path, run) in enumerate((ref_a, ref_b)):
        with TraceReader(path) as r:
            label = (c.run_a, c.run_b)[side]  # the run compare_runs chose: RUN in one trace, else PATH:RUN
            name = run or (label if ref_a[0] == ref_b[0] else label.rsplit(":", 1)[-1])
            if name not in r.runs:
                continue
            found = sampled_only([r.run(name, load_tensors=False).meta], (r.captures(name),))
        if found is not None:
            said[found[0]] = (f"not stored: {path}:{name}'s engine computed logits only at position(s) "
                              f"{_positions(found[1])} (where it sampled); {advice}")
    if not said:
        return c
    skipped = tuple(replace(sk, reason=said[sk.name]) if sk.name in said else sk for sk in c.skipped)
    notes = list(c.facts.get("notes", []))
    if ref_a[0] == ref_b[0]:  # with a tolerance: what the run-time comparison (no tolerance) found there
        with TraceReader(ref_a[0]) as r:
            then = _stored_of(r.comparisons(), c.run_a, c.run_b)
        if then is not None and then.logits is not None:
            d = then.logits
            flips = ", ".join(str(f.position + then.positions[0]) for f in d.argmax_flips[:8]) or "none"
            notes.append(f"when the trace was written (no tolerance), {then.logits_name} was compared at "
                         f"{d.n_positions} position(s): {d.tensor.n_diff:,} of {d.tensor.n_total:,} elements "
                         f"differed (max |Δ| {d.tensor.max_abs_diff:.3g}), {len(d.argmax_flips)} argmax flip(s) "
                         f"at position(s) {flips}")
    return replace(c, skipped=skipped, facts={**c.facts, "notes": notes})
