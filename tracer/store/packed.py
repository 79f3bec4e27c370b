"""Format version 2: a run's capture points packed into one dataset per dtype, and an index.

Store-layer module, registered as format versions 2 and 3 (:mod:`tracer.store.formats`; they differ in
their JSON documents only: :mod:`tracer.store.header`). The layout is specified in
``traces/README.md`` ("The index", ``/runs/<run>/data/<dtype>``): every capture point of dtype
``d`` is a contiguous range of elements of ``/runs/<run>/data/<d>``, in index order, and the
run's ``index`` attribute lists each point's name, kind, op, calls, dtype, shape, offset and the
CRC-32 of its bytes. Writing a run is a few large sequential writes; reading a point is one
positioned read (``os.preadv``, which releases the GIL) straight into the caller's buffer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import h5py
import numpy as np
import torch

from tracer.dtypes import DTYPES, FLOATS
from tracer.errors import TracerError
from tracer.execute.records import RunRecord
from tracer.store.formats import TraceFormat, check_name, register, write_run_group
from tracer.store.header import current, upgrade_v2
from tracer.store.crc import crc32_bytes
from tracer.store.integrity import seal, set_text
from tracer.store.validate import IndexEntry, validate_v2_index

#: HDF5 storage type of each stored dtype name (bf16/fp16 as their uint16 bit patterns)
STORED = {n: np.dtype(f.stored) for n, f in FLOATS.items()}
_RAW16 = tuple(n for n, f in FLOATS.items() if f.raw16)
_NAMES = {f.torch: n for n, f in FLOATS.items()}
#: target size of one HDF5 chunk of a compressed ``data/<dtype>`` dataset
CHUNK_BYTES = 1 << 20
#: largest byte count of one ``preadv`` call (Linux transfers at most 0x7ffff000 bytes per call)
_MAX_IO = 1 << 30


def _host_bits(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's elements as a flat numpy array of their storage type, sharing memory when it can."""
    t = tensor.detach().cpu().resolve_neg().contiguous().reshape(-1)  # a negative view: its values
    name = _NAMES[t.dtype]
    if name in _RAW16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def pack_index(run: RunRecord) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The index entries of ``run`` (``crc32`` still 0) and the element count per dtype.

    Raises:
        TracerError: a capture key that is not its record's name, an invalid name, an unsupported
            dtype, or calls that are not JSON-serialisable.
    """
    entries: list[dict[str, Any]] = []
    totals: dict[str, int] = {}
    try:  # every point's calls as plain JSON data (a copy), in one pass
        all_calls = json.loads(json.dumps([record.calls for record in run.captures.values()]))
    except (TypeError, ValueError):
        all_calls = None  # which point's calls are not JSON: found below, to name it
    for i, (key, record) in enumerate(run.captures.items()):
        if key != record.name:
            raise TracerError(f"capture key {key!r} does not match its record name {record.name!r}; key captures by name")
        name = record.name
        if not isinstance(name, str) or not name or "/" in name or name == ".":
            raise TracerError(f"capture {name!r} is not a valid trace name; use a non-empty name without '/'")
        dtype = _NAMES.get(record.tensor.dtype)
        if dtype is None:
            raise TracerError(f"capture {name} is {record.tensor.dtype}; the trace holds {', '.join(DTYPES)}")
        try:
            calls = all_calls[i] if all_calls is not None else json.loads(json.dumps(record.calls))
        except (TypeError, ValueError) as e:
            raise TracerError(f"calls of capture {name} is not JSON-serialisable ({e}); pass plain "
                              "str/int/float/bool/list/dict values") from None
        offset = totals.get(dtype, 0)
        totals[dtype] = offset + record.tensor.numel()
        entries.append(IndexEntry(name=name, kind=str(record.kind), op=str(record.op), calls=calls, dtype=dtype,
                                  shape=tuple(int(x) for x in record.tensor.shape), offset=offset, crc32=0,
                                  role=str(record.role) if getattr(record, "role", "") else None).to_dict())
    if len({e["name"] for e in entries}) != len(entries):
        raise TracerError(f"run {run.name} names a capture point twice; give each its own name")
    return entries, totals


def write_packed(g: h5py.Group, run: RunRecord, entries: list[dict[str, Any]], totals: dict[str, int], *,
                 compression: str | None = None, sums: dict[str, int] | None = None) -> None:
    """Write the tensors of ``run`` into ``g["data"]`` (one dataset per dtype, points in index order)
    and the ``index`` attribute on ``g``, filling each entry's ``crc32``; ``sums`` receives the
    checksums of the attributes written on ``g`` (for its seal, :func:`~tracer.store.integrity.set_text`).

    Each point is written with one ``write_direct`` from the tensor's own memory, at increasing
    offsets: the file grows front to back. Without ``compression`` the datasets are contiguous
    and never filled first (no zero pass).
    """
    data = g.create_group("data", track_order=True)
    datasets = {}
    for dtype, total in totals.items():
        kw: dict[str, Any] = {}
        if compression is not None and total > 0:
            kw = {"chunks": (max(1, min(total, CHUNK_BYTES // STORED[dtype].itemsize)),), "compression": compression}
        ds = data.create_dataset(dtype, shape=(total,), dtype=STORED[dtype], fill_time="never", **kw)
        seal(ds, sums={})  # no attribute but its seal
        datasets[dtype] = ds
    seal(data, sums={})
    pending: list = []  # consecutive points lying end to end in one host buffer: written together

    def flush() -> None:
        if pending:
            first = pending[0]
            total = sum(b.size for _, b in pending)
            # the points' common buffer, from the first one's start (a view that keeps it alive)
            whole = np.lib.stride_tricks.as_strided(first[1], shape=(total,), strides=(first[1].itemsize,))
            off = first[0]["offset"]
            datasets[first[0]["dtype"]].write_direct(whole, dest_sel=np.s_[off:off + whole.size])
            pending.clear()

    for entry, record in zip(entries, run.captures.values()):
        bits = _host_bits(record.tensor)
        entry["crc32"] = crc32_bytes(bits)
        if not bits.size:
            continue
        if pending and not _follows(pending[-1], entry, bits):
            flush()
        pending.append((entry, bits))
    flush()
    texts = [json.dumps(e) for e in entries]
    set_text(g, "index", "[" + ", ".join(texts) + "]", sums)  # == json.dumps(entries)
    each = [[len(t.encode()), crc32_bytes(t.encode())] for t in texts]
    set_text(g, "index_crc32", json.dumps(each), sums)


def _follows(prev: tuple[dict[str, Any], np.ndarray], entry: dict[str, Any], bits: np.ndarray) -> bool:
    """Whether ``bits`` (point ``entry``) lies right after the previous point both in the host
    buffer and in the dataset (:func:`tracer.execute.capture.host_copies` lays a run out so)."""
    p_entry, p_bits = prev
    return (entry["dtype"] == p_entry["dtype"] and entry["offset"] == p_entry["offset"] + p_bits.size
            and bits.dtype == p_bits.dtype and bits.flags.c_contiguous and p_bits.flags.c_contiguous
            and bits.ctypes.data == p_bits.ctypes.data + p_bits.nbytes)


@dataclass(frozen=True)
class StoredPoint:
    """Where one capture point of a version-2 trace lies: ``shape`` elements of ``dtype`` from
    element ``offset`` of ``blob`` (the run's ``data/<dtype>`` dataset), with CRC-32 ``crc``.

    What :meth:`tracer.store.reader.TraceReader.captures` hands out for a version-2 trace in place of
    a version-1 ``h5py.Dataset``; pass it to :func:`tracer.store.reader.read_tensor`.
    """

    run: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    crc: int
    blob: h5py.Dataset
    fd: int | None  # an open read-only descriptor of the file (None: read through HDF5)

    @property
    def size(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        """Stored bytes."""
        return self.size * STORED[self.dtype].itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def describe(self) -> str:
        """``model.layers.3 in run A``."""
        return f"{self.name} in run {self.run}"

    def read_into(self, out: np.ndarray, start: int = 0) -> None:
        """Read elements ``[offset + start, offset + start + out.size)`` into the flat,
        C-contiguous array ``out`` (of the storage type): one ``preadv`` when the dataset is
        contiguous, else an HDF5 hyperslab read.

        Raises:
            TracerError: the read fails or the file ends early (one line naming the point).
        """
        n = out.size
        if n == 0:
            return
        first = self.offset + start
        try:
            base = self.blob.id.get_offset() if self.fd is not None else None
            if base is None:  # chunked (compressed) or not allocated: through HDF5
                self.blob.read_direct(out.reshape(-1), source_sel=np.s_[first:first + n])
                return
            view = memoryview(out.reshape(-1).view(np.uint8))
            pos, done = base + first * out.itemsize, 0
            while done < len(view):
                k = os.preadv(self.fd, [view[done:done + _MAX_IO]], pos + done)
                if k <= 0:
                    raise OSError("the file ends before the point does")
                done += k
        except (OSError, RuntimeError, ValueError) as e:
            first_line = (str(e).splitlines() or [type(e).__name__])[0][:120]
            raise TracerError(f"trace corrupt: {self.describe()} cannot be read ({first_line}); re-run it") from None

    def fails(self) -> TracerError:
        """The error of a point whose bytes do not match its CRC-32."""
        return TracerError(f"trace corrupt: {self.describe()} fails its checksum; the file was damaged after it "
                           "was written, re-run it")


def bits_to_tensor(array: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The torch tensor (dtype name ``dtype``, ``shape``) whose bits are the flat storage-type ``array``."""
    t = torch.from_numpy(array.view(np.int16) if dtype in _RAW16 else array)
    return (t.view(DTYPES[dtype]) if dtype in _RAW16 else t).reshape(shape)


def empty_host(n: int, dtype: str, pin: bool = False) -> tuple[torch.Tensor, np.ndarray]:
    """A fresh host buffer of ``n`` elements of dtype name ``dtype``: ``(tensor, numpy view of its
    storage type)``; ``pin``: page-locked memory (needs CUDA)."""
    raw16 = dtype in _RAW16
    t = torch.empty(n, dtype=torch.int16 if raw16 else DTYPES[dtype], pin_memory=pin)
    view = t.numpy().view(np.uint16) if raw16 else t.numpy()
    return (t.view(DTYPES[dtype]) if raw16 else t), view


def read_point(p: StoredPoint, rows: slice | None = None, *, pin: bool = False) -> torch.Tensor:
    """The tensor of ``p`` (all of it, checked against its CRC-32; or ``rows`` along the first
    axis, unchecked), bit-exact, on the host (pinned when ``pin``).

    Raises:
        TracerError: the point fails its checksum or cannot be read (one line naming it).
    """
    if rows is None or not p.shape:
        t, view = empty_host(p.size, p.dtype, pin)
        p.read_into(view)
        if crc32_bytes(view) != p.crc:
            raise p.fails()
        return t.reshape(p.shape)
    start, stop, step = rows.indices(p.shape[0])
    row = p.size // p.shape[0] if p.shape[0] else 0
    if step != 1:  # rare: read the whole point (unchecked, as for any slice) and pick the rows
        t, view = empty_host(p.size, p.dtype)
        p.read_into(view)
        picked = np.ascontiguousarray(view.reshape(p.shape)[rows])
        return bits_to_tensor(picked.reshape(-1), p.dtype, picked.shape)
    stop = max(start, stop)
    t, view = empty_host((stop - start) * row, p.dtype)
    p.read_into(view, start * row)
    return t.reshape((stop - start, *p.shape[1:]))


def iter_row_blocks(p: StoredPoint, rows_per_block: int, buffers: Callable[[], np.ndarray] | None = None
                    ) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first row, tensor of the next rows)`` of ``p`` front to back, ``rows_per_block`` rows at a
    time, the CRC-32 carried from block to block and checked after the last block (a mismatch
    raises there, before the caller can report anything computed from the blocks).

    Args:
        buffers: a function returning the next reusable byte buffer (flat ``uint8`` array) to read
            a block into; a yielded tensor then shares it (valid as long as the caller's rotation
            says). A block larger than the buffer gets a fresh one.

    Raises:
        TracerError: the point fails its checksum or cannot be read.
    """
    total = p.shape[0] if p.shape else 1
    row = p.size // total if total else 0
    crc = 0
    for r0 in range(0, total, max(1, rows_per_block)):
        r1 = min(total, r0 + max(1, rows_per_block))
        n = (r1 - r0) * row
        buf = buffers() if buffers is not None else None
        if buf is not None and buf.size >= n * STORED[p.dtype].itemsize:
            raw = buf[:n * STORED[p.dtype].itemsize].view(STORED[p.dtype])
            t = bits_to_tensor(raw, p.dtype, (n,))
        else:
            t, raw = empty_host(n, p.dtype)
        p.read_into(raw, r0 * row)
        crc = crc32_bytes(raw, crc)
        yield r0, t.reshape((r1 - r0, *p.shape[1:]) if p.shape else ())
    if crc != p.crc:
        raise p.fails()


def read_run_tensors(points: list[StoredPoint]) -> dict[str, torch.Tensor]:
    """Every point's tensor, reading each ``data/<dtype>`` dataset with one read (the points of a run
    tile it) and checking each point's CRC-32; name → tensor (views into one buffer per dtype).

    Raises:
        TracerError: a point fails its checksum or the data cannot be read.
    """
    out: dict[str, torch.Tensor] = {}
    by_dtype: dict[str, list[StoredPoint]] = {}
    for p in points:
        by_dtype.setdefault(p.dtype, []).append(p)
    for dtype, ps in by_dtype.items():
        total = ps[-1].offset + ps[-1].size
        t, view = empty_host(total, dtype)
        if total:
            whole = StoredPoint(ps[0].run, f"data/{dtype}", dtype, (total,), 0, 0, ps[0].blob, ps[0].fd)
            whole.read_into(view)
        for p in ps:
            part = view[p.offset:p.offset + p.size]
            if crc32_bytes(part) != p.crc:
                raise p.fails()
            out[p.name] = t[p.offset:p.offset + p.size].reshape(p.shape)
    return {p.name: out[p.name] for p in points}


def write_run_packed(runs: h5py.Group, run: RunRecord, *, compression: str | None = None) -> h5py.Group:
    """Write a whole run as ``runs[run.name]`` in format version 2: attributes, token ids, the
    ``data/<dtype>`` datasets holding every capture end to end and the ``index`` attribute
    (``traces/README.md``).

    Everything is validated first, so a TracerError leaves ``runs`` unchanged; if writing
    itself fails, the half-written group is removed.

    Raises:
        TracerError: invalid or duplicate run name, capture key ≠ record name, invalid capture,
            plan/meta not JSON-able.
    """
    check_name(run.name, "run")
    entries, totals = pack_index(run)
    return write_run_group(runs, run, lambda g, sums: write_packed(g, run, entries, totals, compression=compression,
                                                                     sums=sums))


def _open_run(g: h5py.Group, entries: list[dict[str, Any]], fd: int | None) -> dict[str, StoredPoint]:
    """Capture name → :class:`StoredPoint` of a validated version-2 run (``entries``: its index)."""
    data = g["data"]
    run = g.name.rsplit("/", 1)[-1]
    blobs = {dt: data[dt] for dt in {e["dtype"] for e in entries}}  # one h5py object per dtype, not per point
    return {e["name"]: StoredPoint(run, e["name"], e["dtype"], tuple(e["shape"]), e["offset"], e["crc32"],
                                   blobs[e["dtype"]], fd) for e in entries}


def _point_info(p: StoredPoint, entry: dict[str, Any]) -> dict[str, Any]:
    return {"kind": entry["kind"], "op": entry["op"], "calls": entry["calls"], "dtype": entry["dtype"],
            "shape": list(entry["shape"]), **({"role": entry["role"]} if "role" in entry else {})}


def _crc(p: StoredPoint) -> int | None:
    return p.crc


FORMAT_V2 = register(TraceFormat(
    version=2, run_attrs=("plan", "meta", "window", "index"), handle=StoredPoint,
    write_run=write_run_packed, validate_run=validate_v2_index, open_run=_open_run, info=_point_info,
    read=read_point, row_blocks=iter_row_blocks, crc=_crc, read_all=read_run_tensors, upgrade=upgrade_v2,
))
#: version 3: version 2's layout; the JSON documents are the records of :mod:`tracer.store.header`
FORMAT_V3 = register(replace(FORMAT_V2, version=3, upgrade=current))
