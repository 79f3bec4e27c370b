"""HDF5's global heap, read only after it is checked: the variable-length data of a file tracer did not write.

Variable-length strings and sequences (and region references) live in HDF5's global heap. A damaged
heap collection makes HDF5's C code loop forever while it loads the collection: a zeroed header of
its free-space object (index 0, size 0) is "an object of 0 bytes" that the parser steps over
without moving. The loop holds the GIL, so no Python signal handler and no other thread runs:
``tracer report`` of such a sweep file printed one progress line and ignored SIGTERM (only SIGKILL
ended it). Format-1 traces and sweep files (written before checksums) keep their texts there;
version 2 holds none (fixed-length strings only), so this costs nothing for current files.

:func:`check_heap` runs before anything reads a variable-length value of an open file:

1. it finds the variable-length attributes and datasets by their *type* (object headers, not the
   heap); none: done;
2. it checks every heap collection of the file the way HDF5 parses it (:func:`collection_problem`):
   an object whose size does not move the parser is refused at once;
3. it reads every variable-length value in a forked child process with a deadline
   (:data:`PROBE_S`): a child that does not finish, or crashes, means this process must not read
   them, and the file is refused in one line; a child that finishes shows the same reads are safe
   here (HDF5 reads the same bytes the same way). The parent waits in Python, so SIGTERM and
   Ctrl-C end it at once (the child is killed first).

A file is checked once per process (by device, inode, size and modification time).
"""

from __future__ import annotations

import os
import signal
import struct
import time
from typing import Any

from tracer.errors import TracerError

#: the longest a probe child may take to read a file's variable-length values (seconds); a sound
#: heap of a format-1 file is read in milliseconds
PROBE_S = 10.0
#: a global heap collection's signature and version 1 with its three reserved bytes
_GCOL = b"GCOL\x01\x00\x00\x00"
_MIN_COLLECTION = 4096  # H5HG_MINSIZE: HDF5 never writes a smaller collection
_MAX_WALKED = 256 << 20  # a larger collection (one huge object) is left to the probe
_SCAN_BLOCK = 64 << 20
_checked: set[tuple[int, int, int, int]] = set()


def _has_vlen(t: Any) -> bool:
    """Whether an HDF5 datatype keeps (part of) its values in the global heap."""
    import h5py

    cls = t.get_class()
    if isinstance(t, h5py.h5t.TypeStringID):
        return bool(t.is_variable_str())
    if cls in (h5py.h5t.VLEN, h5py.h5t.REFERENCE):
        return True
    if cls == h5py.h5t.COMPOUND:
        return any(_has_vlen(t.get_member_type(i)) for i in range(t.get_nmembers()))
    if cls == h5py.h5t.ARRAY:
        return _has_vlen(t.get_super())
    return False


def variable_length(f: Any) -> list[tuple[bytes, bytes | None]]:
    """``(object path, attribute name)`` of every variable-length attribute of open file ``f``, and
    ``(dataset path, None)`` of every variable-length dataset, found by type (the heap is not read).
    Names are HDF5's bytes (whatever their encoding). The walk is HDF5's own (``H5Ovisit``, then each
    object's attributes as its attribute storage lists them, ``H5Aiterate`` in storage order): no
    Python object per group or dataset, and no trust in an object's attribute count."""
    import h5py

    found: list[tuple[bytes, bytes | None]] = []

    def attributes(oid: Any, name: bytes) -> None:
        # names listed by walking the attribute storage itself, in storage order (an object's attribute
        # count can be wrong in a damaged file; opening by index trusts it, and by index in name order
        # HDF5 sorts the names at every open), then each opened by name
        keys: list[bytes] = []
        h5py.h5a.iterate(oid, keys.append, index_type=h5py.h5.INDEX_NAME, order=h5py.h5.ITER_NATIVE)
        for key in keys:
            if _has_vlen(h5py.h5a.open(oid, key).get_type()):
                found.append((name, key))

    def look(name: bytes, info: Any) -> None:
        oid = h5py.h5o.open(f.id, name)
        attributes(oid, name)
        if info.type == h5py.h5o.TYPE_DATASET and _has_vlen(oid.get_type()):
            found.append((name, None))

    attributes(f.id, b"/")
    h5py.h5o.visit(f.id, look, info=True)
    return found


def collection_problem(path: str | os.PathLike) -> str | None:
    """The first global heap collection of the file that HDF5 could not finish parsing, as a phrase
    (``None``: every collection parses). Walks each ``GCOL`` collection's objects as HDF5's parser
    does (index 2 bytes, references 2, reserved 4, size 8; an object of index 0 is the free space
    and its size covers its header): an object that does not move the parser forward (size 0 where
    the step is the size) would loop forever."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        at = 0
        while at < size:
            fh.seek(at)
            block = fh.read(_SCAN_BLOCK + len(_GCOL))
            i = block.find(_GCOL)
            while i >= 0:
                problem = _walk_collection(fh, at + i, size)
                if problem is not None:
                    return problem
                i = block.find(_GCOL, i + 1)
            at += _SCAN_BLOCK
    return None


def _walk_collection(fh: Any, start: int, file_size: int) -> str | None:
    fh.seek(start + 8)
    (length,) = struct.unpack("<Q", fh.read(8).ljust(8, b"\0"))
    if length < _MIN_COLLECTION or start + length > file_size or length > _MAX_WALKED:
        return None  # not a collection HDF5 would load (or bytes that only look like one), or left to the probe
    fh.seek(start)
    chunk = fh.read(length)
    p = 16
    while p < length:
        if p + 16 > length:  # the tail is free space
            return None
        index, _refs, _reserved, obj_size = struct.unpack_from("<HHIQ", chunk, p)
        step = obj_size if index == 0 else 16 + ((obj_size + 7) // 8) * 8
        if step == 0:
            return (f"its global heap collection at byte {start} holds an object of 0 bytes at byte {start + p} "
                    "(a zeroed header), on which HDF5 loops forever")
        p += step
    return None


def check_heap(f: Any, path: str | os.PathLike, what: str) -> None:
    """Make sure reading the variable-length values of open file ``f`` (at ``path``) cannot hang or
    crash this process (see the module docstring); ``what`` names the file in messages (``sweep file``).

    Raises:
        TracerError: a heap collection HDF5 cannot parse, or a probe that did not finish in
            :data:`PROBE_S` seconds or crashed (one line; nothing of the heap was read here).
    """
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _checked:
        return
    items = variable_length(f)
    if items:
        problem = collection_problem(path)
        if problem is not None:
            raise TracerError(f"{what} {path} is damaged: {problem}; its texts cannot be read (re-create the file, "
                              "or restore it from a copy)")
        _probe(f, str(path), items, what)
    _checked.add(key)


def _probe(f: Any, path: str, items: list[tuple[bytes, bytes | None]], what: str) -> None:
    """Read ``items`` of open file ``f`` (at ``path``) in a forked child (its copy of ``f``: this process
    reads nothing while it waits), waiting at most :data:`PROBE_S` seconds."""
    pid = os.fork()
    if pid == 0:  # the child: read everything, report by exit code, run nothing of the parent's
        code = 1
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            _read_all(f, items)
            code = 0
        finally:
            os._exit(code)
    status = None
    try:
        deadline, pause = time.monotonic() + PROBE_S, 0.001
        while status is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
            elif time.monotonic() > deadline:
                break
            else:
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
    finally:
        if status is None:  # past the deadline, or interrupted (Ctrl-C, SIGTERM): the child goes first
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if status is None:
        raise TracerError(f"{what} {path} is damaged: HDF5 did not finish reading its variable-length texts in "
                          f"{PROBE_S:g} s (a damaged global heap makes it loop forever); re-create the file")
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        how = f"crashed ({signal.Signals(os.WTERMSIG(status)).name})" if os.WIFSIGNALED(status) else "failed"
        raise TracerError(f"{what} {path} is damaged: HDF5 {how} reading its variable-length texts; re-create the file")


def _read_all(f: Any, items: list[tuple[bytes, bytes | None]]) -> None:
    for name, attr in items:
        obj = f[name]
        if attr is None:
            obj[()]
        else:
            obj.attrs[attr]


__all__ = ["check_heap", "collection_problem", "variable_length", "PROBE_S"]
