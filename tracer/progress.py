"""Progress of long commands on stderr, in a terminal and without one: nothing silent for long.

- :class:`ItemProgress`: a known number of items (sweep points, audit checks): in a terminal a
  rich bar with the count, elapsed time and ETA (kept whole at any width; the item's description
  shortened instead); otherwise one log line per item (and one at least
  every :data:`LOG_INTERVAL_S` seconds while an item runs long), e.g.
  ``sweep: 3/10 (30%) N=40 b=16 diverges · elapsed 12s · ETA 28s``. Items may carry weights (an
  audit check's cost) so that the ETA weighs what is left; :meth:`ItemProgress.note` prints a
  result line that stays (above the bar in a terminal).
- :class:`StatusProgress`: a stream of status messages (``run A: ...``, ``repetition 2/6``): a
  rich status line with the elapsed time in a terminal; otherwise a log line for every phase that
  is still running after :data:`DELAY_S` seconds, and again every :data:`LOG_INTERVAL_S` seconds
  while it runs (a background thread), so a fast phase prints nothing and a slow one is never
  silent; a message with ``k/n`` in it gets an ETA.
- :func:`relay_tqdm`: while a status is shown, the tqdm bars of transformers and huggingface_hub
  (loading weights, reading a GGUF) report into it instead of drawing their own lines over it.
- :func:`phase`: one status for one slow call of a command (``compare: reading t.h5``).

Everything writes nothing when ``mode`` is ``off``; ``auto`` follows ``$TRACER_PROGRESS``
(``bar``, ``lines`` or ``off``) when set. Leaf module: depends on rich (and tqdm, when present) and
textwrap only.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import textwrap
import threading
import time
from typing import Any, Callable, Iterator, TextIO

#: without a terminal, a line at least this often while one item runs (seconds)
LOG_INTERVAL_S = 10.0
#: without a terminal, a status message is printed once its phase has run this long (seconds)
DELAY_S = 2.0
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
    if mode == "auto" and os.environ.get("TRACER_PROGRESS", "") in ("bar", "lines", "off"):
        mode = os.environ["TRACER_PROGRESS"]
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
        weight_total: the summed weight of all items (e.g. each audit check's cost); with it the
            ETA is the time per unit of weight finished in this session times the weight left
            (:meth:`advance` says each item's weight). ``weight_done``: the weight finished before.
    """

    def __init__(self, label: str, total: int | None, *, done: int = 0, mode: str | bool = "auto",
                 stream: TextIO | None = None, interval_s: float = LOG_INTERVAL_S,
                 weight_total: float | None = None, weight_done: float = 0.0) -> None:
        self.label, self.total, self.done = label, total, done
        self.stream = stream
        self.mode = resolve_mode(mode, stream)
        self.interval_s = interval_s
        self.start_done = done
        self.weight_total, self.weight_done, self.session_weight = weight_total, weight_done, 0.0
        self._running: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
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
            from rich.table import Column

            # the count, elapsed time and ETA keep their widths; the item's description takes what is left
            # and is the one shortened ("…") in a narrow terminal
            self.bar = Progress(TextColumn(f"[bold]{self.label}"), BarColumn(bar_width=16), MofNCompleteColumn(),
                                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                TextColumn("{task.description}", markup=False,
                                           table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
                                console=Console(file=self.stream or sys.stderr, stderr=self.stream is None),
                                transient=False, expand=True)
            self.bar.__enter__()
            self.task = self.bar.add_task("", total=self.total, completed=self.done)
        elif self.mode == "lines":  # the heartbeat of an item that runs long (see update)
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="tracer-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.bar is not None:
            self.bar.__exit__(*exc)
            self.bar = None

    def _watch(self) -> None:
        """Without a terminal: the running item's line again every :attr:`interval_s` (only for an
        item announced with :meth:`update`; :meth:`advance` ends it)."""
        while not self._stop.wait(0.2):
            if self._running is not None:
                self.tick(self._running)

    def eta_s(self) -> float | None:
        """Seconds left, from the mean time of the items (or of a unit of weight) finished in this
        session (None: unknown)."""
        elapsed = time.monotonic() - self.t0
        if self.weight_total is not None and self.session_weight > 0:
            return elapsed / self.session_weight * max(0.0, self.weight_total - self.weight_done)
        n = self.done - self.start_done
        if not n or self.total is None:
            return None
        return elapsed / n * max(0, self.total - self.done)

    def note(self, text: str) -> None:
        """A line that stays: above the bar in a terminal, on its own line otherwise (nothing when off)."""
        if self.mode == "bar" and self.bar is not None:  # fitted to the terminal: broken between words
            width = max(20, self.bar.console.width - 1)
            lines = textwrap.wrap(text, width, subsequent_indent=" " * 4, break_long_words=False,
                                  break_on_hyphens=False) or [""]
            self.bar.console.print("\n".join(lines), highlight=False, markup=False, soft_wrap=True)
        elif self.mode != "off":
            self._print(text)

    def line(self, description: str = "", running: bool = False) -> str:
        """The log line for the current state."""
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        pct = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        what = f" running {description}" if running else (f" {description}" if description else "")
        return (f"{self.label}: {count}{pct}{what} · elapsed {_clock(time.monotonic() - self.t0)}"
                f" · ETA {_clock(self.eta_s())}")

    def _print(self, text: str) -> None:
        with self._lock:
            print(text, file=self.stream or sys.stderr, flush=True)
            self.last_line = time.monotonic()

    def advance(self, description: str = "", n: int = 1, weight: float | None = None, timed: bool = True) -> None:
        """``n`` items finished; ``description`` says which (and how it went); ``weight``: their
        weight, when the ETA weighs items (``weight_total``); ``timed=False``: they took no time in
        this session (kept from an earlier one), so the ETA does not learn from them."""
        self.done += n
        self._running = None  # the item announced by update() is over: no more heartbeat for it
        if not timed:
            self.start_done += n
        if weight is not None:
            self.weight_done += weight
            if timed:
                self.session_weight += weight
        if self.mode == "bar" and self.bar is not None:
            self.bar.update(self.task, advance=n, description=description)
        elif self.mode == "lines":
            self._print(self.line(description))

    def update(self, done: int | None = None, total: int | None = None, description: str = "") -> None:
        """The item now running (``description``), with the count so far: a line when ``done`` moved
        or another item starts (or, without a terminal, after :attr:`interval_s` of silence)."""
        moved = (done is not None and done != self.done) or description != self._running
        self._running = description
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
    """A callable ``status(message)``: a rich status line in a terminal; otherwise a log line
    (``label: message · elapsed 12s``, plus an ETA when the message holds ``k/n``) for each phase
    (at once, or once it has run ``delay_s`` seconds), and again every
    :data:`LOG_INTERVAL_S` seconds while it runs. While it is open, tqdm bars report into it
    (:func:`relay_tqdm`).

    Args:
        label: the command, first word of every line.
        mode: ``auto``/``bar``/``lines``/``off`` (see :func:`resolve_mode`).
        stream: where lines go (default stderr).
        delay_s: without a terminal, how long a phase runs before its line is printed (0, the
            default: at once; :data:`DELAY_S` keeps fast phases silent).
        interval_s: without a terminal, the longest silence while a phase runs.
    """

    _COUNT = re.compile(r"(\d+)/(\d+)")

    def __init__(self, label: str, *, mode: str | bool = "auto", stream: TextIO | None = None,
                 delay_s: float = 0.0, interval_s: float = LOG_INTERVAL_S) -> None:
        self.label = label
        self.stream = stream
        self.mode = resolve_mode(mode, stream)
        self.delay_s, self.interval_s = delay_s, interval_s
        self.t0 = time.monotonic()
        self.status: Any = None
        self.message, self.detail, self.since, self.printed_at = "", "", self.t0, None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._relay: Any = None
        # the counted sequence the message is in (``re-run 2/3``): (text before the count, n, first k
        # seen, when it began, current k, when it began): its ETA counts from its own start
        self._count: tuple[str, int, int, float, int, float] | None = None

    def __enter__(self) -> StatusProgress:
        self.t0 = time.monotonic()
        if self.mode == "bar":
            from rich.console import Console

            # the status renders this object at every refresh (rich's spinner, ~12 times a second), so the
            # elapsed time runs while a phase does, not only when a message comes
            self.status = Console(file=self.stream or sys.stderr, stderr=self.stream is None).status(_LiveText(self))
            self.status.__enter__()
        elif self.mode == "lines":
            self._thread = threading.Thread(target=self._watch, name="tracer-progress", daemon=True)
            self._thread.start()
        if self.mode != "off":
            self._relay = relay_tqdm(self.report)
            self._relay.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._relay is not None:
            self._relay.__exit__(*exc)
            self._relay = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.status is not None:
            self.status.__exit__(*exc)
            self.status = None

    def _counted(self, message: str, now: float) -> None:
        """Follow the ``k/n`` count in ``message``: a new sequence (other words before the count,
        another n, or k going back) starts its own clock; each new k notes when it began."""
        m = self._COUNT.search(message)
        if m is None:
            return
        k, n, prefix = int(m.group(1)), int(m.group(2)), message[:m.start()]
        c = self._count
        if c is None or c[0] != prefix or c[1] != n or k < c[4]:
            self._count = (prefix, n, k, now, k, now)
        elif k != c[4]:
            self._count = (prefix, n, c[2], c[3], k, now)

    def eta_s(self, now: float) -> float | None:
        """Seconds left of the counted sequence the current message is in (``re-run 2/3``): the mean
        time of its items finished so far (counted from the sequence's own start, not the command's)
        times the items left, the running one included, less the time the running one has taken;
        None before one item of the sequence finished."""
        c = self._count
        m = self._COUNT.search(self.message)
        if c is None or m is None or c[0] != self.message[:m.start()] or c[4] <= c[2] or c[1] < c[4]:
            return None
        _, n, k0, t_k0, k, t_k = c
        per_item = (t_k - t_k0) / (k - k0)
        return max(0.0, per_item * (n - k + 1) - (now - t_k))

    def _text(self, now: float, elapsed: str = "") -> str:
        eta_s = self.eta_s(now)
        eta = f" · ETA {_clock(eta_s)}" if eta_s is not None else ""
        detail = f" · {self.detail}" if self.detail else ""
        return f"{self.message}{detail} · {elapsed}{_clock(now - self.t0)}{eta}"

    def __call__(self, message: str) -> None:
        """A new phase: ``message`` says what runs now."""
        now = time.monotonic()
        with self._lock:
            self.message, self.detail, self.since, self.printed_at = message, "", now, None
            self._counted(message, now)
            if self.mode == "bar" and self.status is not None:
                self.status.update(_LiveText(self))
            elif self.mode == "lines" and self.delay_s <= 0:
                self._line(now)

    @property
    def loader(self) -> Any:
        """What to give a loader as its ``progress``: this status (its messages and relayed bars
        land here), or False when the status is off (nothing shown, bars included)."""
        return self if self.mode != "off" else False

    def report(self, detail: str) -> None:
        """Progress inside the current phase (``Loading weights 45/272``): shown with its message."""
        with self._lock:
            self.detail = detail  # the status shows it at its next refresh (_LiveText)

    def _line(self, now: float) -> None:
        print(f"{self.label}: {self._text(now, 'elapsed ')}", file=self.stream or sys.stderr, flush=True)
        self.printed_at = now

    def tick(self, now: float) -> bool:
        """Without a terminal: print the current phase's line if it is due at ``now`` (once the phase
        ran :attr:`delay_s`, then every :attr:`interval_s`); True if a line was printed."""
        with self._lock:
            if not self.message or self.mode != "lines":
                return False
            due = (now - self.since >= self.delay_s) if self.printed_at is None else \
                (now - self.printed_at >= self.interval_s)
            if due:
                self._line(now)
            return due

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            self.tick(time.monotonic())


class _LiveText:
    """What a :class:`StatusProgress` shows in a terminal, rendered anew at each of rich's refreshes:
    the current message with the elapsed time (and ETA) of that moment."""

    def __init__(self, owner: StatusProgress) -> None:
        self.owner = owner

    def __rich__(self) -> Any:
        from rich.text import Text

        return Text(self.owner._text(time.monotonic()))


@contextlib.contextmanager
def phase(label: str, message: str, *, mode: str | bool = "auto", stream: TextIO | None = None) -> Iterator[StatusProgress]:
    """One :class:`StatusProgress` around one slow step of a command (reading, comparing, drawing)::

        with phase("compare", f"comparing {a} with {b}"):
            comparison = compare_runs(...)
    """
    with StatusProgress(label, mode=mode, stream=stream, delay_s=DELAY_S) as status:
        status(message)
        yield status


class _Discard:
    """A text stream that keeps nothing (where relayed tqdm bars draw)."""

    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        return None

    def isatty(self) -> bool:
        return False


@contextlib.contextmanager
def relay_tqdm(report: Callable[[str], None]) -> Iterator[None]:
    """While open, every tqdm bar (transformers' weight loading, huggingface_hub's downloads, the
    GGUF reader) draws nothing itself and calls ``report("<desc> <n>/<total>")`` instead, so one
    display shows it; the class is restored afterwards. Without tqdm installed: nothing to do."""
    try:
        import tqdm.std as tstd
    except ImportError:
        yield
        return
    cls = tstd.tqdm
    init, display = cls.__init__, cls.display

    def relayed_init(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) >= 5:  # tqdm(iterable, desc, total, leave, file, ...)
            args = (*args[:4], _Discard(), *args[5:])
        else:
            kwargs["file"] = _Discard()
        init(self, *args, **kwargs)

    def relayed_display(self: Any, msg: Any = None, pos: Any = None) -> bool:
        total = f"/{self.total:g}" if self.total else ""
        desc = (self.desc or "").rstrip(": ") or "working"
        report(f"{desc} {self.n:g}{total}")
        return True

    cls.__init__, cls.display = relayed_init, relayed_display
    try:
        yield
    finally:
        cls.__init__, cls.display = init, display
