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
from typing import Any, Sequence

from tracer.errors import TracerError
from tracer.report.figures.amplification import LABEL_ABS, LABEL_FRAC, LABEL_KV, amplification_data, amplification_figure
from tracer.report.figures.common import LABEL_ZERO, compact_name, short_name, thin_labels
from tracer.report.figures.heatmap import (PositionDiffs, heatmap_figure, position_diffs_comparison,
                                           position_diffs_records, position_diffs_trace, position_max_abs_diff)
from tracer.report.figures.sweep import sweep_data, sweep_figure
from tracer.report.figures.ulp import select_points, ulp_figure

KINDS = ("amplification", "heatmap", "ulp", "sweep")
SUFFIXES = (".png", ".svg", ".pdf")

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
    from tracer.store.integrity import write_error_message

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


__all__ = ["KINDS", "SUFFIXES", "LABEL_ABS", "LABEL_FRAC", "LABEL_KV", "LABEL_ZERO", "PositionDiffs",
           "amplification_data", "amplification_figure", "check_figure_path", "compact_name", "figure_for",
           "heatmap_figure", "position_diffs_comparison", "position_diffs_records", "position_diffs_trace",
           "position_max_abs_diff", "save_figure", "select_points", "short_name", "sweep_data", "sweep_figure",
           "thin_labels", "ulp_figure"]
