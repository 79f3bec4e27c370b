"""``FILE:RUN`` arguments of ``tracer compare`` and ``tracer.compare``: which two stored runs they name.

(Argument parsing: the API layer will own it; it lives here until the CLI/API rewrite moves it.)
"""

from __future__ import annotations

import os
from typing import Any
from pathlib import Path

from tracer.errors import TracerError
from tracer.files import check_input_file


def _is_file_ref(ref: str) -> bool:
    return Path(ref).is_file() or (":" in ref and Path(ref.rsplit(":", 1)[0]).is_file())


def split_ref(ref: str) -> tuple[str, str | None]:
    """``FILE`` → ``(FILE, None)``; ``FILE:RUN`` → ``(FILE, RUN)`` (a path that exists as a file wins)."""
    if Path(ref).exists() or ":" not in ref:
        return ref, None
    path, run = ref.rsplit(":", 1)
    return path, run or None


def resolve_refs(refs: list[str]) -> tuple[tuple[str, str | None], tuple[str, str | None]]:
    """The two runs named by ``tracer compare``'s arguments.

    ``TRACE`` (its first two runs) · ``TRACE RUN_A [RUN_B]`` (runs of one file) ·
    ``TRACE[:RUN] TRACE2[:RUN]`` (a run of each file; a file without ``:RUN`` uses the run of the
    other side's name, else its first run).

    Raises:
        TracerError: no or too many arguments; a second trace missing, or there but no regular file
            (a FIFO, a symlink loop: named as what it is), or a trace where a run name belongs.
    """
    if not 1 <= len(refs) <= 3:
        raise TracerError("give TRACE [RUN_A [RUN_B]] or TRACE[:RUN] TRACE2[:RUN]")
    first = split_ref(refs[0])
    if len(refs) == 2 and _is_file_ref(refs[1]):
        return first, split_ref(refs[1])
    if len(refs) == 1 and first[1] is not None:
        return first, (first[0], None)
    for ref in refs[1:]:  # a run name never looks like a file: a missing second trace is named as such
        path = split_ref(ref)[0]
        if path.lower().endswith((".h5", ".hdf5")) or "/" in path:
            if os.path.lexists(path):  # there, but no regular file (a FIFO, a symlink loop): say what it is
                check_input_file(path, "input")
                raise TracerError(f"{ref} names a trace among {len(refs)} arguments; give TRACE RUN_A RUN_B (two runs of "
                                  "one trace) or TRACE[:RUN] TRACE2[:RUN] (a run of each of two traces)")
            raise TracerError(f"trace file {path} not found; give an existing trace (or a run name of {refs[0]})")
    runs = [first[1]] if first[1] is not None else []
    runs += refs[1:]
    if len(runs) > 2:
        raise TracerError("give at most two run names: TRACE RUN_A RUN_B or TRACE:RUN_A TRACE2:RUN_B")
    runs += [None] * (2 - len(runs))
    return (first[0], runs[0]), (first[0], runs[1])


def is_ref(x: Any) -> bool:
    """``x`` names a stored run: ``"file.h5[:RUN]"``, a path, or ``(file, run)``."""
    return isinstance(x, (str, tuple)) or hasattr(x, "__fspath__")


def stored_ref(x: Any, side: int) -> tuple[str, str]:
    """``(file, run)`` of a reference; a file without a run: its first run (``side`` 0) or second (1).

    Raises:
        TracerError: the file holds too few runs.
    """
    if isinstance(x, tuple):
        return str(x[0]), x[1]
    path, run = split_ref(str(x))
    if run is None:
        from tracer.store.trace import TraceReader

        with TraceReader(path) as r:
            if len(r.runs) <= side:
                raise TracerError(f"{path} holds {len(r.runs)} run(s); name the run as {path}:RUN")
            run = r.runs[side]
    return path, run


def as_record(x: Any, name: str, side: int) -> Any:
    """A RunRecord of a capture, a run record, or a stored run (read whole).

    Raises:
        TracerError: anything else.
    """
    from tracer.execute.records import RunRecord

    if callable(getattr(x, "run_record", None)):  # tracer.capture(...) of any engine hands its run record
        return x.run_record(name)
    if isinstance(x, RunRecord):
        return x
    if is_ref(x):
        from tracer.store.trace import TraceReader

        path, run = stored_ref(x, side)
        with TraceReader(path) as r:
            return r.run(run)
    raise TracerError(f"cannot compare a {type(x).__name__}; give a tracer.capture(...), a RunRecord or 'file.h5:RUN'")
