"""The HDF5 trace: bit-exact tensors, environment header, runs, comparisons, atomic completion.

The on-disk layout is specified in ``traces/README.md`` (format ``tracer-trace``, version
:data:`FORMAT_VERSION`). In short::

    /                         attrs: format, format_version, complete, created, tool_version
    /header                   attrs: json (+ flat scalar copies)
    /runs                     attrs: order
    /runs/<run>               attrs: plan, meta, window, index (one entry per capture point); dataset token_ids
    /runs/<run>/data/<dtype>  every capture point of that dtype, end to end (:mod:`tracer.store.packed`)
    /comparisons/<name>       attrs: json

bf16 and fp16 tensors are stored as their raw 16-bit patterns (uint16); fp32/fp64 natively.
Version 1 (still read; written with ``TraceWriter(..., format_version=1)``) kept one dataset per
capture point under ``/runs/<run>/captures/`` (:func:`write_tensor`, :func:`write_run`). Either
way the round trip is bit-exact and costs no per-element Python.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import datetime as _dt
import importlib.metadata
import json
import math
import re
import os
import platform
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator

import h5py
import numpy as np
import torch

from tracer.dtypes import DTYPES, FLOATS
from tracer.errors import TracerError
from tracer.execute.records import CaptureRecord, RunRecord
from tracer.files import check_input_file
from tracer.store.integrity import (CHECKSUMS, DATA_KEY, GuardedFile, attr_text, check_name_length,
                                    check_output_path, clean_stale_partials, crc32_bytes, partial_pid, seal, set_text,
                                    write_error_message)
from tracer.store.packed import StoredPoint, iter_row_blocks, pack_index, read_point, read_run_tensors, write_packed
from tracer.store.validate import load_json, validate_trace

FORMAT = "tracer-trace"
FORMAT_VERSION = 2
#: format versions this tracer reads
READ_VERSIONS = (1, 2)
#: compression filters accepted by :class:`TraceWriter`
COMPRESSIONS = (None, "lzf", "gzip")
#: target size of one HDF5 chunk (rows along the first axis)
CHUNK_BYTES = 1 << 20

# the one dtype table (:mod:`tracer.dtypes`): names, on-disk layout (bf16/fp16 as uint16 bit patterns)
_DTYPES = DTYPES
_DTYPE_NAMES = {f.torch: n for n, f in FLOATS.items()}
_RAW16 = tuple(n for n, f in FLOATS.items() if f.raw16)
_STORED = {n: f.stored for n, f in FLOATS.items()}


# ---------------------------------------------------------------- environment header


@functools.lru_cache(maxsize=None)  # a process-wide fact: look it up once
def _tool_version() -> str:
    """tracer's version: installed metadata, else the checkout's pyproject.toml, else 'unknown'."""
    try:
        return importlib.metadata.version("tracer")
    except importlib.metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        for line in pyproject.read_text().splitlines():
            if line.strip().startswith("version"):
                return line.split("=", 1)[1].strip().strip("\"'")
    except OSError:
        pass
    return "unknown"


@functools.lru_cache(maxsize=None)  # a process-wide fact: look it up once (importlib.metadata is slow)
def _dist_version(name: str) -> str | None:
    """Installed version of a distribution without importing it (None if absent)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)  # a process-wide fact: look it up once
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=None)  # a process-wide fact: look it up once
def _cublas_version() -> str | None:
    """cuBLAS version from the libcublas already loaded by torch (``cublasGetProperty``), or None."""
    try:
        path = None
        with open("/proc/self/maps") as f:
            for line in f:
                if "libcublas.so" in line:
                    path = line.split()[-1]
                    break
        if path is None:
            return None
        lib = ctypes.CDLL(path)
        parts = []
        for prop in (0, 1, 2):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
            value = ctypes.c_int()
            if lib.cublasGetProperty(prop, ctypes.byref(value)) != 0:
                return None
            parts.append(str(value.value))
        return ".".join(parts)
    except Exception:  # noqa: BLE001 - optional fact: any failure means "not obtainable"
        return None


@functools.lru_cache(maxsize=None)  # a process-wide fact: look it up once
def _nvidia_driver(index: int) -> str | None:
    """Driver version from nvidia-smi when it is on PATH and answers within 5 s, else None."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader", f"--id={index}"],
            capture_output=True, text=True, timeout=5, check=True,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def collect_environment(device: str, extra: dict | None = None) -> dict[str, Any]:
    """The numeric contract of this process: what a bit-exact comparison depends on.

    Args:
        device: the device the runs execute on (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...).
        extra: run-level facts merged in last (model name and weights hash, dtype, attention
            implementation, scenario, block size, split points, ...); its keys win.

    Returns:
        a flat JSON-able dict: versions (python, torch, transformers, numpy, h5py, tracer),
        platform, hostname, CPU model, device name and compute capability, CUDA/HIP, cuDNN,
        cuBLAS and driver versions (None where not obtainable), the TF32 / reduced-precision /
        deterministic flags, ``CUBLAS_WORKSPACE_CONFIG``, thread count and float32 matmul
        precision. Nothing is initialised that the runs would not initialise anyway, except
        that a CUDA device is queried when ``device`` names one.

    Raises:
        TracerError: ``extra`` is not JSON-serialisable.
    """
    matmul = torch.backends.cuda.matmul
    env: dict[str, Any] = {
        "tracer_version": _tool_version(),
        "python": platform.python_version(),
        "torch": str(torch.__version__),  # a str subclass (TorchVersion): h5py needs plain str
        "transformers": _dist_version("transformers"),
        "numpy": np.__version__,
        "h5py": h5py.__version__,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu": _cpu_model(),
        "device": device,
        "device_name": None,
        "device_capability": None,
        "device_sm_count": None,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cublas": None,
        "driver": None,
        "matmul_allow_tf32": bool(matmul.allow_tf32),
        "matmul_allow_bf16_reduced_precision_reduction": bool(matmul.allow_bf16_reduced_precision_reduction),
        "matmul_allow_fp16_reduced_precision_reduction": bool(matmul.allow_fp16_reduced_precision_reduction),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_algorithms_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "num_threads": torch.get_num_threads(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "matmul_fp32_precision": getattr(matmul, "fp32_precision", None),  # torch >= 2.9 API
    }
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        env["device_name"] = props.name
        env["device_capability"] = f"{props.major}.{props.minor}"
        env["device_sm_count"] = props.multi_processor_count
        env["cublas"] = _cublas_version()
        env["driver"] = _nvidia_driver(index)
    elif dev.type == "cpu":
        env["device_name"] = env["cpu"]
    if extra:
        env.update(extra)
    _json_dumps(env, "the environment header")
    return env


# ---------------------------------------------------------------- low-level tensor I/O


def _json_dumps(value: Any, what: str) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as e:
        raise TracerError(f"{what} is not JSON-serialisable ({e}); pass plain str/int/float/bool/list/dict values") from None


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not name or "/" in name or name == ".":
        raise TracerError(f"{what} {name!r} is not a valid trace name; use a non-empty name without '/'")


def tensor_to_numpy(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """A numpy array sharing ``tensor``'s bits (CPU, contiguous) and the dtype name to store.

    bf16/fp16 become uint16 views of the bit patterns; fp32/fp64 stay as they are.

    Raises:
        TracerError: the dtype is not bfloat16/float16/float32/float64.
    """
    name = _DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise TracerError(f"cannot store a {tensor.dtype} tensor; the trace holds {', '.join(_DTYPES)}")
    t = tensor.detach().cpu().contiguous()
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


def read_tensor(ds: h5py.Dataset | StoredPoint, rows: slice | None = None, *, pin: bool = False) -> torch.Tensor:
    """The tensor stored in ``ds`` (all of it, or ``rows`` along the first axis), bit-exact.

    Args:
        pin: read straight into page-locked (pinned) host memory, from which a non-blocking copy
            to a GPU runs at full speed (needs CUDA; whole datasets only).

    A whole-dataset read is checked against the dataset's ``crc32`` (when it has one); a
    ``rows`` slice is not (its checksum covers the whole dataset).

    ``ds`` is a version-1 capture dataset or a version-2 :class:`~tracer.store.packed.StoredPoint`
    (as :meth:`TraceReader.captures` hands them out); both read the same way.

    Raises:
        TracerError: ``trace corrupt: <name> in run <run> fails its checksum``, an unreadable
            dataset, or a missing/unknown dtype.
    """
    if isinstance(ds, StoredPoint):
        return read_point(ds, rows, pin=pin)
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


def _verify_data(ds: h5py.Dataset, array: np.ndarray, expected: int | None) -> None:
    if expected is not None and crc32_bytes(array) != expected:
        raise TracerError(f"trace corrupt: {describe_dataset(ds)} fails its checksum; the file was damaged "
                          "after it was written, re-run it")


def read_row_blocks(handle: h5py.Dataset | StoredPoint, rows_per_block: int,
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
    if isinstance(handle, StoredPoint):
        yield from iter_row_blocks(handle, rows_per_block, buffers)
        return
    expected = _data_crc(handle)
    if handle.ndim == 0:
        yield 0, read_tensor(handle)
        return
    crc, step = 0, max(1, int(rows_per_block))
    for r0 in range(0, handle.shape[0], step):
        t = read_tensor(handle, slice(r0, r0 + step))
        crc = crc32_bytes(tensor_to_numpy(t)[0], crc)
        yield r0, t
    if expected is not None and crc != expected:
        raise TracerError(f"trace corrupt: {describe_dataset(handle)} fails its checksum; the file was damaged "
                          "after it was written, re-run it")


def stored_crc(handle: h5py.Dataset | StoredPoint) -> int | None:
    """The CRC-32 stored for a capture point's data (version 2: its index entry; version 1: its
    dataset's ``crc32``), or None for a trace written before checksums."""
    if isinstance(handle, StoredPoint):
        return handle.crc
    try:
        return _data_crc(handle)
    except TracerError:
        return None


def _capture_info(ds: h5py.Dataset) -> dict[str, Any]:
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
    _check_name(record.name, "capture")
    if record.tensor.dtype not in _DTYPE_NAMES:
        raise TracerError(f"capture {record.name} is {record.tensor.dtype}; the trace holds {', '.join(_DTYPES)}")
    return _json_dumps(record.calls, f"calls of capture {record.name}")


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


def _run_group(runs: h5py.Group, run: RunRecord, fill: Callable[[h5py.Group], None],
               attrs: dict[str, str] | None = None) -> h5py.Group:
    """The group ``runs[run.name]`` with the attributes and token ids both format versions share,
    ``attrs`` (text), then ``fill(group)`` writing the captures, then its seal; a failure removes
    the half-written group. The caller has validated the captures.

    Raises:
        TracerError: invalid or duplicate run name, plan/meta not JSON-able.
    """
    _check_name(run.name, "run")
    if run.name in runs:
        raise TracerError(f"run {run.name!r} is already in this trace; give each run its own name")
    texts = {"plan": _json_dumps(run.plan, f"plan of run {run.name}"),
             "meta": _json_dumps(run.meta, f"meta of run {run.name}"), **(attrs or {})}
    g = runs.create_group(run.name, track_order=True)
    try:
        for key, text in texts.items():
            set_text(g, key, text)
        g.attrs["window"] = np.asarray(run.window, dtype=np.int64)
        ids = np.asarray(run.token_ids, dtype=np.int64).reshape(-1)
        seal(g.create_dataset("token_ids", data=ids), crc32_bytes(ids))
        fill(g)
        seal(g)
    except BaseException:
        del runs[run.name]
        raise
    return g


def write_run(runs: h5py.Group, run: RunRecord, *, compression: str | None = None) -> h5py.Group:
    """Write a whole run as ``runs[run.name]`` in format version 1: attributes, token ids and every
    capture in order, a dataset each.

    Everything is validated first, so a TracerError leaves ``runs`` unchanged; if writing
    itself fails, the half-written group is removed.

    Raises:
        TracerError: invalid or duplicate run name, capture key ≠ record name, invalid capture,
            plan/meta not JSON-able.
    """
    _check_name(run.name, "run")
    for key, record in run.captures.items():
        if key != record.name:
            raise TracerError(f"capture key {key!r} does not match its record name {record.name!r}; key captures by name")
        _check_capture(record)

    def fill(g: h5py.Group) -> None:
        captures = g.create_group("captures", track_order=True)
        for record in run.captures.values():
            write_capture(captures, record, compression=compression)

    return _run_group(runs, run, fill, {"capture_order": json.dumps(list(run.captures))})


def write_run_packed(runs: h5py.Group, run: RunRecord, *, compression: str | None = None) -> h5py.Group:
    """Write a whole run as ``runs[run.name]`` in format version 2: attributes, token ids, the
    ``data/<dtype>`` datasets holding every capture end to end and the ``index`` attribute
    (:mod:`tracer.store.packed`; ``traces/README.md``).

    Everything is validated first, so a TracerError leaves ``runs`` unchanged; if writing
    itself fails, the half-written group is removed.

    Raises:
        TracerError: invalid or duplicate run name, capture key ≠ record name, invalid capture,
            plan/meta not JSON-able.
    """
    _check_name(run.name, "run")
    entries, totals = pack_index(run)
    return _run_group(runs, run, lambda g: write_packed(g, run, entries, totals, compression=compression))


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


# ---------------------------------------------------------------- writer


class TraceWriter:
    """Writes a trace atomically: a temporary sibling file, renamed onto ``path`` when complete.

    Use as a context manager::

        with TraceWriter("traces/x.h5", header=collect_environment("cuda")) as w:
            w.add_run(run_a); w.add_run(run_b)

    On a clean exit ``complete`` is set True, the file is closed and moved onto ``path``; if the
    block raises, the partial file is deleted and ``path`` is left as it was.

    Args:
        path: the trace file to create; parent folders are created.
        header: the environment header (:func:`collect_environment`), JSON-able.
        overwrite: replace an existing ``path`` (only once the new trace is complete).
        compression: ``None`` (default), ``"lzf"`` or ``"gzip"``, passed to ``create_dataset``.
        background: write runs on one background thread, so :meth:`add_run` returns at once and
            the model can run the next plan while run A is written (h5py serialises its own
            calls; torch releases the GIL in its kernels, so the two overlap). Runs are written
            in submission order; :meth:`close` waits for them and re-raises a writer error;
            on an exception in the ``with`` block the thread is joined and the file deleted.
        format_version: the layout to write: :data:`FORMAT_VERSION` (2, default) or 1 (one dataset
            per capture point, as tracer wrote before; for tests and older readers).

    Raises:
        TracerError: ``path`` exists and not ``overwrite``; ``path`` is a folder; bad
            compression or format version; header not JSON-able; the file cannot be created.
    """

    def __init__(self, path: str | os.PathLike, *, header: dict, overwrite: bool = False,
                 compression: str | None = None, background: bool = False,
                 format_version: int = FORMAT_VERSION) -> None:
        self.path = Path(path)
        if format_version not in READ_VERSIONS:
            raise TracerError(f"unknown trace format_version {format_version!r}; this tracer writes {', '.join(map(str, READ_VERSIONS))}")
        self.format_version = format_version
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._futures: list[concurrent.futures.Future] = []
        self.overwrite = overwrite
        if compression not in COMPRESSIONS:
            raise TracerError(f"unknown compression {compression!r}; use one of none, lzf, gzip")
        self.compression = compression
        check_name_length(self.path, "trace")
        if self.path.is_dir():
            raise TracerError(f"trace path {self.path} is a folder; pass a file name such as {self.path / 'trace.h5'}")
        check_output_path(self.path, overwrite, "trace")
        header_json = _json_dumps(header, "the trace header")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TracerError(f"cannot create the folder {self.path.parent} ({e.strerror}); choose another --output") from None
        clean_stale_partials(self.path)
        self.partial_path = self.path.with_name(f"{self.path.name}.partial-{os.getpid()}")
        self._guard: GuardedFile | None = None
        self._file: h5py.File | None = None
        try:
            self.partial_path.unlink(missing_ok=True)  # our own PID's leftover from an earlier writer
            # h5py crashes when HDF5 sees a failed write; the guard keeps errors from it (see GuardedFile)
            self._guard = GuardedFile(self.partial_path)
            self._file = h5py.File(self._guard, "w", track_order=True, libver=("v108", "v110"))
        except OSError as e:
            self.abort()
            raise TracerError(f"cannot create {self.partial_path} ({e.strerror or e}); choose another --output") from None
        try:
            f = self._file
            set_text(f, "format", FORMAT)
            f.attrs["format_version"] = np.int64(self.format_version)
            set_text(f, "created", _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
            set_text(f, "tool_version", _tool_version())
            set_text(f, "checksums", CHECKSUMS)
            seal(f)
            f.attrs["complete"] = False
            h = f.create_group("header")
            set_text(h, "json", header_json)
            for key, value in _flat_scalars(header).items():
                if key not in ("json", "crc32"):
                    set_text(h, key, value) if isinstance(value, str) else h.attrs.create(key, value)
            seal(h)
            self._runs = f.create_group("runs", track_order=True)
            set_text(self._runs, "order", "[]")
            seal(self._runs)
            self._run_names: list[str] = []
            self._check_io()
        except BaseException:
            self.abort()
            raise
        if background:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tracer-writer")

    def _check_io(self) -> None:
        """Raise the first write error the guard recorded (disk full, ``ulimit -f``) as one line."""
        if self._guard is not None and self._guard.error is not None:
            raise TracerError(write_error_message(self.path, self._guard.error))

    def _require_open(self) -> h5py.File:
        if self._file is None:
            raise TracerError(f"trace writer for {self.path} is closed; open a new TraceWriter")
        return self._file

    def add_run(self, run: RunRecord, *, ready: Callable[[], None] | None = None) -> None:
        """Write ``run`` (its token ids, plan, meta, window and every capture, in order).

        Args:
            run: the run; its capture tensors on the host.
            ready: called (on the writing thread) before anything is read from ``run``, e.g. to
                wait for the non-blocking device-to-host copies of its tensors
                (:func:`tracer.execute.capture.host_copies`).

        Raises:
            TracerError: duplicate or invalid run/capture name, unsupported tensor dtype,
                plan/meta/calls not JSON-able, or the writer is closed.
        """
        self._require_open()
        if self._pool is not None:
            self._futures.append(self._pool.submit(self._write_run, run, ready))
        else:
            self._write_run(run, ready)

    def _write_run(self, run: RunRecord, ready: Callable[[], None] | None = None) -> None:
        if ready is not None:
            ready()
        try:
            write = write_run_packed if self.format_version >= 2 else write_run
            write(self._runs, run, compression=self.compression)
        except (OSError, RuntimeError):
            self._check_io()  # a write error reported by HDF5 after the guard's: say the cause
            raise
        self._check_io()
        self._run_names.append(run.name)
        set_text(self._runs, "order", json.dumps(self._run_names))
        seal(self._runs)

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

    def add_comparison(self, name: str, data: dict) -> None:
        """Store a comparison result (JSON-able dict) as ``/comparisons/<name>``.

        Raises:
            TracerError: invalid or duplicate name, data not JSON-able, or the writer is closed.
        """
        f = self._require_open()
        _check_name(name, "comparison")
        text = _json_dumps(data, f"comparison {name}")
        comps = f.require_group("comparisons")
        if name in comps:
            raise TracerError(f"comparison {name!r} is already in this trace; give it another name")
        g = comps.create_group(name)
        set_text(g, "json", text)
        seal(g)
        self._check_io()

    def close(self) -> None:
        """Mark the trace complete, close it and move it onto ``path`` (idempotent).

        Raises:
            TracerError: ``path`` appeared meanwhile and ``overwrite`` is False (the complete
                trace is left at ``partial_path``).
        """
        if self._file is None:
            return
        try:
            self._drain()
            self._check_io()
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
        if self.overwrite:
            os.replace(self.partial_path, self.path)
            return
        try:
            os.link(self.partial_path, self.path)  # atomic, and refuses to clobber
        except FileExistsError:
            raise TracerError(
                f"trace {self.path} appeared while writing; the new trace is at {self.partial_path}; "
                "move it yourself or pass --overwrite"
            ) from None
        except OSError:  # no hard links on this filesystem: check, then rename
            if self.path.exists():
                raise TracerError(
                    f"trace {self.path} appeared while writing; the new trace is at {self.partial_path}; "
                    "move it yourself or pass --overwrite"
                ) from None
            os.replace(self.partial_path, self.path)
            return
        self.partial_path.unlink()

    def abort(self) -> None:
        """Close and delete the partial file; ``path`` is left untouched (idempotent)."""
        try:
            self._drain()
        except BaseException:  # noqa: BLE001 - aborting already; the cause is the caller's
            pass
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

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


# ---------------------------------------------------------------- reader


class TraceReader:
    """Read-only access to a complete trace; a context manager (or call :meth:`close`).

    Attributes:
        path: the trace file.
        header: the environment header (dict).
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
        self._points: dict[str, dict[str, StoredPoint]] = {}  # run -> name -> point (version 2)
        self._entries: dict[str, dict[str, dict[str, Any]]] = {}  # run -> name -> index entry (version 2)
        try:
            self._file = h5py.File(self.path, "r")
        except Exception:  # noqa: BLE001 - h5py raises OSError, RuntimeError, ... for damaged files
            pid = partial_pid(self.path)
            if pid is not None:  # a writer killed before HDF5 flushed its superblock
                raise TracerError(f"{self.path} is incomplete: the partial file of writer process {pid}, which "
                                  "did not finish; re-run it") from None
            raise TracerError(f"{self.path} is not a readable HDF5 file (truncated or corrupt?)") from None
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
        f = self._f
        fmt = attr_text(f.attrs.get("format"))
        if fmt != FORMAT:
            raise TracerError(f"{self.path} is not a tracer trace (no format={FORMAT!r} attribute); pass a file written by tracer")
        raw = f.attrs.get("format_version")
        # an integer, stored as one: "1" or 1.5 are not version 1
        version = int(raw) if isinstance(raw, (int, np.integer)) and not isinstance(raw, (bool, np.bool_)) else None
        if version not in READ_VERSIONS:
            known = ", ".join(map(str, READ_VERSIONS))
            shown = repr(raw.item() if isinstance(raw, np.generic) else raw)[:20]
            raise TracerError(f"{self.path} has trace format_version {shown}; this tracer reads version {known}; use a matching tracer or re-run")
        complete = f.attrs.get("complete")
        if not (isinstance(complete, (bool, np.bool_)) and bool(complete)):
            raise TracerError(f"{self.path} is incomplete: the run that wrote it did not finish; re-run it")
        self.format_version = version
        indexes: dict[str, list[dict[str, Any]]] = {}
        #: True when the file carries checksums (verified on every read); False: written before them
        self.checksummed = validate_trace(f, self.path, indexes)
        self.header: dict[str, Any] = json.loads(f["header"].attrs["json"])
        self.runs: list[str] = json.loads(f["runs"].attrs["order"])
        if version >= 2:
            self._fd = os.open(self.path, os.O_RDONLY)
            for run, entries in indexes.items():
                data = f["runs"][run]["data"]
                self._points[run] = {e["name"]: StoredPoint(run, e["name"], e["dtype"], tuple(e["shape"]), e["offset"],
                                                            e["crc32"], data[e["dtype"]], self._fd) for e in entries}
                self._entries[run] = {e["name"]: e for e in entries}

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

    def _capture_ds(self, run: str, capture: str) -> h5py.Dataset | StoredPoint:
        """The capture's version-1 dataset or version-2 :class:`~tracer.store.packed.StoredPoint`."""
        g = self._run_group(run)
        if self.format_version >= 2:
            point = self._points[run].get(capture)
            if point is None:
                raise self._missing(run, capture)
            return point
        caps = g["captures"]
        if capture not in caps:
            raise self._missing(run, capture)
        return caps[capture]

    def _info(self, run: str, handle: h5py.Dataset | StoredPoint) -> dict[str, Any]:
        if isinstance(handle, StoredPoint):
            e = self._entries[run][handle.name]
            return {"kind": e["kind"], "op": e["op"], "calls": e["calls"], "dtype": e["dtype"], "shape": list(e["shape"]),
                    **({"role": e["role"]} if "role" in e else {})}
        return _capture_info(handle)

    def capture_names(self, run: str) -> list[str]:
        """Capture names of ``run`` in execution order."""
        g = self._run_group(run)
        if self.format_version >= 2:
            return list(self._points[run])
        return json.loads(g.attrs["capture_order"])

    def capture_info(self, run: str, capture: str) -> dict[str, Any]:
        """``{"kind", "op", "calls", "dtype", "shape"}`` of one capture, without reading its data, and
        ``"role"`` when the trace stores one (:attr:`~tracer.execute.records.CaptureRecord.role`)."""
        return self._info(run, self._capture_ds(run, capture))

    def captures(self, run: str) -> dict[str, tuple[dict[str, Any], h5py.Dataset | StoredPoint]]:
        """Capture name → ``(capture_info, handle)`` for every capture of ``run``, in execution
        order, with one pass over the run (for streaming readers: pass the handle, a version-1
        ``h5py.Dataset`` or a version-2 :class:`~tracer.store.packed.StoredPoint`, to
        :func:`read_tensor` or :func:`read_row_blocks`; both have ``shape``, ``ndim`` and ``nbytes``)."""
        if self.format_version >= 2:
            self._run_group(run)
            return {name: (self._info(run, p), p) for name, p in self._points[run].items()}
        caps = self._run_group(run)["captures"]
        out = {}
        for name in self.capture_names(run):
            ds = caps[name]
            out[name] = (_capture_info(ds), ds)
        return out

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
        if load_tensors and self.format_version >= 2:
            loaded = read_run_tensors(list(self._points[name].values()))
        for cap, (info, handle) in self.captures(name).items():
            if loaded is not None:
                tensor = loaded[cap]
            elif load_tensors:
                tensor = read_tensor(handle)
            else:
                tensor = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]], device="meta")
            captures[cap] = CaptureRecord(name=cap, kind=info["kind"], tensor=tensor, calls=info["calls"], op=info["op"],
                                          role=info.get("role", ""))
        start, stop = (int(x) for x in g.attrs["window"])
        ids_ds = g["token_ids"]
        ids = np.asarray(ids_ds[()])
        _verify_data(ids_ds, ids, _data_crc(ids_ds))
        return RunRecord(
            name=name,
            token_ids=[int(x) for x in ids],
            plan=json.loads(g.attrs["plan"]),
            window=(start, stop),
            captures=captures,
            meta=json.loads(g.attrs["meta"]),
        )

    def comparisons(self) -> dict[str, dict]:
        """Stored comparison results, name → data (empty if none)."""
        comps = self._f.get("comparisons")
        if comps is None:
            return {}
        return {name: json.loads(comps[name].attrs["json"]) for name in comps}

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




def json_safe(x: Any) -> Any:
    """Replace non-finite floats by strings so the document is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def default_output(model: str, scenario: str, root: str | Path = "traces") -> Path:
    """``traces/<model>-<scenario>-<UTC timestamp>.h5`` (a free name; never an existing file)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("_") or "model"
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{safe}-{scenario}-{stamp}"
    path, k = base.with_suffix(".h5"), 1
    while path.exists():
        path, k = Path(f"{base}-{k}.h5"), k + 1
    return path


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


__all__ = [
    "FORMAT", "FORMAT_VERSION", "READ_VERSIONS", "collect_environment", "TraceWriter", "TraceReader",
    "write_tensor", "read_tensor", "read_row_blocks", "write_capture", "write_run", "write_run_packed",
    "tensor_to_numpy", "numpy_to_tensor", "StoredPoint",
    "json_safe", "default_output", "check_output",
]
