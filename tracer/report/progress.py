"""Progress of long commands on stderr, in a terminal and without one.

- :class:`ItemProgress`: a known number of items (sweep points, audit checks): in a terminal a
  rich bar with the count, elapsed time and ETA; otherwise one log line per item (and one at least
  every :data:`LOG_INTERVAL_S` seconds while an item runs long), e.g.
  ``sweep: 3/10 (30%) N=40 b=16 diverges · elapsed 12s · ETA 28s``.
- :class:`StatusProgress`: a stream of status messages (``run A: ...``, ``repetition 2/6``): a
  rich status line with the elapsed time in a terminal, one log line per message otherwise; a
  message with ``k/n`` in it gets an ETA.

Both write nothing when ``mode`` is ``off``. Leaf module: depends on rich only.
"""

from __future__ import annotations

import re
import sys
import time
from typing import Any, TextIO

#: without a terminal, a line at least this often while one item runs (seconds)
LOG_INTERVAL_S = 10.0
MODES = ("auto", "bar", "lines", "off")


def _clock(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def resolve_mode(mode: str | bool, stream: TextIO | None = None) -> str:
    """``auto`` (or True) → ``bar`` on a terminal, ``lines`` otherwise; False → ``off``.

    Raises:
        ValueError: an unknown mode (a programming error, not user input).
    """
    if mode is True:
        mode = "auto"
    elif mode is False or mode is None:
        mode = "off"
    if mode not in MODES:
        raise ValueError(f"progress mode {mode!r}; use one of {MODES}")
    if mode == "auto":
        s = stream or sys.stderr
        return "bar" if getattr(s, "isatty", lambda: False)() else "lines"
    return mode


class ItemProgress:
    """Progress over ``total`` items (None: unknown until :meth:`update` says).

    Args:
        label: the command (``sweep``, ``audit``), first word of every line.
        total: number of items; ``done``: items already finished (a resumed sweep).
        mode: ``auto``/``bar``/``lines``/``off`` (see :func:`resolve_mode`).
        stream: where lines go (default stderr).
        interval_s: without a terminal, the longest silence while an item runs.
    """

    def __init__(self, label: str, total: int | None, *, done: int = 0, mode: str | bool = "auto",
                 stream: TextIO | None = None, interval_s: float = LOG_INTERVAL_S) -> None:
        self.label, self.total, self.done = label, total, done
        self.stream = stream
        self.mode = resolve_mode(mode, stream)
        self.interval_s = interval_s
        self.start_done = done
        self.t0 = time.monotonic()
        self.last_line = self.t0
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self) -> ItemProgress:
        self.t0 = self.last_line = time.monotonic()
        if self.mode == "bar":
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.bar = Progress(TextColumn(f"[bold]{self.label}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.description}"), TimeElapsedColumn(), TextColumn("ETA"),
                                TimeRemainingColumn(), console=Console(file=self.stream or sys.stderr, stderr=self.stream is None),
                                transient=False)
            self.bar.__enter__()
            self.task = self.bar.add_task("", total=self.total, completed=self.done)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
            self.bar = None

    def eta_s(self) -> float | None:
        """Seconds left, from the mean time of the items finished in this session (None: unknown)."""
        n = self.done - self.start_done
        if not n or self.total is None:
            return None
        return (time.monotonic() - self.t0) / n * max(0, self.total - self.done)

    def line(self, description: str = "", running: bool = False) -> str:
        """The log line for the current state."""
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        what = f" running {description}" if running else (f" {description}" if description else "")
        return (f"{self.label}: {count}{pct}{what} · elapsed {_clock(time.monotonic() - self.t0)}"
                f" · ETA {_clock(self.eta_s())}")

    def _print(self, text: str) -> None:
        print(text, file=self.stream or sys.stderr, flush=True)
        self.last_line = time.monotonic()

    def advance(self, description: str = "", n: int = 1) -> None:
        """``n`` items finished; ``description`` says which (and how it went)."""
        self.done += n
        if self.mode == "bar" and self.bar is not None:
            self.bar.update(self.task, advance=n, description=description)
        elif self.mode == "lines":
            self._print(self.line(description))

    def update(self, done: int | None = None, total: int | None = None, description: str = "") -> None:
        """The item now running (``description``), with the count so far: a line when ``done`` moved
        (or, without a terminal, after :attr:`interval_s` of silence)."""
        moved = done is not None and done != self.done
        if total is not None:
            self.total = total
        if done is not None:
            self.done = done
        if self.mode == "bar" and self.bar is not None:
            self.bar.update(self.task, completed=self.done, total=self.total, description=description)
        elif self.mode == "lines" and (moved or self.done == 0 or time.monotonic() - self.last_line >= self.interval_s):
            self._print(self.line(description, running=True))

    def tick(self, description: str = "") -> None:
        """Call while an item runs: without a terminal, a line when :attr:`interval_s` passed silently."""
        if self.mode == "lines" and time.monotonic() - self.last_line >= self.interval_s:
            self._print(self.line(description, running=True))


class StatusProgress:
    """A callable ``status(message)``: a rich status line in a terminal, one log line per message
    otherwise (``label: message · elapsed 12s``, plus an ETA when the message holds ``k/n``)."""

    _COUNT = re.compile(r"(\d+)/(\d+)")

    def __init__(self, label: str, *, mode: str | bool = "auto", stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = stream
        self.mode = resolve_mode(mode, stream)
        self.t0 = time.monotonic()
        self.status: Any = None

    def __enter__(self) -> StatusProgress:
        self.t0 = time.monotonic()
        if self.mode == "bar":
            from rich.console import Console

            self.status = Console(file=self.stream or sys.stderr, stderr=self.stream is None).status(self.label)
            self.status.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.status is not None:
            self.status.__exit__(*exc)
            self.status = None

    def __call__(self, message: str) -> None:
        elapsed = time.monotonic() - self.t0
        eta = ""
        m = self._COUNT.search(message)
        if m and int(m.group(1)) > 1 and int(m.group(2)) >= int(m.group(1)):
            k, n = int(m.group(1)), int(m.group(2))
            eta = f" · ETA {_clock(elapsed / (k - 1) * (n - k + 1))}"
        if self.mode == "bar" and self.status is not None:
            self.status.update(f"{message} · {_clock(elapsed)}{eta}")
        elif self.mode == "lines":
            print(f"{self.label}: {message} · elapsed {_clock(elapsed)}{eta}", file=self.stream or sys.stderr, flush=True)
