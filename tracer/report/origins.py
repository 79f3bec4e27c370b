"""The sentences that say a comparison's origins for people: the op, the shapes it saw in both
runs (GEMM M×N×K, queries and keys, rows and width), how much differs, where a KV cache's
difference was born, the kernels that ran, the float64 replay.

The comparison holds each origin as data (:func:`tracer.diff.provenance.origin_facts`,
:func:`tracer.diff.provenance.call_shapes`); this module turns it into :func:`origin_line` and the JSON
record with its ``text`` (:func:`origin_record`), which the terminal table, markdown, HTML and JSON use.
"""

from __future__ import annotations

from typing import Any

from tracer.diff.provenance import call_shapes, classify, origin_facts
from tracer.diff.result import NAN_PAYLOAD, Comparison, PointResult
from tracer.execute.kinds import CACHE_KINDS, PointKind


def _chunk_of(chunks: list | None, pos: int) -> int | None:
    for start, stop in chunks or []:
        if start <= pos < stop:
            return stop - start
    return None


def origin_record(p: PointResult, c: Comparison) -> dict[str, Any]:
    """The JSON record of one origin as ``tracer run --format json`` shows it: its data
    (:func:`tracer.diff.provenance.origin_facts`) with the one-line ``text`` after the counts."""
    facts = origin_facts(p, c)
    at = list(facts).index("max_abs_diff") + 1
    items = list(facts.items())
    return dict(items[:at] + [("text", origin_line(p, c))] + items[at:])


def origin_lines(c: Comparison) -> list[str]:
    """One line per origin of ``c``: op type, shapes in both runs, how much differs (:func:`origin_line`)."""
    return [origin_line(p, c) for p in c.origin_points()]


def class_text(info: dict[str, Any], run_a: str = "A", run_b: str = "B") -> str:
    """``run A nvjet 32x64 (no split-K) vs run B nvjet 64x8 split-K + splitKreduce: shape-driven
    kernel switch`` (the kernel part left out when no kernels were recorded)."""
    cls = info["class"]
    if info["compared_by"] == "ops" and cls == "same kernel, different bits":
        cls = "same aten ops, different bits (the CPU library's GEMM tiles and thread split are not visible)"
    if info["kernels_a"] == "-" and info["kernels_b"] == "-":
        return cls if cls != "origin" else "kernels not recorded (--kernels names them)"
    if info["kernels_a"] == info["kernels_b"]:
        return f"both runs ran {info['kernels_a']}: {cls}"
    return f"run {run_a} {info['kernels_a']} vs run {run_b} {info['kernels_b']}: {cls}"


def _each_call(p: PointResult, calls: list[dict[str, Any]], positions: tuple[int, int]) -> list[dict[str, Any]]:
    """:func:`call_shapes` of every call that computed compared positions (several with --positions all)."""
    hit = [cl for cl in calls if cl.get("positions") and cl["positions"][0] < positions[1] and cl["positions"][1] > positions[0]]
    return [call_shapes(p, [cl], positions) for cl in hit] or [call_shapes(p, calls, positions)]


def _shape_text(p: PointResult, c: Comparison) -> str:
    a, b = call_shapes(p, p.calls_a, c.positions), call_shapes(p, p.calls_b, c.positions)
    ea, eb = _each_call(p, p.calls_a, c.positions), _each_call(p, p.calls_b, c.positions)

    def gemm(xs: list[dict[str, Any]]) -> str:
        return " + ".join(f"{x.get('M', '?')}×{x.get('N', '?')}×{x.get('K', '?')}" for x in xs)

    def each(xs: list[dict[str, Any]], key: str) -> str:
        return "+".join(str(x.get(key, "?")) for x in xs)

    if "M" in a and "M" in b:
        return f"GEMM M×N×K {gemm(ea)} in {c.run_a} vs {gemm(eb)} in {c.run_b}"
    if "queries" in a and "queries" in b:
        return (f"queries {each(ea, 'queries')} vs {each(eb, 'queries')}, keys {each(ea, 'keys')} vs "
                f"{each(eb, 'keys')}, width {a['width']}")
    if p.kind == PointKind.KV_CACHE:
        first, stop = (a.get("positions") or [0, 0])
        text = f"positions {first}..{stop - 1}"
        if p.n_diff_prefix:
            ma = _chunk_of(c.facts.get("chunks_a"), first)
            mb = _chunk_of(c.facts.get("chunks_b"), first)
            if ma is not None and mb is not None:
                text += (f"; positions {first}..{c.positions[0] - 1} computed by a forward pass of "
                         f"{ma} tokens in {c.run_a} vs {mb} in {c.run_b}")
        return text
    if p.kind == PointKind.STATE:
        parts = " + ".join("×".join(map(str, x)) for x in a.get("parts") or [])
        return f"after position {(a.get('positions') or [0, 0])[1] - 1}" + (f", {parts}" if parts else "")
    if "rows" in a and "rows" in b:
        return f"rows {each(ea, 'rows')} vs {each(eb, 'rows')}, width {a['width']}"
    return ""


def origin_line(p: PointResult, c: Comparison) -> str:
    """``model.layers.21.post_attention_layernorm (RMSNorm, rows 250 vs 10, width 576): 8 elements, max 1 ULP``.

    Adds where the difference sits for a ``kv_cache`` point (before the window: born in the
    earlier forward pass, not traced op by op) and, for a decoder layer origin at layers
    granularity, the hint to re-run with ``--granularity sublayers``.
    """
    op = "KVCache" if p.kind == PointKind.KV_CACHE else p.op
    shapes = _shape_text(p, c)
    head = f"{p.name} ({op}{', ' + shapes if shapes else ''})"
    d = p.diff
    ulp = f"max {d.max_ulp} ULP" if d.max_ulp <= 16 else f"max {d.max_ulp_mag:.3g} ULP of the larger magnitude"
    body = f"{d.n_diff:,} element{'s' if d.n_diff != 1 else ''}, {ulp}, max |Δ| {d.max_abs_diff:.3g}"
    if d.nan_payload_only:
        body = f"{d.n_diff:,} element{'s' if d.n_diff != 1 else ''}: {NAN_PAYLOAD}"
    tail = ""
    if p.kind == PointKind.KV_CACHE and p.n_diff_prefix:
        inside = d.n_diff - p.n_diff_prefix
        tail = (f"; {p.n_diff_prefix:,} of them before the compared window: born in the forward pass that "
                f"computed those positions (not traced op by op)" + (f", {inside:,} inside it" if inside else ""))
    subs = [q for q in c.points if q.name.startswith(p.name + ".") and q.kind not in CACHE_KINDS]
    if p.kind == PointKind.LAYER and not subs:
        tail = f"; origin within {p.name} (" + ("sublayers need a family descriptor: hooks/README.md)"
                                               if c.facts.get("family_inferred") else
                                               "use --granularity sublayers to find the op)")
    if p.kind == PointKind.STATE:
        tail = ("; the recurrent state mixes every position, those of the prefix pass included"
                + ("" if [q for q in c.points if q.name.startswith(p.name.rsplit(".", 1)[0] + ".")
                          and q.kind not in CACHE_KINDS] else " (use --granularity sublayers for the mixer's ops)"))
    if p.kind == PointKind.KV_CACHE and not [q for q in c.points if q.name.startswith(p.name.rsplit(".", 1)[0] + ".")
                                     and q.kind not in (PointKind.KV_CACHE,)] and p.diff.n_diff - (p.n_diff_prefix or 0) > 0:
        tail += "; inside the window: origin within the layer's K/V projection (use --granularity sublayers)"
    info = classify(p, c.positions)
    if info is not None and (info["kernels_a"] != "-" or info["kernels_b"] != "-"):
        tail += f"; {class_text(info, c.run_a, c.run_b)}"
    if c.op_replay and p.name in c.op_replay:
        tail += f"; replay in float64: {c.op_replay[p.name].text}"
    return f"{head}: {body}{tail}"
