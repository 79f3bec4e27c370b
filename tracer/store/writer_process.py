"""The writer process: a background trace writer's h5py work, off the calling process's GIL.

Store-layer module. h5py holds the GIL for all its work (and a trace goes through a Python file
object, :class:`~tracer.store.integrity.GuardedFile`), so a background writer *thread* takes the
GIL from the thread launching the next run's kernels: on a launch-bound GPU, each millisecond of
its Python work is a millisecond of the run's wall time. With ``TraceWriter(background="process")``
(or ``background=True`` and ``TRACER_WRITER=process``) the writer's thread only waits for a run's
device-to-host copies and sends its tensors, as raw bytes, through a socket to one long-lived
child process, which writes them with a :class:`~tracer.store.trace_file.TraceFile` exactly as the
thread would.

The child is started on first use (a fresh interpreter: ``python -c``, never a fork of a process
holding CUDA), serves every writer of this process in turn, ignores Ctrl-C (its parent decides
whether a trace is finished or deleted), and deletes the partial file of every trace still open
when its parent goes away. A child that dies is a one-line :class:`~tracer.errors.TracerError` at
the writer's next call or close; the next writer starts a new one.
"""

from __future__ import annotations

import atexit
import itertools
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from tracer.errors import TracerError

#: the environment variable choosing where ``TraceWriter(background=True)`` writes
ENV = "TRACER_WRITER"
#: the background modes, the default first
MODES = ("thread", "process")


def writer_mode(background: bool | str) -> str | None:
    """Where a writer writes: None (in the caller's thread), ``"thread"`` or ``"process"``.

    ``background``: ``False``; ``True`` (the mode :data:`ENV` names, else ``"thread"``); or a mode.

    Raises:
        TracerError: another value, or :data:`ENV` set to something else than a mode.
    """
    if background is False:
        return None
    if background is True:
        value = os.environ.get(ENV, "").strip().lower() or MODES[0]
        if value not in MODES:
            raise TracerError(f"{ENV}={os.environ[ENV]!r} is not a writer mode; set it to thread or process, or unset it")
        return value
    if isinstance(background, str) and background in MODES:
        return background
    raise TracerError(f"background={background!r} is not a writer mode; pass False, True, 'thread' or 'process'")


# ---------------------------------------------------------------- the parent's side


class _Child:
    """The running writer process, and one lock serialising the calls to it (one call: a message,
    the tensors' bytes, the reply)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        if not sys.executable:
            raise TracerError(f"cannot start the trace writer process: this Python does not know its own executable; "
                              f"write from a thread: unset {ENV} or set it to thread")
        self.owner = os.getpid()  # a fork of this process must not talk on this socket: it starts its own child
        root = str(Path(__file__).resolve().parents[2])  # the folder holding this tracer package
        # this process's import path, not python -c's (the working folder first: a json.py there would
        # shadow the standard library's), this package's folder ahead of it while tracer is imported
        path = [root, *(p for p in sys.path if isinstance(p, str))]  # the import system reads str entries only
        code = (f"import sys; sys.path[:] = {path!r}; import tracer; sys.path.remove({root!r}); "
                "from tracer.store.writer_process import main; main(int(sys.argv[1]))")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the child copies bytes: no thread pool of its own
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", code, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env,
                                         start_new_session=True)
        except OSError as e:
            ours.close()
            raise TracerError(f"cannot start the trace writer process ({e.strerror or e}); write from a thread: "
                              f"unset {ENV} or set it to thread") from None
        finally:
            theirs.close()
        self.sock = ours  # the tensors' bytes, raw (sendall: one copy into the kernel, without the GIL)
        self.conn = Connection(os.dup(ours.fileno()))  # the messages, framed by multiprocessing
        self.lock = threading.Lock()
        self.dead = False

    def call(self, op: str, wid: int, args: tuple, buffers: list[Any] = (), what: str | None = None) -> Any:
        """Send ``op`` for writer ``wid`` with ``args`` and the raw bytes of ``buffers`` (1-D uint8
        numpy arrays); return the child's answer. ``what``: what ``args`` are, for the child's
        error when it cannot read them (``"run A"``; default ``op``).

        ``args`` travel as a plain pickle (torch's multiprocessing pickler, which ``Connection.send``
        uses, would send a tensor as a shared-memory handle the child cannot open), after a header
        the child can always read, so that it answers an unreadable message instead of dying.

        Raises:
            TracerError: ``args`` hold a value pickle cannot take (one line naming ``what``, nothing
                sent); the child is gone; or the error the child raised, as raised there.
            KeyboardInterrupt: (or any other exception) between the request and its answer: the child
                is ended first, as its answer would be read as the next call's.
        """
        try:
            payload = pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)  # once: this is what is sent
        except Exception as e:  # noqa: BLE001 - a value pickle cannot take, e.g. an object in a call's dict
            holds = "its plan, meta or calls hold" if (what or "").startswith("run ") else "holds"
            raise TracerError(f"{what or op}: {holds} a value that cannot be sent to the trace writer process "
                              f"({type(e).__name__}: {e}); pass plain str/int/float/bool/list/dict values") from None
        with self.lock:
            if self.dead:
                raise self._gone()
            try:
                self.conn.send((op, wid, what or op, [b.nbytes for b in buffers]))
                self.conn.send_bytes(payload)
                for b in buffers:  # raw after the message: the child reads exactly the sizes it names
                    self.sock.sendall(b)
                reply = self.conn.recv_bytes()
            except (EOFError, OSError):
                self.dead = True
                raise self._gone() from None
            except BaseException:
                self._end()
                raise
        status, value = pickle.loads(reply)
        if status == "error":
            raise value
        return value

    def _end(self) -> None:
        """Kill the child (a call was cut between its request and its answer): no later call may read
        an answer that is not its own, and a child left to finish its work could delete a partial
        file of the same name that the next writer creates. The writers delete their partial files."""
        self.dead = True
        try:
            self.conn.close()
            self.sock.close()
            self.proc.kill()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):  # gone already, or a kill that takes its time
            pass

    def _gone(self) -> TracerError:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = f"exit code {code}" if code is not None and code >= 0 else \
            f"signal {-code}" if code is not None else "no answer"
        return TracerError(f"the trace writer process (PID {self.proc.pid}) ended ({how}); the trace was not "
                           f"written: run again, or write from a thread ({ENV}=thread)")


_LOCK = threading.Lock()
_CHILD: _Child | None = None
_IDS = itertools.count(1)


def _forget_child() -> None:
    """In a fork of this process: close its copies of the socket (the child must see EOF when the
    process that started it dies, whatever forks live on) and forget the child and a lock another
    thread may have held."""
    global _CHILD, _LOCK
    _LOCK = threading.Lock()
    child, _CHILD = _CHILD, None
    if child is not None:
        for end in (child.conn, child.sock):
            try:
                end.close()
            except OSError:
                pass


os.register_at_fork(after_in_child=_forget_child)


def _child() -> _Child:
    """This process's writer process, started now if there is none (or it died, or it is the child of
    the process this one was forked from)."""
    global _CHILD
    with _LOCK:
        if _CHILD is None or _CHILD.owner != os.getpid() or _CHILD.dead or _CHILD.proc.poll() is not None:
            _CHILD = _Child()
        return _CHILD


@atexit.register
def _stop() -> None:
    """At exit: close the socket, so the child deletes what is still open and ends, and reap it."""
    child = _CHILD
    if child is None or child.owner != os.getpid():
        return
    try:
        child.conn.close()
        child.sock.close()
        child.proc.wait(timeout=5)
    except Exception:  # noqa: BLE001 - exiting anyway; a child that lingers ends at its socket's EOF
        pass


def prestart() -> None:
    """Start the writer process now when background writers write there (:data:`ENV` is
    ``process``), so its interpreter starts while the model loads; else do nothing.

    Raises:
        TracerError: :data:`ENV` is not a writer mode; the process cannot be started.
    """
    if writer_mode(True) == "process":
        _child()


def _bytes_of(tensor: Any) -> tuple[Any, int, int, Any]:
    """``(storage, byte offset, byte count, host tensor)`` of ``tensor`` on the host, contiguous."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_neg()  # a negative view's storage holds the negated bits
    if not t.is_contiguous():
        t = t.contiguous()
    return t.untyped_storage(), t.storage_offset() * t.element_size(), t.numel() * t.element_size(), t


def run_message(run: Any) -> tuple[dict[str, Any], list[Any]]:
    """``run`` (a :class:`~tracer.execute.records.RunRecord`) as a message and the raw bytes of its
    tensors: points lying end to end in one host buffer (as
    :func:`~tracer.execute.capture.host_copies` lays them out) share one buffer, sent as is.

    Returns:
        ``(message, buffers)``: the message holds the run's fields and, per capture, its key,
        record fields, dtype, shape and ``(buffer index, byte offset)``; ``buffers`` are 1-D uint8
        numpy arrays viewing the tensors' memory (no copy for host tensors).
    """
    import torch

    layout, spans, keep = [], [], []  # spans: [storage, start, length, dtype]
    for key, rec in run.captures.items():
        storage, start, n, t = _bytes_of(rec.tensor)
        keep.append(t)
        where = (-1, 0)
        if n:
            last = spans[-1] if spans else None
            if last is not None and last[3] == t.dtype and last[0].data_ptr() == storage.data_ptr() \
                    and last[1] + last[2] == start:
                where = (len(spans) - 1, last[2])
                last[2] += n
            else:
                where = (len(spans), 0)
                spans.append([storage, start, n, t.dtype])
        layout.append((key, rec.name, rec.kind, rec.op, rec.calls, getattr(rec, "role", ""), t.dtype,
                       tuple(t.shape), *where))
    buffers = [torch.empty(0, dtype=torch.uint8).set_(storage, start, (n,)).numpy() for storage, start, n, _ in spans]
    message = {"name": run.name, "token_ids": run.token_ids, "plan": run.plan, "window": run.window,
               "meta": run.meta, "layout": layout}
    return message, buffers  # pickled once, by _Child.call, which names a value pickle cannot take


class RemoteTraceFile:
    """A :class:`~tracer.store.trace_file.TraceFile` in the writer process: the same methods, each
    a call that returns when the child has done it (the writer calls them from its thread).

    Raises (every method but :meth:`discard`):
        TracerError: what the child's TraceFile raised, or the child died.
    """

    def __init__(self, path: Path, partial_path: Path, format_version: int, compression: str | None) -> None:
        self.path, self.partial_path = Path(path), Path(partial_path)
        # absolute: the child keeps the working folder it started in, this process may have moved since
        self._args = (str(self.path.absolute()), str(self.partial_path.absolute()), format_version, compression)
        self._id = next(_IDS)
        self._child: _Child | None = None

    def create(self, header: dict[str, Any], header_json: str) -> None:
        """Start (or reuse) the writer process and create the partial file there. ``header`` goes
        as the flat scalar copies the file holds (plain values, which the child can always read)."""
        from tracer.store.trace_file import _flat_scalars

        self._child = _child()
        self._child.call("create", self._id, (*self._args, _flat_scalars(header), header_json), what="header")

    def write_run(self, run: Any) -> None:
        """Send ``run``'s fields and tensor bytes (:func:`run_message`); the child writes it."""
        message, buffers = run_message(run)
        self._child.call("write_run", self._id, (message,), buffers, what=f"run {run.name}")

    def set_meta(self, run: str, text: str) -> None:
        self._child.call("set_meta", self._id, (run, text))

    def remove_run(self, run: str) -> None:
        self._child.call("remove_run", self._id, (run,))

    def write_comparison(self, name: str, text: str) -> None:
        self._child.call("write_comparison", self._id, (name, text))

    def finish(self) -> None:
        self._child.call("finish", self._id, ())

    def discard(self) -> None:
        """Have the child close and delete the partial file; raises nothing (a dead child: the
        writer deletes the file itself)."""
        if self._child is not None:
            try:
                self._child.call("discard", self._id, ())
            except Exception:  # noqa: BLE001 - discarding already; the caller's error is the cause
                pass


# ---------------------------------------------------------------- the child's side


def _run_from(message: dict[str, Any], buffers: list[Any]) -> Any:
    """The :class:`~tracer.execute.records.RunRecord` of :func:`run_message`'s output, its tensors
    views of the received ``buffers`` (uint8 tensors)."""
    import torch

    from tracer.execute.records import CaptureRecord, RunRecord

    captures = {}
    for key, name, kind, op, calls, role, dtype, shape, index, offset in message["layout"]:
        if index < 0:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            tensor = buffers[index][offset:offset + n].view(dtype).view(shape)
        captures[key] = CaptureRecord(name=name, kind=kind, tensor=tensor, calls=calls, op=op, role=role)
    return RunRecord(name=message["name"], token_ids=message["token_ids"], plan=message["plan"],
                     window=message["window"], captures=captures, meta=message["meta"])


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - an exception pickle cannot carry: its type and text
        return RuntimeError(f"{type(e).__name__} in the trace writer process: {e}")


def _recv_exactly(sock: socket.socket, buf: Any) -> None:
    """Fill ``buf`` (a writable buffer) from ``sock``, straight into its memory.

    Raises:
        EOFError: the socket closed first.
    """
    view = memoryview(buf).cast("B")
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError
        got += n


def serve(conn: Connection, sock: socket.socket) -> None:
    """Answer the parent's calls until it closes the socket; then delete the partial files of the
    traces still open (the parent went away before finishing them)."""
    import torch

    from tracer.store.trace_file import TraceFile

    files: dict[int, TraceFile] = {}
    try:
        while True:
            try:
                op, wid, what, sizes = conn.recv()
                payload = conn.recv_bytes()
                buffers = []
                for n in sizes:
                    buf = torch.empty(n, dtype=torch.uint8)
                    _recv_exactly(sock, buf.numpy())
                    buffers.append(buf)
            except (EOFError, OSError):
                return
            try:
                try:
                    args = pickle.loads(payload)
                except Exception as e:  # noqa: BLE001 - e.g. a class of the parent's __main__
                    raise TracerError(f"the trace writer process cannot read the {what} that was sent "
                                      f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]}); pass plain "
                                      "str/int/float/bool/list/dict values, "
                                      f"or write from a thread ({ENV}=thread)") from None
                if op == "create":
                    path, partial, version, compression, header, header_json = args
                    files[wid] = TraceFile(Path(path), Path(partial), version, compression)
                    files[wid].create(header, header_json)
                elif op == "write_run":
                    files[wid].write_run(_run_from(args[0], buffers))
                elif op == "discard":
                    f = files.pop(wid, None)
                    if f is not None:
                        f.discard()
                else:
                    getattr(files[wid], op)(*args)
                    if op == "finish":
                        del files[wid]
                reply = ("ok", None)
            except BaseException as e:  # noqa: BLE001 - every error goes back to the writer that called
                reply = ("error", _picklable(e))
            del buffers
            try:
                conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:  # the parent went away meanwhile: delete what is open, quietly
                return
    finally:
        for f in files.values():
            f.discard()


def main(fd: int) -> None:
    """The writer process's entry point: serve the socket ``fd`` (its parent's other end)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it tells us what to delete
    serve(Connection(os.dup(fd)), socket.socket(fileno=fd))


__all__ = ["ENV", "MODES", "writer_mode", "prestart", "run_message", "RemoteTraceFile", "serve", "main"]
