"""The backstop of SIGTERM, SIGHUP and Ctrl-C: a ``tracer`` command stuck in native code still ends.

The CLI turns these signals into exceptions in the main thread (:func:`tracer.errors.raise_on_termination`),
so partial files, scratch folders and worker processes are cleaned up and the command exits 143, 129
or 130. But Python runs a signal handler only between bytecodes of the main thread: native code that
holds the GIL and does not return (HDF5 looping on a damaged global heap; measured: a thread
printing once a second printed nothing while h5py read such a file) defers the handler forever, and
no other thread of the process runs either. So the backstop lives in another process:

- :func:`start` forks a small watchdog child once, when the command starts (before any file is open);
- Python's C-level signal handler writes each signal's number to the wakeup fd
  (:func:`signal.set_wakeup_fd`) the moment it arrives, whatever the main thread is doing: the
  watchdog reads that pipe;
- the command's own Python handler, when it runs, acknowledges the signal on a second pipe
  (:func:`ack`, called by :func:`tracer.errors.raise_on_termination`'s handlers); a heartbeat
  thread writes to that pipe every :data:`BEAT_S` seconds too, for a handler that is not tracer's
  (an engine's): it can only run while the main thread lets go of the GIL;
- a SIGTERM, SIGHUP or SIGINT followed by :data:`GRACE_S` seconds without an acknowledgement or two
  heartbeats means the command is stuck in native code that holds the GIL: the watchdog prints one
  line, removes the partial files the command holds open (``*.partial-PID``, ``.*.point-PID.h5``,
  read from ``/proc/PID/fd``) and kills it with SIGKILL (exit status 137: the clean exit 143 needs
  the command's own code to run). A command that acknowledged is cleaning up in Python: left alone.

The watchdog ignores the signals itself (a Ctrl-C reaches the whole process group) and exits as
soon as the command does. ``TRACER_WATCHDOG=off`` leaves it out. POSIX only (``os.fork``).

An engine that starts processes of its own (an engine core and its workers) is guarded while it
starts (:func:`guard_start`, a thread of the command): a start can hang for the engine's own ready
timeout (10 minutes) when a worker fails, with heartbeats flowing (the main thread waits in a
poll that lets go of the GIL), and after a signal the engine's own cleanup can wait on those hung
processes. The guard tracks the processes the engine starts (named by their process title), and
when one of them dies during the start, the start exceeds its bound, or a terminating signal
came (the block's ``seen`` list, :func:`tracer.errors.signals_seen`), it kills them (SIGKILL,
after :data:`GRACE_S` for a signal: the engine's cleanup first): the engine's start then fails at
once, and the caller names :attr:`StartGuard.reason` in one line.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import threading
import time
from typing import Iterator

#: seconds after a terminating signal without a heartbeat before the stuck command is killed
GRACE_S = 3.0
#: seconds between heartbeats of a command that can run Python
BEAT_S = 0.5
_STOP = (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", signal.SIGTERM))
_state: dict[str, int] = {}


def start() -> None:
    """Start the watchdog of this process (once; a no-op without ``os.fork``, outside the main thread,
    or with ``TRACER_WATCHDOG=off``)."""
    if _state.get("pid") == os.getpid() or not hasattr(os, "fork") or os.environ.get("TRACER_WATCHDOG") == "off":
        return
    if threading.current_thread() is not threading.main_thread():
        return
    sig_r, sig_w = os.pipe()
    beat_r, beat_w = os.pipe()
    for fd in (sig_w, beat_w):
        os.set_blocking(fd, False)
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        try:
            _watch(parent, sig_r, beat_r)
        finally:
            os._exit(0)
    os.close(sig_r)
    os.close(beat_r)
    signal.set_wakeup_fd(sig_w, warn_on_full_buffer=False)
    _state.update(pid=parent, child=child, sig_w=sig_w, beat_w=beat_w)
    if not _state.get("hooked"):
        os.register_at_fork(after_in_child=_forget)  # a forked worker must not speak for this process
        _state["hooked"] = 1
    threading.Thread(target=_beat, args=(beat_w,), name="tracer-heartbeat", daemon=True).start()
    import atexit

    atexit.register(stop)


def ack() -> None:
    """Tell the watchdog that this process's Python signal handler runs (it cleans up on its own)."""
    fd = _state.get("beat_w")
    if fd is not None and _state.get("pid") == os.getpid():
        try:
            os.write(fd, b"a")
        except OSError:
            pass


def stop() -> None:
    """End the watchdog (the command is exiting): its pipes close, so it exits."""
    if _state.get("pid") != os.getpid():
        return
    try:
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        pass
    for key in ("sig_w", "beat_w"):
        fd = _state.pop(key, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def _forget() -> None:
    """In a child forked from the command: no wakeup fd, no pipes of the parent's watchdog."""
    try:
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        pass
    for key in ("sig_w", "beat_w"):
        fd = _state.pop(key, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _state.pop("pid", None)


def _beat(fd: int) -> None:
    while True:
        time.sleep(BEAT_S)
        try:
            os.write(fd, b".")
        except BlockingIOError:  # the watchdog reads when a signal came; a full pipe is a heartbeat already
            pass
        except OSError:
            return


def _watch(parent: int, sig_r: int, beat_r: int) -> None:
    """The watchdog's loop (in the forked child): see the module docstring."""
    for sig in _STOP:
        signal.signal(sig, signal.SIG_IGN)
    try:
        open_fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        open_fds = list(range(256))
    for fd in open_fds:  # hold nothing of the command's open (its stdout pipe, its files and their locks)
        if fd not in (sig_r, beat_r, 2):
            try:
                os.close(fd)
            except OSError:
                pass
    pending: tuple[int, float] | None = None  # (signal, when) not yet followed by heartbeats
    beats = 0  # heartbeats since the signal: two prove the command runs Python again (one may have been
    # written just before it got stuck)
    while os.getppid() == parent:
        wait = 1.0 if pending is None else max(0.0, pending[1] + GRACE_S - time.monotonic())
        ready, _, _ = select.select([sig_r, beat_r], [], [], wait)
        if beat_r in ready:  # heartbeats first: one read with the signal predates it
            data = os.read(beat_r, 4096)
            if not data:
                return  # the command is gone
            if pending is not None:
                beats += data.count(b".")
                if b"a" in data or beats >= 2:
                    pending = None  # it runs Python after the signal: its own handler cleans up
        if sig_r in ready:
            data = os.read(sig_r, 256)
            if not data:
                return
            stops = [b for b in data if b in _STOP]
            if stops and pending is None:
                pending, beats = (stops[0], time.monotonic()), 0
        if pending is not None and time.monotonic() >= pending[1] + GRACE_S:
            _end(parent, pending[0])
            return


#: seconds a guarded engine start may take (``TRACER_ENGINE_START_S`` overrides)
START_S = 600.0
#: seconds between the start guard's looks at the engine's processes
LOOK_S = 0.25
#: seconds the guard waits, after killing a start's processes, for the start to return before it
#: ends the command itself (:meth:`StartGuard.leave`)
LEAVE_S = 10.0


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux ``/proc/PID/task/TID/children``; ``[]`` elsewhere)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                out.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            pass
    return out


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class StartGuard:
    """The guard of one engine start (:func:`guard_start`): ``reason`` is None, or why it ended the start
    in words (``WHAT's TITLE (pid 123) exited while the engine started``, ``WHAT's engine did not
    start within 600 s``); ``killed``: the processes it killed (pids)."""

    def __init__(self, what: str, marker: str, bound_s: float, seen: list[int]) -> None:
        self.what, self.marker, self.bound_s, self.seen = what, marker, bound_s, seen
        self.reason: str | None = None
        self.killed: list[int] = []
        self.tracked: dict[int, str] = {}
        self._before = set(self._descendants())
        self._done = threading.Event()

    def _descendants(self) -> list[int]:
        out, todo = [], [os.getpid()]
        while todo:
            kids = _children(todo.pop())
            out.extend(kids)
            todo.extend(kids)
        return out

    def look(self, elapsed: float) -> bool:
        """One look at the engine's processes after ``elapsed`` seconds; True when the start must end
        (its processes are killed then)."""
        for pid in self._descendants():
            if pid not in self._before and pid not in self.tracked:
                title = _title(pid)
                if self.marker in title:
                    self.tracked[pid] = next((w for w in title.split() if self.marker in w), title)[:60]
        dead = [pid for pid in self.tracked if not _alive(pid)]
        if dead:
            self.reason = f"{self.what}'s {self.tracked[dead[0]]} (pid {dead[0]}) exited while the engine started"
        elif self.bound_s and elapsed > self.bound_s and self.tracked:
            self.reason = f"{self.what}'s engine did not start within {self.bound_s:g} s"
        elif not (self.seen and elapsed >= self._signal_at + GRACE_S):
            return False
        self.kill()
        return True

    _signal_at = float("inf")

    def kill(self) -> None:
        """SIGKILL every tracked process that still runs."""
        for pid in self.tracked:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                    self.killed.append(pid)
                except OSError:
                    pass

    def run(self) -> None:
        t0 = time.monotonic()
        while not self._done.wait(LOOK_S):
            elapsed = time.monotonic() - t0
            if self.seen and self._signal_at == float("inf"):
                self._signal_at = elapsed
            if self.look(elapsed):
                # the engine's start should fail now; an engine's wait for its core's ready message may
                # watch no process and swallow the signal's exception (a poll retried after the
                # handler ran), so a start still running after LEAVE_S ends the command from here
                if not self._done.wait(LEAVE_S):
                    self.leave()
                return

    def leave(self) -> None:
        """End the command from the guard's thread: one line on stderr, the partial files it holds
        open removed, exit ``128 + signum`` after a signal, else 2 (``os._exit``: the main thread
        is stuck in the engine's wait)."""
        signum = self.seen[0] if self.seen else None
        removed = _remove_partials(os.getpid())
        why = (f"terminated: {self.what}'s start did not return within {GRACE_S + LEAVE_S:g} s of "
               f"{signal.Signals(signum).name}; killed its processes and stopped" if signum is not None else
               f"error: {self.reason}; its start did not return after its processes were killed, so tracer "
               f"stopped (its log says why)")
        line = why + (f"; removed {removed} partial file(s)" if removed else "") + "\n"
        try:  # sys.stderr: the terminal, also while an engine's start sends fd 2 to its log
            import sys

            sys.stderr.write(line)
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - a closed stream: the file descriptor
            os.write(2, line.encode())
        os._exit(128 + signum if signum is not None else 2)


@contextlib.contextmanager
def guard_start(what: str, marker: str, seen: list[int], bound_s: float | None = None) -> Iterator[StartGuard]:
    """Guard an engine's start (the block) from a thread of this process: the processes the block
    starts whose command line holds ``marker`` (the engine's process titles) are tracked; when
    one dies, the block runs longer than ``bound_s`` seconds (default :data:`START_S`, or
    ``TRACER_ENGINE_START_S``; 0: no bound) while it has tracked processes, or a signal is in ``seen``
    for :data:`GRACE_S` seconds, the guard kills them all (SIGKILL), so an engine waiting on them
    fails at once. Yields the :class:`StartGuard`; after the block its ``reason`` says why it killed
    them (None: it did not, or for a signal only). Linux (``/proc``); elsewhere it tracks nothing."""
    if bound_s is None:
        bound_s = start_bound()
    guard = StartGuard(what, marker, bound_s, seen)
    thread = threading.Thread(target=guard.run, name="tracer-start-guard", daemon=True)
    thread.start()
    try:
        yield guard
    finally:
        guard._done.set()
        thread.join(2 * LOOK_S + 1)


def _partials(parent: int) -> list[str]:
    """The partial files ``parent`` holds open (``*.partial-PID``, ``.*.point-PID.h5``; ``/proc``)."""
    pattern = re.compile(rf"\.partial-{parent}(?:-\d+)?(?:\.[A-Za-z0-9]+)?$|\.point-{parent}\.h5$")
    partials = []
    try:
        for fd in os.listdir(f"/proc/{parent}/fd"):
            try:
                target = os.readlink(f"/proc/{parent}/fd/{fd}")
            except OSError:
                continue
            if pattern.search(target) and os.path.isfile(target):
                partials.append(target)
    except OSError:
        pass
    return list(dict.fromkeys(partials))


def _unlink(paths: list[str]) -> int:
    n = 0
    for path in paths:
        try:
            os.unlink(path)
            n += 1
        except OSError:
            pass
    return n


def _remove_partials(parent: int) -> int:
    """Remove the partial files ``parent`` holds open; how many were removed."""
    return _unlink(_partials(parent))


def start_bound() -> float:
    """The bound of a guarded engine start in seconds: ``TRACER_ENGINE_START_S`` (0: no bound), else
    :data:`START_S`.

    Raises:
        TracerError: the variable is not a finite number of seconds >= 0 (one line).
    """
    import math

    raw = os.environ.get("TRACER_ENGINE_START_S")
    if raw is None or not raw.strip():
        return START_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 0:
        from tracer.errors import TracerError

        raise TracerError(f"TRACER_ENGINE_START_S={raw!r} is not a number of seconds >= 0; set it to the seconds an "
                          f"engine may take to start (0: no bound), or unset it ({START_S:g} s)")
    return value


def _end(parent: int, signum: int) -> None:
    """Kill the stuck command after removing the partial files it holds open."""
    partials = _partials(parent)
    name = signal.Signals(signum).name
    os.write(2, (f"terminated: tracer did not stop within {GRACE_S:g} s of {name} (inside native code that does not "
                 f"return to Python, e.g. HDF5 on a damaged file); killed it"
                 + (f" and removed {len(partials)} partial file(s)" if partials else "") + "\n").encode())
    try:
        os.kill(parent, signal.SIGKILL)
    except OSError:
        return
    _unlink(partials)


__all__ = ["start", "ack", "stop", "guard_start", "start_bound", "StartGuard", "GRACE_S", "BEAT_S", "START_S", "LEAVE_S"]
