"""Showing untrusted text (from trace files, prompts, model names) safely in a terminal.

Report-layer helper (target: ``tracer/report/textsafe.py``). Text read from a file can hold
terminal escape sequences (clear the screen, set the window title, fake a verdict) and rich
markup (``[/bogus]`` raises, ``[link=...]`` hides a URL). :func:`printable` shows control
characters escaped; :func:`plain` also neutralises rich markup, for strings passed to rich.
"""

from __future__ import annotations

import re
from typing import Any

# C0 and C1 controls, DEL, and the Unicode bidi overrides/isolates (which reorder what is shown)
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_CONTROL_NL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match) -> str:
    c = m.group(0)
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def printable(value: Any, *, newlines: bool = False) -> str:
    """``str(value)`` with control characters shown as ``\\x1b``-style escapes.

    Args:
        newlines: keep ``\\n`` and ``\\t`` as they are (for multi-line text); by default they
            are escaped too, so one value stays on one line.
    """
    text = value if isinstance(value, str) else str(value)
    return (_CONTROL if newlines else _CONTROL_NL).sub(_escape, text)


def token_text(text: str, limit: int = 16) -> str:
    """A decoded token as a user can read it on one line: quoted (a leading space shows), newlines
    and tabs as ``\\n`` and ``\\t``, other control characters escaped (:func:`printable`), and
    shortened to ``limit`` characters inside the quotes with ``…``: ``' the'``, ``'\\n\\n'``."""
    s = printable(text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r"))
    return f"'{s[:limit - 1] + '…' if len(s) > limit else s}'"


def plain(value: Any, *, newlines: bool = False) -> str:
    """:func:`printable`, then rich markup escaped: safe to pass to ``console.print`` or a Table."""
    from rich.markup import escape

    return escape(printable(value, newlines=newlines))
