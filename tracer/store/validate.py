"""Validate an open trace file against its written spec (``traces/README.md``) before any use.

Store-layer module (target: ``tracer/store/validate.py``). :func:`validate_trace` walks the
structure the spec defines, reading metadata only (no tensor data), and refuses anything a
reader could misread: wrong types, shapes that do not match the window, token ids of the wrong
dtype or rank, windows outside the sequence, declared sizes the file cannot hold, external
storage, soft or external links, objects linked twice, and (for files that carry them)
attributes that fail their checksums. Every refusal is one :class:`TracerError` line.
"""

from __future__ import annotations

import json
import os
from typing import Any

import h5py
import numpy as np

from tracer.errors import TracerError
from tracer.store.integrity import CHECKSUMS, DATA_KEY, attr_text, verify_attrs

#: the largest ratio of a compressed dataset's size to its stored bytes that is believed
#: (gzip's best case is ~1000:1); a larger declared size is refused before anything is allocated
MAX_COMPRESSION_RATIO = 1100
_DTYPES = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.float32, "float64": np.float64}
_RUN_ATTRS = ("plan", "meta", "window", "capture_order")
_CAPTURE_ATTRS = ("dtype", "kind", "op", "calls")
#: capture kinds whose tensors are (T, *feature) over the run's window (the spec's list)
WINDOW_KINDS = ("embedding", "layer", "final_norm", "logits", "linear", "norm", "attention", "attention_core",
                "mlp", "activation")


def _corrupt(path: Any, what: str) -> TracerError:
    return TracerError(f"trace corrupt: {path}: {what}; the file is damaged or was not written by tracer, re-run it")


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


def validate_trace(f: h5py.File, path: Any) -> bool:
    """Validate an open trace whose root ``format``/``format_version``/``complete`` were checked.

    Returns:
        True when the file carries checksums (attributes verified here; data verified by
        :func:`tracer.store.trace.read_tensor`), False for a file written before checksums existed.

    Raises:
        TracerError: one line naming the first problem found (``trace corrupt: ...``).
    """
    checked = attr_text(f.attrs.get("checksums"))
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
    load_json(root["header"].attrs.get("json"), path, "/header json", dict)
    order = _names(load_json(root["runs"].attrs.get("order"), path, "/runs order", list), path, "/runs order")
    runs = _members(root["runs"], path, "/runs", seen)
    if set(runs) != set(order):
        raise _corrupt(path, f"/runs order lists {sorted(order)} but the file holds runs {sorted(runs)}")
    for name in order:
        _validate_run(runs[name], name, path, file_size, checked, seen)
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


def _validate_run(g: Any, run: str, path: Any, file_size: int, checked: bool, seen: set) -> None:
    if not isinstance(g, h5py.Group):
        raise _corrupt(path, f"run {run} is not a group")
    if checked:
        verify_attrs(g, f"run {run}", _RUN_ATTRS)
    for key in _RUN_ATTRS:
        if key not in g.attrs:
            raise _corrupt(path, f"run {run} has no {key} attribute")
    plan = load_json(g.attrs["plan"], path, f"plan of run {run}", dict)
    load_json(g.attrs["meta"], path, f"meta of run {run}", dict)
    order = _names(load_json(g.attrs["capture_order"], path, f"capture_order of run {run}", list),
                   path, f"capture_order of run {run}")
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
    caps = members.get("captures")
    if not isinstance(caps, h5py.Group):
        raise _corrupt(path, f"run {run} has no captures group")
    datasets = _members(caps, path, f"/runs/{run}/captures", seen)
    if set(datasets) != set(order):
        missing = sorted(set(order) - set(datasets)) + sorted(set(datasets) - set(order))
        raise _corrupt(path, f"capture_order of run {run} and its datasets disagree (on {missing[0]})")
    for name in order:
        _validate_capture(datasets[name], name, run, (stop - start, n), path, file_size, checked)


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
    if kind is None or op is None:
        raise _corrupt(path, f"{what} has a non-string kind or op")
    calls = load_json(ds.attrs["calls"], path, f"calls of {what}", list)
    if not all(isinstance(c, dict) for c in calls):
        raise _corrupt(path, f"calls of {what} are not JSON objects")
    _check_storage(ds, path, what, file_size)
    window_rows, seq_rows = rows
    if ds.size and kind == "kv_cache" and (ds.ndim != 2 or ds.shape[0] > seq_rows):
        raise _corrupt(path, f"{what} has shape {tuple(ds.shape)}; a KV cache is (positions <= {seq_rows}, features)")
    rows_given = ds.ndim >= 1 and ds.shape[0] > 0  # (0, ...) = not captured in this run
    if kind in WINDOW_KINDS and (ds.size or rows_given):
        if ds.ndim == 0 or ds.shape[0] != window_rows:
            raise _corrupt(path, f"{what} has shape {tuple(ds.shape)}; its window holds {window_rows} positions")
        if kind == "logits" and (ds.ndim < 2 or ds.shape[-1] == 0):
            raise _corrupt(path, f"logits {what} have shape {tuple(ds.shape)}, not (positions, vocab)")
