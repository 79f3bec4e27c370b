"""Where a report prints: the console of the terminal, or of a file at a sane width."""

from __future__ import annotations

import sys

from rich.console import Console

from tracer.report.layout import piped_width


def stdout_console(explicit_columns: bool = False) -> Console:
    """The console reports print to: styled at the terminal's width in a terminal; piped, plain text
    :func:`tracer.report.layout.piped_width` wide (``$COLUMNS``, else 120), or wide enough for every
    column when the columns were asked for explicitly (``--wide``, ``--columns``): nothing asked for
    is left out of a file."""
    if sys.stdout.isatty():
        return Console()
    return Console(width=1 << 12 if explicit_columns else piped_width(), no_color=True, highlight=False)
