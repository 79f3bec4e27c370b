"""A sweep's divergence map: which prompt lengths diverge, from which capture point, how much."""

from __future__ import annotations

from typing import Any

import numpy as np

from tracer.errors import TracerError
from tracer.execute.kinds import PointKind
from tracer.report.figures.common import literal_text, LABEL_ZERO, _figure, _log_norm, _plt, compact_name


def sweep_data(result: Any, block_size: int | None = None) -> dict[str, Any]:
    """Arrays behind :func:`sweep_figure` for one block size (default: the first).

    Returns:
        ``{"lengths": int (L,), "names": [C], "max_abs_diff": float64 (C, L),
        "logits_max_abs_diff": float64 (L,), "argmax_flips": int (L,), "first_divergent": int (L,)}``
        with lengths sorted ascending.
    """
    bs = result.params.get("block_sizes") or sorted({r.block_size for r in result.rows})
    b = bs[0] if block_size is None else block_size
    rows = result.rows_at(b)
    c = len(result.points)
    return {
        "block_size": b,
        "lengths": np.asarray([r.length for r in rows], dtype=np.int64),
        "names": list(result.points),
        "max_abs_diff": np.asarray([r.max_abs_diff for r in rows], dtype=np.float64).T.reshape(c, len(rows)),
        "logits_max_abs_diff": np.asarray([r.logits_max_abs_diff for r in rows], dtype=np.float64),
        "argmax_flips": np.asarray([r.argmax_flips for r in rows], dtype=np.int64),
        "first_divergent": np.asarray([r.first_divergent for r in rows], dtype=np.int64),
    }


def _edges(values: np.ndarray) -> np.ndarray:
    """Cell edges for possibly uneven sorted centres (pcolormesh): contiguous, halfway between
    neighbours; :func:`measured_spans` says which part of each cell was measured."""
    v = values.astype(np.float64)
    if v.size == 1:
        return np.array([v[0] - 0.5, v[0] + 0.5])
    mid = (v[1:] + v[:-1]) / 2
    return np.concatenate([[v[0] - (mid[0] - v[0])], mid, [v[-1] + (v[-1] - mid[-1])]])


#: a measured length's column is at least this fraction (1/VISIBLE) of the length axis wide
VISIBLE = 80


def measured_spans(lengths: np.ndarray) -> np.ndarray:
    """``(L, 2)`` x-ranges drawn for the measured prompt lengths: each length is a column as wide as
    the finest spacing of the sweep (``1`` for ``17:512``, ``16`` for ``16:1024:16``; at least
    1/:data:`VISIBLE` of the axis, so a lone length stays visible), centred on it and never reaching
    halfway to a neighbour. On an evenly spaced grid the columns touch; between unevenly spaced lengths the
    axis shows the gaps (not measured) instead of stretching a cell over them."""
    v = np.asarray(lengths, dtype=np.float64)
    if v.size == 0:
        return np.zeros((0, 2))
    gaps = np.diff(v)
    finest = float(gaps.min()) if gaps.size else 1.0
    half = np.full(v.size, max(finest, (v[-1] - v[0]) / VISIBLE if v.size > 1 else 1.0) / 2)
    if gaps.size:
        half = np.minimum(half, np.concatenate([[np.inf], gaps / 2]))
        half = np.minimum(half, np.concatenate([gaps / 2, [np.inf]]))
    return np.stack([v - half, v + half], axis=1)


def _hide_unmeasured(ax: Any, lengths: np.ndarray) -> tuple[float, float]:
    """Cover what a contiguous mesh would paint between measured lengths (hatched grey, "not
    measured"); return the x-limits: the measured range and the columns' half-widths, no more."""
    spans = measured_spans(lengths)
    pad = 0.01 * float(spans[-1, 1] - spans[0, 0])  # the outermost markers of the top panel stay inside
    lo, hi = float(spans[0, 0]) - pad, float(spans[-1, 1]) + pad
    gaps = [(lo, spans[0, 0])] + [(spans[i, 1], spans[i + 1, 0]) for i in range(len(lengths) - 1)] + [(spans[-1, 1], hi)]
    for a, b in gaps:
        if b - a > 1e-9:
            ax.axvspan(a, b, facecolor="#eeeeee", edgecolor="#cccccc", hatch="//", lw=0, zorder=3)
    return lo, hi


@literal_text
def sweep_figure(result: Any, *, title: str | None = None, figsize: tuple[float, float] | None = None):
    """The divergence map of a sweep.

    Top: max |logit diff| per measured prompt length, as points (log y; bit-identical lengths
    drawn on a ``0`` row at the bottom as hollow green circles), one series per block size,
    argmax flips marked ``x``.
    Bottom, one block size: capture points × lengths heat map of max |A − B| (white:
    bit-identical) with the first divergent point of each length dotted. Several block sizes:
    block sizes × lengths heat map of max |logit diff| (grey: that block size did not run that length).
    Only measured lengths are drawn: each is a column as wide as the sweep's finest spacing
    (:func:`measured_spans`), the axis spans the measured range, and the gaps between unevenly
    spaced lengths are hatched "not measured".

    Returns:
        a matplotlib Figure; ``fig.tracer_data`` holds the arrays drawn.

    Raises:
        TracerError: the sweep has no finished points.
    """
    plt = _plt()
    if not result.rows:
        raise TracerError("the sweep has no finished points yet; run 'tracer sweep' first")
    bs = list(result.params.get("block_sizes") or sorted({r.block_size for r in result.rows}))
    bs = [b for b in bs if any(r.block_size == b for r in result.rows)]
    fig, (ax1, ax2) = _figure(2, 1, figsize=figsize or (12.0, 8.5), layout="constrained",
                              gridspec_kw={"height_ratios": [1, 2.2]}, sharex=True)
    all_lengths = sorted({r.length for r in result.rows})
    per_block = {b: sweep_data(result, b) for b in bs}
    pos = [v for d in per_block.values() for v in d["logits_max_abs_diff"] if v > 0 and np.isfinite(v)]
    zero_y = min(pos) / 8 if pos else 1e-3
    for b, d in per_block.items():
        y = np.where(d["logits_max_abs_diff"] > 0, d["logits_max_abs_diff"], np.nan)
        line, = ax1.plot(d["lengths"], y, ".", ms=4, label=f"block {b}")
        ident = d["lengths"][d["logits_max_abs_diff"] == 0]
        ax1.plot(ident, np.full(ident.size, zero_y), "o", ms=3.5, mfc="none", mec="tab:green", ls="none",
                 label=LABEL_ZERO if b == bs[0] else None)
        fl = d["argmax_flips"] > 0
        if fl.any():
            ax1.plot(d["lengths"][fl], y[fl], "x", color="black", ms=6, label="argmax flip" if b == bs[0] else None)
    ax1.set_yscale("log")
    ticks = [t for t in ax1.get_yticks() if t > zero_y * 2]
    ax1.axhline(zero_y * 2, color="gray", lw=0.6, ls=":")
    ax1.set_ylim(zero_y / 2, None)
    ax1.set_yticks([zero_y, *ticks])
    ax1.set_yticklabels(["0", *(f"{t:g}" for t in ticks)])
    ax1.set_ylabel("max |logit diff|")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    cmap = plt.get_cmap("magma_r").with_extremes(bad="white")
    if len(bs) == 1:
        d = per_block[bs[0]]
        vals = d["max_abs_diff"].copy()
        vals[np.isinf(vals)] = np.nanmax(np.where(np.isfinite(vals), vals, 0)) or 1.0
        norm = _log_norm(vals)
        c = vals.shape[0]
        mesh = ax2.pcolormesh(_edges(d["lengths"]), np.arange(c + 1) - 0.5, np.ma.masked_where(vals <= 0, vals),
                              cmap=cmap, norm=norm, shading="flat")
        fd = d["first_divergent"] >= 0
        ax2.plot(d["lengths"][fd], d["first_divergent"][fd], ".", color="deepskyblue", ms=3, label="first divergent")
        ax2.set_ylim(c - 0.5, -0.5)
        kinds = list(getattr(result, "kinds", None) or [])
        ax2.set_yticks(range(c))
        ax2.set_yticklabels([compact_name(nm, kinds[i] if i < len(kinds) else None) for i, nm in enumerate(d["names"])],
                            fontsize=max(4.5, min(8.0, 400 / max(1, c))))
        for i, k in enumerate(kinds[:c]):
            if k == PointKind.KV_CACHE:
                ax2.get_yticklabels()[i].set_color("tab:purple")
        if norm is not None:
            fig.colorbar(mesh, ax=ax2, label="max |A − B| (log)", location="right")
            ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, -0.08), borderaxespad=0)
        ax2.set_ylabel("capture point")
        lo, hi = _hide_unmeasured(ax2, d["lengths"])
        data = {"kind": "layers", "lengths": d["lengths"], "values": d["max_abs_diff"], "names": d["names"]}
    else:
        grid = np.zeros((len(bs), len(all_lengths)))
        grid[:] = np.nan
        col = {n: i for i, n in enumerate(all_lengths)}
        for i, b in enumerate(bs):
            for n, v in zip(per_block[b]["lengths"], per_block[b]["logits_max_abs_diff"]):
                grid[i, col[int(n)]] = v
        shown = np.where(np.isinf(grid), np.nanmax(np.where(np.isfinite(grid), grid, 0)) or 1.0, grid)
        norm = _log_norm(np.nan_to_num(shown))
        mesh = ax2.pcolormesh(_edges(np.asarray(all_lengths)), np.arange(len(bs) + 1) - 0.5,
                              np.ma.masked_where(~(shown > 0), shown), cmap=cmap, norm=norm, shading="flat")
        if np.isnan(grid).any():  # a block size that did not run a length: grey, not "bit-identical" white
            ax2.pcolormesh(_edges(np.asarray(all_lengths)), np.arange(len(bs) + 1) - 0.5,
                           np.ma.masked_where(~np.isnan(grid), np.ones_like(grid)), cmap="Greys", vmin=0, vmax=4,
                           shading="flat")
        lo, hi = _hide_unmeasured(ax2, np.asarray(all_lengths))
        ax2.set_yticks(range(len(bs)))
        ax2.set_yticklabels([str(b) for b in bs])
        ax2.set_ylabel("KV block size")
        if norm is not None:
            fig.colorbar(mesh, ax=ax2, label="max |logit diff| (log; white: bit-identical)")
        data = {"kind": "block_sizes", "lengths": np.asarray(all_lengths), "values": grid, "block_sizes": bs}
    ax2.set_xlim(lo, hi)  # the measured range (sharex: the top panel too)
    uneven = len(set(np.diff(all_lengths).tolist())) > 1
    ax2.set_xlabel("prompt length N (tokens)" + ("; hatched: lengths not measured" if uneven else ""))
    p = result.params
    n_div = sum(r.diverged for r in result.rows)
    ax1.set_title(title or (f"{p.get('scenario')} sweep · {p.get('model')} · {p.get('dtype')} · {p.get('device')}"
                            f"{' · mitigation ' + str(p['mitigation']) if p.get('mitigation') else ''}\n"
                            f"{n_div} of {len(result.rows)} points diverge"
                            f"{'' if result.complete else ' (sweep unfinished)'}"), fontsize=9)
    fig.tracer_data = data
    return fig
