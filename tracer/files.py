"""Files the user names as input: regular files only, bounded, decoded strictly.

Bottom-layer helpers (next to :mod:`tracer.errors`; every layer may use them). Refusing FIFOs,
devices and sockets before opening them is what keeps a read from blocking forever.
"""

from __future__ import annotations

import json
import os
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


def check_input_file(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a Path after checking it names an existing regular file (symlinks followed).

    Refusing FIFOs, devices and sockets up front is what keeps a read from blocking forever.

    Raises:
        TracerError: missing, unreadable, or not a regular file (folder, FIFO, device, socket).
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise TracerError(f"{what} {p} not found; check the path") from None
    except OSError as e:
        raise TracerError(f"cannot read {what} {p} ({e.strerror}); check the path and its permissions") from None
    if not stat.S_ISREG(st.st_mode):
        raise TracerError(f"{what} {p} is {file_kind(st.st_mode)}; pass a regular file")
    return p


def read_text_file(path: str | os.PathLike, option: str) -> str:
    """The UTF-8 text of a regular file of at most :data:`MAX_INPUT_BYTES` (FIFOs, devices and
    folders are refused before anything is read, so nothing blocks).

    Raises:
        TracerError: missing, not a regular file, too large, unreadable or not UTF-8.
    """
    if not os.path.exists(path):
        raise TracerError(f"cannot read {option} {path}: No such file or directory; check the path")
    p = check_input_file(path, option)
    try:
        size = p.stat().st_size
        if size > MAX_INPUT_BYTES:
            raise TracerError(f"{option} {p} is {size} bytes; the limit is {MAX_INPUT_BYTES} bytes")
        data = p.read_bytes()
    except OSError as e:
        raise TracerError(f"cannot read {option} {p}: {e.strerror}; check the path") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TracerError(f"{option} {p} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None


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
        with open(p, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise TracerError(f"cannot read {option} {p}: {e.strerror}; check the path") from None
    if head != GGUF_MAGIC:
        raise TracerError(f"{option} {p} is not a GGUF file (it does not start with 'GGUF'); pass the model's .gguf file")
    return str(p)


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
