"""The per-position heat map: capture points × compared positions, max |A − B| per cell.

Does a divergence start at one token and spread? The data (:class:`PositionDiffs`) comes from a
comparison's per-position statistics, two in-memory runs, or two runs of a stored trace.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch

from tracer.diff.compare import check_alignable
from tracer.dtypes import INT_VIEW
from tracer.errors import TracerError
from tracer.execute.kinds import PointKind
from tracer.report.figures.common import literal_text, _figure, _log_norm, _plt, _tick_labels, thin_labels
from tracer.store.trace import TraceReader

_ELEMENTS_PER_CHUNK = 1 << 21
#: the heat map labels every row up to this many (the default run's 63 points, sublayers of small
#: models); beyond it the landmarks, the title saying how many rows carry a label
MAX_ROW_LABELS = 160



@dataclass(frozen=True)
class PositionDiffs:
    """Max |A − B| per capture point and compared position.

    Attributes:
        names, kinds: capture points in execution order (logits last when present).
        positions: ``(start, stop)`` absolute token positions of the columns.
        values: float64 ``(C, T)``; 0 where the position's elements are bit-identical, ``inf``
            where a NaN/inf mismatch sits.
        n_diff: int64 ``(C, T)``: differing elements per point and position.
        before: the rows whose elements differ only before the compared positions (a KV cache born
            different in the cached-prefix pass): white across the map, marked as such.
    """

    names: list[str]
    kinds: list[str]
    positions: tuple[int, int]
    values: np.ndarray
    n_diff: np.ndarray
    before: tuple[str, ...] = ()


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
    before: list[str] = []
    logits = None
    t = positions[1] - positions[0]
    for name, kind, ta, tb in pairs:
        if ta.dim() == 0 or ta.shape != tb.shape:
            continue  # no position axis, or not comparable
        prefix = 0
        if ta.shape[0] != t:
            if ta.shape[0] != positions[1]:
                continue  # not a window capture
            prefix = int(position_max_abs_diff(ta[:positions[0]], tb[:positions[0]])[1].sum())
            ta, tb = ta[positions[0]:], tb[positions[0]:]  # kept for all N positions (the KV cache): its window rows
        mx, nd = position_max_abs_diff(ta, tb)
        if prefix and not nd.any():
            before.append(name)
        if kind == PointKind.LOGITS:
            logits = (name, kind, mx, nd)
            continue
        names.append(name), kinds.append(kind), vals.append(mx), nds.append(nd)
    if logits is not None:
        names.append(logits[0]), kinds.append(logits[1]), vals.append(logits[2]), nds.append(logits[3])
    return PositionDiffs(names=names, kinds=kinds, positions=tuple(positions),
                         values=np.stack(vals) if vals else np.zeros((0, t)),
                         n_diff=np.stack(nds) if nds else np.zeros((0, t), dtype=np.int64), before=tuple(before))


def position_diffs_comparison(comparison: Any) -> PositionDiffs | None:
    """:class:`PositionDiffs` from the per-position data a comparison carries
    (:attr:`~tracer.diff.result.Comparison.per_position`; no tensor is read), None when it has none.
    With more compared positions than :data:`tracer.diff.positions.MAX_COLUMNS`, columns are bins of
    consecutive positions (max |Δ| and counts per bin)."""
    pp = getattr(comparison, "per_position", None)
    if not pp:
        return None
    order = sorted(range(len(pp["names"])), key=lambda i: pp["kinds"][i] == PointKind.LOGITS)  # logits last, stable
    vals = np.asarray([[np.inf if isinstance(v, str) else v for v in pp["max_abs_diff"][i]] for i in order],
                      dtype=np.float64)
    n_diff = np.asarray([pp["n_diff"][i] for i in order], dtype=np.int64)
    names = [pp["names"][i] for i in order]
    # a point differing somewhere (its count covers all N positions: a KV cache) but at no compared position
    differs = {p.name for p in getattr(comparison, "points", ()) if p.diff.n_diff}
    return PositionDiffs(names=names, kinds=[pp["kinds"][i] for i in order],
                         positions=(int(pp["start"]), int(pp["stop"])), values=vals, n_diff=n_diff,
                         before=tuple(n for n, row in zip(names, n_diff) if n in differs and not row.any()))


def position_diffs_records(a: Any, b: Any) -> PositionDiffs:
    """:class:`PositionDiffs` of two in-memory :class:`~tracer.execute.records.RunRecord` objects.

    Raises:
        TracerError: the runs processed different prompts or windows.
    """
    check_alignable(a.name, a.token_ids, a.window, b.name, b.token_ids, b.window)
    pairs = ((n, r.kind, r.tensor, b.captures[n].tensor) for n, r in a.captures.items() if n in b.captures)
    return _position_diffs(pairs, tuple(a.window))


def position_diffs_trace(path: str | os.PathLike, run_a: str | None = None, run_b: str | None = None) -> PositionDiffs:
    """:class:`PositionDiffs` of two runs of a stored trace (default: its first two), one point at a time.

    Raises:
        TracerError: missing/corrupt trace, unknown runs, runs of different prompts.
    """
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


@literal_text
def heatmap_figure(diffs: PositionDiffs, *, title: str | None = None, figsize: tuple[float, float] | None = None):
    """Capture points (rows, execution order) × compared positions (columns): max |A − B|.

    Log colour scale; bit-identical cells are left white; ``inf`` cells are drawn at the top of
    the scale. A row that differs only before the compared positions (:attr:`PositionDiffs.before`:
    the origin KV cache of a cached-prefix divergence) is white too: hatched and labelled so, and
    the title says it. The image array has shape ``(C, T)`` = ``diffs.values.shape``. Every row is
    labelled up to :data:`MAX_ROW_LABELS` rows (the figure is as tall as they need); beyond, the
    landmark rows are, and the title says how many of the rows carry a label
    (``fig.tracer_data["labelled"]``: their indices).

    Returns:
        a matplotlib Figure with one image on axes 0 (colour bar on axes 1 when anything differs).
    """
    plt = _plt()
    c, t = diffs.values.shape
    vals = diffs.values.copy()
    finite_max = vals[np.isfinite(vals)].max() if np.isfinite(vals).any() else 0.0
    vals[np.isinf(vals)] = finite_max if finite_max > 0 else 1.0
    masked = np.ma.masked_where(vals <= 0, vals)
    # every row labelled: ~11 pt per row up to MAX_ROW_LABELS rows (the figure grows with them)
    fig, ax = _figure(figsize=figsize or (min(16.0, max(9.0, 5 + 0.12 * t)),
                                          min(2.5 + 0.155 * MAX_ROW_LABELS, max(3.5, 2.5 + 0.155 * c))),
                      layout="constrained")
    cmap = plt.get_cmap("magma_r").with_extremes(bad="white")
    norm = _log_norm(vals)
    im = ax.imshow(masked, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
                   extent=(diffs.positions[0] - 0.5, diffs.positions[1] - 0.5, c - 0.5, -0.5))
    if norm is not None:
        fig.colorbar(im, ax=ax, label="max |A − B| at the position (log)", fraction=0.04, shrink=0.7)
    else:
        ax.text(0.5, 0.5, "bit-identical everywhere", transform=ax.transAxes, ha="center", va="center", color="green")
    labelled = thin_labels(diffs.names, diffs.kinds, MAX_ROW_LABELS)
    _tick_labels(ax, diffs.names, axis="y", max_labels=MAX_ROW_LABELS, kinds=diffs.kinds)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("token position")
    skipped = "" if len(labelled) == c else (f"; {len(labelled)} of {c} rows labelled (layer outputs, KV caches, "
                                               "norms, logits; every row drawn)")
    p0 = diffs.positions[0]
    for name in diffs.before:  # white, but not bit-identical: its differences lie in positions 0..P-1
        row = diffs.names.index(name)
        ax.axhspan(row - 0.5, row + 0.5, fill=False, hatch="///", edgecolor="tab:red", linewidth=0)
        ax.text(p0 - 0.4, row, f"differs only before position {p0} (cached prefix)", va="center", ha="left",
                fontsize=7, color="tab:red")
    before = (f"; hatched: differs only before position {p0}, outside the compared positions ({len(diffs.before)} "
              "row(s))") if diffs.before else ""
    ax.set_title(title or f"max |A − B| per capture point and position (white: bit-identical){before}{skipped}",
                 fontsize=9)
    fig.tracer_data = {"names": diffs.names, "values": diffs.values, "positions": diffs.positions,
                       "labelled": labelled, "before": list(diffs.before)}
    return fig
