"""Output paths of the report layer (the ``--report`` HTML file, figures), checked before any work:
light (no torch, no matplotlib), so a bad path is refused before a model loads."""

from __future__ import annotations

import os
from pathlib import Path

from tracer.errors import TracerError
from tracer.store.integrity import check_name_length, check_output_path

#: the figure formats ``tracer plot`` and ``--plot`` write (from the file's suffix)
SUFFIXES = (".png", ".svg", ".pdf")


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


__all__ = ["SUFFIXES", "check_report_path", "check_figure_path"]
