"""Writing a trace atomically: a partial sibling file, sealed, marked complete, moved into place.

Store-layer module. :class:`TraceWriter` writes the root attributes, the header and the runs in
the layout of the requested format version (looked up in :mod:`tracer.store.formats`) through a
:class:`~tracer.store.trace_file.TraceFile`: in the caller's thread, on a background thread, or
in the writer process (:mod:`tracer.store.writer_process`). It moves the finished file onto its
name only when it is complete; any failure deletes the partial file.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
from pathlib import Path
from typing import Any, Callable

from tracer import schema
from tracer.errors import TracerError
from tracer.execute.records import RunRecord
from tracer.plan.plans import RunPlan
from tracer.store.formats import COMPRESSIONS, FORMAT_VERSION, FORMATS, check_name, json_dumps
from tracer.store.header import RunMeta, TraceHeader
from tracer.store.integrity import check_name_length, check_output_path, clean_stale_partials
from tracer.store.trace_file import TraceFile
from tracer.store.writer_process import RemoteTraceFile, writer_mode


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


# a fork has no open writers: its exit handlers must not delete the partial files of its parent's
os.register_at_fork(after_in_child=_OPEN_PARTIALS.clear)


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
        background: ``False`` (default): every call writes before it returns. ``True``: write in
            the background, so :meth:`add_run` returns at once and the model can run the next
            plan while run A is written; where is ``TRACER_WRITER``'s choice (``thread``, the
            default, or ``process``). ``"thread"``: on one background thread of this process
            (h5py holds the GIL while it works, so its Python work delays a launching thread).
            ``"process"``: the h5py work in the writer process
            (:mod:`tracer.store.writer_process`), off this process's GIL; a background thread
            here waits for the run's copies and sends its tensors there through a socket. Either
            way runs are written in submission order; :meth:`close` waits for them and
            re-raises a writer error; on an exception in the ``with`` block the writes are
            awaited and the file deleted.
        format_version: the layout to write: :data:`FORMAT_VERSION` (3, default), 2 (the same
            layout) or 1 (one dataset per capture point, as tracer wrote before); for tests and older
            readers. The JSON documents are always version 3's, which the readers of versions 1 and
            2 read unchanged.

    Raises:
        TracerError: ``path`` exists and not ``overwrite``; ``path`` is a folder; bad
            compression, format version, ``background`` or ``TRACER_WRITER``; header not
            JSON-able; the file cannot be created.
    """

    def __init__(self, path: str | os.PathLike, *, header: TraceHeader | dict[str, Any], overwrite: bool = False,
                 compression: str | None = None, background: bool | str = False,
                 format_version: int = FORMAT_VERSION) -> None:
        self.path = Path(path)
        if not isinstance(format_version, int) or format_version not in FORMATS:
            raise TracerError(f"unknown trace format_version {format_version!r}; this tracer writes "
                              f"{', '.join(map(str, sorted(FORMATS)))}")
        self.format_version = format_version
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._futures: list[concurrent.futures.Future] = []
        self._comparisons: set[str] = set()
        self.overwrite = overwrite
        if compression not in COMPRESSIONS:
            raise TracerError(f"unknown compression {compression!r}; use one of none, lzf, gzip")
        self.compression = compression
        mode = writer_mode(background)
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
        #: the h5py side: here (synchronous, thread) or in the writer process
        self._ops: TraceFile | RemoteTraceFile = (RemoteTraceFile if mode == "process" else TraceFile)(
            self.path, self.partial_path, format_version, compression)
        self._open = True  # until close() or abort()
        self._failed: BaseException | None = None  # the set-up's error, when it ran on the thread
        #: ``"thread"`` or ``"process"`` (background writes), or None (synchronous)
        self.mode = mode
        if mode is not None:
            # the file's set-up (creating it, the header and its checksums) runs on the writing
            # thread, overlapping run A on the GPU; its errors surface at the next add or close
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tracer-writer")
            self._futures.append(self._pool.submit(self._create, header, header_json))
        else:
            self._create(header, header_json)

    def _create(self, header: dict, header_json: str) -> None:
        """Create the partial file (:meth:`TraceFile.create`); on failure remember the error (the
        thread's is raised once, by :meth:`close`) and remove the partial file.

        Raises:
            TracerError: the file cannot be created or written.
        """
        try:
            self._ops.create(header, header_json)
        except BaseException as e:
            self._failed = e
            self._discard()  # not abort(): this may run on the writing thread, which abort() waits for
            raise

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
        self._ops.write_run(run)

    def set_meta(self, run: str, meta: dict) -> None:
        """Replace the ``meta`` of run ``run`` (added earlier), e.g. with facts known only after the
        comparison; on the writing thread, after the run's own write.

        Raises:
            TracerError: meta not JSON-able, or the writer is closed (a run not written: at close).
        """
        self._require_open()
        schema.decode(RunMeta, meta, f"meta of run {run}")
        text = json_dumps(meta, f"meta of run {run}")
        self._after(self._ops.set_meta, run, text)

    def remove_run(self, run: str) -> None:
        """Take run ``run`` (added earlier) out of the trace again; on the writing thread, in order.

        Raises:
            TracerError: the writer is closed.
        """
        self._require_open()
        self._after(self._ops.remove_run, run)

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
        if self._failed is None:
            self._ops.write_comparison(name, text)

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
            self._open = False
            self._ops.finish()
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
        try:
            self._ops.discard()
        finally:  # a Ctrl-C in the writer process's discard too
            self.partial_path.unlink(missing_ok=True)  # also where the writer process could not
            _OPEN_PARTIALS.discard(self.partial_path)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
