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
"""

from __future__ import annotations

import os
import re
import select
import signal
import threading
import time

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


def _end(parent: int, signum: int) -> None:
    """Kill the stuck command after removing the partial files it holds open."""
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
    name = signal.Signals(signum).name
    os.write(2, (f"terminated: tracer did not stop within {GRACE_S:g} s of {name} (inside native code that does not "
                 f"return to Python, e.g. HDF5 on a damaged file); killed it"
                 + (f" and removed {len(partials)} partial file(s)" if partials else "") + "\n").encode())
    try:
        os.kill(parent, signal.SIGKILL)
    except OSError:
        return
    for path in dict.fromkeys(partials):
        try:
            os.unlink(path)
        except OSError:
            pass


__all__ = ["start", "ack", "stop", "GRACE_S", "BEAT_S"]
