"""Validate an open trace file against its written spec (``traces/README.md``) before any use.

Store-layer module (target: ``tracer/store/validate.py``). :func:`validate_trace` walks the
structure the spec defines, reading metadata only (no tensor data), and refuses anything a
reader could misread: wrong types, shapes that do not match the window, token ids of the wrong
dtype or rank, windows outside the sequence, declared sizes the file cannot hold, external
storage, soft or external links, objects linked twice, and (for files that carry them)
attributes that fail their checksums. The JSON documents (header, each run's plan and meta, each
index entry) are checked by decoding them into their records (:mod:`tracer.store.header`), after
the file's version has turned them into the current version's (:attr:`TraceFormat.upgrade`).
Every refusal is one :class:`TracerError` line.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Annotated, Any

import h5py
import numpy as np

from tracer import schema
from tracer.errors import TracerError
from tracer.execute.kinds import PointKind
from tracer.execute.records import calls_problem
from tracer.plan.plans import RunPlan
from tracer.store.formats import TraceFormat, format_for
from tracer.store.header import RunMeta, TraceHeader
from tracer.store.crc import crc32_bytes
from tracer.store.integrity import CHECKSUMS, DATA_KEY, attr_text, verify_attrs

#: the largest ratio of a compressed dataset's size to its stored bytes that is believed
#: (gzip's best case is ~1000:1); a larger declared size is refused before anything is allocated
MAX_COMPRESSION_RATIO = 1100
_DTYPES = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.float32, "float64": np.float64}
_CAPTURE_ATTRS = ("dtype", "kind", "op", "calls")
#: capture kinds whose tensors are (T, *feature) over the run's window (the spec's list)
WINDOW_KINDS = ("embedding", "layer", "final_norm", "logits", "linear", "norm", "attention", "attention_core",
                "mlp", "activation")


@dataclass(frozen=True)
class IndexEntry(schema.Record):
    """One entry of a version-2 or -3 run's ``index`` (``traces/README.md``, "The index"): a capture
    point's name, kind, op, forward calls (:class:`~tracer.execute.records.Call` documents), dtype,
    shape, offset into ``data/<dtype>`` (in elements), CRC-32 and role (absent: none). Written by
    :mod:`tracer.store.packed` from this record, checked here; the reader keeps the documents."""

    schema_sparse = True

    name: str
    kind: str
    op: str
    calls: list[dict[str, Any]]
    dtype: str
    shape: schema.Shape
    offset: schema.Count
    crc32: Annotated[int, schema.Check(lambda c: 0 <= c <= 0xFFFFFFFF, "a CRC-32")]
    role: str | None = None

    def schema_check(self) -> str | None:
        if math.prod(self.shape) >= schema.BIG:
            return f"shape {list(self.shape)} holds too many elements"
        problem = calls_problem(self.calls)  # each a Call document (kept as written)
        return f"calls: {problem}" if problem else None


def _corrupt(path: Any, what: str) -> TracerError:
    return TracerError(f"trace corrupt: {path}: {what}; the file is damaged or was not written by tracer, re-run it")


def check_doc(cls: type, doc: Any, where: str, path: Any) -> Any:
    """``doc`` decoded as a ``cls`` record (:func:`tracer.schema.decode`).

    Raises:
        TracerError: ``trace corrupt: <path>: <where>.<key>: what is wrong`` (one line).
    """
    try:
        return schema.decode(cls, doc, where)
    except TracerError as e:
        raise _corrupt(path, str(e)) from None


def read_header(f: h5py.File, fmt: TraceFormat, path: Any) -> dict[str, Any]:
    """The trace's header as the current version writes it (the file's version's
    :attr:`~tracer.store.formats.TraceFormat.upgrade`), checked against :class:`TraceHeader`.

    Raises:
        TracerError: the header is not JSON, not an object, or a fact of the wrong type or range.
    """
    header = fmt.upgrade("header", load_json(f["header"].attrs.get("json"), path, "/header json", dict))
    check_doc(TraceHeader, header, "the header", path)
    return header


def read_run_json(g: h5py.Group, fmt: TraceFormat, run: str, path: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A run's ``plan`` and ``meta`` as the current version writes them, checked against
    :class:`~tracer.plan.plans.RunPlan` and :class:`RunMeta`.

    Raises:
        TracerError: not JSON objects, or a fact of the wrong type or range.
    """
    plan = fmt.upgrade("plan", load_json(g.attrs["plan"], path, f"plan of run {run}", dict))
    meta = fmt.upgrade("meta", load_json(g.attrs["meta"], path, f"meta of run {run}", dict))
    check_doc(RunPlan, plan, f"plan of run {run}", path)
    check_doc(RunMeta, meta, f"meta of run {run}", path)
    return plan, meta


def load_json(raw: Any, path: Any, what: str, kind: type | tuple[type, ...]) -> Any:
    """Parse a JSON attribute, checking its type.

    Raises:
        TracerError: not a string, invalid JSON (or nested too deeply), or not of ``kind``.
    """
    raw = attr_text(raw)
    if raw is None:
        raise _corrupt(path, f"{what} is missing or not UTF-8 JSON text")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        raise _corrupt(path, f"{what} is not valid JSON") from None
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise _corrupt(path, f"{what} is a JSON {type(value).__name__}, not a {names}")
    return value


def _names(value: Any, path: Any, what: str) -> list[str]:
    """A JSON list of unique, valid object names."""
    if not all(isinstance(x, str) and x and "/" not in x and x != "." for x in value):
        raise _corrupt(path, f"{what} holds a non-string or invalid name")
    if len(set(value)) != len(value):
        raise _corrupt(path, f"{what} names an entry twice")
    return value


def _members(group: h5py.Group, path: Any, where: str, seen: set) -> dict[str, Any]:
    """Children of ``group`` by name: hard links only, each object reached once in the file."""
    out = {}
    for name in group:
        link = group.get(name, getlink=True)
        if not isinstance(link, h5py.HardLink):
            kind = "an external link" if isinstance(link, h5py.ExternalLink) else "a soft link"
            raise _corrupt(path, f"{where}/{name} is {kind}; traces hold no links")
        obj = group[name]
        info = h5py.h5o.get_info(obj.id)
        addr = info.token if hasattr(info, "token") else info.addr  # HDF5 >= 1.12: a token
        key = bytes(addr) if isinstance(addr, (bytes, bytearray, memoryview)) else addr
        if key in seen:
            raise _corrupt(path, f"{where}/{name} is the same object as another entry")
        seen.add(key)
        out[name] = obj
    return out


def _check_storage(ds: h5py.Dataset, path: Any, what: str, file_size: int) -> None:
    """No external or virtual storage; the declared size fits what the file holds."""
    if ds.is_virtual:
        raise _corrupt(path, f"{what} is a virtual dataset (data in other files)")
    plist = ds.id.get_create_plist()
    if plist.get_external_count() > 0:
        raise _corrupt(path, f"{what} keeps its data in external files")
    nbytes = int(np.prod(ds.shape, dtype=np.float64) * ds.dtype.itemsize) if ds.shape else ds.dtype.itemsize
    layout = plist.get_layout()
    stored = ds.id.get_storage_size()
    if layout == h5py.h5d.CONTIGUOUS:
        offset = ds.id.get_offset()
        if nbytes > 0 and (offset is None or stored != nbytes or offset + nbytes > file_size):
            raise _corrupt(path, f"{what} declares {nbytes} bytes that the file does not hold")
    elif layout == h5py.h5d.CHUNKED:
        filtered = plist.get_nfilters() > 0
        limit = stored * MAX_COMPRESSION_RATIO if filtered else stored
        if stored > file_size or (nbytes > 0 and nbytes > max(limit, 0)):
            raise _corrupt(path, f"{what} declares {nbytes} bytes that the file does not hold")
    elif nbytes > file_size:  # compact: inside the object header
        raise _corrupt(path, f"{what} declares {nbytes} bytes that the file does not hold")


def validate_trace(f: h5py.File, path: Any, indexes: dict[str, list[dict[str, Any]]] | None = None) -> bool:
    """Validate an open trace whose root ``format``/``format_version``/``complete`` were checked.

    Args:
        indexes: for a version-2 trace, filled with run name → its validated index entries
            (:func:`check_index`), so the reader need not parse them again.

    Returns:
        True when the file carries checksums (attributes verified here; data verified by
        :func:`tracer.store.reader.read_tensor`), False for a file written before checksums existed.

    Raises:
        TracerError: one line naming the first problem found (``trace corrupt: ...``).
    """
    checked = attr_text(f.attrs.get("checksums"))
    if checked is None and "crc32" in f.attrs:
        # the root is sealed yet names no scheme: the attribute was removed after writing
        raise _corrupt(path, "the root attribute 'checksums' is missing from a checksummed trace (removed by an edit)")
    if checked is not None and checked != CHECKSUMS:
        raise _corrupt(path, f"unknown checksum scheme {checked!r} (this tracer knows {CHECKSUMS!r})")
    checked = checked == CHECKSUMS
    file_size = os.fstat(f.id.get_vfd_handle()).st_size if f.driver == "sec2" else os.path.getsize(path)
    seen: set = set()
    if checked:
        verify_attrs(f, "the root group", ("format", "format_version"))
    root = _members(f, path, "", seen)
    for group in ("header", "runs"):
        if not isinstance(root.get(group), h5py.Group):
            raise _corrupt(path, f"/{group} is missing or not a group")
    if checked:
        verify_attrs(root["header"], "the header", ("json",))
        verify_attrs(root["runs"], "the run list", ("order",))
    version = int(f.attrs["format_version"])
    read_header(f, format_for(version, path), path)
    order = _names(load_json(root["runs"].attrs.get("order"), path, "/runs order", list), path, "/runs order")
    runs = _members(root["runs"], path, "/runs", seen)
    if set(runs) != set(order):
        raise _corrupt(path, f"/runs order lists {sorted(order)} but the file holds runs {sorted(runs)}")
    for name in order:
        entries = _validate_run(runs[name], name, path, file_size, checked, seen, version)
        if indexes is not None and entries is not None:
            indexes[name] = entries
    comps = root.get("comparisons")
    if comps is not None:
        if not isinstance(comps, h5py.Group):
            raise _corrupt(path, "/comparisons is not a group")
        for cname, g in _members(comps, path, "/comparisons", seen).items():
            if not isinstance(g, h5py.Group):
                raise _corrupt(path, f"comparison {cname} is not a group")
            if checked:
                verify_attrs(g, f"comparison {cname}", ("json",))
            load_json(g.attrs.get("json"), path, f"comparison {cname}", dict)
    return checked


def _validate_run(g: Any, run: str, path: Any, file_size: int, checked: bool, seen: set,
                  version: int = 1) -> list[dict[str, Any]] | None:
    """Validate one run group: what every format version shares here, the layout of its captures
    by the version's registered validator; return its index entries (version 2) or None."""
    if not isinstance(g, h5py.Group):
        raise _corrupt(path, f"run {run} is not a group")
    fmt = format_for(version, path)
    required = fmt.run_attrs
    if checked:
        try:
            verify_attrs(g, f"run {run}", required)
        except TracerError:
            if "index" in required:  # name the capture point whose index entry was damaged, when it can be told
                index = attr_text(g.attrs.get("index"))
                where = damaged_entry(index, attr_text(g.attrs.get("index_crc32"))) if index is not None else None
                if where is not None:
                    raise TracerError(f"trace corrupt: index {where} of run {run} fails its checksum; the file was "
                                      "damaged after it was written, re-run it") from None
            raise
    for key in required:
        if key not in g.attrs:
            raise _corrupt(path, f"run {run} has no {key} attribute")
    plan, _meta = read_run_json(g, fmt, run, path)
    members = _members(g, path, f"/runs/{run}", seen)
    ids = members.get("token_ids")
    if not isinstance(ids, h5py.Dataset) or ids.dtype != np.int64 or ids.ndim != 1 or ids.size == 0:
        raise _corrupt(path, f"token_ids of run {run} is not a non-empty 1-D int64 dataset")
    _check_storage(ids, path, f"token_ids of run {run}", file_size)
    if checked:
        verify_attrs(ids, f"token_ids of run {run}", (DATA_KEY,))
    window = g.attrs["window"]
    if not (isinstance(window, np.ndarray) and window.dtype.kind in "iu" and window.shape == (2,)):
        raise _corrupt(path, f"window of run {run} is not two integers")
    start, stop = int(window[0]), int(window[1])
    generate = plan.get("generate") or 0
    if not isinstance(generate, int) or isinstance(generate, bool) or generate < 0:
        raise _corrupt(path, f"plan of run {run} has generate={generate!r}, not a count of tokens")
    n = ids.size + generate  # a generation run's window reaches into the generated tokens
    if not 0 <= start < stop <= n:
        raise _corrupt(path, f"window of run {run} is [{start}, {stop}], outside the sequence of {n} positions")
    return fmt.validate_run(g, members, run, path, file_size, checked, seen, (stop - start, n))


def validate_v2_index(g: Any, members: dict[str, Any], run: str, path: Any, file_size: int, checked: bool,
                      seen: set, rows: tuple[int, int]) -> list[dict[str, Any]]:
    """The version-2 part of a run: its index and ``data/<dtype>`` datasets (:func:`check_index`) and
    each point's shape against its kind; returns the entries in execution order."""
    entries = check_index(g, members, run, path, file_size, checked, seen)
    for e in entries:
        _check_shape(tuple(e["shape"]), e["kind"], f"{e['name']} in run {run}", rows, path)
    return entries


def validate_v1_captures(g: Any, members: dict[str, Any], run: str, path: Any, file_size: int, checked: bool,
                         seen: set, rows: tuple[int, int]) -> None:
    """The version-1 part of a run: ``capture_order`` and one valid dataset per capture point."""
    order = _names(load_json(g.attrs["capture_order"], path, f"capture_order of run {run}", list),
                   path, f"capture_order of run {run}")
    caps = members.get("captures")
    if not isinstance(caps, h5py.Group):
        raise _corrupt(path, f"run {run} has no captures group")
    datasets = _members(caps, path, f"/runs/{run}/captures", seen)
    if set(datasets) != set(order):
        missing = sorted(set(order) - set(datasets)) + sorted(set(datasets) - set(order))
        raise _corrupt(path, f"capture_order of run {run} and its datasets disagree (on {missing[0]})")
    for name in order:
        _validate_capture(datasets[name], name, run, rows, path, file_size, checked)


def _validate_capture(ds: Any, name: str, run: str, rows: tuple[int, int], path: Any, file_size: int, checked: bool) -> None:
    what = f"{name} in run {run}"
    if not isinstance(ds, h5py.Dataset):
        raise _corrupt(path, f"{what} is not a dataset")
    if checked:
        verify_attrs(ds, what, (*_CAPTURE_ATTRS, DATA_KEY))
    for key in _CAPTURE_ATTRS:
        if key not in ds.attrs:
            raise _corrupt(path, f"{what} has no {key} attribute")
    dtype = attr_text(ds.attrs["dtype"])
    if dtype not in _DTYPES:
        raise _corrupt(path, f"{what} has dtype {str(dtype)[:20]!r}; traces hold {', '.join(_DTYPES)}")
    if ds.dtype != _DTYPES[dtype]:
        raise _corrupt(path, f"{what} is stored as {ds.dtype}, which does not hold {dtype} values")
    kind, op = attr_text(ds.attrs["kind"]), attr_text(ds.attrs["op"])
    if kind is None or op is None or ("role" in ds.attrs and attr_text(ds.attrs["role"]) is None):
        raise _corrupt(path, f"{what} has a non-string kind, op or role")
    calls = load_json(ds.attrs["calls"], path, f"calls of {what}", list)
    problem = calls_problem(calls)
    if problem:
        raise _corrupt(path, f"calls of {what}: {problem}")
    if len(ds.shape) > 16:
        raise _corrupt(path, f"{what} has {len(ds.shape)} dimensions")
    _check_storage(ds, path, what, file_size)
    _check_shape(tuple(ds.shape), kind, what, rows, path)


def _check_shape(shape: tuple[int, ...], kind: str, what: str, rows: tuple[int, int], path: Any) -> None:
    """A capture's shape against its kind: window rows, KV cache positions, logits width."""
    window_rows, seq_rows = rows
    size = int(np.prod(shape, dtype=np.float64)) if shape else 1
    if size and kind == PointKind.KV_CACHE and (len(shape) != 2 or shape[0] > seq_rows):
        raise _corrupt(path, f"{what} has shape {shape}; a KV cache is (positions <= {seq_rows}, features)")
    if size and kind == PointKind.STATE and (len(shape) != 2 or shape[0] != 1):
        raise _corrupt(path, f"{what} has shape {shape}; a cached state is (1, features)")
    rows_given = len(shape) >= 1 and shape[0] > 0  # (0, ...) = not captured in this run
    if kind in WINDOW_KINDS and (size or rows_given):
        if len(shape) == 0 or shape[0] != window_rows:
            raise _corrupt(path, f"{what} has shape {shape}; its window holds {window_rows} positions")
        if kind == PointKind.LOGITS and (len(shape) != 2 or shape[-1] == 0):
            raise _corrupt(path, f"logits {what} have shape {shape}, not (positions, vocab)")


def check_doc_list(cls: type, docs: list[Any], where: str, path: Any) -> None:
    """Every document of ``docs`` decoded as a ``cls`` record (:func:`check_doc`), ``where[i]`` naming it.

    Raises:
        TracerError: ``trace corrupt: ...`` naming the first bad entry and key.
    """
    for i, doc in enumerate(docs):
        check_doc(cls, doc, f"{where}, entry {i}", path)


def check_index(g: h5py.Group, members: dict[str, Any], run: str, path: Any, file_size: int, checked: bool,
                seen: set) -> list[dict[str, Any]]:
    """Validate a version-2 run's ``index`` attribute and ``data/<dtype>`` datasets (the spec's
    "Tiling" rules: every entry well-typed, names unique, each dtype's points tiling its dataset
    exactly); return the entries in execution order.

    Raises:
        TracerError: one line naming the first problem (``trace corrupt: ...``).
    """
    entries = load_json(g.attrs["index"], path, f"index of run {run}", list)
    check_doc_list(IndexEntry, entries, f"index of run {run}", path)
    _names([e["name"] for e in entries], path, f"index of run {run}")
    data = members.get("data")
    if not isinstance(data, h5py.Group):
        raise _corrupt(path, f"run {run} has no data group")
    if checked:
        verify_attrs(data, f"data of run {run}")
    blobs = _members(data, path, f"/runs/{run}/data", seen)
    ends: dict[str, int] = {}
    for e in entries:
        what = f"{e['name']} in run {run}"
        dtype = e["dtype"]
        if dtype not in _DTYPES:
            raise _corrupt(path, f"{what} has dtype {dtype[:20]!r}; traces hold {', '.join(_DTYPES)}")
        if dtype not in blobs:
            raise _corrupt(path, f"{what} lies in data/{dtype}, which run {run} does not hold")
        if e["offset"] != ends.get(dtype, 0):
            raise _corrupt(path, f"{what} starts at element {e['offset']} of data/{dtype}, not where the previous "
                                 f"point ends ({ends.get(dtype, 0)})")
        size = 1
        for x in e["shape"]:
            size *= x
        ends[dtype] = e["offset"] + size
    for dtype, ds in blobs.items():
        what = f"data/{dtype} of run {run}"
        if dtype not in _DTYPES or not isinstance(ds, h5py.Dataset) or ds.ndim != 1 or ds.dtype != _DTYPES[dtype]:
            raise _corrupt(path, f"{what[:60]} is not a 1-D dataset of a stored dtype's type")
        if checked:
            verify_attrs(ds, what)
        _check_storage(ds, path, what, file_size)
        if dtype not in ends or ends[dtype] != ds.shape[0]:
            raise _corrupt(path, f"{what} holds {ds.shape[0]} elements but its points cover {ends.get(dtype, 0)}")
    return entries


_ENTRY_NAME = re.compile(r'\{"name": ("(?:[^"\\]|\\.)*")')


def damaged_entry(index_text: str, sums_text: str | None) -> str | None:
    """``entry 3 (model.layers.1)``: the first index entry whose bytes fail their CRC-32 in the
    run's ``index_crc32`` (one ``[byte length, CRC-32]`` per entry, the index being the entries'
    JSON joined by ``", "`` in brackets), or None when it cannot be told (no or damaged sums)."""
    try:
        sums = json.loads(sums_text) if sums_text is not None else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(sums, list) or not all(isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) for v in x)
                                             for x in sums):
        return None
    raw, pos = index_text.encode("utf-8", "surrogatepass"), 1
    for i, (length, crc) in enumerate(sums):
        part = raw[pos:pos + length]
        if crc32_bytes(part) != crc:
            m = _ENTRY_NAME.match(part.decode("utf-8", "replace"))
            try:
                name = json.loads(m.group(1)) if m else None
            except ValueError:
                name = None
            return f"entry {i}" + (f" ({name})" if isinstance(name, str) else "")
        pos += length + 2
    return None

