"""Handing the runs' captures to the trace writer under ``--store auto``.

Store-layer module, called by :func:`tracer.pipeline.run_scenario`: the comparison has seen every
capture point on the model's device; :func:`store_auto` chooses the points kept in full
(:func:`tracer.store.budget.choose`), copies only those to pinned host memory on a side stream
(:func:`tracer.execute.capture.host_copies`) and gives the writer both runs. When the whole trace
will fit the budget anyway, :func:`early_run_a` hands run A to the writer before run B executes
(as ``--store tensors`` does), so its write overlaps run B; the choice is then only confirmed.
"""

from __future__ import annotations

from dataclasses import replace as _replace
from typing import Any, Callable

from tracer import schema
from tracer.execute.capture import host_copies
from tracer.store.budget import StoreAuto, choose


def hand_over(rec: Any, writer: Any, *, online: bool, keep: bool, budget: int | None,
              first: bool) -> tuple[Any, Any]:
    """A run just executed, handed to the trace writer (when there is one) without waiting.

    ``--store tensors`` (not ``online``, captures kept on the device): pinned host copies on a
    side stream, written once they land; ``stats``: the run without tensors; ``--store auto``
    (``budget``): run A (``first``) early when the whole trace will fit (:func:`early_run_a`),
    else nothing before the comparison (:func:`store_auto`). The writer's thread waits for the
    copies and fills the run's time (:func:`tracer.execute.records.settle_wall`).

    Returns:
        ``(the run's host record, run A's host record when handed over early, else None)``.
    """
    from tracer.execute.records import settle_wall

    host_rec, wait = rec, None
    if not online and keep and budget is None:
        captures, wait = host_copies(rec.captures)
        host_rec = _replace(rec, captures=captures)
    if writer is not None and budget is None:
        writer.add_run(_replace(rec, captures={}) if online else host_rec,
                       ready=lambda: (wait and wait(), settle_wall(rec)))
    elif budget is not None and first:
        return host_rec, early_run_a(rec, budget, writer, settle_wall)
    return host_rec, None


def early_run_a(rec_a: Any, budget: int, writer: Any, settle: Callable[[Any], Any]) -> Any | None:
    """Right after run A: when both runs will fit ``budget`` whole (run B captures run A's points:
    twice run A's bytes), copy run A to the host on a side stream and hand it to ``writer`` now;
    :func:`store_auto` confirms the choice after the comparison (or takes the run back).

    Args:
        settle: fills the run's time (``tracer.execute.records.settle_wall``), on the writer's thread.

    Returns:
        run A's host record (its own ``meta`` dict), or None when it was not handed over.
    """
    if writer is None or 2 * sum(c.tensor.nbytes for c in rec_a.captures.values()) > budget:
        return None
    captures, wait = host_copies(rec_a.captures)
    host = _replace(rec_a, captures=captures, meta=dict(rec_a.meta))

    def ready() -> None:
        wait()
        settle(rec_a)
        host.meta["wall_s"] = rec_a.meta.get("wall_s")

    writer.add_run(host, ready=ready)
    return host


def store_auto(records: list[Any], comparison: Any, budget: int, writer: Any,
               say: Callable[[str], None], early: Any = None) -> tuple[Any, list[Any]]:
    """``--store auto`` after the comparison: choose the points kept in full
    (:func:`tracer.store.budget.choose`), copy only those to the host, hand both runs to the writer
    (when there is one), and name the choice in the comparison's notes. ``early``: run A's host
    record, already with the writer (:func:`early_run_a`): its meta is completed when the whole
    trace was kept, else the run is taken back and written again with the kept points only.

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
    record = schema.build(StoreAuto, {**kept.to_dict(), "logits": comparison.logits_name,
                                      "kinds": kinds}).to_dict()  # each stored run's meta
    host = []
    for rec in records:
        if early is not None and rec is records[0]:
            if not kept.dropped:  # kept whole, as foreseen: run A's data is written, its meta completed
                early.meta.update(wall_s=rec.meta.get("wall_s"), store_auto=record)  # the run's time: settled by now
                writer.set_meta(early.name, early.meta)
                host.append(early)
                continue
            writer.remove_run(early.name)  # run B held more than run A: written again, within the budget
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
