"""Figures (matplotlib, imported lazily; the optional extra ``plot``).

- :func:`amplification_figure`: per capture point in execution order, max |diff| (log scale)
  and the differing fraction, origin points and the logits marked: the seed's table as a picture.
- :func:`heatmap_figure`: capture points × compared positions, max |diff| per position (log
  colour scale): does divergence start at one token and spread?
- :func:`ulp_figure`: the ULP-distance histogram of a few capture points.
- :func:`sweep_figure`: a sweep's divergence map (which lengths diverge, from which layer, how much).

Every function returns a :class:`matplotlib.figure.Figure` and never shows it; outside Jupyter
the Agg backend is used. :func:`save_figure` writes one without clobbering existing files.

The figures live in :mod:`tracer.report.figures` (one module per figure); this module is the one
place the commands and the API reach them: the dispatch by kind (:func:`figure_for`) and the files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tracer.diff.compare import compare_trace
from tracer.diff.stored import stored_comparison
from tracer.errors import TracerError
from tracer.files import check_input_file
from tracer.report.figures.amplification import (LABEL_ABS, LABEL_FRAC, LABEL_KV, amplification_data,
                                                 amplification_figure)
from tracer.report.figures.common import LABEL_ZERO, compact_name, short_name, thin_labels
from tracer.report.figures.heatmap import (PositionDiffs, heatmap_figure, position_diffs_comparison,
                                           position_diffs_records, position_diffs_trace, position_max_abs_diff)
from tracer.report.figures.sweep import sweep_data, sweep_figure
from tracer.report.figures.ulp import select_points, ulp_figure
from tracer.report.outputs import KINDS, SUFFIXES, check_figure_path, check_plot_options
from tracer.store.integrity import write_error_message
from tracer.store.sweepfile import is_sweep_file, read_sweep

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from tracer.diff.result import Comparison
    from tracer.store.sweepfile import SweepResult

# ---------------------------------------------------------------- files


def save_figure(fig: Figure, path: str | os.PathLike, *, overwrite: bool = False, dpi: int = 110) -> Path:
    """Write ``fig`` to ``path`` (format from the suffix) via a temporary sibling, then rename.

    Raises:
        TracerError: see :func:`check_figure_path`.
    """
    p = check_figure_path(path, overwrite)
    tmp = p.with_name(f".{p.stem}.partial-{os.getpid()}{p.suffix}")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, dpi=dpi, format=p.suffix.lower().lstrip("."))
        os.replace(tmp, p)
    except OSError as e:  # a full disk, ulimit -f, a folder that turned read-only: one line
        raise TracerError(write_error_message(p, e).replace("--output", "-o")) from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return p


def figure_for(kind: str, *, comparison: Comparison | None = None, runs: tuple | None = None, trace: str | None = None,
               run_names: tuple[str | None, str | None] = (None, None), layers: Sequence[str | int] | None = None,
               sweep: SweepResult | None = None) -> Figure:
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


def figure_of(obj: Any, kind: str | None = None, **kwargs: Any):
    """:func:`tracer.api.plot`: a figure of a RunResult, Comparison, SweepResult, or a trace/sweep file path.

    Raises:
        TracerError: unknown kind for this object, matplotlib missing.
    """
    if isinstance(obj, (str, bytes)) or hasattr(obj, "__fspath__"):
        if is_sweep_file(obj):
            return figure_for(kind or "sweep", sweep=read_sweep(str(obj)), **kwargs)
        return figure_for(kind or "amplification", trace=str(obj), **kwargs)
    if hasattr(obj, "rows") and hasattr(obj, "params"):  # a SweepResult
        return figure_for(kind or "sweep", sweep=obj, **kwargs)
    if hasattr(obj, "comparison"):  # a RunResult: the figure may read its runs' tensors
        return figure_for(kind or "amplification", comparison=obj.comparison, runs=obj.runs, trace=obj.trace, **kwargs)
    return figure_for(kind or "amplification", comparison=obj, trace=obj.trace, run_names=(obj.run_a, obj.run_b),
                      **kwargs)


def plot_file(path: Any, *, kind: str | None = None, output: Any = None, overwrite: bool = False,
              layers: str | Sequence[str | int] | None = None, run_a: str | None = None, run_b: str | None = None) -> Path:
    """``tracer plot``: draw ``kind`` from a trace or sweep file and save it (see :func:`tracer.api.plot_file`).

    Default kind: ``sweep`` for a sweep file, ``amplification`` for a trace. Default output:
    ``<input stem>-<kind>.png`` beside the input. A trace's figure is drawn from its stored
    comparison when it has one (nothing recomputed).

    Raises:
        TracerError: unknown kind, a kind that does not fit the file, ``layers`` with another kind than
            ``ulp``, runs of a sweep file, bad output path, unreadable file.
    """
    layers = layers.split(",") if isinstance(layers, str) else layers  # the command line's a,b,c
    check_plot_options(kind, layers, output, overwrite)  # before the file is opened
    src = Path(path)
    if not src.exists():
        raise TracerError(f"file {src} not found; pass a trace or sweep file")
    check_input_file(src, "input file")  # a FIFO or device would block the read
    is_sweep = is_sweep_file(src)
    kind = kind or ("sweep" if is_sweep else "amplification")
    if is_sweep != (kind == "sweep"):
        raise TracerError(f"--kind {kind} needs a {'sweep file' if kind == 'sweep' else 'trace'}, "
                          f"but {src} is a {'sweep file' if is_sweep else 'trace'}; "
                          f"use --kind {'sweep' if is_sweep else 'amplification, heatmap or ulp'}")
    if layers is not None and kind != "ulp":
        raise TracerError(f"--layers picks the points of --kind ulp; the {kind} figure draws every point: drop "
                          "--layers or add --kind ulp")
    if is_sweep and (run_a is not None or run_b is not None):
        raise TracerError(f"--run-a/--run-b name runs of a trace; {src} is a sweep file, whose figure draws every point")
    out = check_figure_path(output if output is not None else src.with_name(f"{src.stem}-{kind}.png"), overwrite)
    if is_sweep:
        return save_figure(sweep_figure(read_sweep(src)), out, overwrite=overwrite)
    stored = stored_comparison(src) if run_a is None and run_b is None else None
    if stored is not None and (kind != "heatmap" or stored.per_position):  # drawn from the stored numbers
        fig = figure_for(kind, comparison=stored, layers=layers)
    elif kind == "heatmap":  # a trace written before comparisons were stored with it: from its tensors
        fig = heatmap_figure(position_diffs_trace(src, run_a, run_b))
    else:
        fig = figure_for(kind, comparison=compare_trace(str(src), run_a, run_b), layers=layers)
    return save_figure(fig, out, overwrite=overwrite)


__all__ = ["KINDS", "SUFFIXES", "LABEL_ABS", "LABEL_FRAC", "LABEL_KV", "LABEL_ZERO", "PositionDiffs",
           "amplification_data", "amplification_figure", "check_figure_path", "compact_name", "figure_for",
           "figure_of", "heatmap_figure", "plot_file", "position_diffs_comparison", "position_diffs_records", "position_diffs_trace",
           "position_max_abs_diff", "save_figure", "select_points", "short_name", "sweep_data", "sweep_figure",
           "thin_labels", "ulp_figure"]
