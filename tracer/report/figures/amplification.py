"""The amplification figure: max |A − B| per capture point in execution order (the table as a picture)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tracer.execute.kinds import LAYER_KINDS, PointKind
from tracer.report.figures.common import literal_text, LABEL_ZERO, _figure, _tick_labels, _title

#: labels of the amplification figure's two lines (tests and notebooks find them by label)
LABEL_ABS, LABEL_FRAC = "max |diff|", "differing fraction"
#: label of the KV-cache series
LABEL_KV = "KV cache max |diff|"


def amplification_data(comparison: Any) -> dict[str, Any]:
    """The data behind :func:`amplification_figure`, one entry per capture point, logits last.

    Returns:
        ``{"names": [str], "kinds": [str], "max_abs_diff": float64 (C,), "fraction": float64 (C,),
        "origin": bool (C,), "zero": bool (C,) (max |diff| = 0), "logits_index": int | None,
        "series": {"points": int (P,), "kv_cache": int (K,)}}``: ``series`` splits the indices
        into the residual-stream/sublayer/logits series and the per-layer KV-cache series.
    """
    names, kinds, mad, frac, origin = [], [], [], [], []
    for p in comparison.points:
        names.append(p.name)
        kinds.append(p.kind)
        mad.append(float(p.diff.max_abs_diff))
        frac.append(p.diff.n_diff / p.diff.n_total if p.diff.n_total else 0.0)
        origin.append(bool(getattr(p, "origin", False)))
    logits_index = None
    if comparison.logits is not None:
        d = comparison.logits.tensor
        logits_index = len(names)
        names.append(comparison.logits_name or "logits")
        kinds.append(PointKind.LOGITS)
        mad.append(float(d.max_abs_diff))
        frac.append(d.n_diff / d.n_total if d.n_total else 0.0)
        origin.append(bool(getattr(comparison, "logits_origin", False)))
    mad_a = np.asarray(mad, dtype=np.float64)
    kv = np.asarray([i for i, k in enumerate(kinds) if k == PointKind.KV_CACHE], dtype=np.int64)
    rest = np.asarray([i for i, k in enumerate(kinds) if k != PointKind.KV_CACHE], dtype=np.int64)
    return {"names": names, "kinds": kinds, "max_abs_diff": mad_a,
            "fraction": np.asarray(frac, dtype=np.float64), "origin": np.asarray(origin, dtype=bool),
            "zero": mad_a == 0, "logits_index": logits_index, "series": {"points": rest, "kv_cache": kv}}



def _panel(ax: Any, data: dict[str, Any], idx: np.ndarray, label: str, color: str, zero_y: float) -> None:
    """One series of max |diff| over the points ``idx`` (x = 0..len(idx)-1): a log line with gaps
    at zeros, and the zeros drawn explicitly as hollow markers on a separate ``0`` row below."""
    x = np.arange(idx.size)
    mad = data["max_abs_diff"][idx]
    ax.plot(x, np.where(mad > 0, mad, np.nan), "o-", color=color, ms=3.5, lw=1.4, label=label)
    z = data["zero"][idx]
    ax.plot(x[z], np.full(int(z.sum()), zero_y), "o", ms=4, mfc="none", mec="tab:green", ls="none",
            label=LABEL_ZERO)
    org = np.flatnonzero(data["origin"][idx])
    if org.size:
        ax.scatter(x[org], np.where(mad[org] > 0, mad[org], zero_y), s=140, facecolors="none",
                   edgecolors="black", linewidths=1.5, zorder=5, label="origin")
    ax.set_yscale("log")
    ax.axhline(zero_y * 2, color="gray", lw=0.6, ls=":")
    ticks = [t for t in ax.get_yticks() if t > zero_y * 2]
    ax.set_ylim(zero_y / 2, None)
    ax.set_yticks([zero_y, *ticks])
    ax.set_yticklabels(["0", *(f"{t:g}" for t in ticks)])
    ax.set_xlim(-0.5, max(0, idx.size - 0.5))
    ax.grid(True, which="major", axis="y", alpha=0.3)
    kinds = [data["kinds"][i] for i in idx]
    _tick_labels(ax, [data["names"][i] for i in idx], kinds=kinds, keep=[int(i) for i in org],
                 compact=bool(kinds) and all(k == PointKind.KV_CACHE for k in kinds))


@literal_text
def amplification_figure(comparison: Any, *, title: str | None = None, figsize: tuple[float, float] | None = None):
    """Max |diff| (log y) per capture point in execution order, the KV caches as a separate panel.

    Panel 0: residual stream (and sublayers) and the logits, with the differing fraction on a
    twin axis (line :data:`LABEL_FRAC`); panel 1 (when KV caches were captured): each layer's KV
    cache (line :data:`LABEL_KV`). In both, max |diff| (:data:`LABEL_ABS`) has a gap where a point
    is bit-identical and the zeros are drawn explicitly (:data:`LABEL_ZERO`) on a ``0`` row below
    the log axis; origins are circled; the logits point has a dotted vertical line. Labels are
    thinned to the landmarks with sublayers; the legend sits outside the axes.

    Returns:
        a matplotlib Figure; ``fig.tracer_data`` is :func:`amplification_data` plus ``argmax_flips``.
    """
    data = amplification_data(comparison)
    pts, kv = data["series"]["points"], data["series"]["kv_cache"]
    pos = data["max_abs_diff"][(data["max_abs_diff"] > 0) & np.isfinite(data["max_abs_diff"])]
    zero_y = float(pos.min()) / 8 if pos.size else 1e-3
    n = max(pts.size, kv.size)
    width = figsize[0] if figsize else max(7.0, min(18.0, 0.22 * n + 4))
    nrows = 2 if kv.size else 1
    fig, axes = _figure(nrows, 1, figsize=figsize or (width, 4.4 + 2.8 * (nrows - 1)), layout="constrained",
                        gridspec_kw={"height_ratios": [1.4, 1]} if nrows == 2 else None)
    axes = list(np.atleast_1d(axes))
    ax = axes[0]
    _panel(ax, data, pts, LABEL_ABS, "tab:red", zero_y)
    ax.set_ylabel("max |A − B| (log)")
    ax2 = ax.twinx()
    ax2.plot(np.arange(pts.size), data["fraction"][pts], "s--", color="tab:blue", ms=2.5, lw=1, alpha=0.8,
             label=LABEL_FRAC)
    ax2.set_ylabel("differing fraction")
    ax2.set_ylim(-0.02, 1.02)
    if data["logits_index"] is not None:
        xl = int(np.flatnonzero(pts == data["logits_index"])[0])
        ax.axvline(xl, color="gray", ls=":", lw=1)
        ax.annotate("logits", (xl, 1.0), xycoords=("data", "axes fraction"), ha="right", va="top", fontsize=8,
                    color="gray", rotation=90)
    subs = any(k not in LAYER_KINDS for k in data["kinds"])
    ax.set_title("residual stream" + (" and sublayers" if subs else "") + " · logits", fontsize=9)
    if kv.size:
        _panel(axes[1], data, kv, LABEL_KV, "tab:purple", zero_y)
        axes[1].set_ylabel("max |A − B| (log)")
        axes[1].set_title("KV cache of each layer (all N positions)", fontsize=9)
    if not pos.size:
        ax.text(0.5, 0.5, "bit-identical at every capture point", transform=ax.transAxes, ha="center",
                va="center", color="green")
    handles, labels = [], []
    for a in [*axes, ax2]:
        for h, lab in zip(*a.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=8, frameon=False)
    flips = len(comparison.logits.argmax_flips) if comparison.logits is not None else 0
    fig.suptitle(title or f"{_title(comparison)}\n{comparison.verdict()}", fontsize=9)
    fig.tracer_data = {**data, "argmax_flips": flips}
    return fig
