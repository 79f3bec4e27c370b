"""A :class:`~tracer.diff.result.Comparison` rebuilt from its stored JSON document (no recomputation).

``tracer run`` and ``tracer audit`` store every comparison's :meth:`Comparison.to_dict` in the
trace (``/comparisons/<name>``); :func:`comparison_from_dict` turns that document back into the
result object (:meth:`Comparison.from_dict`: every field is in the document, :mod:`tracer.schema`),
so reports and figures are drawn from the stored numbers without re-reading any tensor (and from
``--store stats`` traces, which hold no tensors). Documents written before a field existed give
that field its default. :func:`compare_stored` compares two stored runs into the same result as the
comparison made when they ran, whatever the file kept.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

from tracer.diff.compare import compare_runs
from tracer.diff.metrics import flips_phrase
from tracer.diff.result import Comparison
from tracer.errors import TracerError
from tracer.store.integrity import is_checksummed
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


def sampled_only(metas: list[dict[str, Any]], captures: tuple[dict[str, Any], dict[str, Any]]
                 ) -> tuple[str, list[int]] | None:
    """``(logits name, positions)`` when a run's meta says its logits exist at some positions only
    (an engine that computes them where it samples: its ``meta["logits"]``) and the trace holds
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
    seen = [p for p in dict.fromkeys(str(p) for p in paths) if p not in c.unverified]
    bare = tuple(p for p in seen if not is_checksummed(p))
    return replace(c, unverified=c.unverified + bare) if bare else c


@dataclass(frozen=True)
class Gaps:
    """What the tensors a trace holds cannot give of a comparison of two of its runs.

    Attributes:
        dropped: ``--store auto`` kept statistics only of some points: ``(kept, total)`` points.
        mixed: the capture points that hold another dtype in each run (``rollout-vs-train`` with
            ``--train-dtype`` or ``--lm-head-fp32``: the run compared them in the wider dtype),
            and the two dtypes of the first.
        sampled: ``(logits name, positions)``: an engine held the logits at those positions only
            (where it sampled), and the trace does not store them.
    """

    dropped: tuple[int, int] | None = None
    mixed: tuple[tuple[str, ...], str, str] | None = None
    sampled: tuple[str, list[int]] | None = None

    def __bool__(self) -> bool:
        return any(x is not None for x in (self.dropped, self.mixed, self.sampled))

    def why(self, a: str, b: str) -> str:
        """One line: why the comparison comes from the one made when the trace was written."""
        head = "from the comparison made when the trace was written: "
        if self.sampled is not None:
            name, positions = self.sampled
            return (head + f"{name} (logits) exists only at position(s) {_positions(positions)}, where the engine "
                    "sampled; the run compared them there, and the trace does not store them")
        if self.dropped is not None:
            return (head + f"--store auto kept full tensors of {self.dropped[0]} of {self.dropped[1]} points, so the "
                    "others cannot be recomputed from the file")
        names, da, db = self.mixed  # type: ignore[misc]
        return (head + f"{len(names)} capture point(s) hold {da} in run {a} but {db} in run {b} (e.g. {names[0]}); "
                "the run compared them in the wider dtype")


def gaps(r: TraceReader, a: str, b: str) -> Gaps:
    """What runs ``a`` and ``b`` of the open trace ``r`` cannot give from their tensors (:class:`Gaps`)."""
    run_metas = [r.run(n, load_tensors=False).meta for n in (a, b)]
    metas = [m.get("store_auto") for m in run_metas]
    kept = next((m for m in metas if isinstance(m, dict) and m.get("dropped")), None)
    caps_a, caps_b = r.captures(a), r.captures(b)
    mixed = [n for n, (info, _) in caps_a.items() if n in caps_b and info.get("dtype") != caps_b[n][0].get("dtype")
             and all(math.prod(i.get("shape") or [0]) for i in (info, caps_b[n][0]))]  # an empty point has no dtype
    return Gaps(
        dropped=(len(kept.get("kept", [])), len(kept.get("kept", [])) + len(kept["dropped"])) if kept else None,
        mixed=(tuple(mixed), caps_a[mixed[0]][0].get("dtype"), caps_b[mixed[0]][0].get("dtype")) if mixed else None,
        sampled=sampled_only(run_metas, (caps_a, caps_b)))


#: the parts of a comparison only the run itself can compute: the RL metrics (from every
#: sequence's logits, which only the run held), the noise verdict (re-runs at higher precision) and
#: the float64 op replay (the model's ops); a comparison of stored runs takes them from the one
#: made when the trace was written
RUN_TIME_ONLY = ("rl", "noise", "op_replay")


def compare_stored(ref_a: tuple[str, str | None], ref_b: tuple[str, str | None], *, atol: float | None = None,
                   rtol: float | None = None, device: str | None = None) -> Comparison:
    """Two stored runs compared (no model needed): the same result as the comparison made when the
    runs ran, whatever ``--store`` kept.

    Runs of one trace that stores their run-time comparison: when the file's tensors cannot give
    it (:class:`Gaps`: ``--store auto`` dropped tensors, points in two dtypes, logits an engine
    held only where it sampled) and the tolerances asked are the run's, the result is that
    comparison, with a note saying why; otherwise the stored tensors are compared
    (:func:`tracer.diff.compare.compare_runs`, every checksum verified) and the parts only the run
    could compute (:data:`RUN_TIME_ONLY`) are the run-time comparison's. Logits an engine held only
    where it sampled, compared at another tolerance or across two traces, are skipped with that
    reason (and what the run-time comparison found there, in a note), not a bare "missing".

    Raises:
        TracerError: missing/corrupt trace, unknown run names, runs of different prompts, an
            unavailable device.
    """
    (pa, ra), (pb, rb) = ref_a, ref_b
    then, missing = None, Gaps()
    if pa == pb:
        with TraceReader(pa) as r:
            a, b = _pair(r, ra, rb)
            if a in r.runs and b in r.runs:
                then = _stored_of(r.comparisons(), a, b)
                missing = gaps(r, a, b) if then is not None else Gaps()
    if then is not None and missing and (atol, rtol) == (then.atol, then.rtol):
        notes = [*then.facts.get("notes", []), missing.why(then.run_a, then.run_b)]
        return replace(then, facts={**then.facts, "notes": notes})
    c = compare_runs((pa, ra), (pb, rb), atol=atol, rtol=rtol, device=device)
    c = _sampled_reasons(c, (pa, ra), (pb, rb), then)
    if then is not None:  # what only the run computed: from its comparison
        c = replace(c, **{k: getattr(then, k) for k in RUN_TIME_ONLY if getattr(c, k) is None})
    return c


def _sampled_reasons(c: Comparison, ref_a: tuple[str, str | None], ref_b: tuple[str, str | None],
                     then: Comparison | None) -> Comparison:
    """``c`` (stored runs compared now: runs of two traces, or of one trace at another tolerance)
    with the reason of a logits point skipped because one side's engine computed logits only where
    it sampled said as such, instead of a bare "missing in run ...": the trace does not
    store those rows. The point still fails ``--fail-on any`` (it was not compared); ``then``, the
    run-time comparison (runs of one trace), says in a note what it found there.

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
    if then is not None and then.logits is not None:  # with a tolerance: what the run-time comparison found there
        d = then.logits
        flips = ", ".join(str(f.position + then.positions[0]) for f in d.argmax_flips[:8])
        notes.append(f"when the trace was written (no tolerance), {then.logits_name} was compared at "
                     f"{d.n_positions} position(s): {d.tensor.n_diff:,} of {d.tensor.n_total:,} elements "
                     f"differed (max |Δ| {d.tensor.max_abs_diff:.3g}), {flips_phrase(len(d.argmax_flips))}"
                     + (f" at position{'s' if len(d.argmax_flips) > 1 else ''} {flips}" if d.argmax_flips else ""))
    return replace(c, skipped=skipped, facts={**c.facts, "notes": notes})
