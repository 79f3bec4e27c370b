"""The h5py work of one trace writer: the partial file, its header, runs and comparisons.

Store-layer module. :class:`TraceFile` is what :class:`~tracer.store.writer.TraceWriter` drives on
the thread or process that writes: in the caller's thread, on the writer's background thread, or
in the writer process (:mod:`tracer.store.writer_process`), which holds one per open writer. It
writes through a :class:`~tracer.store.integrity.GuardedFile`, turns a write error into one
line, and never renames anything: moving the complete file onto its name is the writer's.
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from tracer.errors import TracerError
from tracer.execute.records import RunRecord
from tracer.store import format_v1, packed  # noqa: F401 - register format versions 1, 2 and 3
from tracer.store.environment import tool_version
from tracer.store.formats import FORMAT, format_for
from tracer.store.integrity import CHECKSUMS, GuardedFile, seal, set_text, set_value, write_error_message

#: header subtrees left out of the flat attribute copies (large and nested; the ``json`` attribute has them)
_NOT_FLAT = ("numeric_contract", "options", "audit")


def _flat_scalars(d: dict, prefix: str = "", depth: int = 2) -> dict[str, Any]:
    """Scalar entries of a nested dict down to ``depth`` levels, keys joined with '.', for readable
    h5ls attributes (each attribute costs a write and its checksum: the big subtrees
    :data:`_NOT_FLAT` stay in the ``json`` attribute only)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            if depth > 1 and not (prefix == "" and k in _NOT_FLAT):
                out.update(_flat_scalars(v, key + ".", depth - 1))
        elif isinstance(v, bool):
            out[key] = bool(v)
        elif isinstance(v, str):
            out[key] = str(v)  # a plain str: h5py rejects subclasses such as torch's TorchVersion
        elif isinstance(v, int):
            out[key] = int(v)
        elif isinstance(v, float):
            out[key] = float(v)
    return out


class TraceFile:
    """One trace's partial file and the h5py objects in it, written in the order the calls come.

    Args:
        path: the trace's final name (for error messages only).
        partial_path: the file to create (``<path>.partial-<PID>``; must not exist).
        format_version: the layout (:data:`tracer.store.formats.FORMATS`).
        compression: ``None``, ``"lzf"`` or ``"gzip"``.

    Every method raises :class:`~tracer.errors.TracerError` (one line: the path and the cause) for a
    write error the guard recorded (disk full, ``ulimit -f``); :meth:`discard` raises nothing.
    """

    def __init__(self, path: Path, partial_path: Path, format_version: int, compression: str | None) -> None:
        self.path, self.partial_path = Path(path), Path(partial_path)
        self.format_version = format_version
        self._format = format_for(format_version)
        self.compression = compression
        self.guard: GuardedFile | None = None
        self.file: h5py.File | None = None
        self._runs: h5py.Group | None = None
        self._run_names: list[str] = []

    def create(self, header: dict[str, Any], header_json: str) -> None:
        """Create the partial file with the root attributes, the header (``header_json`` and the
        flat scalar copies of ``header``) and the empty ``/runs``.

        Raises:
            TracerError: the file cannot be created or written (the partial file is then removed).
        """
        try:
            self.partial_path.unlink(missing_ok=True)  # our own PID's leftover from an earlier writer
            # h5py crashes when HDF5 sees a failed write; the guard keeps errors from it (see GuardedFile)
            self.guard = GuardedFile(self.partial_path)
            self.file = h5py.File(self.guard, "w", track_order=True, libver=("v108", "v110"))
        except OSError as e:
            self.discard()
            raise TracerError(f"cannot create {self.partial_path} ({e.strerror or e}); choose another --output") from None
        except BaseException:  # an interrupt here too: the partial never outlives this call
            self.discard()
            raise
        try:
            # every object's checksums from the values as written (seal(..., sums)), not read back
            f, sums = self.file, {}
            set_text(f, "format", FORMAT, sums)
            set_value(f, "format_version", np.int64(self.format_version), sums)
            set_text(f, "created", _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), sums)
            set_text(f, "tool_version", tool_version(), sums)
            set_text(f, "checksums", CHECKSUMS, sums)
            seal(f, sums=sums)
            f.attrs["complete"] = False
            h, sums = f.create_group("header"), {}
            set_text(h, "json", header_json, sums)
            for key, value in _flat_scalars(header).items():
                if key not in ("json", "crc32"):
                    set_text(h, key, value, sums) if isinstance(value, str) else set_value(h, key, value, sums)
            seal(h, sums=sums)
            self._runs = f.create_group("runs", track_order=True)
            self._seal_order()
            self.check_io()
        except BaseException:
            self.discard()
            raise

    def check_io(self) -> None:
        """Raise the first write error the guard recorded (disk full, ``ulimit -f``) as one line."""
        if self.guard is not None and self.guard.error is not None:
            raise TracerError(write_error_message(self.path, self.guard.error))

    def write_run(self, run: RunRecord) -> None:
        """Write ``run`` (host tensors) in this file's format; ``/runs``' order after it.

        Raises:
            TracerError: what the format's writer refuses (names, dtypes, calls), or a write error.
        """
        try:
            self._format.write_run(self._runs, run, compression=self.compression)
        except (OSError, RuntimeError):
            self.check_io()  # a write error reported by HDF5 after the guard's: say the cause
            raise
        self.check_io()
        self._run_names.append(run.name)
        self._seal_order()

    def _seal_order(self) -> None:
        """``/runs``' ``order`` attribute (the runs written so far, in order) and its seal."""
        sums: dict[str, int] = {}
        set_text(self._runs, "order", json.dumps(self._run_names), sums)
        seal(self._runs, sums=sums)

    def set_meta(self, run: str, text: str) -> None:
        """Replace run ``run``'s ``meta`` attribute by ``text`` (a JSON document) and reseal it."""
        g = self._runs[run]
        set_text(g, "meta", text)
        seal(g)
        self.check_io()

    def remove_run(self, run: str) -> None:
        """Delete run ``run`` (when present) and take it out of ``/runs``' order."""
        if run in self._runs:
            del self._runs[run]
        self._run_names = [n for n in self._run_names if n != run]
        self._seal_order()
        self.check_io()

    def write_comparison(self, name: str, text: str) -> None:
        """``/comparisons/<name>`` with its ``json`` attribute ``text``, sealed."""
        g, sums = self.file.require_group("comparisons").create_group(name), {}
        set_text(g, "json", text, sums)
        seal(g, sums=sums)
        self.check_io()

    def finish(self) -> None:
        """Mark the file complete and close it (it stays at :attr:`partial_path`).

        Raises:
            TracerError: a write error, now or earlier (the file is then closed, not removed).
        """
        self.check_io()
        f, self.file = self.file, None
        f.attrs["complete"] = True
        f.flush()
        f.close()
        guard, self.guard = self.guard, None
        guard.close()
        if guard.error is not None:
            raise TracerError(write_error_message(self.path, guard.error))

    def discard(self) -> None:
        """Close the file (if open) and delete the partial file (idempotent; raises nothing)."""
        f, self.file = self.file, None
        if f is not None:
            try:
                f.close()  # safe after a write error: the guard kept it from HDF5
            except Exception:  # noqa: BLE001 - closing a broken file must not mask the cause
                pass
        guard, self.guard = self.guard, None
        if guard is not None:
            guard.close()
        self.partial_path.unlink(missing_ok=True)


__all__ = ["TraceFile"]
