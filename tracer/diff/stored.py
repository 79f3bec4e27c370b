"""A :class:`~tracer.diff.result.Comparison` rebuilt from its stored JSON document (no recomputation).

``tracer run`` and ``tracer audit`` store every comparison's :meth:`Comparison.to_dict` in the
trace (``/comparisons/<name>``); :func:`comparison_from_dict` turns that document back into the
result object (:meth:`Comparison.from_dict`: every field is in the document, :mod:`tracer.schema`),
so reports and figures are drawn from the stored numbers without re-reading any tensor (and from
``--store stats`` traces, which hold no tensors). Documents written before a field existed give
that field its default.
"""

from __future__ import annotations

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
    """For a ``--store auto`` trace that dropped tensors, the comparison stored at run time of the
    two runs asked for (default: its first two), with a note; None when the trace keeps every
    point it compared, or stores no comparison of exactly these runs.

    Raises:
        TracerError: unreadable trace.
    """
    with TraceReader(path) as r:
        runs = r.runs
        a = run_a or (runs[0] if runs else None)
        b = run_b or next((n for n in runs if n != a), None)
        if a not in runs or b not in runs:
            return None
        metas = [r.run(n, load_tensors=False).meta.get("store_auto") for n in (a, b)]
        if not any(isinstance(m, dict) and m.get("dropped") for m in metas):
            return None
        stored = r.comparisons()
    for doc in stored.values():
        if isinstance(doc, dict) and list(doc.get("runs") or []) == [a, b]:
            c = comparison_from_dict(doc)
            kept = metas[0] if isinstance(metas[0], dict) else {}
            note = (f"from the comparison made when the trace was written: --store auto kept full tensors of "
                    f"{len(kept.get('kept', []))} of {len(kept.get('kept', [])) + len(kept.get('dropped', []))} "
                    "points, so the others cannot be recomputed from the file")
            return replace(c, facts={**c.facts, "notes": list(c.facts.get("notes", [])) + [note]})
    return None
