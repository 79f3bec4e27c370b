"""Reading a trace: validated once on open, every point read bit-exact and checked.

Store-layer module. :class:`TraceReader` checks the root (format, version, completeness), runs the
spec's validation (:func:`tracer.store.validate.validate_trace`, metadata only), and hands out each
run's capture points through the layout registered for the file's format version
(:mod:`tracer.store.formats`): version-1 ``h5py.Dataset`` handles or version-2
:class:`~tracer.store.packed.StoredPoint` handles, which :func:`read_tensor`,
:func:`read_row_blocks` and :func:`stored_crc` read whatever their version.
"""

from __future__ import annotations

import json
import os
import pickle
from collections import OrderedDict
from typing import Any, Callable, Iterator

import h5py
import numpy as np
import torch

from tracer.dtypes import DTYPES
from tracer.errors import TracerError
from tracer.execute.records import CaptureRecord, RunRecord
from tracer.files import check_input_file
from tracer.store import packed  # noqa: F401 - registers format versions 2 and 3
from tracer.store.format_v1 import verify_dataset
from tracer.store.formats import FORMAT, TraceFormat, format_for, format_of, read_versions
from tracer.store.header import TraceHeader
from tracer.store.integrity import attr_text, partial_pid
from tracer.store.validate import validate_trace

#: format versions this tracer reads
READ_VERSIONS = read_versions()


def read_tensor(handle: Any, rows: slice | None = None, *, pin: bool = False) -> torch.Tensor:
    """The tensor of one capture point (all of it, or ``rows`` along the first axis), bit-exact.

    Args:
        handle: what :meth:`TraceReader.captures` hands out (a version-1 ``h5py.Dataset`` or a
            version-2 :class:`~tracer.store.packed.StoredPoint`).
        pin: read straight into page-locked (pinned) host memory, from which a non-blocking copy
            to a GPU runs at full speed (needs CUDA; whole points only).

    A whole read is checked against the point's CRC-32 (when the file has one); a ``rows`` slice
    is not (its checksum covers the whole point).

    Raises:
        TracerError: ``trace corrupt: <name> in run <run> fails its checksum``, an unreadable
            point, or a missing/unknown dtype.
    """
    return format_of(handle).read(handle, rows, pin=pin)


def read_row_blocks(handle: Any, rows_per_block: int,
                    buffers: Callable[[], np.ndarray] | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """A capture point's tensor front to back in blocks of ``rows_per_block`` rows (first axis):
    ``(first row, tensor (rows, *feature))``, bit-exact, for comparing points larger than memory.

    The CRC-32 is carried from block to block and checked after the last block, so a damaged
    point raises before the caller reports anything computed from its blocks. ``buffers``
    (version-2 points only): a function returning the next reusable byte buffer (flat ``uint8``)
    to read a block into (:func:`tracer.store.packed.iter_row_blocks`); a yielded tensor then
    shares it. A 0-d tensor is one block.

    Raises:
        TracerError: ``trace corrupt: <name> in run <run> fails its checksum`` or an unreadable point.
    """
    return format_of(handle).row_blocks(handle, rows_per_block, buffers)


def stored_crc(handle: Any) -> int | None:
    """The CRC-32 stored for a capture point's data (version 2: its index entry; version 1: its
    dataset's ``crc32``), or None for a trace written before checksums."""
    return format_of(handle).crc(handle)


#: what :func:`~tracer.store.validate.validate_trace` found for the files this process validated, keyed
#: by the file's identity and change times (a file written or touched since gets another key): a
#: ``tracer compare`` opens one trace up to four times, and each validation decodes every index entry
_VALIDATED: "OrderedDict[tuple[int, ...], tuple[bool, bytes]]" = OrderedDict()  # (validated, pickled index entries)


def _validated(f: h5py.File, path: str, indexes: dict[str, list[dict[str, Any]]]) -> bool:
    """:func:`validate_trace` of ``f``, once per unchanged file in a process (:data:`_VALIDATED`): the
    same file, not written since (its device, inode, size, modification and change times in ns), is
    taken as validated, with a copy of its index entries. Data checksums are verified on every read.

    Raises:
        TracerError: as :func:`validate_trace`.
    """
    st = _stat_of(f, path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    hit = _VALIDATED.get(key)
    if hit is None:
        checked = validate_trace(f, path, indexes)
        _VALIDATED[key] = hit = (checked, pickle.dumps(indexes, pickle.HIGHEST_PROTOCOL))
        while len(_VALIDATED) > 16:
            _VALIDATED.popitem(last=False)
    else:  # a fresh copy each time (the caller's to change): unpickled in C, 7x faster than copy.deepcopy
        indexes.update(pickle.loads(hit[1]))
    return hit[0]


def _stat_of(f: h5py.File, path: str) -> os.stat_result:
    """The status of the file ``f`` has open (its descriptor's, not the path's: a trace written
    again is renamed onto the path, maybe while it is being opened), else of ``path``."""
    try:
        return os.fstat(f.id.get_vfd_handle())
    except (OSError, ValueError, TypeError, AttributeError):  # a driver without an OS descriptor
        return os.stat(path)


class TraceReader:
    """Read-only access to a complete trace; a context manager (or call :meth:`close`).

    Attributes:
        path: the trace file.
        header: the environment header, the document of a :class:`~tracer.store.header.TraceHeader`
            as the current format version writes it (:attr:`facts` is the record).
        runs: run names in written order.
        format_version: the file's format version.

    Raises:
        TracerError: the file is missing, not readable HDF5, not a tracer trace, of a format
            version this tracer does not read, or incomplete.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = check_input_file(path, "trace file")
        self._file: h5py.File | None = None
        self._fd: int | None = None  # for version-2 points: positioned reads that release the GIL
        self._format: TraceFormat | None = None
        self._points: dict[str, dict[str, Any]] = {}  # run -> name -> point handle (its format's type)
        self._entries: dict[str, dict[str, dict[str, Any]]] = {}  # run -> name -> index entry (version 2)
        try:
            self._file = h5py.File(self.path, "r")
        except Exception:  # noqa: BLE001 - h5py raises OSError, RuntimeError, ... for damaged files
            pid = partial_pid(self.path)
            if pid is not None:  # a writer killed before HDF5 flushed its superblock
                raise TracerError(f"{self.path} is incomplete: the partial file of writer process {pid}, which "
                                  "did not finish; re-run it") from None
            raise TracerError(f"{self.path} is not a readable HDF5 file (truncated or corrupt?); pass a trace "
                              "written by tracer (tracer run ... -o FILE.h5)") from None
        try:
            self._open()
        except TracerError:
            self.close()
            raise
        except (OSError, RuntimeError, KeyError, ValueError, TypeError, AttributeError, IndexError) as e:
            self.close()
            first = (str(e).splitlines() or [""])[0][:100]
            raise TracerError(f"trace corrupt: {self.path} cannot be read ({type(e).__name__}: {first}); re-run it") from None
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        from tracer.store.heap import check_heap

        f = self._f
        check_heap(f, self.path, "trace")  # variable-length texts (format 1) only after a probe: a damaged heap hangs HDF5
        fmt = attr_text(f.attrs.get("format"))
        if fmt != FORMAT:
            raise TracerError(f"{self.path} is not a tracer trace (no format={FORMAT!r} attribute); pass a file written by tracer")
        raw = f.attrs.get("format_version")
        # an integer, stored as one: "1" or 1.5 are not version 1
        version = int(raw) if isinstance(raw, (int, np.integer)) and not isinstance(raw, (bool, np.bool_)) else raw
        self._format = format_for(version.item() if isinstance(version, np.generic) else version, self.path)
        complete = f.attrs.get("complete")
        if not (isinstance(complete, (bool, np.bool_)) and bool(complete)):
            raise TracerError(f"{self.path} is incomplete: the run that wrote it did not finish; re-run it")
        self.format_version = self._format.version
        indexes: dict[str, list[dict[str, Any]]] = {}
        #: True when the file carries checksums (verified on every read); False: written before them
        self.checksummed = _validated(f, self.path, indexes)
        upgrade = self._format.upgrade  # the documents as the current version writes them
        self.header: dict[str, Any] = upgrade("header", json.loads(f["header"].attrs["json"]))
        self.runs: list[str] = json.loads(f["runs"].attrs["order"])
        self._fd = os.open(self.path, os.O_RDONLY)  # for positioned reads (version 2), which release the GIL
        opened, held = _stat_of(f, self.path), os.fstat(self._fd)
        if (opened.st_dev, opened.st_ino) != (held.st_dev, held.st_ino):  # replaced since HDF5 opened it
            raise TracerError(f"{self.path} was replaced while it was being opened (a run writing it finished); "
                              "open it again")
        for run in self.runs:
            entries = indexes.get(run)
            self._points[run] = self._format.open_run(f["runs"][run], entries, self._fd)
            self._entries[run] = {e["name"]: e for e in entries} if entries is not None else {}

    @property
    def _f(self) -> h5py.File:
        if self._file is None:
            raise TracerError(f"trace {self.path} is closed; open it again with tracer.read_trace")
        return self._file

    def _run_group(self, run: str) -> h5py.Group:
        if run not in self.runs:
            raise TracerError(f"run {run!r} not in {self.path}; available runs: {', '.join(self.runs) or 'none'}")
        return self._f["runs"][run]

    def _missing(self, run: str, capture: str) -> TracerError:
        names = self.capture_names(run)
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        return TracerError(f"capture {capture!r} not in run {run!r}; available: {shown or 'none'}")

    def _capture_ds(self, run: str, capture: str) -> Any:
        """The capture's point handle (version 1: ``h5py.Dataset``; 2: :class:`~tracer.store.packed.StoredPoint`)."""
        self._run_group(run)
        point = self._points[run].get(capture)
        if point is None:
            raise self._missing(run, capture)
        return point

    def _info(self, run: str, name: str, handle: Any) -> dict[str, Any]:
        return self._format.info(handle, self._entries[run].get(name))

    def capture_names(self, run: str) -> list[str]:
        """Capture names of ``run`` in execution order."""
        self._run_group(run)
        return list(self._points[run])

    def capture_info(self, run: str, capture: str) -> dict[str, Any]:
        """``{"kind", "op", "calls", "dtype", "shape"}`` of one capture, without reading its data, and
        ``"role"`` when the trace stores one (:attr:`~tracer.execute.records.CaptureRecord.role`)."""
        return self._info(run, capture, self._capture_ds(run, capture))

    def captures(self, run: str) -> dict[str, tuple[dict[str, Any], Any]]:
        """Capture name → ``(capture_info, handle)`` for every capture of ``run``, in execution
        order, with one pass over the run (for streaming readers: pass the handle, a version-1
        ``h5py.Dataset`` or a version-2 :class:`~tracer.store.packed.StoredPoint`, to
        :func:`read_tensor` or :func:`read_row_blocks`; both have ``shape``, ``ndim`` and ``nbytes``)."""
        self._run_group(run)
        return {name: (self._info(run, name, p), p) for name, p in self._points[run].items()}

    def tensor(self, run: str, capture: str, *, rows: slice | None = None, pin: bool = False) -> torch.Tensor:
        """The captured tensor exactly as stored (bf16 back as ``torch.bfloat16``), on the CPU.

        Args:
            rows: optional slice along the first (position) axis, read without loading the rest.
            pin: read into pinned host memory (for a fast copy to a GPU; see :func:`read_tensor`).
        """
        return read_tensor(self._capture_ds(run, capture), rows, pin=pin)

    def run(self, name: str, *, load_tensors: bool = True) -> RunRecord:
        """The :class:`RunRecord` of run ``name``, captures in execution order.

        With ``load_tensors=False`` each capture's tensor is a ``meta``-device tensor of the
        stored shape and dtype (no data is read). A version-2 run is read with one read per
        ``data/<dtype>`` dataset (every point checked against its CRC-32).

        Raises:
            TracerError: unknown run (the message lists the available ones), a point that fails
                its checksum.
        """
        g = self._run_group(name)
        captures: dict[str, CaptureRecord] = {}
        loaded = None
        if load_tensors and self._format.read_all is not None:
            loaded = self._format.read_all(list(self._points[name].values()))
        for cap, (info, handle) in self.captures(name).items():
            if loaded is not None:
                tensor = loaded[cap]
            elif load_tensors:
                tensor = read_tensor(handle)
            else:
                tensor = torch.empty(info["shape"], dtype=DTYPES[info["dtype"]], device="meta")
            captures[cap] = CaptureRecord(name=cap, kind=info["kind"], tensor=tensor, calls=info["calls"], op=info["op"],
                                          role=info.get("role", ""))
        start, stop = (int(x) for x in g.attrs["window"])
        ids_ds = g["token_ids"]
        ids = np.asarray(ids_ds[()])
        verify_dataset(ids_ds, ids)
        return RunRecord(
            name=name,
            token_ids=[int(x) for x in ids],
            plan=self._format.upgrade("plan", json.loads(g.attrs["plan"])),
            window=(start, stop),
            captures=captures,
            meta=self._format.upgrade("meta", json.loads(g.attrs["meta"])),
        )

    @property
    def facts(self) -> TraceHeader:
        """The header as its record (:class:`~tracer.store.header.TraceHeader`, checked on open);
        :attr:`header` is its document."""
        return TraceHeader.from_dict(self.header)

    def comparisons(self) -> dict[str, dict]:
        """Stored comparison results, name → document as the current version writes it (empty if none)."""
        comps = self._f.get("comparisons")
        if comps is None:
            return {}
        return {name: self._format.upgrade("comparison", json.loads(comps[name].attrs["json"])) for name in comps}

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
