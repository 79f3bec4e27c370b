"""Writing a trace atomically: a partial sibling file, sealed, marked complete, moved into place.

Store-layer module. :class:`TraceWriter` writes the root attributes, the header and the runs in
the layout of the requested format version (looked up in :mod:`tracer.store.formats`), on an
optional background thread, and moves the finished file onto its name only when it is complete;
any failure deletes the partial file.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import datetime as _dt
import json
import os
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np

from tracer import schema
from tracer.errors import TracerError
from tracer.execute.records import RunRecord
from tracer.plan.plans import RunPlan
from tracer.store import format_v1, packed  # noqa: F401 - register format versions 1, 2 and 3
from tracer.store.environment import tool_version
from tracer.store.formats import COMPRESSIONS, FORMAT, FORMAT_VERSION, FORMATS, check_name, format_for, json_dumps
from tracer.store.header import RunMeta, TraceHeader
from tracer.store.integrity import (CHECKSUMS, GuardedFile, check_name_length, check_output_path, clean_stale_partials,
                                    seal, set_text, set_value, write_error_message)


def header_document(header: TraceHeader | dict[str, Any]) -> dict[str, Any]:
    """The JSON document of a trace header: a :class:`~tracer.store.header.TraceHeader`'s, or a
    document checked against that record (a fact of the wrong type or range is refused here, not
    by the reader of the finished file).

    Raises:
        TracerError: not a header document, or a fact of the wrong type or range (naming it).
    """
    if isinstance(header, TraceHeader):
        return header.to_dict()
    if not isinstance(header, dict):
        raise TracerError(f"the trace header is a {type(header).__name__}; pass a TraceHeader or a dict")
    schema.decode(TraceHeader, header, "the trace header")
    return header


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


#: partial files of writers open in this process (two writers of one path in one process get two names)
_OPEN_PARTIALS: set[Path] = set()


@atexit.register
def _remove_open_partials() -> None:
    """At interpreter exit (an interrupt or termination that struck between a writer's creation and its
    ``with`` block, or a writer never closed), remove the partial files of this process's writers."""
    for p in list(_OPEN_PARTIALS):
        try:
            p.unlink(missing_ok=True)
        except OSError:
            pass


def _partial_name(path: Path) -> Path:
    """``<path>.partial-<PID>``, or ``<path>.partial-<PID>-<k>`` while a writer of this process has that one open."""
    for k in range(1 << 16):
        p = path.with_name(f"{path.name}.partial-{os.getpid()}{f'-{k}' if k else ''}")
        if p not in _OPEN_PARTIALS:
            _OPEN_PARTIALS.add(p)
            return p
    raise TracerError(f"too many writers of {path} in this process")  # pragma: no cover


class TraceWriter:
    """Writes a trace atomically: a temporary sibling file, renamed onto ``path`` when complete.

    Use as a context manager::

        with TraceWriter("traces/x.h5", header=collect_environment("cuda")) as w:
            w.add_run(run_a); w.add_run(run_b)

    On a clean exit ``complete`` is set True, the file is closed and moved onto ``path``; if the
    block raises, the partial file is deleted and ``path`` is left as it was.

    Args:
        path: the trace file to create; parent folders are created.
        header: the trace header: a :class:`~tracer.store.header.TraceHeader` (written as its
            document), or a document of one (JSON-able; checked against the record, written as given).
        overwrite: replace an existing ``path`` (only once the new trace is complete).
        compression: ``None`` (default), ``"lzf"`` or ``"gzip"``, passed to ``create_dataset``.
        background: write runs on one background thread, so :meth:`add_run` returns at once and
            the model can run the next plan while run A is written (h5py serialises its own
            calls; torch releases the GIL in its kernels, so the two overlap). Runs are written
            in submission order; :meth:`close` waits for them and re-raises a writer error;
            on an exception in the ``with`` block the thread is joined and the file deleted.
        format_version: the layout to write: :data:`FORMAT_VERSION` (3, default), 2 (the same
            layout) or 1 (one dataset per capture point, as tracer wrote before); for tests and older
            readers. The JSON documents are always version 3's, which the readers of versions 1 and
            2 read unchanged.

    Raises:
        TracerError: ``path`` exists and not ``overwrite``; ``path`` is a folder; bad
            compression or format version; header not JSON-able; the file cannot be created.
    """

    def __init__(self, path: str | os.PathLike, *, header: TraceHeader | dict[str, Any], overwrite: bool = False,
                 compression: str | None = None, background: bool = False,
                 format_version: int = FORMAT_VERSION) -> None:
        self.path = Path(path)
        if not isinstance(format_version, int) or format_version not in FORMATS:
            raise TracerError(f"unknown trace format_version {format_version!r}; this tracer writes "
                              f"{', '.join(map(str, sorted(FORMATS)))}")
        self.format_version = format_version
        self._format = format_for(format_version)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._futures: list[concurrent.futures.Future] = []
        self._comparisons: set[str] = set()
        self.overwrite = overwrite
        if compression not in COMPRESSIONS:
            raise TracerError(f"unknown compression {compression!r}; use one of none, lzf, gzip")
        self.compression = compression
        check_name_length(self.path, "trace")
        if self.path.is_dir():
            raise TracerError(f"trace path {self.path} is a folder; pass a file name such as {self.path / 'trace.h5'}")
        check_output_path(self.path, overwrite, "trace")
        header = header_document(header)
        header_json = json_dumps(header, "the trace header")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TracerError(f"cannot create the folder {self.path.parent} ({e.strerror}); choose another --output") from None
        clean_stale_partials(self.path)
        self.partial_path = _partial_name(self.path)
        self._guard: GuardedFile | None = None
        self._file: h5py.File | None = None
        self._open = True  # until close() or abort()
        self._failed: BaseException | None = None  # the set-up's error, when it ran on the thread
        self._run_names: list[str] = []
        if background:
            # the file's set-up (creating it, the header and its checksums) runs on the writing
            # thread, overlapping run A on the GPU; its errors surface at the next add or close
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tracer-writer")
            self._futures.append(self._pool.submit(self._create, header, header_json))
        else:
            self._create(header, header_json)

    def _create(self, header: dict, header_json: str) -> None:
        """Create the partial file with the root attributes, the header and the empty ``/runs``.

        Raises:
            TracerError: the file cannot be created or written (the partial file is removed).
        """
        try:
            self.partial_path.unlink(missing_ok=True)  # our own PID's leftover from an earlier writer
            # h5py crashes when HDF5 sees a failed write; the guard keeps errors from it (see GuardedFile)
            self._guard = GuardedFile(self.partial_path)
            self._file = h5py.File(self._guard, "w", track_order=True, libver=("v108", "v110"))
        except BaseException as e:  # an interrupt here too: the partial never outlives this call
            self._failed = (TracerError(f"cannot create {self.partial_path} ({e.strerror or e}); choose another --output")
                            if isinstance(e, OSError) else e)
            self._discard()  # not abort(): this may run on the writing thread, which abort() waits for
            if isinstance(e, OSError):
                raise self._failed from None
            raise
        try:
            # every object's checksums from the values as written (seal(..., sums)), not read back
            f, sums = self._file, {}
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
            self._check_io()
        except BaseException as e:
            self._failed = e
            self._discard()
            raise

    def _check_io(self) -> None:
        """Raise the first write error the guard recorded (disk full, ``ulimit -f``) as one line."""
        if self._guard is not None and self._guard.error is not None:
            raise TracerError(write_error_message(self.path, self._guard.error))

    def _require_open(self) -> None:
        if not self._open:
            raise TracerError(f"trace writer for {self.path} is closed; open a new TraceWriter")

    def add_run(self, run: RunRecord, *, ready: Callable[[], None] | None = None) -> None:
        """Write ``run`` (its token ids, plan, meta, window and every capture, in order).

        Args:
            run: the run; its capture tensors on the host.
            ready: called (on the writing thread) before anything is read from ``run``, e.g. to
                wait for the non-blocking device-to-host copies of its tensors
                (:func:`tracer.execute.capture.host_copies`).

        Raises:
            TracerError: duplicate or invalid run/capture name, unsupported tensor dtype,
                plan/meta/calls not JSON-able or not the documents of a
                :class:`~tracer.plan.plans.RunPlan` and a :class:`~tracer.store.header.RunMeta`
                (what the reader checks, refused now), or the writer is closed.
        """
        self._require_open()
        schema.decode(RunPlan, run.plan, f"plan of run {run.name}")
        schema.decode(RunMeta, run.meta, f"meta of run {run.name}")
        if self._pool is not None:
            self._futures.append(self._pool.submit(self._write_run, run, ready))
        else:
            self._write_run(run, ready)

    def _write_run(self, run: RunRecord, ready: Callable[[], None] | None = None) -> None:
        if ready is not None:
            ready()
        if self._failed is not None:  # the set-up failed: its error is raised once, by close()
            return
        try:
            self._format.write_run(self._runs, run, compression=self.compression)
        except (OSError, RuntimeError):
            self._check_io()  # a write error reported by HDF5 after the guard's: say the cause
            raise
        self._check_io()
        self._run_names.append(run.name)
        self._seal_order()

    def _seal_order(self) -> None:
        """``/runs``' ``order`` attribute (the runs written so far, in order) and its seal."""
        sums: dict[str, int] = {}
        set_text(self._runs, "order", json.dumps(self._run_names), sums)
        seal(self._runs, sums=sums)

    def set_meta(self, run: str, meta: dict) -> None:
        """Replace the ``meta`` of run ``run`` (added earlier), e.g. with facts known only after the
        comparison; on the writing thread, after the run's own write.

        Raises:
            TracerError: meta not JSON-able, or the writer is closed (a run not written: at close).
        """
        self._require_open()
        schema.decode(RunMeta, meta, f"meta of run {run}")
        text = json_dumps(meta, f"meta of run {run}")
        self._after(self._set_meta, run, text)

    def _set_meta(self, run: str, text: str) -> None:
        g = self._runs[run]
        set_text(g, "meta", text)
        seal(g)
        self._check_io()

    def remove_run(self, run: str) -> None:
        """Take run ``run`` (added earlier) out of the trace again; on the writing thread, in order.

        Raises:
            TracerError: the writer is closed.
        """
        self._require_open()
        self._after(self._remove_run, run)

    def _remove_run(self, run: str) -> None:
        if run in self._runs:
            del self._runs[run]
        self._run_names = [n for n in self._run_names if n != run]
        self._seal_order()
        self._check_io()

    def _after(self, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)`` after everything queued so far (on the writing thread when there is one)."""
        def guarded() -> None:
            if self._failed is None:
                fn(*args)

        if self._pool is not None:
            self._futures.append(self._pool.submit(guarded))
        else:
            guarded()

    def _drain(self) -> None:
        """Wait for the background writes (if any); re-raise the first error; stop the thread."""
        if self._pool is None:
            return
        pool, self._pool = self._pool, None
        futures, self._futures = self._futures, []
        try:
            for fut in futures:
                fut.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def add_comparison(self, name: str, data: dict, *, safe: bool = False) -> None:
        """Store a comparison result (JSON-able dict) as ``/comparisons/<name>``; ``safe``: its
        non-finite floats as strings, as :func:`tracer.store.trace.json_safe` writes them
        (:func:`~tracer.store.formats.json_dumps`).

        Raises:
            TracerError: invalid or duplicate name, data not JSON-able, or the writer is closed.
        """
        self._require_open()
        check_name(name, "comparison")
        text = json_dumps(data, f"comparison {name}", safe=safe)
        if name in self._comparisons:
            raise TracerError(f"comparison {name!r} is already in this trace; give it another name")
        self._comparisons.add(name)
        if self._pool is not None:  # after the runs, on the writing thread
            self._futures.append(self._pool.submit(self._write_comparison, name, text))
        else:
            self._write_comparison(name, text)

    def _write_comparison(self, name: str, text: str) -> None:
        if self._failed is not None:
            return
        g, sums = self._file.require_group("comparisons").create_group(name), {}
        set_text(g, "json", text, sums)
        seal(g, sums=sums)
        self._check_io()

    def close(self) -> None:
        """Mark the trace complete, close it and move it onto ``path`` (idempotent).

        Raises:
            TracerError: ``path`` appeared meanwhile and ``overwrite`` is False (the complete
                trace is left at ``partial_path``).
        """
        if not self._open:
            return
        try:
            self._drain()
            self._check_io()
            self._open = False
            f = self._file
            f.attrs["complete"] = True
            f.flush()
            f.close()
            self._file = None
            guard, self._guard = self._guard, None
            guard.close()
            if guard.error is not None:
                raise TracerError(write_error_message(self.path, guard.error))
        except BaseException:
            self.abort()
            raise
        _OPEN_PARTIALS.discard(self.partial_path)
        if self.overwrite:
            os.replace(self.partial_path, self.path)
            return
        try:
            os.link(self.partial_path, self.path)  # atomic, and refuses to clobber
        except FileExistsError:
            self._keep_elsewhere()
        except OSError:  # no hard links on this filesystem: check, then rename
            if self.path.exists():
                self._keep_elsewhere()
            os.replace(self.partial_path, self.path)
            return
        self.partial_path.unlink()

    def _keep_elsewhere(self) -> None:
        """``path`` appeared while this writer wrote (another writer won): keep the complete new trace
        under a name of its own, ``<stem>.new-<PID>[-<k>]<suffix>``, which no stale-partial clean-up
        touches (only ``*.partial-<PID>`` files are), and say where it is.

        Raises:
            TracerError: always: the trace was not written to ``path``; the message names the kept file.
        """
        stem, suffix = self.path.stem, self.path.suffix or ".h5"
        for k in range(1000):
            kept = self.path.with_name(f"{stem}.new-{os.getpid()}{f'-{k}' if k else ''}{suffix}")
            try:
                os.link(self.partial_path, kept)  # never clobbers
            except FileExistsError:
                continue
            except OSError:
                if kept.exists():
                    continue
                os.replace(self.partial_path, kept)
                break
            self.partial_path.unlink()
            break
        else:  # pragma: no cover - 1000 kept traces of one PID
            raise TracerError(f"trace {self.path} appeared while writing; the new trace is at {self.partial_path}; "
                              "move it now (a later run removes *.partial-PID files of finished processes)")
        raise TracerError(f"trace {self.path} appeared while writing (another writer); the new trace was kept as "
                          f"{kept}; compare or move it, or pass --overwrite")

    def abort(self) -> None:
        """Close and delete the partial file; ``path`` is left untouched (idempotent)."""
        self._open = False
        try:
            self._drain()
        except BaseException:  # noqa: BLE001 - aborting already; the cause is the caller's
            pass
        self._discard()

    def _discard(self) -> None:
        """Close the file (if open) and delete the partial file (idempotent; no thread is waited for)."""
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()  # safe after a write error: the guard kept it from HDF5
            except Exception:  # noqa: BLE001 - closing a broken file must not mask the cause
                pass
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.close()
        self.partial_path.unlink(missing_ok=True)
        _OPEN_PARTIALS.discard(self.partial_path)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
