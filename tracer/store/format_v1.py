"""Format version 1: one HDF5 dataset per capture point (read, and written on request).

Store-layer module. A version-1 run keeps a ``capture_order`` attribute and a ``captures/``
group with one dataset per point, named by its module path, of shape ``(T, *feature)`` in the
storage type of the dtype table (bf16/fp16 as uint16 bit patterns), with ``dtype``, ``kind``,
``op``, ``calls`` and ``crc32`` attributes (``traces/README.md``, "Format version 1"). Also the
tensor <-> storage-bits conversions both versions describe. Registered as format version 1
(:mod:`tracer.store.formats`).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator

import h5py
import numpy as np
import torch

from tracer.dtypes import DTYPES, FLOATS
from tracer.errors import TracerError
from tracer.execute.records import CaptureRecord, RunRecord
from tracer.store.formats import TraceFormat, check_name, json_dumps, register, write_run_group
from tracer.store.header import upgrade_v2
from tracer.store.crc import crc32_bytes
from tracer.store.integrity import DATA_KEY, attr_text, seal, set_text
from tracer.store.validate import load_json, validate_v1_captures

#: target size of one HDF5 chunk of a compressed capture dataset (rows along the first axis)
CHUNK_BYTES = 1 << 20

# the one dtype table (:mod:`tracer.dtypes`): names, on-disk layout (bf16/fp16 as uint16 bit patterns)
_DTYPES = DTYPES
_DTYPE_NAMES = {f.torch: n for n, f in FLOATS.items()}
_RAW16 = tuple(n for n, f in FLOATS.items() if f.raw16)
_STORED = {n: f.stored for n, f in FLOATS.items()}


def tensor_to_numpy(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """A numpy array sharing ``tensor``'s bits (CPU, contiguous) and the dtype name to store.

    bf16/fp16 become uint16 views of the bit patterns; fp32/fp64 stay as they are.

    Raises:
        TracerError: the dtype is not bfloat16/float16/float32/float64.
    """
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise TracerError(f"cannot store a {tensor.dtype} tensor; the trace holds {', '.join(_DTYPES)}")
    t = tensor.detach().cpu().resolve_neg().contiguous()  # a negative view: its values
    if name in _RAW16:
        return t.view(torch.int16).numpy().view(np.uint16), name
    return t.numpy(), name


def numpy_to_tensor(array: np.ndarray, dtype: str) -> torch.Tensor:
    """The torch tensor whose bits are ``array`` (as stored), in dtype ``dtype`` (a name).

    Raises:
        TracerError: unknown dtype name, or an array whose storage type does not match it.
    """
    if dtype not in _DTYPES:
        raise TracerError(f"stored dtype {dtype!r} is unknown; this tracer reads {', '.join(_DTYPES)}")
    if array.dtype != _STORED[dtype]:
        raise TracerError(f"dataset of {array.dtype} does not hold {dtype} values; the trace is corrupt, re-run it")
    if not array.flags.c_contiguous:
        array = array.copy(order="C")  # (np.ascontiguousarray would turn a 0-d array 1-d)
    if dtype in _RAW16:
        return torch.from_numpy(array.view(np.int16)).view(_DTYPES[dtype])
    return torch.from_numpy(array)


def write_tensor(group: h5py.Group, name: str, tensor: torch.Tensor, *, compression: str | None = None,
                 attrs: dict[str, Any] | None = None) -> h5py.Dataset:
    """Write ``tensor`` bit-exactly as dataset ``group[name]`` with a ``dtype`` attribute, the
    given extra ``attrs``, and a ``crc32`` attribute sealing them and the data's raw bytes
    (:func:`tracer.store.integrity.seal`; CRC-32 of the bytes costs ~0.1 s per GiB, see the README).

    One ``create_dataset`` call. Without compression the dataset is contiguous: reading it
    back is one sequential read, at the disk's speed (measured on the H200 machine: 1 MiB
    chunks read at about half the raw bandwidth). With ``compression`` it is chunked along the
    first axis (~:data:`CHUNK_BYTES` per chunk), which HDF5 filters need.
    """
    array, dtype = tensor_to_numpy(tensor)
    chunks = None
    if compression is not None and array.ndim >= 1 and array.size > 0:
        row_bytes = array.itemsize * (array.size // array.shape[0])
        rows = max(1, min(array.shape[0], CHUNK_BYTES // max(1, row_bytes)))
        chunks = (rows, *array.shape[1:])
    data_crc = crc32_bytes(array)
    ds = group.create_dataset(name, data=array, chunks=chunks, compression=compression if chunks else None)
    set_text(ds, "dtype", dtype)
    for key, value in (attrs or {}).items():
        set_text(ds, key, value) if isinstance(value, str) else ds.attrs.create(key, value)
    seal(ds, data_crc)
    return ds


def read_dataset(ds: h5py.Dataset, rows: slice | None = None, *, pin: bool = False) -> torch.Tensor:
    """The tensor stored in the version-1 capture dataset ``ds`` (all of it, or ``rows`` along the first axis), bit-exact.

    Args:
        pin: read straight into page-locked (pinned) host memory, from which a non-blocking copy
            to a GPU runs at full speed (needs CUDA; whole datasets only).

    A whole-dataset read is checked against the dataset's ``crc32`` (when it has one); a
    ``rows`` slice is not (its checksum covers the whole dataset).

    Raises:
        TracerError: ``trace corrupt: <name> in run <run> fails its checksum``, an unreadable
            dataset, or a missing/unknown dtype.
    """
    try:
        dtype = attr_text(ds.attrs["dtype"])
        if dtype is None:
            raise KeyError("dtype")
        expected = _data_crc(ds) if rows is None else None
        if pin and rows is None and dtype in _DTYPES and ds.dtype == _STORED[dtype] and ds.size > 0:
            raw16 = dtype in _RAW16
            out = torch.empty(ds.shape, dtype=torch.int16 if raw16 else _DTYPES[dtype], pin_memory=True)
            view = out.numpy().view(np.uint16) if raw16 else out.numpy()
            ds.read_direct(view)  # no conversion: the stored type and the buffer's agree
            _verify_data(ds, view, expected)
            return out.view(_DTYPES[dtype]) if raw16 else out
        data = np.asarray(ds[()] if rows is None else ds[rows])
    except KeyError:
        raise TracerError(f"trace corrupt: {describe_dataset(ds)} has no dtype attribute; re-run it") from None
    except (OSError, RuntimeError, ValueError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0][:120]
        raise TracerError(f"trace corrupt: {describe_dataset(ds)} cannot be read ({first}); re-run it") from None
    _verify_data(ds, data, expected)
    return numpy_to_tensor(data, dtype)


def describe_dataset(ds: h5py.Dataset) -> str:
    """``model.layers.3 in run A`` for ``/runs/A/captures/model.layers.3`` (else the HDF5 path)."""
    parts = ds.name.split("/")
    if len(parts) >= 5 and parts[-2] == "captures":
        return f"{parts[-1]} in run {parts[-3]}"
    if len(parts) >= 3 and parts[-1] == "token_ids":
        return f"token_ids of run {parts[-2]}"
    return ds.name


def _data_crc(ds: h5py.Dataset) -> int | None:
    """The CRC-32 stored for ``ds``'s data, or None (a trace written before checksums)."""
    raw = ds.attrs.get("crc32")
    if raw is None:
        return None
    sums = load_json(raw, ds.file.filename, f"the checksum of {describe_dataset(ds)}", dict)
    value = sums.get(DATA_KEY)
    if not isinstance(value, int):
        raise TracerError(f"trace corrupt: {describe_dataset(ds)} fails its checksum; re-run it")
    return value


def verify_dataset(ds: h5py.Dataset, array: np.ndarray) -> None:
    """Check ``array`` (all of ``ds``, as read) against the dataset's stored ``@data`` CRC-32 (if any).

    Raises:
        TracerError: ``trace corrupt: <what> fails its checksum``.
    """
    _verify_data(ds, array, _data_crc(ds))


def _verify_data(ds: h5py.Dataset, array: np.ndarray, expected: int | None) -> None:
    if expected is not None and crc32_bytes(array) != expected:
        raise TracerError(f"trace corrupt: {describe_dataset(ds)} fails its checksum; the file was damaged "
                          "after it was written, re-run it")


def dataset_row_blocks(handle: h5py.Dataset, rows_per_block: int,
                       buffers: Callable[[], np.ndarray] | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """A capture point's tensor front to back in blocks of ``rows_per_block`` rows (first axis):
    ``(first row, tensor (rows, *feature))``, bit-exact, for comparing points larger than memory.

    The CRC-32 is carried from block to block and checked after the last block, so a damaged
    point raises before the caller reports anything computed from its blocks. ``buffers`` is
    accepted for the common signature and not used (HDF5 allocates each block). A 0-d tensor
    is one block.

    Raises:
        TracerError: ``trace corrupt: <name> in run <run> fails its checksum`` or an unreadable point.
    """
    expected = _data_crc(handle)
    if handle.ndim == 0:
        yield 0, read_dataset(handle)
        return
    crc, step = 0, max(1, int(rows_per_block))
    for r0 in range(0, handle.shape[0], step):
        t = read_dataset(handle, slice(r0, r0 + step))
        crc = crc32_bytes(tensor_to_numpy(t)[0], crc)
        yield r0, t
    if expected is not None and crc != expected:
        raise TracerError(f"trace corrupt: {describe_dataset(handle)} fails its checksum; the file was damaged "
                          "after it was written, re-run it")


def dataset_crc(handle: h5py.Dataset) -> int | None:
    """The CRC-32 stored for a version-1 capture dataset's data (its ``crc32``'s ``@data``), or None
    for a trace written before checksums (or a damaged checksum, which a whole read refuses)."""
    try:
        return _data_crc(handle)
    except TracerError:
        return None


def _capture_info(ds: h5py.Dataset, entry: dict[str, Any] | None = None) -> dict[str, Any]:
    attrs = ds.attrs
    return {
        "kind": attr_text(attrs["kind"]),
        "op": attr_text(attrs["op"]),
        "calls": json.loads(attrs["calls"]),
        "dtype": attr_text(attrs["dtype"]),
        "shape": list(ds.shape),
        **({"role": attr_text(attrs["role"])} if "role" in attrs else {}),
    }


def _check_capture(record: CaptureRecord) -> str:
    """Validate a capture before anything is written; return its calls as JSON."""
    check_name(record.name, "capture")
    if record.tensor.dtype not in _DTYPE_NAMES:
        raise TracerError(f"capture {record.name} is {record.tensor.dtype}; the trace holds {', '.join(_DTYPES)}")
    return json_dumps(record.calls, f"calls of capture {record.name}")


def write_capture(group: h5py.Group, record: CaptureRecord, *, compression: str | None = None) -> h5py.Dataset:
    """Write one capture point's record as dataset ``group[record.name]`` (tensor + kind/op/calls).

    Raises:
        TracerError: invalid name, unsupported dtype, or calls not JSON-able.
    """
    calls = _check_capture(record)
    attrs = {"kind": str(record.kind), "op": str(record.op), "calls": calls}
    if getattr(record, "role", ""):
        attrs["role"] = str(record.role)
    return write_tensor(group, record.name, record.tensor, compression=compression, attrs=attrs)


def write_run(runs: h5py.Group, run: RunRecord, *, compression: str | None = None) -> h5py.Group:
    """Write a whole run as ``runs[run.name]`` in format version 1: attributes, token ids and every
    capture in order, a dataset each.

    Everything is validated first, so a TracerError leaves ``runs`` unchanged; if writing
    itself fails, the half-written group is removed.

    Raises:
        TracerError: invalid or duplicate run name, capture key ≠ record name, invalid capture,
            plan/meta not JSON-able.
    """
    check_name(run.name, "run")
    for key, record in run.captures.items():
        if key != record.name:
            raise TracerError(f"capture key {key!r} does not match its record name {record.name!r}; key captures by name")
        _check_capture(record)

    def fill(g: h5py.Group, sums: dict[str, int]) -> None:  # no attribute on the run's group
        captures = g.create_group("captures", track_order=True)
        for record in run.captures.values():
            write_capture(captures, record, compression=compression)

    return write_run_group(runs, run, fill, {"capture_order": json.dumps(list(run.captures))})


def _open_run(g: h5py.Group, entries: Any, fd: int | None) -> dict[str, h5py.Dataset]:
    """Capture name → dataset of a validated version-1 run, in execution order."""
    caps = g["captures"]
    return {name: caps[name] for name in json.loads(g.attrs["capture_order"])}


FORMAT_V1 = register(TraceFormat(
    version=1, run_attrs=("plan", "meta", "window", "capture_order"), handle=h5py.Dataset,
    write_run=write_run, validate_run=validate_v1_captures, open_run=_open_run, info=_capture_info,
    read=read_dataset, row_blocks=dataset_row_blocks, crc=dataset_crc, upgrade=upgrade_v2,
))
