"""A sweep in a few lines for people: per block size, which lengths diverge, from where, how much."""

from __future__ import annotations

from typing import Any

from tracer.store.sweepfile import compress_ranges


def sweep_summary_lines(result: Any) -> list[str]:
    """A few lines for people: per block size, which lengths diverge, from which point at which
    lengths (``model.layers.3 (N=17..20, 64)``), how much."""
    lines = []
    if not getattr(result, "verified", True):
        lines.append("note: a format-1 sweep file (written before checksums): read unverified, its values range-checked only")
    for b in result.params.get("block_sizes", []):
        rows = [r for r in result.rows if r.block_size == b]
        if not rows:
            lines.append(f"block size {b}: no finished points")
            continue
        div = [r for r in rows if r.diverged]
        flips = [r for r in rows if r.argmax_flips]
        lines.append(f"block size {b}: {len(div)} of {len(rows)} lengths diverge, "
                     f"{len(flips)} with argmax flips")
        if div:
            lines.append(f"  diverging lengths: {compress_ranges([r.length for r in div])}")
            at: dict[str, list[int]] = {}  # first divergent point -> the lengths it is first at
            for r in div:
                at.setdefault(result.point_name(r.first_divergent) or "?", []).append(r.length)
            common = sorted(at.items(), key=lambda kv: (-len(kv[1]), result.points.index(kv[0]) if kv[0] in result.points else 0))
            lines.append("  first divergent at: " + "; ".join(f"{n} (N={compress_ranges(ns)})" for n, ns in common[:6])
                         + (f"; ... ({len(common)} points)" if len(common) > 6 else ""))
            worst = max(div, key=lambda r: r.logits_max_abs_diff)
            lines.append(f"  max |logit diff| {worst.logits_max_abs_diff:.4g} at N={worst.length}; "
                         f"last-layer differing fraction up to {max(r.last_layer_fraction for r in div):.3g}")
        if flips:
            lines.append(f"  argmax flips at: {compress_ranges([r.length for r in flips])}")
    return lines


