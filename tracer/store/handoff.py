"""Handing a run's captures to the trace writer after the comparison: ``--store auto``.

Store-layer module, called by :func:`tracer.pipeline.run_scenario`: the comparison has seen every
capture point on the model's device; this chooses the points kept in full
(:func:`tracer.store.budget.choose`), copies only those to pinned host memory on a side stream
(:func:`tracer.execute.capture.host_copies`) and gives the writer both runs.
"""

from __future__ import annotations

from dataclasses import replace as _replace
from typing import Any, Callable

from tracer.execute.capture import host_copies
from tracer.store.budget import choose


def store_auto(records: list[Any], comparison: Any, budget: int, writer: Any,
               say: Callable[[str], None]) -> tuple[Any, list[Any]]:
    """``--store auto`` after the comparison: choose the points kept in full
    (:func:`tracer.store.budget.choose`), copy only those to the host, hand both runs to the writer
    (when there is one), and name the choice in the comparison's notes.

    Returns:
        ``(comparison with the note, host records holding the kept tensors)``.
    """
    rec_a, rec_b = records
    sizes = [(n, c.tensor.nbytes + (rec_b.captures[n].tensor.nbytes if n in rec_b.captures else 0))
             for n, c in rec_a.captures.items()]
    sizes += [(n, c.tensor.nbytes) for n, c in rec_b.captures.items() if n not in rec_a.captures]
    origins = tuple(p.name for p in comparison.origins)
    if comparison.logits_origin and comparison.logits_name:
        origins += (comparison.logits_name,)
    kept = choose(sizes, budget, origins=origins, logits=comparison.logits_name)
    say(kept.summary())
    dropped = set(kept.dropped)
    kinds = {n: c.kind for r in records for n, c in r.captures.items() if n in dropped}
    record = {**kept.to_dict(), "logits": comparison.logits_name, "kinds": kinds}  # each stored run's meta
    host = []
    for rec in records:
        captures, wait = host_copies({n: c for n, c in rec.captures.items() if n in kept.reasons})
        host_rec = _replace(rec, captures=captures, meta={**rec.meta, "store_auto": record})
        host.append(host_rec)
        if writer is not None:
            writer.add_run(host_rec, ready=wait)
        else:
            wait()
    if not kept.dropped:  # the whole trace fitted: nothing to say
        return comparison, host
    facts = {**comparison.facts, "notes": list(comparison.facts.get("notes", [])) + [kept.summary()]}
    return _replace(comparison, facts=facts), host
