"""Where a report prints: the console of the terminal, or of a file at a sane width."""

from __future__ import annotations

import sys

from rich.console import Console, RenderableType

from tracer.report.layout import piped_width


def stdout_console(explicit_columns: bool = False) -> Console:
    """The console reports print to: styled at the terminal's width in a terminal; piped, plain text
    :func:`tracer.report.layout.piped_width` wide (``$COLUMNS``, else 120), or wide enough for every
    column when the columns were asked for explicitly (``--wide``, ``--columns``): nothing asked for
    is left out of a file."""
    if sys.stdout.isatty():
        return Console()
    return Console(width=1 << 12 if explicit_columns else piped_width(), no_color=True, highlight=False)


def print_whole(console: Console, renderable: RenderableType, width: int) -> None:
    """Print ``renderable`` (a table fitted to ``width`` characters) at ``width`` even where the console is
    narrower: rich caps ``print(width=...)`` at the console's width and then squeezes fixed-width columns,
    folding headers mid-word and numbers onto a second line; a table wider than the terminal wraps
    instead, and every number stays whole."""
    if width <= console.width:
        console.print(renderable)
        return
    saved = console._width  # noqa: SLF001 - rich has no public way back to "not set" (the terminal's width)
    console.width = width
    try:
        console.print(renderable, crop=False)
    finally:
        console._width = saved  # noqa: SLF001
