"""Why a capture point differs: which kernels ran in each run, the shapes its op saw, the finer
origin class, and each origin's record as data.

Pure functions of a compared point (:class:`tracer.diff.result.PointResult`, duck-typed: ``diverged``,
``origin``, ``kind``, ``op``, ``calls_a``, ``calls_b``, ``n_diff_prefix``, ``diff``) and the compared
positions. Kernel lists come from ``calls[k]["kernels"]`` (``--kernels``, :mod:`tracer.execute.kernels`).
The shapes a point's op saw in the call that computed the compared window: :func:`call_shapes`; an
origin's JSON record (op, shapes in both runs, counts, class, kernels, float64 replay):
:func:`origin_facts`, which the sentence of :func:`tracer.report.origins.origin_line` says.

Classes of a differing point:

=============================  ===============================================================
``shape-driven kernel switch``  an origin (its inputs are bit-identical) whose kernels differ
                                between the runs while its input shapes differ: the seed's
                                mechanism (another tile or split-K for another GEMM M)
``kernel switch``               the same, with identical shapes (e.g. another attention backend)
``same kernel, different bits`` an origin whose kernels are the same in both runs: run-to-run
                                non-determinism (atomics, split-K reductions in global memory),
                                level 0 of the hierarchy. On the CPU the comparable "kernels" are
                                aten ops, so this reads ``same aten ops, different bits``: the
                                CPU library's tile and thread partition are not visible
``born in an earlier pass``     a ``kv_cache`` origin whose differing rows were computed before
                                the compared window (the cached-prefix pass, not traced op by op)
``origin``                      an origin whose kernels were not recorded (run with --kernels)
``inherited``                   a propagated point: its inputs already differ
=============================  ===============================================================
"""

from __future__ import annotations

from typing import Any

from tracer.execute import kernels as _k
from tracer.execute.kinds import CACHE_KINDS, PointKind

CLASSES = ("shape-driven kernel switch", "kernel switch", "same kernel, different bits", "born in an earlier pass",
           "origin", "inherited")


def window_calls(calls: list[dict[str, Any]], positions: tuple[int, int]) -> list[dict[str, Any]]:
    """The forward calls that computed compared positions (all of them with ``--positions all``)."""
    hit = [c for c in calls if c.get("positions") and c["positions"][0] < positions[1] and c["positions"][1] > positions[0]]
    return hit or (calls[-1:] if calls else [])


def merged_kernels(calls: list[dict[str, Any]], positions: tuple[int, int]) -> dict[str, Any] | None:
    """The kernels of every call that computed compared positions, counts summed; None when the
    run recorded no kernels for this point."""
    picked = [c["kernels"] for c in window_calls(calls, positions) if "kernels" in c]
    if not picked:
        return None
    out: dict[str, dict[str, int]] = {"device": {}, "ops": {}}
    for k in picked:
        for part in ("device", "ops"):
            for item in k.get(part) or []:
                out[part][item["name"]] = out[part].get(item["name"], 0) + int(item["count"])
    return {part: [{"name": n, "count": v} for n, v in d.items()] for part, d in out.items()}


def _shapes(calls: list[dict[str, Any]], positions: tuple[int, int]) -> list:
    return [c.get("in") for c in window_calls(calls, positions)]


def classify(p: Any, positions: tuple[int, int]) -> dict[str, Any] | None:
    """The class of a differing point and the kernels of both runs.

    Returns:
        None for a bit-identical point; else ``{"class": one of CLASSES, "kernels_a": text,
        "kernels_b": text, "compared_by": "device"|"ops"|"none"}``.
    """
    if not p.diverged:
        return None
    ka, kb = merged_kernels(p.calls_a, positions), merged_kernels(p.calls_b, positions)
    out = {"kernels_a": _k.summarize(ka), "kernels_b": _k.summarize(kb), "compared_by": "none"}
    if not p.origin:
        return dict(out, **{"class": "inherited"})
    if p.kind == PointKind.KV_CACHE and p.n_diff_prefix and p.diff.n_diff == p.n_diff_prefix:
        return dict(out, **{"class": "born in an earlier pass"})
    if ka is None or kb is None:
        return dict(out, **{"class": "origin"})
    (na, by_a), (nb, by_b) = _k.main_names(ka), _k.main_names(kb)
    by = by_a if by_a == by_b else "ops"
    if by_a != by_b:
        na, nb = _k.main_names({"ops": ka.get("ops")})[0], _k.main_names({"ops": kb.get("ops")})[0]
    out["compared_by"] = by
    if na != nb:
        same_shapes = _shapes(p.calls_a, positions) == _shapes(p.calls_b, positions)
        return dict(out, **{"class": "kernel switch" if same_shapes else "shape-driven kernel switch"})
    return dict(out, **{"class": "same kernel, different bits"})


def kernel_rows(calls: list[dict[str, Any]], positions: tuple[int, int]) -> list[dict[str, Any]] | None:
    """The JSON ``kernels_a``/``kernels_b`` of one point: every kernel (count, parsed fields) of the
    calls that computed compared positions; None when not recorded."""
    k = merged_kernels(calls, positions)
    return None if k is None else _k.rows(k)


def _window_call(calls: list[dict[str, Any]], positions: tuple[int, int]) -> dict[str, Any] | None:
    """The (last) forward call that computed positions of the compared window."""
    return (window_calls(calls, positions) or [None])[-1]


def _prod(xs: list[int]) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def call_shapes(p: Any, calls: list[dict[str, Any]], positions: tuple[int, int]) -> dict[str, Any]:
    """The shapes the op of ``p`` saw in the call that computed the compared window.

    Returns:
        ``{}`` if unknown; for a Linear ``{"M", "N", "K"}`` (GEMM: M = product of the input's
        leading dims, K its last, N the output's last); for the attention core ``{"queries",
        "keys", "width"}``; for a ``kv_cache`` ``{"positions": [first, stop]}``; otherwise
        ``{"rows", "width"}`` of the captured tensor's source.
    """
    call = _window_call(calls, positions)
    if call is None:
        return {}
    ins, outs = call.get("in") or [], call.get("out") or []
    ins, outs = ([ins] if ins and isinstance(ins[0], int) else ins), ([outs] if outs and isinstance(outs[0], int) else outs)
    ins, outs = [x for x in ins if x], [x for x in outs if x]  # one flat shape (the spec's example); no None
    if p.kind in CACHE_KINDS:
        return {"positions": list(call["positions"]), **({"parts": outs} if p.kind == PointKind.STATE else {})}
    if p.kind == PointKind.ATTENTION_CORE and ins:
        return {"queries": _prod(ins[0][:-1]), "keys": int(call["positions"][1]), "width": int(ins[0][-1])}
    if p.kind in (PointKind.LINEAR,) and ins and outs:
        return {"M": _prod(ins[0][:-1]), "N": int(outs[0][-1]), "K": int(ins[0][-1])}
    if p.kind == PointKind.LOGITS and ins and outs:
        return {"M": _prod(ins[0][:-1]), "N": int(outs[0][-1]), "K": int(ins[0][-1])}
    src = ins[0] if p.kind in (PointKind.ATTENTION_CORE, PointKind.MLP_HIDDEN) and ins else (outs[0] if outs else None)
    if not src:
        return {}
    return {"rows": _prod(src[:-1]), "width": int(src[-1])}


def origin_facts(p: Any, c: Any) -> dict[str, Any]:
    """The JSON record of one origin, as data: name, kind, op, the shapes it saw in both runs,
    counts, its origin class, kernels and float64 replay (the document's ``origins``; the
    sentence that says it for people is :func:`tracer.report.origins.origin_line`)."""
    return {"name": p.name, "kind": p.kind, "op": p.op,
            "shapes_a": call_shapes(p, p.calls_a, c.positions), "shapes_b": call_shapes(p, p.calls_b, c.positions),
            "n_diff": p.diff.n_diff, "n_diff_prefix": p.n_diff_prefix, "max_ulp": p.diff.max_ulp,
            "max_ulp_mag": p.diff.max_ulp_mag, "max_abs_diff": p.diff.max_abs_diff,
            "class": (classify(p, c.positions) or {}).get("class"),
            "kernels_a": kernel_rows(p.calls_a, c.positions), "kernels_b": kernel_rows(p.calls_b, c.positions),
            "replay": (c.op_replay[p.name].to_dict() if c.op_replay and p.name in c.op_replay else None)}
