"""Figures (matplotlib, imported lazily; the optional extra ``plot``).

- :func:`amplification_figure`: per capture point in execution order, max |diff| (log scale)
  and the differing fraction, origin points and the logits marked: the seed's table as a picture.
- :func:`heatmap_figure`: capture points × compared positions, max |diff| per position (log
  colour scale): does divergence start at one token and spread?
- :func:`ulp_figure`: the ULP-distance histogram of a few capture points.
- :func:`sweep_figure`: a sweep's divergence map (which lengths diverge, from which layer, how much).

Every function returns a :class:`matplotlib.figure.Figure` and never shows it; outside Jupyter
the Agg backend is used. :func:`save_figure` writes one without clobbering existing files.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from tracer.dtypes import INT_VIEW
from tracer.errors import TracerError

KINDS = ("amplification", "heatmap", "ulp", "sweep")
SUFFIXES = (".png", ".svg", ".pdf")
#: labels of the amplification figure's two lines (tests and notebooks find them by label)
LABEL_ABS, LABEL_FRAC = "max |diff|", "differing fraction"
_ELEMENTS_PER_CHUNK = 1 << 21


def _plt():
    """matplotlib.pyplot, with the Agg backend unless pyplot is already in use or we are in IPython.

    Raises:
        TracerError: matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        raise TracerError("matplotlib is not installed; pip install 'tracer[plot]' (or matplotlib) to draw figures") from None
    if "matplotlib.pyplot" not in sys.modules and "IPython" not in sys.modules and "ipykernel" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(nrows: int = 1, ncols: int = 1, **kw: Any):
    """A new figure and axes, detached from pyplot's registry (so Jupyter shows it once, when returned)."""
    plt = _plt()
    fig, axes = plt.subplots(nrows, ncols, **kw)
    plt.close(fig)
    return fig, axes


def compact_name(name: str, kind: str | None = None) -> str:
    """``model.layers.3.self_attn.kv_cache`` → ``L3 KV``, ``model.layers.3`` → ``L3``,
    ``model.layers.3.mlp.down_proj`` → ``L3 mlp.down_proj`` (dense axis labels); others as :func:`short_name`."""
    parts = short_name(name).split(".")
    # the first numbered component is the decoder layer's index (the layer list's child), whatever
    # the family calls the list (model.layers.3, transformer.h.3)
    at = next((i for i, p in enumerate(parts) if i and p.isdigit()), None)
    if at is not None:
        rest = ".".join(parts[at + 1:])
        if kind == "kv_cache" or rest.endswith("kv_cache"):
            return f"L{parts[at]} KV"
        return f"L{parts[at]}" + (f" {rest}" if rest else "")
    return short_name(name)


def short_name(name: str) -> str:
    """``model.layers.3.mlp.down_proj`` → ``layers.3.mlp.down_proj`` (axis labels)."""
    return name[len("model."):] if name.startswith("model.") else name


#: point kinds that always get an axis label when labels are thinned (sublayers)
_LANDMARKS = ("embedding", "layer", "final_norm", "logits", "kv_cache")


def thin_labels(names: Sequence[str], kinds: Sequence[str] | None = None, max_labels: int = 40,
                keep: Iterable[int] = ()) -> list[int]:
    """Indices of the points that get an axis label: all when they fit, else the ``keep`` ones
    (origins), the landmarks (layer outputs, KV caches, embedding, final norm, logits) and, when
    those still do not fit, every k-th landmark; the last point is always labelled."""
    n = len(names)
    if n <= max_labels:
        return list(range(n))
    keep = set(keep)
    marks = [i for i in range(n) if kinds is not None and kinds[i] in _LANDMARKS] or list(range(n))
    room = max(1, max_labels - len(keep) - 1)
    step = max(1, -(-len(marks) // room))
    return sorted(keep | set(marks[::step]) | {n - 1})


def _tick_labels(ax: Any, names: Sequence[str], axis: str = "x", max_labels: int = 40,
                 kinds: Sequence[str] | None = None, keep: Iterable[int] = (), compact: bool = False) -> None:
    idx = thin_labels(names, kinds, max_labels, keep)
    pos = idx
    labels = [compact_name(names[i], kinds[i] if kinds else None) if compact else short_name(names[i]) for i in idx]
    if axis == "x":
        ax.set_xticks(pos)
        ax.set_xticklabels(labels, rotation=90, fontsize=7)
    else:
        ax.set_yticks(pos)
        ax.set_yticklabels(labels, fontsize=7)


# ---------------------------------------------------------------- amplification

#: labels of the KV-cache series and of the explicit zero markers
LABEL_KV, LABEL_ZERO = "KV cache max |diff|", "bit-identical (|diff| = 0)"


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
        kinds.append("logits")
        mad.append(float(d.max_abs_diff))
        frac.append(d.n_diff / d.n_total if d.n_total else 0.0)
        origin.append(bool(getattr(comparison, "logits_origin", False)))
    mad_a = np.asarray(mad, dtype=np.float64)
    kv = np.asarray([i for i, k in enumerate(kinds) if k == "kv_cache"], dtype=np.int64)
    rest = np.asarray([i for i, k in enumerate(kinds) if k != "kv_cache"], dtype=np.int64)
    return {"names": names, "kinds": kinds, "max_abs_diff": mad_a,
            "fraction": np.asarray(frac, dtype=np.float64), "origin": np.asarray(origin, dtype=bool),
            "zero": mad_a == 0, "logits_index": logits_index, "series": {"points": rest, "kv_cache": kv}}


def _title(comparison: Any) -> str:
    f = getattr(comparison, "facts", {}) or {}
    bits = [str(comparison.scenario), str(comparison.model)]
    for key in ("dtype", "device_name", "device"):
        if f.get(key):
            bits.append(str(f[key]))
            break
    n = f.get("n_tokens")
    bits.append(f"positions {comparison.positions[0]}..{comparison.positions[1] - 1}" + (f" of {n}" if n else ""))
    return " · ".join(bits)


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
                 compact=bool(kinds) and all(k == "kv_cache" for k in kinds))


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
    ax.set_title("residual stream" + (" and sublayers" if any(k not in ("embedding", "layer", "final_norm", "logits", "kv_cache")
                                                           for k in data["kinds"]) else "") + " · logits", fontsize=9)
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


# ---------------------------------------------------------------- per-position heat map


@dataclass(frozen=True)
class PositionDiffs:
    """Max |A − B| per capture point and compared position.

    Attributes:
        names, kinds: capture points in execution order (logits last when present).
        positions: ``(start, stop)`` absolute token positions of the columns.
        values: float64 ``(C, T)``; 0 where the position's elements are bit-identical, ``inf``
            where a NaN/inf mismatch sits.
        n_diff: int64 ``(C, T)``: differing elements per point and position.
    """

    names: list[str]
    kinds: list[str]
    positions: tuple[int, int]
    values: np.ndarray
    n_diff: np.ndarray


def position_max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per position (first axis), the max |a − b| and the number of bitwise-differing elements.

    Args:
        a, b: ``(T, *feature)`` tensors of one shape and float dtype (bf16/fp16/fp32/fp64).

    Returns:
        ``(max_abs float64 (T,), n_diff int64 (T,))``; equal bits count 0; a differing pair with
        a NaN or an infinite difference counts ``inf``. Processed in row chunks (bounded memory).

    Raises:
        TracerError: shapes or dtypes differ, or an unsupported dtype.
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        raise TracerError(f"cannot compare {tuple(a.shape)} {a.dtype} with {tuple(b.shape)} {b.dtype}; "
                          "the runs used different models or dtypes")
    if a.dtype not in INT_VIEW:
        raise TracerError(f"unsupported dtype {a.dtype}; use bfloat16, float16, float32 or float64")
    t = a.shape[0] if a.dim() else 1
    a2, b2 = a.reshape(t, -1), b.reshape(t, -1)
    width = max(1, a2.shape[1])
    step = max(1, _ELEMENTS_PER_CHUNK // width)
    mx, nd = np.zeros(t, dtype=np.float64), np.zeros(t, dtype=np.int64)
    for s in range(0, t, step):
        xa, xb = a2[s:s + step], b2[s:s + step]
        differ = xa.view(INT_VIEW[a.dtype]) != xb.view(INT_VIEW[a.dtype])  # (rows, F) bool
        d = (xa.double() - xb.double()).abs()
        d = torch.where(differ, torch.nan_to_num(d, nan=float("inf")), torch.zeros_like(d))
        if d.shape[1]:
            mx[s:s + step] = d.amax(dim=1).numpy()
            nd[s:s + step] = differ.sum(dim=1).numpy()
    return mx, nd


def _position_diffs(pairs: Iterable[tuple[str, str, torch.Tensor, torch.Tensor]], positions: tuple[int, int]) -> PositionDiffs:
    names, kinds, vals, nds = [], [], [], []
    logits = None
    t = positions[1] - positions[0]
    for name, kind, ta, tb in pairs:
        if ta.dim() == 0 or ta.shape != tb.shape:
            continue  # no position axis, or not comparable
        if ta.shape[0] != t:
            if ta.shape[0] != positions[1]:
                continue  # not a window capture
            ta, tb = ta[positions[0]:], tb[positions[0]:]  # kept for all N positions (the KV cache): its window rows
        mx, nd = position_max_abs_diff(ta, tb)
        if kind == "logits":
            logits = (name, kind, mx, nd)
            continue
        names.append(name), kinds.append(kind), vals.append(mx), nds.append(nd)
    if logits is not None:
        names.append(logits[0]), kinds.append(logits[1]), vals.append(logits[2]), nds.append(logits[3])
    return PositionDiffs(names=names, kinds=kinds, positions=tuple(positions),
                         values=np.stack(vals) if vals else np.zeros((0, t)),
                         n_diff=np.stack(nds) if nds else np.zeros((0, t), dtype=np.int64))


def position_diffs_comparison(comparison: Any) -> PositionDiffs | None:
    """:class:`PositionDiffs` from the per-position data a comparison carries
    (:attr:`~tracer.diff.result.Comparison.per_position`; no tensor is read), None when it has none.
    With more compared positions than :data:`tracer.diff.positions.MAX_COLUMNS`, columns are bins of
    consecutive positions (max |Δ| and counts per bin)."""
    pp = getattr(comparison, "per_position", None)
    if not pp:
        return None
    order = sorted(range(len(pp["names"])), key=lambda i: pp["kinds"][i] == "logits")  # logits last, stable
    vals = np.asarray([[np.inf if isinstance(v, str) else v for v in pp["max_abs_diff"][i]] for i in order],
                      dtype=np.float64)
    return PositionDiffs(names=[pp["names"][i] for i in order], kinds=[pp["kinds"][i] for i in order],
                         positions=(int(pp["start"]), int(pp["stop"])), values=vals,
                         n_diff=np.asarray([pp["n_diff"][i] for i in order], dtype=np.int64))


def position_diffs_records(a: Any, b: Any) -> PositionDiffs:
    """:class:`PositionDiffs` of two in-memory :class:`~tracer.execute.records.RunRecord` objects.

    Raises:
        TracerError: the runs processed different prompts or windows.
    """
    from tracer.diff.compare import check_alignable

    check_alignable(a.name, a.token_ids, a.window, b.name, b.token_ids, b.window)
    pairs = ((n, r.kind, r.tensor, b.captures[n].tensor) for n, r in a.captures.items() if n in b.captures)
    return _position_diffs(pairs, tuple(a.window))


def position_diffs_trace(path: str | os.PathLike, run_a: str | None = None, run_b: str | None = None) -> PositionDiffs:
    """:class:`PositionDiffs` of two runs of a stored trace (default: its first two), one point at a time.

    Raises:
        TracerError: missing/corrupt trace, unknown runs, runs of different prompts.
    """
    from tracer.diff.compare import check_alignable
    from tracer.store.trace import TraceReader

    with TraceReader(path) as r:
        names = r.runs
        if run_a is None or run_b is None:
            if len(names) < 2:
                raise TracerError(f"trace {path} holds {len(names)} run(s); a heat map needs two")
            run_a, run_b = run_a or names[0], run_b or names[1]
        ra, rb = r.run(run_a, load_tensors=False), r.run(run_b, load_tensors=False)
        check_alignable(ra.name, ra.token_ids, ra.window, rb.name, rb.token_ids, rb.window)
        common = set(r.capture_names(run_b))
        pairs = ((n, r.capture_info(run_a, n)["kind"], r.tensor(run_a, n), r.tensor(run_b, n))
                 for n in r.capture_names(run_a) if n in common)
        return _position_diffs(pairs, tuple(ra.window))


def _log_norm(values: np.ndarray):
    from matplotlib.colors import LogNorm

    pos = values[(values > 0) & np.isfinite(values)]
    if pos.size == 0:
        return None
    lo, hi = float(pos.min()), float(pos.max())
    return LogNorm(vmin=lo, vmax=hi if hi > lo else lo * 10)


def heatmap_figure(diffs: PositionDiffs, *, title: str | None = None, figsize: tuple[float, float] | None = None):
    """Capture points (rows, execution order) × compared positions (columns): max |A − B|.

    Log colour scale; bit-identical cells are left white; ``inf`` cells are drawn at the top of
    the scale. The image array has shape ``(C, T)`` = ``diffs.values.shape``.

    Returns:
        a matplotlib Figure with one image on axes 0 (colour bar on axes 1 when anything differs).
    """
    plt = _plt()
    c, t = diffs.values.shape
    vals = diffs.values.copy()
    finite_max = vals[np.isfinite(vals)].max() if np.isfinite(vals).any() else 0.0
    vals[np.isinf(vals)] = finite_max if finite_max > 0 else 1.0
    masked = np.ma.masked_where(vals <= 0, vals)
    fig, ax = _figure(figsize=figsize or (min(16.0, max(9.0, 5 + 0.12 * t)), min(12.0, max(3.5, 2.5 + 0.16 * c))), layout="constrained")
    cmap = plt.get_cmap("magma_r").with_extremes(bad="white")
    norm = _log_norm(vals)
    im = ax.imshow(masked, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
                   extent=(diffs.positions[0] - 0.5, diffs.positions[1] - 0.5, c - 0.5, -0.5))
    if norm is not None:
        fig.colorbar(im, ax=ax, label="max |A − B| at the position (log)", fraction=0.04, shrink=0.7)
    else:
        ax.text(0.5, 0.5, "bit-identical everywhere", transform=ax.transAxes, ha="center", va="center", color="green")
    _tick_labels(ax, diffs.names, axis="y", max_labels=45, kinds=diffs.kinds)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("token position")
    ax.set_title(title or "max |A − B| per capture point and position (white: bit-identical)", fontsize=9)
    fig.tracer_data = {"names": diffs.names, "values": diffs.values, "positions": diffs.positions}
    return fig


# ---------------------------------------------------------------- ULP histogram


def select_points(comparison: Any, layers: Sequence[str | int] | None = None) -> list[tuple[str, Any]]:
    """``(name, TensorDiff)`` of the chosen capture points (names, suffixes or indices; logits allowed).

    Default: the first divergent point, the middle and the last ``layer`` point, and the logits.

    Raises:
        TracerError: a name or index that is not a capture point of the comparison.
    """
    table = [(p.name, p.diff, p.kind) for p in comparison.points]
    if comparison.logits is not None:
        table.append((comparison.logits_name or "logits", comparison.logits.tensor, "logits"))
    if layers:
        chosen = []
        for key in layers:
            key = str(key).strip()
            if key.lstrip("-").isdigit():
                i = int(key)
                if not -len(table) <= i < len(table):
                    raise TracerError(f"--layers index {i} is outside 0..{len(table) - 1}; pass indices or capture names")
                chosen.append(table[i][:2])
                continue
            hits = [row for row in table if row[0] == key] or [row for row in table if short_name(row[0]) == key]
            if not hits and key == "logits" and comparison.logits is not None:
                hits = [table[-1]]
            if not hits:
                raise TracerError(f"--layers {key!r} is not a capture point; e.g. {short_name(table[1][0]) if len(table) > 1 else table[0][0]} or an index")
            chosen.append(hits[0][:2])
        return chosen
    picks: list[int] = []
    first = next((i for i, row in enumerate(table) if row[1].n_diff), None)
    layer_idx = [i for i, row in enumerate(table) if row[2] == "layer"]
    after = [i for i in layer_idx if first is None or i >= first] or layer_idx  # middle of the divergent stretch
    for i in (first, after[len(after) // 2] if after else None, layer_idx[-1] if layer_idx else None,
              len(table) - 1 if comparison.logits is not None else None):
        if i is not None and i not in picks:
            picks.append(i)
    return [table[i][:2] for i in sorted(picks)]


def ulp_figure(comparison: Any, layers: Sequence[str | int] | None = None, *, title: str | None = None,
               figsize: tuple[float, float] | None = None):
    """Grouped bars: elements per ULP-distance bin (0, 1, 2, 3-4, 5-8, 9-16, >16), one group per point.

    Counts on a log scale; each point's bar container holds 7 bars whose heights are its
    ``TensorDiff.ulp_hist`` (label = capture name).

    Raises:
        TracerError: unknown ``layers`` entries (see :func:`select_points`).
    """
    from tracer.diff.metrics import ULP_BINS

    chosen = select_points(comparison, layers)
    fig, ax = _figure(figsize=figsize or (8.0, 4.2), layout="constrained")
    x = np.arange(len(ULP_BINS))
    width = 0.8 / max(1, len(chosen))
    for k, (name, d) in enumerate(chosen):
        ax.bar(x + (k - (len(chosen) - 1) / 2) * width, np.asarray(d.ulp_hist, dtype=np.float64), width,
               label=f"{short_name(name)} ({d.n_diff:,} of {d.n_total:,} differ)")
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels(ULP_BINS)
    ax.set_xlabel("ULP distance between A and B (storage dtype)")
    ax.set_ylabel("elements (log)")
    ax.legend(fontsize=8)
    ax.set_title(title or f"ULP distance histogram · {_title(comparison)}", fontsize=9)
    fig.tracer_data = {"names": [n for n, _ in chosen], "hist": [list(d.ulp_hist) for _, d in chosen]}
    return fig


# ---------------------------------------------------------------- sweep map


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
    """Cell edges for possibly uneven sorted centres (pcolormesh)."""
    v = values.astype(np.float64)
    if v.size == 1:
        return np.array([v[0] - 0.5, v[0] + 0.5])
    mid = (v[1:] + v[:-1]) / 2
    return np.concatenate([[v[0] - (mid[0] - v[0])], mid, [v[-1] + (v[-1] - mid[-1])]])


def sweep_figure(result: Any, *, title: str | None = None, figsize: tuple[float, float] | None = None):
    """The divergence map of a sweep.

    Top: max |logit diff| per prompt length (log y; identical lengths drawn at the bottom
    as grey ticks), one series per block size, argmax flips marked ``x``.
    Bottom, one block size: capture points × lengths heat map of max |A − B| (white:
    bit-identical) with the first divergent point of each length dotted. Several block sizes:
    block sizes × lengths heat map of max |logit diff|.

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
            if k == "kv_cache":
                ax2.get_yticklabels()[i].set_color("tab:purple")
        if norm is not None:
            fig.colorbar(mesh, ax=ax2, label="max |A − B| (log)", location="right")
            ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, -0.08), borderaxespad=0)
        ax2.set_ylabel("capture point")
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
        ax2.set_yticks(range(len(bs)))
        ax2.set_yticklabels([str(b) for b in bs])
        ax2.set_ylabel("KV block size")
        if norm is not None:
            fig.colorbar(mesh, ax=ax2, label="max |logit diff| (log; white: bit-identical)")
        data = {"kind": "block_sizes", "lengths": np.asarray(all_lengths), "values": grid, "block_sizes": bs}
    ax2.set_xlabel("prompt length N (tokens)")
    p = result.params
    n_div = sum(r.diverged for r in result.rows)
    ax1.set_title(title or (f"{p.get('scenario')} sweep · {p.get('model')} · {p.get('dtype')} · {p.get('device')}"
                            f"{' · mitigation ' + str(p['mitigation']) if p.get('mitigation') else ''}\n"
                            f"{n_div} of {len(result.rows)} points diverge"
                            f"{'' if result.complete else ' (sweep unfinished)'}"), fontsize=9)
    fig.tracer_data = data
    return fig


# ---------------------------------------------------------------- files


def check_figure_path(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Validate a figure output path before anything is computed.

    Raises:
        TracerError: unsupported suffix, a directory, or an existing file without ``overwrite``.
    """
    from tracer.store.integrity import check_name_length, check_output_path

    p = check_name_length(path, "figure file")
    if p.suffix.lower() not in SUFFIXES:
        raise TracerError(f"figure file {p} must end in {', '.join(SUFFIXES)}")
    if p.is_dir():
        raise TracerError(f"figure file {p} is a directory; give a file name ending in .png or .svg")
    if p.exists() and not overwrite:
        raise TracerError(f"{p} exists; pass --overwrite to replace it or choose another -o")
    return check_output_path(p, overwrite, "figure file")  # FIFOs, devices, file/p.png, read-only folders


def save_figure(fig: Any, path: str | os.PathLike, *, overwrite: bool = False, dpi: int = 110) -> Path:
    """Write ``fig`` to ``path`` (format from the suffix) via a temporary sibling, then rename.

    Raises:
        TracerError: see :func:`check_figure_path`.
    """
    p = check_figure_path(path, overwrite)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.stem}.partial-{os.getpid()}{p.suffix}")
    try:
        fig.savefig(tmp, dpi=dpi, format=p.suffix.lower().lstrip("."))
        os.replace(tmp, p)
    finally:
        if tmp.exists():
            tmp.unlink()
    return p


def figure_for(kind: str, *, comparison: Any = None, runs: tuple | None = None, trace: str | None = None,
               run_names: tuple[str | None, str | None] = (None, None), layers: Sequence[str | int] | None = None,
               sweep: Any = None):
    """Dispatch ``kind`` to a figure from whatever is at hand (``tracer.report.plot`` and ``RunResult.plot``).

    Raises:
        TracerError: unknown kind, or a heat map with neither in-memory runs nor a trace.
    """
    match kind:
        case "amplification":
            return amplification_figure(comparison)
        case "ulp":
            return ulp_figure(comparison, layers)
        case "heatmap":
            carried = position_diffs_comparison(comparison) if comparison is not None else None
            if carried is not None and carried.names:
                return heatmap_figure(carried)
            if runs is not None and all(r is not None and r.captures for r in runs):
                return heatmap_figure(position_diffs_records(*runs))
            if trace is not None:
                d = position_diffs_trace(trace, *run_names)
                if d.names:
                    return heatmap_figure(d)
            raise TracerError("a heat map needs the captured tensors: run with store='tensors' (the default)")
        case "sweep":
            if sweep is None:
                raise TracerError("kind 'sweep' plots a sweep; pass a SweepResult or a sweep file to tracer.report.plot")
            return sweep_figure(sweep)
    raise TracerError(f"unknown plot kind '{kind}'; use one of: {', '.join(KINDS)}")
