"""Where a report prints, and how a line of it fits the terminal.

- :func:`stdout_console`: the console of the terminal, or of a file at a sane width.
- :func:`fit`: one line of text fitted to the console's width: broken between words, every further
  line indented under the first (a hanging indent), styles kept; on stdout piped too (at
  ``$COLUMNS``, else 80), on a piped stderr the line as given (one line a script reads as the
  error). :func:`print_fitted` prints it; :func:`fitted` says which.
- :func:`print_whole`: a table fitted to a width, printed whole even where the console is narrower.
"""

from __future__ import annotations

import re
import sys

from rich.cells import cell_len
from rich.console import Console, RenderableType
from rich.text import Text

from tracer.errors import exit_broken_pipe
from tracer.report.layout import piped_width

#: the indent of a line's continuation when nothing else says (under the first word)
INDENT = 2


class _StdoutConsole(Console):
    """rich's console, ending a command whose stdout reader went away with
    :func:`tracer.errors.exit_broken_pipe` (rich's own ``on_broken_pipe`` exits 1: "diverged")."""

    def on_broken_pipe(self) -> None:
        exit_broken_pipe()


def stdout_console(explicit_columns: bool = False) -> Console:
    """The console reports print to: styled at the terminal's width in a terminal (as rich detects
    one: a TTY, or ``TTY_COMPATIBLE=1`` / ``FORCE_COLOR``); piped, plain text
    :func:`tracer.report.layout.piped_width` wide (``$COLUMNS``, else 80), or wide enough for every
    column when the columns were asked for explicitly (``--wide``, ``--columns``): nothing asked for
    is left out of a file."""
    console = _StdoutConsole()
    if console.is_terminal:
        return console
    return _StdoutConsole(width=1 << 12 if explicit_columns else piped_width(), no_color=True, highlight=False)


def fitted(console: Console) -> bool:
    """Whether lines printed to ``console`` are fitted to its width: in a terminal, and on a piped
    stdout (``$COLUMNS``, else 80: :func:`stdout_console`); not on a piped stderr, where an error or a
    note stays one line for the script that reads it."""
    return console.is_terminal or not console.stderr


def _breaks(text: str, first: int, rest: int) -> list[tuple[int, int]]:
    """``(start, end)`` offsets of each line of ``text`` broken between words: the first line at most
    ``first`` cells, the others ``rest``. A backticked command (`` `tracer sweep ...` ``) that fits
    ``rest`` is kept whole, as one word. A word longer than a line is folded (the one case that
    cuts inside a word: there is no other way to show it whole in that width)."""
    spans: list[tuple[int, int]] = []
    start, n = 0, len(text)
    # a `command` that fits a line of its own is never broken inside its backticks
    whole = {i for m in re.finditer(r"`[^`]+`", text) if cell_len(m.group()) <= rest
             for i in range(m.start(), m.end()) if text[i] == " "}
    room = first
    while start < n:
        while start < n and text[start] == " " and spans:  # a continuation starts at a word
            start += 1
        end, last_space, width = start, -1, 0
        while end < n:
            w = cell_len(text[end])
            if width + w > room:
                break
            if text[end] == " " and end not in whole:
                last_space = end
            width += w
            end += 1
        if end < n and last_space > start:
            end = last_space
        elif end < n and end == start:  # not one cell of room: take a character anyway
            end += 1
        stop = end
        while stop > start and text[stop - 1] == " ":
            stop -= 1
        spans.append((start, stop))
        start, room = end, rest
    return spans or [(0, 0)]


def fit(text: str | Text, console: Console, indent: int = INDENT, *, label: str | Text | None = None,
        width: int | None = None) -> Text:
    """``label`` then ``text``, fitted to ``width`` cells (default: the console's width) when
    :func:`fitted` says so (a terminal, a piped stdout): broken between words, every further line
    indented ``indent`` cells (with a label: under the text, the label padded to ``indent``). On a
    piped stderr, one line as given. Styles of a
    :class:`~rich.text.Text` are kept. A line feed in ``text`` starts a new line (under the text
    after a label, else at the left edge).

    Args:
        text: the line (plain text is not parsed as markup).
        console: decides terminal or not, and the width.
        indent: cells before each continuation line (at least 1).
        label: printed first (``verdict:``); the text starts ``indent`` cells in.
        width: the cells available (default ``console.width``).
    """
    body = text if isinstance(text, Text) else Text(text)
    head = Text() if label is None else (label.copy() if isinstance(label, Text) else Text.assemble((label, "bold")))
    if label is not None:  # padded to the indent, and at least one space after it
        head.append(" " * max(0 if head.plain.endswith(" ") else 1, indent - cell_len(head.plain)))
    room = console.width if width is None else width
    if not fitted(console):
        return Text.assemble(head, body)
    lead = cell_len(head.plain) if label is not None else 0  # a new line ("\n") starts here, continuations at indent
    out = head.copy()
    for n, part in enumerate(body.split("\n", allow_blank=True)):
        first, rest = room - lead, room - indent
        cont = indent
        if rest < 16:  # no room worth indenting into: continue at the edge
            rest, cont = room, 0
        for i, (a, b) in enumerate(_breaks(part.plain, max(1, first), max(1, rest))):
            if i or n:
                out.append("\n" + " " * (cont if i else lead))
            out.append_text(part[a:b])
    return out


def print_fitted(console: Console, text: str | Text, indent: int = INDENT, *, label: str | Text | None = None,
                 style: str | None = None) -> None:
    """Print :func:`fit` of ``text`` (styled ``style``) to ``console``: never wider than a terminal,
    never wrapped by the terminal itself (so continuation lines keep their indent)."""
    body = text.copy() if isinstance(text, Text) else Text(text)
    if style:
        body.stylize(style)
    console.print(fit(body, console, indent, label=label), soft_wrap=True, highlight=False)


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
