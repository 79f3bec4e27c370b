"""Figures: the data behind each figure (line x/y, image arrays, bar heights), not pixels."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import tracer
from tests.helpers import run_record as _run
from tests.helpers import cli_session, planted_pair, tracer_cli
from tracer.diff.compare import compare_records, compare_trace
from tracer.errors import TracerError
from tracer.report.plot import (LABEL_ABS, LABEL_FRAC, amplification_figure, heatmap_figure, position_diffs_records,
                         position_diffs_trace, sweep_figure, ulp_figure)
from tracer.store.trace import TraceWriter
from tracer.loops.sweep import SweepResult, SweepRow


@pytest.fixture
def pair():
    """Runs A/B of 2 positions: emb identical, l0 1 ULP off at (1, 3), l1 off at (0, 0) and (1, 7)."""
    return planted_pair()[:2]


def _line(fig, label):
    lines = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_label() == label]
    assert len(lines) == 1, [ln.get_label() for ax in fig.axes for ln in ax.get_lines()]
    return lines[0]


def _oracle_max(a, b):
    return float((a.double() - b.double()).abs().max())


def test_amplification_line_data(pair):
    a, b = pair
    fig = amplification_figure(compare_records(a, b, scenario="s", model="m"))
    ab, fr = _line(fig, LABEL_ABS), _line(fig, LABEL_FRAC)
    assert list(ab.get_xdata()) == [0, 1, 2, 3] and list(fr.get_xdata()) == [0, 1, 2, 3]
    y = np.asarray(ab.get_ydata(), dtype=float)
    assert np.isnan(y[0])  # bit-identical embedding: nothing on the log axis
    expect = [_oracle_max(a.captures[n].tensor, b.captures[n].tensor) for n in ("l0", "l1", "head")]
    assert y[1:] == pytest.approx(expect)
    assert list(fr.get_ydata()) == pytest.approx([0.0, 1 / 16, 2 / 16, 1 / 8])
    assert fig.tracer_data["logits_index"] == 3


def test_amplification_marks_origin_rows(pair):
    a, b = pair
    c = compare_records(a, b, scenario="s", model="m")
    points = [SimpleNamespace(name=p.name, diff=p.diff, kind=p.kind, origin=(p.name == "l0")) for p in c.points]
    fake = SimpleNamespace(points=points, logits=c.logits, logits_name=c.logits_name, scenario="s", model="m",
                           positions=c.positions, facts={}, verdict=c.verdict)
    fig = amplification_figure(fake)
    marked = [coll for coll in fig.axes[0].collections if coll.get_label() == "origin"]
    assert len(marked) == 1 and marked[0].get_offsets()[:, 0].tolist() == [1.0]


def test_heatmap_from_records_and_trace(pair, tmp_path):
    a, b = pair
    d = position_diffs_records(a, b)
    assert d.names == ["emb", "l0", "l1", "head"] and d.positions == (2, 4)
    for i, n in enumerate(d.names):
        ta, tb = a.captures[n].tensor, b.captures[n].tensor
        for t in range(2):
            assert d.values[i, t] == pytest.approx(_oracle_max(ta[t], tb[t]))
            assert d.n_diff[i, t] == int((ta[t].view(torch.int16) != tb[t].view(torch.int16)).sum())
    path = tmp_path / "t.h5"
    with TraceWriter(path, header={"scenario": {"name": "s"}, "model": {"name": "m"}}) as w:
        w.add_run(a)
        w.add_run(b)
    stored = position_diffs_trace(path)
    assert np.array_equal(stored.values, d.values) and stored.names == d.names
    fig = heatmap_figure(stored)
    img = fig.axes[0].images[0].get_array()
    assert img.shape == (4, 2)
    assert bool(img.mask[0].all())  # the identical embedding row is masked (drawn white)
    fig2 = tracer.plot(compare_trace(str(path)), "heatmap")
    assert fig2.axes[0].images[0].get_array().shape == (4, 2)


def test_position_diff_nan_counts_inf():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    b = torch.tensor([[1.0, float("nan")], [3.0, 4.5]])
    from tracer.report.plot import position_max_abs_diff

    mx, nd = position_max_abs_diff(a, b)
    assert mx[0] == float("inf") and mx[1] == 0.5 and nd.tolist() == [1, 1]


def test_ulp_bars_are_the_histograms(pair):
    a, b = pair
    c = compare_records(a, b, scenario="s", model="m")
    fig = ulp_figure(c, ["l0", "1", "head"])
    bars = fig.axes[0].containers
    assert len(bars) == 3  # l0 twice (by name and by index) and the logits
    l0 = next(p for p in c.points if p.name == "l0").diff
    assert [r.get_height() for r in bars[0]] == list(l0.ulp_hist) and len(bars[0]) == 7
    assert [r.get_height() for r in bars[-1]] == list(c.logits.tensor.ulp_hist)
    with pytest.raises(TracerError, match="not a capture point"):
        ulp_figure(c, ["nope"])
    default = ulp_figure(c)
    assert default.tracer_data["names"][0] == "l0" and default.tracer_data["names"][-1] == "head"


def _sweep_result(block_sizes=(16,)):
    rows = []
    for b in block_sizes:
        for n in (17, 18, 20, 23):
            div = n in (18, 23)
            mad = (0.0, 0.5 if div else 0.0, 2.0 if div else 0.0)
            rows.append(SweepRow(length=n, block_size=b, split_at=16, n_positions=n - 16,
                                 first_divergent=1 if div else -1, n_diff=(0, int(div), 3 * int(div)),
                                 n_total=(8, 8, 8), max_abs_diff=mad, last_layer_fraction=0.125 * div,
                                 logits_max_abs_diff=mad[2], argmax_flips=int(n == 23)))
    return SweepResult(params={"block_sizes": list(block_sizes), "model": "m", "scenario": "s"},
                       points=["emb", "l0", "head"], kinds=["embedding", "layer", "logits"], rows=rows, complete=True)


def test_sweep_figure_single_block():
    res = _sweep_result()
    fig = sweep_figure(res)
    mesh = fig.axes[1].collections[0]
    arr = mesh.get_array()
    assert arr.shape == (3, 4)  # capture points × lengths
    assert np.asarray(arr.filled(0))[1].tolist() == [0.0, 0.5, 0.0, 0.5]
    top = fig.axes[0].get_lines()[0]
    assert list(top.get_xdata()) == [17, 18, 20, 23]
    assert res.diverging_lengths() == [18, 23]


def test_sweep_figure_block_axis():
    fig = sweep_figure(_sweep_result((16, 8)))
    arr = fig.axes[1].collections[0].get_array()
    assert arr.shape == (2, 4)  # block sizes × lengths
    assert fig.tracer_data["kind"] == "block_sizes"


def test_to_pandas(pair, monkeypatch):
    a, b = pair
    c = compare_records(a, b, scenario="s", model="m")
    df = tracer.to_pandas(c)
    assert list(df["name"]) == ["emb", "l0", "l1", "head (logits)"] and df["n_diff"].tolist() == [0, 1, 2, 1]
    sdf = tracer.to_pandas(_sweep_result())
    assert len(sdf) == 4 and sdf["diverged"].tolist() == [False, True, False, True]
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(TracerError, match="pip install"):
        tracer.to_pandas(c)


def test_plot_cli(pair, tmp_path, cli_env):
    a, b = pair
    path = tmp_path / "t.h5"
    with TraceWriter(path, header={"scenario": {"name": "s"}, "model": {"name": "m"}}) as w:
        w.add_run(a)
        w.add_run(b)

    out = tmp_path / "amp.svg"
    first, refused = cli_session([["plot", str(path), "-o", str(out)],
                                  ["plot", str(path), "--kind", "heatmap", "-o", str(out)]], cli_env, tmp_path)
    assert first.returncode == 0, first.stderr
    assert out.read_text().lstrip().startswith("<?xml")
    assert refused.returncode == 2 and "--overwrite" in refused.stderr and "Traceback" not in refused.stderr
    before = out.read_bytes()
    overwritten, jpg, sweep, ulp = cli_session(
        [["plot", str(path), "--kind", "heatmap", "-o", str(out), "--overwrite"],
         ["plot", str(path), "-o", str(tmp_path / "x.jpg")],
         ["plot", str(path), "--kind", "sweep"],
         ["plot", str(path), "--kind", "ulp"]], cli_env, tmp_path)
    assert overwritten.returncode == 0, overwritten.stderr
    assert out.read_bytes() != before  # the heatmap replaced the amplification figure
    assert jpg.returncode == 2 and ".png" in jpg.stderr
    assert sweep.returncode == 2 and "sweep file" in sweep.stderr
    assert ulp.returncode == 0 and (tmp_path / "t-ulp.png").exists()


def test_plot_options_of_another_kind_are_refused_not_ignored(pair, tmp_path):
    """`tracer plot T.h5 --layers 1,2` drew the amplification figure of every point, --layers unused; runs of a
    sweep file were dropped the same way. Now each is an error, and nothing is written."""
    from tracer.report.plot import plot_file

    a, b = pair
    path = tmp_path / "t.h5"
    with TraceWriter(path, header={"scenario": {"name": "s"}, "model": {"name": "m"}}) as w:
        w.add_run(a)
        w.add_run(b)
    for kind in (None, "amplification", "heatmap"):
        with pytest.raises(TracerError, match="--layers picks the points of --kind ulp"):
            plot_file(path, kind=kind, layers="l0", output=tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    assert plot_file(path, kind="ulp", layers="l0,l1", output=tmp_path / "u.png").exists()
    sweep_file = tmp_path / "s.h5"
    tracer.sweep("tiny-llama", scenario="repeat", lengths="4", output=str(sweep_file), progress=False)
    with pytest.raises(TracerError, match="--run-a/--run-b name runs of a trace"):
        plot_file(sweep_file, run_a="A", output=tmp_path / "y.png")


def _kv_pair():
    """A, B with KV caches (4 positions, window 2..3): L0 + its cache identical, L1's cache 1 ULP off
    in a prefix row and a window row, L1 off, logits flipped at window row 1."""
    g = torch.Generator().manual_seed(3)
    emb, l0, l1 = (torch.randn(2, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    kv0, kv1 = (torch.randn(4, 8, generator=g).to(torch.bfloat16) for _ in range(2))
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [5.0, 1.0, 0.0, 4.9]], dtype=torch.bfloat16)
    kv1b, l1b, lb = kv1.clone(), l1.clone(), logits.clone()
    kv1b.view(torch.int16)[0, 2] += 1
    kv1b.view(torch.int16)[3, 5] += 3
    l1b[0, 0] += 4.0
    lb[1, 3] = 5.5
    names = ["emb", "layers.0.kv_cache", "layers.0", "layers.1.kv_cache", "layers.1", "head"]
    kinds = ["embedding", "kv_cache", "layer", "kv_cache", "layer", "logits"]
    ta = [emb, kv0, l0, kv1, l1, logits]
    tb = [emb.clone(), kv0.clone(), l0.clone(), kv1b, l1b, lb]
    return (_run("A", list(zip(names, kinds, ta))), _run("B", list(zip(names, kinds, tb))), dict(zip(names, ta)),
            dict(zip(names, tb)))


def test_amplification_series_split_and_zero_markers():
    from tracer.report.plot import LABEL_KV, LABEL_ZERO

    a, b, ta, tb = _kv_pair()
    c = compare_records(a, b, scenario="s", model="m")
    fig = amplification_figure(c)
    main, kv = _line(fig, LABEL_ABS), _line(fig, LABEL_KV)
    # the independent oracle: max |a - b| of each raw tensor, KV caches over all their rows
    want_main = [_oracle_max(ta[n], tb[n]) for n in ("emb", "layers.0", "layers.1", "head")]
    want_kv = [_oracle_max(ta[n], tb[n]) for n in ("layers.0.kv_cache", "layers.1.kv_cache")]
    for line, want in ((main, want_main), (kv, want_kv)):
        y = np.asarray(line.get_ydata(), dtype=float)
        assert list(line.get_xdata()) == list(range(len(want)))
        assert np.array_equal(np.isnan(y), np.asarray(want) == 0)  # a gap exactly where bit-identical ...
        assert np.allclose(y[~np.isnan(y)], [w for w in want if w])
    zeros = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_label() == LABEL_ZERO]
    assert len(zeros) == 2  # ... and a zero marker there, in each panel
    assert [list(z.get_xdata()) for z in zeros] == [[i for i, w in enumerate(want_main) if w == 0],
                                                     [i for i, w in enumerate(want_kv) if w == 0]]
    for z, ax in zip(zeros, fig.axes):  # the zero row sits below every non-zero value, labelled "0"
        zy = set(z.get_ydata())
        assert len(zy) == 1 and min(zy) < min(w for w in want_main + want_kv if w)
        assert ax.get_yticklabels()[0].get_text() == "0"
    assert fig.legends and not any(ax.get_legend() for ax in fig.axes)  # the legend sits outside the axes


def test_heatmap_from_the_comparison_needs_no_trace():
    a, b, ta, tb = _kv_pair()
    c = compare_records(a, b, scenario="s", model="m")
    fig = tracer.plot(c, "heatmap")  # from c.per_position: no tensors, no trace
    d = fig.tracer_data
    assert d["names"] == ["emb", "layers.0.kv_cache", "layers.0", "layers.1.kv_cache", "layers.1", "head"]
    for i, n in enumerate(d["names"]):
        x, y = ta[n], tb[n]
        if x.shape[0] == 4:  # a KV cache: its window rows 2..3
            x, y = x[2:], y[2:]
        for t in range(2):
            assert d["values"][i, t] == pytest.approx(_oracle_max(x[t], y[t]))
    from tracer.diff.stored import comparison_from_dict

    again = comparison_from_dict(json.loads(json.dumps(c.to_dict())))  # as stored in a trace
    assert np.array_equal(tracer.plot(again, "heatmap").tracer_data["values"], d["values"])


def test_position_stats_bin_long_windows(monkeypatch):
    import tracer.diff.positions as positions

    monkeypatch.setattr(positions, "MAX_COLUMNS", 4)
    g = torch.Generator().manual_seed(4)
    a = torch.randn(10, 3, generator=g)
    b = a.clone()
    b[1, 0] += 1.0
    b[6, 2] -= 0.5
    b[7, 1] -= 2.0
    st = positions.PositionStats((0, 10))
    st.add("x", "layer", a, b)
    r = st.result()
    assert r["bin"] == 3  # ceil(10 / 4) positions per column: [0-2], [3-5], [6-8], [9]
    diff = (a.double() - b.double()).abs().max(dim=1).values
    want = [float(diff[i:i + 3].max()) for i in range(0, 10, 3)]
    assert r["max_abs_diff"][0] == pytest.approx(want) and r["n_diff"][0] == [1, 0, 2, 0]


def test_a_row_white_because_it_differs_before_the_window_is_marked():
    """The default run's origin, a KV cache born different in the cached-prefix pass, drew as a white
    (bit-identical-looking) row: its differences lie before the compared positions. The heat map now
    marks such a row and says why, from the comparison, the runs and the HTML report alike."""
    a, b, ta, tb = _kv_pair()
    kv = tb["layers.0.kv_cache"]
    kv.view(torch.int16)[1, 4] += 2  # layer 0's cache now differs at prefix position 1 only (window: 2..3)
    before = [n for n in ta if ta[n].shape[0] == 4 and not torch.equal(ta[n][:2], tb[n][:2])
              and torch.equal(ta[n][2:], tb[n][2:])]
    assert before == ["layers.0.kv_cache"]  # the planted bits, independently
    c = compare_records(a, b, scenario="s", model="m")
    for fig in (tracer.plot(c, "heatmap"), heatmap_figure(position_diffs_records(a, b))):
        assert fig.tracer_data["before"] == before
        assert "differs only before position 2" in fig.axes[0].get_title()
        assert any("differs only before position 2" in t.get_text() for t in fig.axes[0].texts)
    from tracer.report.html import comparison_figures

    caption = next(cap for fid, cap, _ in comparison_figures(c) if fid == "fig-heatmap")
    assert "hatched rows (layers.0.kv_cache) are white because their differences lie before" in caption
