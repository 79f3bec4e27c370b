"""Why a capture point differs: which kernels ran in each run, and the finer origin class.

Pure functions of a compared point (:class:`tracer.diff.result.PointResult`, duck-typed: ``diverged``,
``origin``, ``kind``, ``calls_a``, ``calls_b``, ``n_diff_prefix``, ``diff``) and the compared
positions. Kernel lists come from ``calls[k]["kernels"]`` (``--kernels``, :mod:`tracer.execute.kernels`).

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
from tracer.execute.kinds import PointKind

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
