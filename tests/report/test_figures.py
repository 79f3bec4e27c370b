"""Plots that show only what was measured: sweep columns at the measured lengths only (the axis spanning
their range, gaps hatched "not measured"), a heat map that labels every row it shows, legends that
cover no data, plans not headed ``A (A)``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tracer.diff.compare import compare_records
from tracer.execute.records import CaptureRecord, RunRecord
from tracer.loops.sweep import SweepResult, SweepRow

pytest.importorskip("matplotlib")

from tracer.report.figures.heatmap import MAX_ROW_LABELS, PositionDiffs  # noqa: E402
from tracer.report.figures.sweep import measured_spans  # noqa: E402
from tracer.report.plot import heatmap_figure, sweep_figure, ulp_figure  # noqa: E402

LENGTHS = (17, 18, 100, 250)  # the lengths of issue 25's figure


def _sweep(lengths=LENGTHS):
    rows = []
    for n in lengths:
        div = n in (18, 250)
        mad = (0.0, 0.25 if div else 0.0, 0.5 if div else 0.0)
        rows.append(SweepRow(length=n, block_size=16, split_at=16, n_positions=n - 16, first_divergent=1 if div else -1,
                             n_diff=(0, int(div), int(div)), n_total=(8, 8, 8), max_abs_diff=mad,
                             last_layer_fraction=0.125 * div, logits_max_abs_diff=mad[2], argmax_flips=0))
    return SweepResult(params={"block_sizes": [16], "model": "m", "scenario": "s"}, points=["emb", "l0", "head"],
                       kinds=["embedding", "layer", "logits"], rows=rows, complete=True)


def _hatched(ax):
    """The x-ranges the figure marks "not measured" (hatched spans)."""
    out = []
    for p in ax.patches:
        if p.get_hatch():
            xs = p.get_path().transformed(p.get_patch_transform()).vertices[:, 0]
            out.append((float(xs.min()), float(xs.max())))
    return out


def test_sweep_draws_measured_lengths_only():
    fig = sweep_figure(_sweep())
    top, heat = fig.axes[0], fig.axes[1]
    lo, hi = heat.get_xlim()
    span = LENGTHS[-1] - LENGTHS[0]
    assert LENGTHS[0] - 0.05 * span < lo < LENGTHS[0] and LENGTHS[-1] < hi < LENGTHS[-1] + 0.05 * span
    assert top.get_xlim() == (lo, hi)  # one length axis, the measured range
    hatched = _hatched(heat)
    covered = lambda x: any(a <= x <= b for a, b in hatched)  # noqa: E731
    for x in (30, 59, 140, 175, 200, 240):  # never run: drawn as not measured, not painted by a neighbour
        assert covered(x), x
    for n in LENGTHS:  # every measured length is a visible column of its own
        assert not covered(n), n
    marked = [line for line in top.get_lines() if line.get_marker() not in ("None", "", None)]
    assert marked and all(line.get_linestyle() in ("None", "") for line in marked)  # points, no line through gaps


@pytest.mark.parametrize("lengths", [tuple(range(17, 40)), tuple(range(16, 200, 16))])
def test_an_even_grid_is_one_contiguous_map(lengths):
    spans = measured_spans(np.asarray(lengths))
    assert np.allclose(spans[1:, 0], spans[:-1, 1])  # columns touch: nothing in between went unmeasured
    fig = sweep_figure(_sweep(lengths))
    lo, hi = fig.axes[1].get_xlim()
    inner = [(a, b) for a, b in _hatched(fig.axes[1]) if a > lo + 1e-9 and b < hi - 1e-9]
    assert inner == []  # hatching only in the thin margins outside the first and last column


def _diffs(rows: int) -> PositionDiffs:
    names = [f"model.layers.{i}" for i in range(rows)]
    vals = np.zeros((rows, 4))
    vals[rows // 2:, 1] = 0.5
    return PositionDiffs(names=names, kinds=["layer"] * rows, positions=(10, 14), values=vals,
                         n_diff=(vals > 0).astype(np.int64))


def test_heatmap_labels_every_row_it_shows():
    fig = heatmap_figure(_diffs(63))  # the default run's 63 capture points
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == [f"layers.{i}" for i in range(63)]
    assert "labelled" not in fig.axes[0].get_title()
    many = heatmap_figure(_diffs(MAX_ROW_LABELS + 40))
    n = len(many.axes[0].get_yticklabels())
    assert n < MAX_ROW_LABELS + 40 and f"{n} of {MAX_ROW_LABELS + 40} rows labelled" in many.axes[0].get_title()


def test_ulp_legend_covers_no_bar():
    g = torch.Generator().manual_seed(0)
    names = ["emb", "l0", "l1", "head"]
    kinds = ["embedding", "layer", "layer", "logits"]
    ta = [torch.randn(4, 32, generator=g).to(torch.bfloat16) for _ in names]
    tb = [t.clone() for t in ta]
    for t in tb[1:]:
        t.view(-1).view(torch.int16)[:9] += 3

    def run(name, ts):
        caps = {n: CaptureRecord(name=n, kind=k, tensor=t, calls=[], op="X") for n, k, t in zip(names, kinds, ts)}
        return RunRecord(name=name, token_ids=list(range(1, 9)), plan={"chunks": [[0, 8]]}, window=(4, 8), captures=caps)

    fig = ulp_figure(compare_records(run("A", ta), run("B", tb), scenario="s", model="m"))
    ax = fig.axes[0]
    assert ax.get_legend() is None and fig.legends  # outside the axes
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()  # a real canvas: the constrained layout runs, as when saved
    box = fig.legends[0].get_window_extent()
    axes_box = ax.get_window_extent()
    assert box.y1 <= axes_box.y0  # entirely below the axes: no bar under it


def test_plans_are_not_headed_a_a():
    from tracer.report.html import _side

    assert _side("A", "A") == "A" and _side("B", "L2-prefix-cache.B") == "B (L2-prefix-cache.B)"
