"""Opening the files of an engine dump: the input gate for ``.pt``, ``.npz`` and ``.safetensors``.

Every member of a dump passes :func:`tracer.files.check_input_file` (a regular file, never a FIFO,
device or procfs file: nothing blocks) and is decoded within :func:`tracer.files.input_budget`,
checked *before* anything is allocated:

- ``.pt`` (``torch.save``): the zip members' declared sizes are checked before ``torch.load``
  (``weights_only=True``, nothing unpickled but tensors and plain containers) reads them; every
  tensor it returns is then checked by shape and strides: its logical size (elements × element
  size) must fit the budget, and a tensor whose storage is smaller than its logical size (stride 0:
  ``expand``, or overlapping strides) is materialised only then (:func:`bounded`);
- ``.npz``: each member's declared uncompressed size, its npy header (dtype: no objects; shape ×
  item size must equal the member's data size) and its compression ratio are checked before the
  member is inflated, and then exactly the declared bytes are read;
- ``.safetensors``: the file size bounds what the loader maps and copies (it checks its header's
  offsets against the file itself).

A dump is one input: its files and the copies tracer makes of them (token ids widened to int64,
TP shards joined, rows stacked onto positions) are charged to one running total, a
:class:`tracer.files.Ledger` (:func:`tracer.engines.dumps.read.read_dump` makes it; the mapping,
:func:`tracer.engines.dumps.namemap.map_dump`, charges its copies to it), each before it is allocated.
Only dense CPU tensors are read (a sparse, quantized or nested tensor is refused by its layout).

A refusal is one :class:`~tracer.errors.TracerError` line naming the file and the reason.
"""

from __future__ import annotations

import math
import pickle
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tracer.errors import TracerError
from tracer.files import Ledger, check_budget, check_input_file, input_budget

#: an archive member inflating more than this many times its compressed size (and above
#: :data:`BOMB_MIN_BYTES`) is a decompression bomb, refused before inflating
MAX_RATIO = 256
BOMB_MIN_BYTES = 256 << 20
#: the deepest nesting of containers a ``.pt`` may hold
MAX_DEPTH = 32


def gate(path: str | Path, what: str = "dump file") -> Path:
    """A dump member through the input gate (regular file, not procfs, at most the budget in size).

    Raises:
        TracerError: see :func:`tracer.files.check_input_file`.
    """
    return check_input_file(path, what, input_budget())


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:120]


def _check_zip(path: Path, budget: int) -> None:
    """Refuse a zip whose members declare more bytes than the budget, or inflate like a bomb."""
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise TracerError(f"cannot read {path} as a zip archive ({_first_line(e)})") from None
    total = 0
    for info in infos:
        total += info.file_size
        if info.file_size > BOMB_MIN_BYTES and info.file_size > MAX_RATIO * max(1, info.compress_size):
            raise TracerError(f"{path}: member {info.filename!r} declares {info.file_size:,} bytes from "
                              f"{info.compress_size:,} compressed (more than {MAX_RATIO}:1, a decompression bomb); "
                              "refused before inflating")
    check_budget(total, f"{path} (its members)", budget)


def bounded(obj: Any, where: str, budget: int | None = None, _depth: int = 0, ledger: Ledger | None = None) -> Any:
    """``obj`` (what ``torch.load`` returned) with every tensor checked against the budget by shape
    and strides; a tensor whose storage is smaller than its logical size (stride 0 or overlapping
    strides) is materialised (made contiguous) once the check passed. Containers are rebuilt.
    ``ledger``: the dump's running total (default: one for ``obj`` alone).

    Raises:
        TracerError: a tensor (or all together) larger than the budget, nesting deeper than
            :data:`MAX_DEPTH`, a tensor that is not dense (sparse, quantized, nested) or not on the CPU.
    """
    ledger = Ledger(where, budget) if ledger is None else ledger
    if _depth > MAX_DEPTH:
        raise TracerError(f"{where} nests containers more than {MAX_DEPTH} deep; tracer reads tensors in plain dicts/lists")
    if isinstance(obj, torch.Tensor):
        _check_dense(obj, where)
        logical = math.prod(obj.shape) * obj.element_size()
        ledger.charge(logical, f"{where}: a tensor of shape {tuple(obj.shape)} {str(obj.dtype).removeprefix('torch.')}"
                      f"{' (stride 0 / overlapping: ' + str(tuple(obj.stride())) + ')' if _overlaps(obj) else ''}")
        return obj.contiguous() if _overlaps(obj) else obj
    if isinstance(obj, dict):
        return {k: bounded(v, where, budget, _depth + 1, ledger) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(bounded(v, where, budget, _depth + 1, ledger) for v in obj)
    return obj


def _check_dense(t: torch.Tensor, where: str) -> None:
    """Refuse what no capture point holds: a sparse (COO, CSR, ...), quantized or nested tensor, or one
    that is not on the CPU (a meta tensor holds no values)."""
    kind = None
    if t.layout != torch.strided:
        kind = f"a {str(t.layout).removeprefix('torch.')} (not dense) tensor"
    elif t.is_quantized:
        kind = f"a quantized tensor ({str(t.dtype).removeprefix('torch.')})"
    elif getattr(t, "is_nested", False):
        kind = "a nested tensor"
    elif t.device.type != "cpu":
        kind = f"a tensor on device {t.device.type}"
    if kind is not None:
        raise TracerError(f"{where} holds {kind} of shape {tuple(t.shape)}; tracer reads dense CPU tensors "
                          "(save t.to_dense() / t.dequantize() / t.cpu())")


def _overlaps(t: torch.Tensor) -> bool:
    """True when the tensor's elements do not each have their own storage bytes (stride 0 or overlap)."""
    if t.numel() <= 1 or t.is_contiguous():
        return False
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()) if n > 0)
    return span < t.numel() or any(s == 0 for n, s in zip(t.shape, t.stride()) if n > 1)


def load_pt(path: str | Path, ledger: Ledger | None = None) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU through the gate, within the budget
    (``ledger``: the dump's running total, default one for this file).

    Raises:
        TracerError: not a regular file, too large, declared sizes over the budget, pickled
            objects that need an unsafe unpickler, an unreadable file (naming it).
    """
    p = gate(path)
    budget = input_budget()
    if zipfile.is_zipfile(p):
        _check_zip(p, budget)
    try:
        data = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise TracerError(f"{p} holds objects that only an unsafe unpickler can load ({_first_line(e)}); "
                          "tracer reads tensors and plain dicts/lists only (torch.load weights_only=True)") from None
    except (OSError, RuntimeError, EOFError, ValueError, MemoryError, OverflowError, IndexError, KeyError,
            AttributeError, TypeError, zipfile.BadZipFile) as e:
        raise TracerError(f"cannot read {p} as a torch.save file ({_first_line(e)})") from None
    return bounded(data, str(p), budget, ledger=ledger)


def _npy_header(f: Any, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    from numpy.lib import format as npf

    try:
        version = npf.read_magic(f)
        if version == (1, 0):
            return npf.read_array_header_1_0(f, max_header_size=1 << 16)
        if version in ((2, 0), (3, 0)):
            return npf.read_array_header_2_0(f, max_header_size=1 << 16)
    except (ValueError, OSError, EOFError, SyntaxError, TypeError, zipfile.BadZipFile) as e:
        raise TracerError(f"{where}: not an npy array ({_first_line(e)})") from None
    raise TracerError(f"{where}: npy format version {version} is not read; save it with np.savez")


def load_npz(path: str | Path, ledger: Ledger | None = None) -> dict[str, torch.Tensor]:
    """The arrays of an ``.npz`` through the gate: each member's npy header, declared size and
    compression ratio checked against the budget (``ledger``: the dump's running total) before it
    is inflated; objects never unpickled.

    Raises:
        TracerError: not a regular file or zip; a member that is not a plain numeric npy array
            (pickled objects), whose header disagrees with its size, or over the budget.
    """
    p = gate(path)
    budget = input_budget()
    _check_zip(p, budget)
    out: dict[str, torch.Tensor] = {}
    ledger = Ledger(str(p), budget) if ledger is None else ledger
    with zipfile.ZipFile(p) as z:
        for info in z.infolist():
            where = f"{p}: member {info.filename!r}"
            with z.open(info) as f:
                shape, fortran, dtype = _npy_header(f, where)
                if dtype.hasobject:
                    raise TracerError(f"{p} holds pickled objects (member {info.filename!r} has dtype object); "
                                      "save plain numeric arrays (np.savez)")
                if any(not isinstance(n, int) or n < 0 for n in shape):
                    raise TracerError(f"{where}: npy header declares shape {shape}; not an array shape")
                nbytes = math.prod(shape) * dtype.itemsize
                ledger.charge(nbytes, f"{where} (shape {shape} {dtype})")
                header = f.tell()
                if header + nbytes != info.file_size:
                    raise TracerError(f"{where}: its npy header declares shape {shape} {dtype} ({nbytes:,} bytes) "
                                      f"but the member holds {max(0, info.file_size - header):,}; the file is damaged")
                try:
                    raw = f.read(nbytes)
                except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
                    raise TracerError(f"{where}: cannot inflate it ({_first_line(e)}); the file is damaged") from None
            if len(raw) != nbytes:
                raise TracerError(f"{where}: holds {len(raw):,} of its {nbytes:,} declared bytes; the file is damaged")
            if dtype.kind not in "biuf":
                raise TracerError(f"{where}: dtype {dtype} is not a real number type; save plain numeric arrays (np.savez)")
            arr = np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="), copy=True)
            arr = arr.reshape(shape[::-1]).T if fortran else arr.reshape(shape)
            name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
            out[name] = torch.from_numpy(np.ascontiguousarray(arr))
    return out


def load_safetensors(path: str | Path, ledger: Ledger | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file through the gate (its size is within the budget, and
    charged to ``ledger``, the dump's running total: the tensors it holds are copied out of it).

    Raises:
        TracerError: not a regular file, too large, not a readable safetensors file, a tensor
            that is not dense.
    """
    p = gate(path)
    if ledger is not None:
        ledger.charge(p.stat().st_size, f"{p} (its tensors)")
    try:
        from safetensors.torch import load_file

        return load_file(str(p))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise TracerError(f"cannot read {p} as a safetensors file ({_first_line(e)})") from None
