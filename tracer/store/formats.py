"""The trace format versions this tracer reads and writes: one registration per version.

Store-layer module (anndata's pattern: readers and writers registered per encoding version). Each
layout module registers a :class:`TraceFormat` when it is imported (:mod:`tracer.store.format_v1`:
one dataset per capture point; :mod:`tracer.store.packed`: versions 2 and 3, every point of a dtype
in one dataset plus an index; version 3's JSON documents are the records of
:mod:`tracer.store.header`, and a version's :attr:`TraceFormat.upgrade` turns the documents an
older version wrote into version 3's); :mod:`tracer.store.reader` and :mod:`tracer.store.writer`
look the file's version up here. A new format version is a new registration, not a branch in old
code. An unknown version is refused with a one-line error naming the versions this tracer reads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

import h5py
import numpy as np

from tracer.errors import TracerError
from tracer.execute.records import RunRecord
from tracer.store.crc import crc32_bytes
from tracer.store.integrity import seal, set_text, set_value

#: the root ``format`` attribute of every trace
FORMAT = "tracer-trace"
#: the format version :class:`~tracer.store.writer.TraceWriter` writes by default
FORMAT_VERSION = 3
#: compression filters accepted by the writer
COMPRESSIONS = (None, "lzf", "gzip")


@dataclass(frozen=True)
class TraceFormat:
    """How one format version lays out a run, and the functions that read and write it.

    Attributes:
        version: the root ``format_version`` it is registered under.
        run_attrs: the run group attributes this version requires (checked and checksummed first).
        handle: the type of the per-point handle :meth:`TraceReader.captures` hands out.
        write_run: ``(runs group, RunRecord, compression) -> run group``: write one whole run.
        validate_run: ``(run group, members, run, path, file_size, checked, seen, (T, N)) ->
            entries or None``: check the version-specific part of a run before any use
            (:func:`tracer.store.validate.validate_trace`); raises :class:`TracerError`.
        open_run: ``(run group, entries, fd) -> {name: handle}`` in execution order.
        info: ``(handle, entry or None) -> {"kind", "op", "calls", "dtype", "shape"}``.
        read: ``(handle, rows, pin) -> tensor``: a point's tensor, bit-exact (whole reads checked).
        read_all: ``(handles) -> {name: tensor}`` or None (then :attr:`read` per point).
        row_blocks: ``(handle, rows_per_block, buffers) -> iterator of (first row, tensor)``.
        crc: ``(handle) -> stored CRC-32 of the point's data, or None``.
        upgrade: ``(kind, document) -> document``: a JSON document this version wrote (``kind``:
            ``header``, ``plan``, ``meta``, ``comparison``) as the current version writes it
            (:func:`tracer.store.header.upgrade_v2`); the reader and the validation see only that.
    """

    version: int
    run_attrs: tuple[str, ...]
    handle: type
    write_run: Callable[..., Any]
    validate_run: Callable[..., Any]
    open_run: Callable[..., dict[str, Any]]
    info: Callable[..., dict[str, Any]]
    read: Callable[..., Any]
    row_blocks: Callable[..., Any]
    crc: Callable[..., int | None]
    read_all: Callable[..., Any] | None = None
    upgrade: Callable[[str, Any], Any] = lambda kind, doc: doc


FORMATS: dict[int, TraceFormat] = {}


def register(fmt: TraceFormat) -> TraceFormat:
    """Register ``fmt`` under its version (a module registers its layout once, on import).

    Raises:
        TracerError: another format is already registered under that version.
    """
    old = FORMATS.get(fmt.version)
    if old is not None and old != fmt:
        raise TracerError(f"trace format_version {fmt.version} is registered twice; a new layout needs a new version")
    FORMATS[fmt.version] = fmt
    return fmt


def read_versions() -> tuple[int, ...]:
    """The format versions this tracer reads, ascending."""
    return tuple(sorted(FORMATS))


def format_for(version: Any, where: Any = "the trace") -> TraceFormat:
    """The registered format of ``version`` (an int, as stored; ``"1"`` or ``1.5`` are not versions).

    Raises:
        TracerError: an unknown or malformed version, naming the versions this tracer reads.
    """
    fmt = FORMATS.get(version) if isinstance(version, int) and not isinstance(version, bool) else None
    if fmt is None:
        known = ", ".join(map(str, read_versions()))
        shown = repr(version)[:20]
        raise TracerError(f"{where} has trace format_version {shown}; this tracer reads version {known}; "
                          "use a matching tracer or re-run")
    return fmt


def format_of(handle: Any) -> TraceFormat:
    """The registered format whose point handles are of ``handle``'s type.

    Raises:
        TracerError: ``handle`` is not a capture point handle of any registered format.
    """
    for fmt in FORMATS.values():
        if isinstance(handle, fmt.handle):
            return fmt
    raise TracerError(f"{type(handle).__name__} is not a capture point of a trace; pass what TraceReader.captures() returns")


def json_dumps(value: Any, what: str, *, safe: bool = False) -> str:
    """``json.dumps(value)``, or a one-line error naming ``what`` when it is not JSON-serialisable.

    ``safe``: strict JSON, a non-finite float written as the string ``"inf"``, ``"-inf"`` or
    ``"nan"``: the same text as ``json.dumps(tracer.store.trace.json_safe(value))``, without its
    walk over every value in Python (a comparison's document holds thousands): the bare tokens
    ``Infinity``/``-Infinity``/``NaN`` that :func:`json.dumps` writes outside its strings are
    replaced in the text.

    Raises:
        TracerError: ``value`` holds something JSON cannot encode.
    """
    try:
        text = json.dumps(value)
    except (TypeError, ValueError) as e:
        raise TracerError(f"{what} is not JSON-serialisable ({e}); pass plain str/int/float/bool/list/dict values") from None
    if not safe or ("NaN" not in text and "Infinity" not in text):
        return text
    parts, end = [], 0
    for m in _TOKENS.finditer(text):  # every string, skipped whole, and every bare token
        if m.lastindex:
            start, stop = m.span()
            parts += (text[end:start], _SAFE[m[1]])
            end = stop
    parts.append(text[end:])
    return "".join(parts)


#: a JSON string as json.dumps writes it (ASCII, quotes and backslashes escaped), or a bare non-finite float
_TOKENS = re.compile(r'"(?:[^"\\]++|\\.)*+"|(-?Infinity|NaN)')
_SAFE = {"Infinity": '"inf"', "-Infinity": '"-inf"', "NaN": '"nan"'}


def check_name(name: Any, what: str) -> None:
    """Refuse a run, capture or comparison name that is not a valid HDF5 link name for a trace.

    Raises:
        TracerError: not a non-empty UTF-8 string, contains ``/``, or is ``.``.
    """
    if not isinstance(name, str) or not name or "/" in name or name == ".":
        raise TracerError(f"{what} {name!r} is not a valid trace name; use a non-empty name without '/'")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise TracerError(f"{what} {name!r} holds bytes that are not UTF-8; use a UTF-8 name") from None


def write_run_group(runs: h5py.Group, run: RunRecord, fill: Callable[[h5py.Group, dict[str, int]], None],
                    attrs: dict[str, str] | None = None) -> h5py.Group:
    """The group ``runs[run.name]`` with the attributes and token ids every format version shares,
    ``attrs`` (text), then ``fill(group, sums)`` writing the captures (and recording in ``sums`` the
    checksum of each attribute it writes on the group: :func:`~tracer.store.integrity.set_text`), then
    its seal; a failure removes the half-written group. The caller has validated the captures.

    Raises:
        TracerError: invalid or duplicate run name, plan/meta not JSON-able.
    """
    check_name(run.name, "run")
    if run.name in runs:
        raise TracerError(f"run {run.name!r} is already in this trace; give each run its own name")
    texts = {"plan": json_dumps(run.plan, f"plan of run {run.name}"),
             "meta": json_dumps(run.meta, f"meta of run {run.name}"), **(attrs or {})}
    g, sums = runs.create_group(run.name, track_order=True), {}
    try:
        for key, text in texts.items():
            set_text(g, key, text, sums)
        set_value(g, "window", np.asarray(run.window, dtype=np.int64), sums)
        ids = np.asarray(run.token_ids, dtype=np.int64).reshape(-1)  # (N,) int64
        seal(g.create_dataset("token_ids", data=ids), crc32_bytes(ids), sums={})
        fill(g, sums)
        seal(g, sums=sums)
    except BaseException:
        del runs[run.name]
        raise
    return g
