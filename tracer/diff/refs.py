"""``FILE:RUN`` arguments of ``tracer compare`` and ``tracer.compare``: which two stored runs they name.

(Argument parsing: the API layer will own it; it lives here until the CLI/API rewrite moves it.)
"""

from __future__ import annotations

from pathlib import Path

from tracer.errors import TracerError


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
        TracerError: no or too many arguments.
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
            raise TracerError(f"trace file {path} not found; give an existing trace (or a run name of {refs[0]})")
    runs = [first[1]] if first[1] is not None else []
    runs += refs[1:]
    if len(runs) > 2:
        raise TracerError("give at most two run names: TRACE RUN_A RUN_B or TRACE:RUN_A TRACE2:RUN_B")
    runs += [None] * (2 - len(runs))
    return (first[0], runs[0]), (first[0], runs[1])
