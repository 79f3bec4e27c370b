"""Origin analysis: which differing capture points *create* a divergence and which inherit it.

A differing point is an origin when everything it consumes (:mod:`tracer.diff.dataflow`) was
bit-identical in both runs; :func:`classify_origins` marks every point and fills the
layer-to-layer growth.
"""

from __future__ import annotations

from dataclasses import replace

from tracer.diff.dataflow import dataflow
from tracer.diff.metrics import amplification
from tracer.diff.result import Comparison, PointResult
from tracer.execute.kinds import PointKind


def _growth(points: list[PointResult]) -> list[float | None]:
    """Layer-to-layer amplification of each point (see ``PointResult.growth``): against the point of
    the same path in the previous layer. A point's layer is the longest layer name that is the
    point's name or a dotted prefix of it."""
    index = {p.name: i for i, p in enumerate(q for q in points if q.kind == PointKind.LAYER)}
    layers = list(index)
    by_name = {p.name: p for p in points}
    out: list[float | None] = []
    for p in points:
        parts = p.name.split(".")
        owner = next((o for o in (".".join(parts[:k]) for k in range(len(parts), 0, -1)) if o in index), None)
        g = None
        if owner is not None and index[owner] > 0:
            prev = by_name.get(layers[index[owner] - 1] + p.name[len(owner):])
            if prev is not None:
                g = amplification(prev.diff.max_abs_diff, p.diff.max_abs_diff)
        out.append(g)
    return out


def classify_origins(c: Comparison, roles: dict[str, str] | None = None) -> Comparison:
    """Mark every differing capture point as origin or propagated, and fill ``growth``.

    A differing point is an **origin** when every capture point it consumes
    (:func:`tracer.diff.dataflow.dataflow`) was bit-identical in both runs: the op itself computed
    differently. Otherwise it is **propagated** and ``differing_inputs`` names the culprits.
    A ``kv_cache`` point is judged per part: its rows inside the compared window against its
    K/V producers, its rows before the window (computed by an earlier forward pass) against the
    previous layer's cache rows there; a ``state`` point (a linear-attention layer's recurrent
    state, which mixes all positions) against both at once. The logits are an origin when they
    differ while the final norm (their input) did not. ``roles`` (capture name → role, :mod:`tracer.execute.family`)
    gives each point's place in the block; points without one get their layer's inferred roles.

    Returns:
        a new :class:`Comparison` with ``origin``, ``differing_inputs``, ``consumes`` and
        ``growth`` set on its points and ``logits_origin`` set.
    """
    roles = roles or {}
    names = [(p.name, p.kind, roles.get(p.name, "")) for p in c.points]
    if c.logits_name is not None:
        names.append((c.logits_name, "logits", "logits"))
    flow = dataflow(names)
    by_name = {p.name: p for p in c.points}

    def diverged(n: str) -> bool:
        return n in by_name and by_name[n].diverged

    def prefix_diverged(n: str) -> bool:
        q = by_name.get(n)
        return q is not None and bool(q.n_diff_prefix if q.n_diff_prefix is not None else q.diverged)

    out = []
    for p, growth in zip(c.points, _growth(list(c.points))):
        cons = flow[p.name]
        origin, bad = False, ()
        if p.diverged:
            bad_w = tuple(d for d in cons.points if diverged(d))
            if p.n_diff_prefix is not None:
                in_window = p.diff.n_diff - p.n_diff_prefix > 0
                bad_p = tuple(d for d in cons.prefix if prefix_diverged(d))
                origin = (in_window and not bad_w) or (p.n_diff_prefix > 0 and not bad_p)
                bad = tuple(dict.fromkeys((bad_w if in_window else ()) + (bad_p if p.n_diff_prefix else ())))
            elif cons.prefix:  # a layer's state (no rows to split): its inputs here and in the prefix pass
                bad = tuple(dict.fromkeys(bad_w + tuple(d for d in cons.prefix if prefix_diverged(d))))
                origin = not bad
            else:
                origin, bad = not bad_w, bad_w
        out.append(replace(p, consumes=cons, origin=origin, differing_inputs=bad, growth=growth))
    logits_origin = False
    if c.logits is not None and c.logits.tensor.n_diff and c.logits_name in flow:
        logits_origin = not any(diverged(d) for d in flow[c.logits_name].points)
    return replace(c, points=tuple(out), logits_origin=logits_origin)
