"""The first code a spawned tensor-parallel rank runs: tie its life to the parent, then take the job.

A rank is a ``torch.multiprocessing`` spawn child. Everything it imports before this module's
:func:`rank_main` runs is time during which a ``kill -9`` of the parent would leave it running
(reparented to init), so this module imports nothing heavy (no torch: importing it takes seconds on
a loaded machine): the parent-death signal is set within a few hundred milliseconds of the
interpreter's start, and only then is the job (the model's shared tensors, the plan, the points)
received over a pipe and the real work (:func:`tracer.engines.tp.ranks.worker`) imported.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

#: libc's prctl option that sends the calling process a signal when its parent thread exits
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Kill this process when the parent goes away, even after a SIGKILL of the parent: the kernel's
    parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, Linux), checked once against a parent
    that is already gone, and a watchdog thread polling the parent PID (every 0.2 s) where prctl is
    unavailable."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True, name="tracer-tp-watchdog").start()


def rank_main(rank: int, conn: Any, parent_pid: int) -> None:
    """The spawned rank's entry point: :func:`die_with_parent`, then receive the job from ``conn``
    (the reading end of a pipe the parent writes one :class:`~tracer.engines.tp.ranks.Job` into)
    and run it. A parent that dies before sending ends the rank (EOF on the pipe)."""
    die_with_parent(parent_pid)
    try:
        job = conn.recv()
    except (EOFError, OSError):
        os._exit(1)
    finally:
        conn.close()
    from tracer.engines.tp.ranks import worker

    worker(rank, job)
