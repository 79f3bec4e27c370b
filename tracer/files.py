"""Files the user names as input: the one gate. Regular files only, bounded, decoded strictly.

Bottom-layer helpers (next to :mod:`tracer.errors`; every layer may use them). Every file tracer
reads because a user named it (traces, sweep files, engine maps, dump members, prompt and token-id
files, GGUF files, recipes) passes :func:`check_input_file` first: a regular file (FIFOs, devices,
sockets and folders refused before anything opens them, so no read blocks forever), not a kernel
pseudo-file under ``/proc`` or ``/sys`` (they report size 0 and may block: ``/proc/kmsg``), and
at most a bounded number of bytes where the whole file is read into memory. Anything decoded
from a file is bounded by :func:`input_budget` before it is allocated (the callers check declared
sizes, shapes and strides against it: :mod:`tracer.engines.dumps.files`).
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

from tracer.errors import TracerError

#: the longest prompt tracer accepts, in tokens (no model has a longer context)
MAX_TOKENS = 1 << 24
#: the largest prompt / token-id file read (bytes)
MAX_INPUT_BYTES = 256 << 20
#: the deepest JSON nesting accepted in a token-id file (a flat array is depth 1)
MAX_JSON_DEPTH = 2
#: the first bytes of every GGUF file
GGUF_MAGIC = b"GGUF"


def file_kind(mode: int) -> str:
    """'a folder', 'a FIFO (named pipe)', ... for a non-regular ``st_mode``."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _pseudo_devices() -> set[int]:
    """``st_dev`` of the kernel's pseudo-filesystems (procfs, sysfs) on this machine."""
    out = set()
    for root in ("/proc", "/sys"):
        try:
            out.add(os.stat(root).st_dev)
        except OSError:
            pass
    return out


def shown_path(path: str | os.PathLike) -> str:
    """``path`` for a one-line message: control characters (a newline, an escape sequence) as ``\\x0a``."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", lambda m: f"\\x{ord(m.group()):02x}", os.fspath(path))


def check_input_file(path: str | os.PathLike, what: str, max_bytes: int | None = None) -> Path:
    """``path`` as a Path after checking it names an existing regular file (symlinks followed) that
    is not a kernel pseudo-file and, when ``max_bytes`` is given, holds at most that many bytes.

    Refusing FIFOs, devices, sockets and procfs/sysfs files up front is what keeps a read from
    blocking forever.

    Raises:
        TracerError: missing, unreadable, not a regular file (folder, FIFO, device, socket), a
            procfs/sysfs file, or larger than ``max_bytes``.
    """
    p = Path(path)
    q = shown_path(p)
    if str(path) == "":
        raise TracerError(f"{what} is empty; give a file path")
    try:
        st = os.stat(p)
    except FileNotFoundError:
        head = str(path).rsplit(":", 1)[0] if ":" in str(path) else None
        if head and os.path.isfile(head):  # FILE:RUN where a command takes the file alone
            raise TracerError(f"{what} {q} not found, but {shown_path(head)} is a file: this command takes the file "
                              "alone, not FILE:RUN; give the file") from None
        raise TracerError(f"{what} {q} not found; check the path") from None
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise TracerError(f"cannot read {what} {q} ({why}); check the path and its permissions") from None
    if not stat.S_ISREG(st.st_mode):
        raise TracerError(f"{what} {q} is {file_kind(st.st_mode)}; pass a regular file")
    if st.st_dev in _pseudo_devices():
        raise TracerError(f"{what} {q} is a kernel pseudo-file (procfs/sysfs), whose reads may block or never end; "
                          "copy what you need into a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise TracerError(f"{what} {q} is {st.st_size:,} bytes; the limit is {max_bytes:,} bytes")
    return p


def check_exists(spec: str | os.PathLike, what: str = "input") -> None:
    """Refuse at once an input path that does not exist, as given or as ``PATH:RUN`` (a trace and a
    run name): the commands on stored files call this before torch is imported, so a typo is one
    line within a fraction of a second; the full checks (:func:`check_input_file`, the trace's
    validation) come later, where the file is read.

    A FIFO, device or socket is refused here too (by ``stat``, which never blocks), before the
    progress display of a slow start-up can print a line ahead of the error.

    Raises:
        TracerError: empty; neither ``spec`` nor its part before the last ``:`` exists; it is a
            FIFO, device or socket.
    """
    text = os.fspath(spec)
    if text == "":
        raise TracerError(f"{what} is empty; give a file path")
    for path in (text, text.rsplit(":", 1)[0] if ":" in text else None):
        if path is not None and os.path.lexists(path):
            try:
                mode = os.stat(path).st_mode
            except OSError:
                return  # a dangling link or no permission: the full check says which
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise TracerError(f"{what} {shown_path(path)} is {file_kind(mode)}; pass a regular file")
            return
    raise TracerError(f"{what} {shown_path(text)} not found; check the path")


#: environment variable that sets :func:`input_budget` (bytes)
BUDGET_ENV = "TRACER_INPUT_BUDGET"


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f.read(1 << 16).splitlines():
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _address_space_left() -> int | None:
    """Bytes of address space this process may still map under ``RLIMIT_AS`` (None: unlimited)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/statm", "rb") as f:
            used = int(f.read(4096).split()[0]) * os.sysconf("SC_PAGE_SIZE")
        return max(0, soft - used)
    except (OSError, ValueError, IndexError, ImportError):
        return None


def input_budget() -> int:
    """Bytes that decoding one user-named input may allocate: ``$TRACER_INPUT_BUDGET`` when set, else
    half of what is available (the smaller of the machine's available memory and the address space
    ``RLIMIT_AS`` leaves this process), at least 64 MiB. Declared sizes (archive members, npy
    headers, tensor shapes and strides) are checked against it before anything is allocated.

    Raises:
        TracerError: ``$TRACER_INPUT_BUDGET`` is not a positive integer number of bytes.
    """
    raw = os.environ.get(BUDGET_ENV)
    if raw is not None:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value <= 0:
            raise TracerError(f"{BUDGET_ENV}={raw!r} must be a positive integer number of bytes, e.g. 8000000000")
        return value
    limits = [x for x in (_mem_available(), _address_space_left()) if x is not None]
    return max(64 << 20, min(limits) // 2) if limits else 8 << 30


def check_budget(nbytes: int, what: str, budget: int | None = None) -> None:
    """Refuse to allocate ``nbytes`` for ``what`` beyond :func:`input_budget`.

    Raises:
        TracerError: ``nbytes`` exceeds the budget (one line: what, how much, the budget, the knob).
    """
    limit = input_budget() if budget is None else budget
    if nbytes > limit:
        raise TracerError(f"{what} declares {nbytes:,} bytes, over the input budget of {limit:,} bytes (half the "
                          f"memory available to this process; {BUDGET_ENV} sets it); refused before allocating")


class Ledger:
    """The bytes one user-named input (an engine dump: many files) has made tracer allocate so far,
    against one :func:`input_budget`: every tensor read, every copy made of it (token ids widened to
    int64, shards joined, rows stacked), charged *before* it is allocated.

    Args:
        what: the input, for messages (``engine dump d/``).
        budget: bytes (default :func:`input_budget`).
    """

    def __init__(self, what: str, budget: int | None = None) -> None:
        self.what = what
        self.budget = input_budget() if budget is None else budget
        self.used = 0

    def charge(self, nbytes: int, what: str) -> None:
        """Add ``nbytes`` for ``what`` (one allocation about to be made).

        Raises:
            TracerError: the total would exceed the budget (nothing is added then).
        """
        before = self.used
        total = before + max(0, int(nbytes))
        with_rest = f" (with the {before:,} bytes already read or copied from {self.what})" if before else ""
        check_budget(total, f"{what}{with_rest}", self.budget)
        self.used = total


def read_text_file(path: str | os.PathLike, option: str) -> str:
    """The UTF-8 text of a regular file of at most :data:`MAX_INPUT_BYTES` (FIFOs, devices and
    folders are refused before anything is read, so nothing blocks).

    Raises:
        TracerError: missing, not a regular file, too large, unreadable or not UTF-8.
    """
    if str(path) and not os.path.exists(path):
        raise TracerError(f"cannot read {option} {path}: No such file or directory; check the path")
    p = check_input_file(path, option, MAX_INPUT_BYTES)
    try:
        data = read_bounded(p, MAX_INPUT_BYTES)
    except OSError as e:
        raise TracerError(f"cannot read {option} {p}: {e.strerror}; check the path") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TracerError(f"{option} {p} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None


def read_bounded(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of a file already through :func:`check_input_file`, read without blocking
    (``O_NONBLOCK``: a file swapped for a FIFO after the check gives EAGAIN, not a hang) and at most
    ``limit`` of them (a file that grew since the check is refused).

    Raises:
        OSError: unreadable; TracerError: longer than ``limit``.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TracerError(f"{path} is {file_kind(os.fstat(fd).st_mode)}; pass a regular file")
        chunks, n = [], 0
        while True:
            b = os.read(fd, min(1 << 20, limit + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
            if n > limit:
                raise TracerError(f"{path} holds more than {limit:,} bytes; the limit is {limit:,} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_toml(path: str | os.PathLike, what: str) -> dict:
    """A TOML document from a regular UTF-8 file of at most :data:`MAX_INPUT_BYTES` (engine maps,
    recipes, family descriptors).

    Raises:
        TracerError: not a regular file, too large, not UTF-8, not valid TOML (one line).
    """
    try:
        import tomllib
    except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]

    text = read_text_file(path, what)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TracerError(f"{what} {path} is not valid TOML ({str(e).splitlines()[0][:160]})") from None
    except RecursionError:
        raise TracerError(f"{what} {path} nests too deeply to be an engine map or recipe") from None


def _depth_ok(text: str, limit: int) -> bool:
    """True when the JSON text nests brackets at most ``limit`` deep (strings skipped)."""
    depth, in_str, esc = 0, False, False
    for ch in text:
        if in_str:
            esc, in_str = (False, in_str) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def read_token_ids(path: str | os.PathLike, option: str = "--token-ids-file") -> list[int]:
    """A JSON array of token ids (ints in 0..2**31-1) from a regular UTF-8 file.

    Raises:
        TracerError: unreadable, not UTF-8, nested, not JSON, not a non-empty flat array of ints.
    """
    text = read_text_file(path, option)
    shape = f"{option} {path} must hold a flat JSON array of ints (token ids), e.g. [1, 2, 3]"
    if not _depth_ok(text, MAX_JSON_DEPTH - 1):
        raise TracerError(shape)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        where = f" ({e.msg} at line {e.lineno})" if isinstance(e, json.JSONDecodeError) else ""
        raise TracerError(f"{option} {path} is not JSON{where}; it must hold a JSON array of ints, e.g. [1, 2, 3]") from None
    if not isinstance(data, list) or not data or not all(isinstance(x, int) and not isinstance(x, bool) for x in data):
        raise TracerError(shape)
    if not all(0 <= x < 2**31 for x in data):
        raise TracerError(f"{option} {path} holds a token id outside 0..2**31-1; token ids index the vocabulary")
    if len(data) > MAX_TOKENS:
        raise TracerError(f"{option} {path} holds {len(data)} ids; the limit is {MAX_TOKENS}")
    return data


def check_gguf_file(path: str | os.PathLike, option: str = "--gguf") -> str:
    """A regular file that starts with the GGUF magic bytes.

    Raises:
        TracerError: missing, not a regular file, or not a GGUF file.
    """
    p = check_input_file(path, option)
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(24)
    except OSError as e:
        raise TracerError(f"cannot read {option} {p}: {e.strerror}; check the path") from None
    if head[:4] != GGUF_MAGIC:
        raise TracerError(f"{option} {p} is not a GGUF file (it does not start with 'GGUF'); pass the model's .gguf file")
    import struct

    if len(head) < 24:
        raise TracerError(f"{option} {p} is not a readable GGUF file ({size} bytes, shorter than a GGUF header); "
                          "it is truncated or damaged: download it again")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
    # every tensor info takes at least 24 bytes and every key/value 12 (GGUF v2/v3 layouts)
    if version not in (2, 3) or n_tensors * 24 + n_kv * 12 > size:
        raise TracerError(f"{option} {p} is not a readable GGUF file (version {version}, {n_tensors:,} tensors and "
                          f"{n_kv:,} metadata entries declared in {size:,} bytes); it is truncated or damaged: "
                          "download it again")
    return str(p)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's content, streamed in ``chunk``-byte reads.

    Raises:
        OSError: unreadable.
    """
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists (also when it belongs to another user)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
