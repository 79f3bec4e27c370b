"""Integrity of trace files: checksums, file-type checks, guarded writes, stale partial files.

Store-layer helpers (target: ``tracer/store/integrity.py``), used by :mod:`tracer.store.trace` and by
every command that opens a file the user named. Nothing here imports torch.

Checksums (``traces/README.md``, "Integrity"): every group and dataset a writer creates carries
a ``crc32`` JSON attribute, an object mapping each of its other attributes' names (and
``"@data"`` for a dataset's raw bytes) to the CRC-32 (:func:`zlib.crc32`) of their canonical
bytes (:func:`attr_bytes`). The root group's ``checksums = "crc32"`` says the file carries them;
a file without it was written before checksums existed and is read unverified. The CRC-32 of a
large buffer (a dataset's data), on several threads: :mod:`tracer.store.crc`.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import resource
import stat
import zlib
from pathlib import Path
from typing import Any

from tracer.errors import TracerError
from tracer.files import file_kind, pid_alive

#: the checksum scheme this tracer writes (root attribute ``checksums``)
CHECKSUMS = "crc32"
#: the name of the per-object checksum attribute
CRC_ATTR = "crc32"
#: key of a dataset's raw data in its ``crc32`` attribute
DATA_KEY = "@data"
#: root attributes not covered by the root's checksum (written after it: ``complete``)
UNSEALED_ROOT = ("complete",)
#: longest file name most filesystems accept (bytes)
NAME_MAX = 255


# ---------------------------------------------------------------- text attributes


def set_text(obj: Any, name: str, text: str, sums: dict[str, int] | None = None) -> None:
    """Write ``text`` as a fixed-length UTF-8 string attribute ``obj.attrs[name]``.

    Fixed-length strings live in the object header, which HDF5 (file format of 1.8 and later)
    protects with its own checksum; variable-length ones live in the global heap, which has none
    (zeroed bytes there make HDF5 loop forever). ``sums``: also record there the CRC-32 :func:`seal`
    computes for this attribute (a fixed-length string reads back as its bytes, trailing NULs
    dropped), so the seal need not read it back.
    """
    import h5py
    import numpy as np

    data = text.encode("utf-8", "surrogatepass")
    obj.attrs.create(name, np.array(data, dtype=h5py.string_dtype("utf-8", max(1, len(data)))))
    if sums is not None:
        sums[name] = zlib.crc32(attr_bytes(data.rstrip(b"\0"))) & 0xFFFFFFFF


def set_value(obj: Any, name: str, value: Any, sums: dict[str, int] | None = None) -> None:
    """Write a number, boolean or numeric array as ``obj.attrs[name]`` (Python ints as int64, floats as
    float64, booleans as HDF5's numpy bool); ``sums`` as :func:`set_text`."""
    import numpy as np

    arr = np.asarray(value)
    obj.attrs.create(name, arr)
    if sums is not None:
        sums[name] = zlib.crc32(attr_bytes(arr)) & 0xFFFFFFFF


def attr_text(value: Any) -> str | None:
    """A text attribute's value as ``str`` (fixed-length bytes decoded, variable-length as is);
    None when it is not text or not valid UTF-8."""
    import numpy as np

    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return None
    return value if isinstance(value, str) else None


# ---------------------------------------------------------------- checksums


def attr_bytes(value: Any) -> bytes:
    """Canonical bytes of an HDF5 attribute value as h5py returns it.

    ``str`` → UTF-8; ``bytes`` as they are; numbers, booleans and arrays → their numpy bytes
    (``np.asarray(value).tobytes()``, native order), prefixed by the numpy dtype string so that
    ``1`` (int64) and ``1.0`` (float64) differ.
    """
    if isinstance(value, str):
        return b"s" + value.encode("utf-8", "surrogatepass")
    if isinstance(value, bytes):
        return b"b" + value
    import numpy as np

    arr = np.asarray(value)
    if arr.dtype.kind in "OUS":
        return b"o" + json.dumps(arr.tolist(), default=str).encode()
    return arr.dtype.str.encode() + arr.tobytes()


def seal(obj: Any, data_crc: int | None = None, sums: dict[str, int] | None = None) -> None:
    """Write ``obj.attrs["crc32"]``: the CRC-32 of every other attribute of ``obj`` (an h5py
    Group, Dataset or File), plus ``"@data"`` = ``data_crc`` for a dataset.

    Call it after the object's last attribute write; calling it again re-seals (e.g. after
    ``/runs``' ``order`` grows). The root's ``complete`` is left out (it is set last).
    ``sums``: the CRC-32 of **every** attribute of ``obj`` as its writer recorded them
    (:func:`set_text`, :func:`set_value`), used instead of reading each attribute back (each
    read is an HDF5 call); an attribute missing from it is then not covered, which every reader
    refuses (:func:`verify_attrs`).
    """
    if sums is not None:
        sums = dict(sums)
    else:
        sums = {}
        root = obj.name == "/"
        for name in obj.attrs:
            if name == CRC_ATTR or (root and name in UNSEALED_ROOT):
                continue
            sums[name] = zlib.crc32(attr_bytes(obj.attrs[name])) & 0xFFFFFFFF
    if data_crc is not None:
        sums[DATA_KEY] = int(data_crc)
    set_text(obj, CRC_ATTR, json.dumps(sums, sort_keys=True))


def verify_attrs(obj: Any, what: str, required: tuple[str, ...] = ()) -> dict[str, int]:
    """Check every attribute of ``obj`` against its ``crc32``; return the parsed sums.

    Args:
        what: how the object is named in the error (``model.layers.3 in run A``).
        required: attributes that must be covered (present in the sums).

    Raises:
        TracerError: ``trace corrupt: <what> fails its checksum`` (missing or unparsable
            ``crc32``, an attribute whose bytes differ, a required attribute not covered).
    """
    bad = TracerError(f"trace corrupt: {what} fails its checksum; the file was damaged after it was written, re-run it")
    raw = attr_text(obj.attrs.get(CRC_ATTR))
    if raw is None:
        raise bad
    try:
        sums = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad from None
    if not isinstance(sums, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in sums.values()):
        raise bad
    root = obj.name == "/"
    present = [n for n in obj.attrs if n != CRC_ATTR and not (root and n in UNSEALED_ROOT)]
    for name in present:
        if name not in sums or (zlib.crc32(attr_bytes(obj.attrs[name])) & 0xFFFFFFFF) != sums[name]:
            raise bad
    if any(name != DATA_KEY and name not in present for name in sums) or any(r not in sums for r in required):
        raise bad  # an attribute was removed (or renamed)
    return sums


# ---------------------------------------------------------------- files the user names


def check_name_length(path: str | os.PathLike, what: str = "output") -> Path:
    """``path`` as a Path after checking no component is longer than :data:`NAME_MAX` bytes.

    Raises:
        TracerError: a file or folder name longer than 255 bytes.
    """
    p = Path(path)
    for part in p.parts:
        if len(os.fsencode(part)) > NAME_MAX:
            raise TracerError(f"{what} name {part[:40]}... is {len(os.fsencode(part))} bytes long; "
                              f"file names are limited to {NAME_MAX} bytes, choose a shorter name")
    return p


def check_output_path(path: str | os.PathLike, overwrite: bool, what: str = "output", *,
                      resume: bool = False) -> Path:
    """Check that ``path`` may be written: its name fits the filesystem, an existing entry is
    replaced only when ``overwrite`` is given and it is a regular file or a symlink (``resume``:
    an existing regular file may also be continued), and the nearest existing parent is a folder
    this process can write.

    Raises:
        TracerError: a name longer than 255 bytes; an existing folder, FIFO, device or socket
            (with or without ``overwrite``); an existing file without ``overwrite``/``resume``;
            the parent is an existing non-folder or not writable.
    """
    p = check_name_length(path, what)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        raise TracerError(f"{what} {p}: a parent of it is a file, not a folder; choose another path") from None
    except OSError as e:
        raise TracerError(f"cannot inspect {what} {p} ({e.strerror}); choose another path") from None
    if st is not None:
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            raise TracerError(f"{what} {p} is {file_kind(st.st_mode)}; only a regular file is ever replaced, choose a file name")
        if not overwrite and not resume:
            raise TracerError(f"{what} {p} exists; pass --overwrite or choose another --output")
    from tracer.files import _pseudo_devices

    for parent in (p.absolute().parent, *p.absolute().parents):
        if parent.exists():
            if not parent.is_dir():
                raise TracerError(f"{what} {p}: {parent} is a file, not a folder; choose another path")
            if os.stat(parent).st_dev in _pseudo_devices():
                raise TracerError(f"{what} {p}: {parent} is in a kernel pseudo-filesystem (procfs/sysfs), where "
                                  "files cannot be written; choose a folder on a disk")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise TracerError(f"{what} {p}: the folder {parent} is not writable; choose another path")
            break
    return p


def check_not_an_input(output: str | os.PathLike, inputs: dict[str, Any], what: str = "--output") -> None:
    """Refuse an output path that names a file the same command reads (``import -o`` onto its ``-r``
    reference, ``-o`` onto ``--prompt-file``): writing it would destroy the input, ``--overwrite``
    or not.

    Args:
        inputs: option → path (None entries are skipped).

    Raises:
        TracerError: ``output`` is (or resolves to, or is a hard link of) one of ``inputs``.
    """
    out = Path(output)
    for option, src in inputs.items():
        if src is None or str(src) == "":
            continue
        same = os.path.realpath(out) == os.path.realpath(src)
        if not same and out.exists() and os.path.exists(src):
            try:
                same = os.path.samefile(out, src)
            except OSError:
                same = False
        if same:
            raise TracerError(f"{what} {output} is the {option} input {src} of this command; writing it would "
                              f"destroy the input: choose another {what}")


def is_checksummed(path: str | os.PathLike) -> bool:
    """Whether the trace at ``path`` carries checksums (its root ``checksums`` attribute names the
    scheme this tracer verifies); False for a trace written before checksums, or stripped of them.
    Reads that one attribute (the file's reader validated the rest).

    Raises:
        TracerError: not a readable regular file.
    """
    import h5py

    from tracer.files import check_input_file

    from tracer.store.heap import check_heap

    p = check_input_file(path, "trace")
    try:
        with h5py.File(p, "r") as f:
            check_heap(f, p, "trace")
            return attr_text(f.attrs.get("checksums")) == CHECKSUMS
    except OSError as e:
        raise TracerError(f"cannot open {p} as HDF5 ({e}); pass a trace written by tracer") from None


_PARTIAL = re.compile(r"\.partial-(\d+)(?:-\d+)?$")


#: a sweep's hidden per-point trace (``--keep-tensors``): ``.<sweep stem>.point-<PID>.h5``
_POINT = re.compile(r"^\..+\.point-(\d+)\.h5$")


def check_output(output: str | Path | None, overwrite: bool) -> None:
    """Refuse an existing output file (before anything is loaded or run).

    Raises:
        TracerError: the file exists and ``overwrite`` is False, or it is a directory.
    """
    if output is None:
        return
    p = check_name_length(output, "--output")
    check_output_path(p, overwrite, "--output")  # devices, FIFOs, long names, read-only folders
    if p.is_dir():
        raise TracerError(f"--output {p} is a directory; give a file path ending in .h5")
    if p.exists() and not overwrite:
        raise TracerError(f"trace {p} exists; pass --overwrite to replace it or choose another --output")


def clean_stale_partials(path: str | os.PathLike) -> list[Path]:
    """Delete the ``*.partial-<PID>`` files in ``path``'s folder left by writers that no longer run
    (of any trace name, hidden ones included: a default name carries a timestamp, so the next run
    never has the dead one's name), and the hidden per-point traces of sweeps
    (``.<name>.point-<PID>.h5``) whose process is gone; return them.

    Only regular files whose PID is gone are deleted (a live writer's file is kept). A trace that
    tracer told the user to keep is never named like this (``<stem>.new-<PID>.h5``).
    """
    p = Path(path)
    removed = []
    try:
        siblings = list(p.parent.glob("*.partial-*")) + list(p.parent.glob(".*.point-*.h5"))
    except OSError:
        return removed
    for s in siblings:
        m = _PARTIAL.search(s.name) or _POINT.match(s.name)
        if m is None or int(m.group(1)) == os.getpid() or pid_alive(int(m.group(1))):
            continue
        try:
            if stat.S_ISREG(os.lstat(s).st_mode):
                s.unlink()
                removed.append(s)
        except OSError:
            pass
    return removed


def partial_pid(path: str | os.PathLike) -> int | None:
    """The writer PID of a ``*.partial-<PID>`` file name, else None."""
    m = _PARTIAL.search(Path(path).name)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------- guarded writes


class GuardedFile(io.RawIOBase):
    """A file object for h5py's ``fileobj`` driver that never reports a write error to HDF5.

    h5py crashes (segfault) when HDF5 sees a failing write (disk full, ``ulimit -f``) and later
    closes or frees the file. This wrapper records the first error, then accepts (and drops)
    every further write, so HDF5 finishes normally; the writer checks :attr:`error` and turns
    it into a one-line :class:`TracerError`, deleting the partial file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = Path(path)
        self._f = open(self.path, "x+b", buffering=0)  # noqa: SIM115 - closed by close()
        self.error: OSError | None = None

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, b: Any) -> int:
        return self._f.readinto(b)

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        if self.error is None:
            done = 0
            try:
                while done < n:
                    k = self._f.write(view[done:])
                    if not k:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    done += k
            except OSError as e:
                self.error = e
                self._f.seek(self._f.tell() + (n - done))
        else:
            self._f.seek(self._f.tell() + n)
        return n

    def truncate(self, size: int | None = None) -> int:
        if self.error is None:
            try:
                return self._f.truncate(size)
            except OSError as e:
                self.error = e
        return self._f.tell() if size is None else size

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
        super().close()


def check_space(path: str | os.PathLike, need: int, what: str) -> None:
    """Refuse to grow ``path`` by ``need`` bytes when the filesystem's free space or the process's
    file size limit (``ulimit -f``) cannot take them: for writers that write in place (a sweep
    file), where a failing write would leave HDF5 (and the file) broken.

    Raises:
        TracerError: too little space or too low a limit; the message says which.
    """
    p = Path(path)
    try:
        size = p.stat().st_size if p.exists() else 0
        st = os.statvfs(p.parent if p.parent.exists() else ".")
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if need > free:
        raise TracerError(f"{what}: {need} more bytes needed but {free} are free on the disk of {p}; free space, "
                          "then re-run the same command (the finished points are kept)")
    if limit != resource.RLIM_INFINITY and size + need > limit:
        raise TracerError(f"{what}: the file size limit (ulimit -f, {limit} bytes) would be exceeded; raise it, "
                          "then re-run the same command (the finished points are kept)")


def write_error_message(path: str | os.PathLike, e: OSError) -> str:
    """One line for a failed trace write: what failed and what to do."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        cause = "the disk is full (or over quota)"
    elif e.errno == errno.EFBIG:
        cause = "the file size limit was reached (ulimit -f)"
    else:
        cause = e.strerror or str(e)
    return f"cannot write {path}: {cause}; the partial file was removed, free space or choose another --output"
