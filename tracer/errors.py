"""The one exception type tracer raises for bad input or a missing resource.

Every message is one line that says what is wrong and what to do next; the CLI prints it
without a traceback and exits with :data:`EXIT_ERROR`; any other exception is a bug and exits
with :data:`EXIT_INTERNAL`.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

#: Exit codes of the ``tracer`` command.
EXIT_OK = 0  # ran; bit-identical, or report-only mode
EXIT_DIVERGED = 1  # ran; the comparison failed the rule chosen with --fail-on
EXIT_ERROR = 2  # bad input, missing resource or corrupt file; nothing was run or written
EXIT_INTERNAL = 3  # an internal error (a bug): one line, the traceback with TRACER_DEBUG=1
EXIT_BROKEN_PIPE = 141  # stdout's reader went away (`tracer show T | head -1`): 128 + SIGPIPE, as a shell tool's


def exit_broken_pipe() -> None:
    """End the command quietly because the reader of stdout went away: stdout pointed at
    ``os.devnull`` (nothing more is written, and Python's flush at exit cannot fail again), then
    ``SystemExit(EXIT_BROKEN_PIPE)``, never exit 1, which says "diverged".

    Raises:
        SystemExit: always, with :data:`EXIT_BROKEN_PIPE`.
    """
    import os
    import sys

    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    raise SystemExit(EXIT_BROKEN_PIPE)


def did_you_mean(word: str, choices: list[str] | tuple[str, ...], cutoff: float = 0.6) -> str | None:
    """The choice closest to ``word`` (``difflib``), or None when none is close: the "did you mean"
    of a one-line error about an unknown name."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return close[0] if close else None


class TracerError(Exception):
    """Bad input or a missing resource, with a one-line message that names the fix.

    Raised by every public function of tracer for conditions the user can correct
    (unknown model, missing files, bad option values, existing output, corrupt trace).
    """

    def __init__(self, message: str) -> None:
        if "\n" in message:
            raise ValueError("TracerError messages are one line")
        super().__init__(message)


#: who reads tracer's messages: ``"api"`` (Python: ``device="cpu"``) unless the ``tracer`` command set
#: ``"cli"`` (``--device cpu``) for its call (:func:`cli_wording`)
_WORDING: contextvars.ContextVar[str] = contextvars.ContextVar("tracer_wording", default="api")


@contextlib.contextmanager
def cli_wording() -> Iterator[None]:
    """Within the block, :func:`option` spells options as the ``tracer`` command's flags (the CLI's
    ``main`` runs every command in it); outside it, as the Python API's keywords."""
    token = _WORDING.set("cli")
    try:
        yield
    finally:
        _WORDING.reset(token)


def from_cli() -> bool:
    """Whether the ``tracer`` command is the caller (:func:`cli_wording`): a message then names
    commands (``tracer import ...``), else the API's calls (``tracer.import_dump(...)``)."""
    return _WORDING.get() == "cli"


def option(name: str, value: Any = None, flag: str | None = None) -> str:
    """An option as the caller writes it, for a message that says what to do: ``--device cpu`` from
    the ``tracer`` command (:func:`cli_wording`), ``device="cpu"`` from Python (``name`` is the API
    keyword, ``device_map``; its flag is ``--device-map``). ``value`` None: the name alone (``--tp`` /
    ``tp=``); ``flag``: the command's flag where it is not the keyword's (``engine_map``: ``--map``)."""
    if _WORDING.get() == "cli":
        flag = flag or "--" + name.replace("_", "-")
        return flag if value is None else f"{flag} {value}"
    if value is None:
        return f"{name}="
    return f"{name}={value!r}".replace("'", '"') if isinstance(value, str) else f"{name}={value!r}"


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread so that every ``finally`` runs (partial files,
    scratch folders and worker processes are cleaned up as on Ctrl-C); the command exits 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_RECEIVED: list[int] = []


def terminated_by() -> int | None:
    """The signal :func:`raise_on_termination` turned into :class:`Terminated`, if one came."""
    return _RECEIVED[0] if _RECEIVED else None


def raise_on_termination(on_signal: Callable[[], None] | None = None) -> None:
    """Turn SIGTERM and SIGHUP into :class:`Terminated` in this (main) thread: a terminated command
    cleans up on the same path as an interrupted one, instead of dying with its partial files.
    SIGINT raises KeyboardInterrupt, as Python's own handler does. ``on_signal``: called first by
    each of the three handlers (the CLI's watchdog acknowledgement, :func:`tracer.watchdog.ack`)."""
    import signal

    _RECEIVED.clear()  # a new command (tracer.cli.main called again in one process): earlier signals are done

    def handler(signum: int, _frame: object) -> None:
        if on_signal is not None:
            on_signal()
        if _IN_HOOK:  # raised here it would be dropped again: deliver it once the hook has returned
            _redeliver_later(signum)
            return
        _RECEIVED.append(signum)
        raise Terminated(signum)

    def interrupt_handler(signum: int, _frame: object) -> None:
        if on_signal is not None:
            on_signal()
        if _IN_HOOK:
            _redeliver_later(signum)
            return
        raise KeyboardInterrupt

    for sig, fn in ((signal.SIGTERM, handler), (getattr(signal, "SIGHUP", None), handler),
                    (signal.SIGINT, interrupt_handler if on_signal is not None else None)):
        if sig is not None and fn is not None:
            try:
                signal.signal(sig, fn)
            except (ValueError, OSError):  # not the main thread, or not settable here
                pass
    _redeliver_swallowed()


#: the main thread is inside :func:`_redeliver_swallowed`'s hook (a handler must not raise there)
_IN_HOOK: list[bool] = []


def _redeliver_later(signum: int, delay: float = 0.01) -> None:
    """Deliver ``signum`` to the main thread again ``delay`` seconds from now, from a helper thread:
    its handler then runs in the code the main thread went back to, not in the hook that is running
    now (a handler's exception there would be dropped too)."""
    import _thread
    import threading

    timer = threading.Timer(delay, _thread.interrupt_main, args=(signum,))
    timer.daemon = True
    timer.start()


def _redeliver_swallowed() -> None:
    """A handler's exception raised while the main thread ran a finalizer (``__del__``, a weakref
    callback) is printed and dropped by Python ("Exception ignored in ..."), and the command went on
    for minutes: such an interrupt is delivered again, to the main thread, instead of printed. It is
    delivered once the hook has returned (:func:`_redeliver_later`): delivered inside the hook, the
    handler's exception would be dropped as well ("Exception ignored in sys.unraisablehook"). An
    interrupt that struck an exit hook (``atexit``) is not delivered again: it ended that hook, and
    the process is exiting (delivered again, it struck every later hook in turn)."""
    import signal
    import sys

    previous = sys.unraisablehook
    if getattr(previous, "_tracer", False):
        return

    def hook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, (Terminated, KeyboardInterrupt)):
            if "atexit callback" in (unraisable.err_msg or ""):
                # the process is exiting: the exit hook it struck has ended; delivered again, it would
                # strike every later hook in turn (their exceptions come here too) and none would run
                return
            _IN_HOOK.append(True)
            try:
                _redeliver_later(exc.signum if isinstance(exc, Terminated) else signal.SIGINT)
            finally:
                _IN_HOOK.pop()
            return
        previous(unraisable)

    hook._tracer = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def interrupted_in(exc: BaseException) -> bool:
    """Whether ``exc`` (any exception) comes of an interrupt: a signal was received for
    :class:`Terminated`, or a KeyboardInterrupt / Terminated is in its chain (Cython code that was
    interrupted reports ``SystemError: ... returned a result with an exception set``)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return bool(_RECEIVED)


@contextlib.contextmanager
def signals_seen() -> Iterator[list[int]]:
    """Record SIGINT, SIGTERM and SIGHUP inside the block (yields the list of signal numbers), each
    still handled by the handler it had: for library code that swallows an interrupt (an engine's start
    swallows a KeyboardInterrupt, so Ctrl-C ran the whole run, or re-raises it as another error);
    the caller honours what was recorded (:func:`interrupt`). Only callable handlers are wrapped (a default action still kills), and
    only in the main thread; they are restored afterwards."""
    import signal
    import threading

    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    wrapped = {}
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        old = signal.getsignal(sig) if sig is not None else None
        if callable(old):
            def handler(signum: int, frame: Any, _old: Callable = old) -> None:
                seen.append(signum)
                _old(signum, frame)

            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, handler)
                wrapped[sig] = old
    try:
        yield seen
    finally:
        for sig, old in wrapped.items():
            signal.signal(sig, old)


def interrupt(seen: list[int]) -> None:
    """Raise the interrupt of the first signal in ``seen`` (KeyboardInterrupt for SIGINT,
    :class:`~tracer.errors.Terminated` for SIGTERM/SIGHUP); nothing if it is empty."""
    import signal

    if not seen:
        return
    if seen[0] == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(seen[0])
