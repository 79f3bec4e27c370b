"""How a ``tracer`` process ends: the exit code after a signal, a crash, or a signal during exit.

:func:`exit_interrupted` ends an interrupted or terminated command (130, or 128 + signum) after the
exit hooks; :func:`quiet_exit_on_signals` ends a finished command at once on a late Ctrl-C or
SIGTERM (:func:`restore_signals` undoes it for the next command in the same process);
:func:`dump_on_crash` prints every thread's stack on a native crash; :func:`debug_exit` prints
the traceback of an internal error (``TRACER_DEBUG=1``). :func:`tracer.cli.main` calls them.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from tracer.errors import EXIT_INTERNAL


def dump_on_crash() -> None:
    """A crash in native code (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) prints every thread's Python
    stack to stderr before the process dies of it (:mod:`faulthandler`; the exit status stays the
    signal's): a rare crash (a run once ended with SIGSEGV instead of exit 130 after Ctrl-C, under
    load, and did not recur in 20 runs) leaves the stacks that locate it."""
    import faulthandler

    if not faulthandler.is_enabled():
        try:
            faulthandler.enable(file=sys.stderr, all_threads=True)
        except (ValueError, OSError, AttributeError):  # stderr without a file descriptor (captured in-process)
            pass


def quiet_exit_on_signals() -> None:
    """The command is done (result printed, files written and renamed): a Ctrl-C or SIGTERM that
    comes while Python shuts down (an in-process engine's exit hook takes seconds) ends the
    process at once with 130 / 128 + signum and one line, instead of a traceback from that hook."""
    import signal

    def now(signum: int, _frame: object) -> None:
        sys.stdout.flush()
        os.write(2, b"interrupted while exiting (the command had finished)\n")
        os._exit(130 if signum == signal.SIGINT else 128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            try:
                _BEFORE_EXIT.setdefault(sig, signal.signal(sig, now))
            except (ValueError, OSError):  # not the main thread
                pass


#: the handlers :func:`quiet_exit_on_signals` replaced, for a later main() in the same process
_BEFORE_EXIT: dict[int, Any] = {}


def restore_signals() -> None:
    """Put back the handlers :func:`quiet_exit_on_signals` replaced: a command run in the same process
    after another (``main()`` called again) cleans up on Ctrl-C instead of ending the process at once."""
    import signal

    while _BEFORE_EXIT:
        sig, old = _BEFORE_EXIT.popitem()
        try:
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        except (ValueError, OSError):  # pragma: no cover - not the main thread
            pass


def exit_interrupted(standalone: bool = True) -> None:
    """Exit 128 + signum after SIGTERM/SIGHUP ("terminated"), else 130 after Ctrl-C ("interrupted");
    a terminated command that is not the whole process (``standalone`` False) raises ``SystemExit``."""
    from tracer.errors import terminated_by
    from tracer.report.terminal import err

    signum = terminated_by()
    if signum is not None:  # the signal decides, whatever click or typer made of the interrupt
        err.print("terminated", highlight=False)
        if not standalone:
            sys.exit(128 + signum)
    else:
        err.print("interrupted")
    # Not sys.exit: when the KeyboardInterrupt passed through code that CPython ran as a string
    # (PyRun_*), the interpreter remembers it as unhandled and kills itself with SIGINT at exit
    # (exit -2, about 1 run in 10 here) although it was handled; and a terminated command must end
    # within seconds, while the interpreter's last garbage collection of a large comparison took 3 s
    # (30 s on a loaded machine). Every finally block has run: the exit hooks run, then the exit.
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(130 if signum is None else 128 + signum)


def debug_exit() -> int:
    """Print the traceback of the exception being handled (stderr); returns :data:`tracer.errors.EXIT_INTERNAL`."""
    import traceback

    traceback.print_exc()
    return EXIT_INTERNAL
