"""Output paths of the report layer (the ``--report`` HTML file, figures), checked before any work:
light (no torch, no matplotlib), so a bad path is refused before a model loads."""

from __future__ import annotations

import os
from pathlib import Path

from tracer.errors import TracerError
from tracer.store.integrity import check_name_length, check_output_path

#: the figure formats ``tracer plot`` and ``--plot`` write (from the file's suffix)
SUFFIXES = (".png", ".svg", ".pdf")
#: the figures ``tracer plot --kind`` draws
KINDS = ("amplification", "heatmap", "ulp", "sweep")


def check_report_path(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Validate an HTML report path before anything runs.

    Raises:
        TracerError: not ``.html``, a directory, an existing file without ``overwrite``, a path that
            cannot be written (FIFOs, devices, read-only folders, /proc).
    """
    p = check_name_length(path, "report file")
    if p.suffix.lower() not in (".html", ".htm"):
        raise TracerError(f"report file {p} must end in .html")
    if p.is_dir():
        raise TracerError(f"report file {p} is a directory; give a file name ending in .html")
    if p.exists() and not overwrite:
        raise TracerError(f"{p} exists; pass --overwrite to replace it or choose another file")
    return check_output_path(p, overwrite, "report file")  # FIFOs, devices, read-only folders, /proc


def check_figure_path(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Validate a figure output path before anything is computed.

    Raises:
        TracerError: unsupported suffix, a directory, an existing file without ``overwrite``, a
            path that cannot be written.
    """
    p = check_name_length(path, "figure file")
    if p.suffix.lower() not in SUFFIXES:
        raise TracerError(f"figure file {p} must end in {', '.join(SUFFIXES)}")
    if p.is_dir():
        raise TracerError(f"figure file {p} is a directory; give a file name ending in .png or .svg")
    if p.exists() and not overwrite:
        raise TracerError(f"{p} exists; pass --overwrite to replace it or choose another -o")
    return check_output_path(p, overwrite, "figure file")  # FIFOs, devices, file/p.png, read-only folders


def check_plot_options(kind: str | None, layers: object, output: str | os.PathLike | None, overwrite: bool) -> None:
    """``tracer plot``'s options that need no file: a known ``--kind``, ``--layers`` only with ``--kind
    ulp``, an ``--output`` figure path that can be written (before torch, matplotlib or the trace load).

    Raises:
        TracerError: one line naming the option and the fix.
    """
    if kind is not None and kind not in KINDS:
        from tracer.errors import did_you_mean

        guess = did_you_mean(str(kind), KINDS)
        raise TracerError(f"unknown plot kind '{kind}'; use one of: {', '.join(KINDS)}"
                          + (f" (did you mean {guess}?)" if guess else ""))
    if layers is not None and kind != "ulp":
        raise TracerError(f"--layers picks the points of --kind ulp; the {kind or 'default'} figure draws every point: "
                          "drop --layers or add --kind ulp")
    if output is not None:
        check_figure_path(output, overwrite)


__all__ = ["SUFFIXES", "KINDS", "check_report_path", "check_figure_path", "check_plot_options"]
