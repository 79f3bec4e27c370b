"""Reading a sweep file safely: every attribute sealed, every committed byte checksummed, every value
validated against the spec (``traces/README.md``, "Sweep files") before use, reads bounded.

:func:`check_sweep` walks an open sweep file and returns its content as plain data; anything a
reader could misread is one :class:`~tracer.errors.TracerError` line (``sweep corrupt: ...``).
A version-2 file's texts are fixed-length strings (object headers, which HDF5 checksums); a
variable-length string attribute is refused by its type, *before* its value is read from the
global heap (a damaged heap makes HDF5 loop forever). Version-1 files (no checksums, variable-length
strings) are read unverified, their values still range-checked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from tracer.errors import TracerError
from tracer.store.crc import crc32_bytes
from tracer.store.integrity import CHECKSUMS, attr_text, verify_attrs
from tracer.store.validate import _check_storage, _members, load_json

FORMAT = "tracer-sweep"
#: params keys: name → accepted JSON types (None: null)
PARAMS = {"model": (str,), "scenario": (str,), "mitigation": (str, type(None)), "granularity": (str,),
          "dtype": (str,), "device": (str, type(None)), "attn": (str, type(None)), "lengths": (list,),
          "block_sizes": (list,), "keep_tensors": (bool,), "prompt_sha256": (str,)}


def corrupt(path: Any, what: str) -> TracerError:
    return TracerError(f"sweep corrupt: {path}: {what}; the file is damaged or was not written by tracer "
                       "(re-run the sweep with --overwrite)")


@dataclass
class SweepData:
    """A validated sweep file's content: parameters, points, kinds, ``n`` committed rows per dataset."""

    params: dict[str, Any]
    points: list[str]
    kinds: list[str]
    columns: dict[str, np.ndarray]
    n_done: int
    complete: bool
    version: int
    index: dict[str, Any]


def is_variable_string(obj: Any, name: str) -> bool:
    """True when attribute ``name`` of ``obj`` is a variable-length string (checked by its type; the
    value, which lives in the global heap, is not read)."""
    try:
        t = obj.attrs.get_id(name).get_type()
    except (KeyError, OSError, RuntimeError):
        return False
    return isinstance(t, h5py.h5t.TypeStringID) and t.is_variable_str() or \
        (t.get_class() == h5py.h5t.VLEN)


def fixed_text(obj: Any, name: str, path: Any, where: str) -> str:
    """A fixed-length string attribute's text (refusing a variable-length one before reading it)."""
    if name not in obj.attrs:
        raise corrupt(path, f"{where} has no attribute {name!r}")
    if is_variable_string(obj, name):
        raise corrupt(path, f"{where} attribute {name!r} is a variable-length string (outside any checksum); "
                            "a version-2 sweep file holds fixed-length strings only")
    text = attr_text(obj.attrs[name])
    if text is None:
        raise corrupt(path, f"{where} attribute {name!r} is not UTF-8 text")
    return text


def sealed(obj: Any, path: Any, where: str, required: tuple[str, ...] = ()) -> None:
    """Check an object's attributes: none a variable-length string (refused by type, before its value
    is read), each covered by the object's ``crc32`` seal, ``required`` ones present.

    Raises:
        TracerError: a variable-length string, or ``trace corrupt: ... fails its checksum``.
    """
    for name in obj.attrs:
        if is_variable_string(obj, name):
            raise corrupt(path, f"{where} attribute {name!r} is a variable-length string (outside any checksum); "
                                "a version-2 sweep file holds fixed-length strings only")
    try:
        verify_attrs(obj, where, required)
    except TracerError:
        raise corrupt(path, f"{where} fails its checksum (an attribute was changed, added or removed)") from None


def _check_params(params: dict[str, Any], path: Any) -> None:
    for key, kinds in PARAMS.items():
        if key not in params or not isinstance(params[key], kinds) or (bool in kinds) != isinstance(params[key], bool):
            raise corrupt(path, f"params.{key} is missing or of the wrong type")
    for key in ("lengths", "block_sizes"):
        v = params[key]
        if not v or not all(isinstance(x, int) and not isinstance(x, bool) and 1 <= x < 2**40 for x in v):
            raise corrupt(path, f"params.{key} is not a non-empty list of positive ints")
    sha = params["prompt_sha256"]
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise corrupt(path, "params.prompt_sha256 is not 64 hex digits")
    if "options" in params and not isinstance(params["options"], dict):
        raise corrupt(path, "params.options is not an object")


def _check_index(index: dict[str, Any], path: Any, names: set[str]) -> tuple[int, int, dict[str, int]]:
    n, cols, crcs = index.get("n_done"), index.get("columns"), index.get("crc32")
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (n, cols))
    if not ints or n < 0 or cols < 0 or n > 2**40 or cols > 2**31 or not isinstance(crcs, dict):
        raise corrupt(path, "/sweep index is not {n_done: int >= 0, columns: int >= 0, crc32: {...}}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32 for v in crcs.values()):
        raise corrupt(path, "/sweep index holds a CRC-32 that is not an unsigned 32-bit int")
    if set(crcs) - names or (n > 0 and set(crcs) != names):
        raise corrupt(path, "/sweep index does not list one CRC-32 per dataset")
    return n, cols, crcs


def _check_names(points: list, kinds: list, cols: int, path: Any) -> None:
    from tracer.execute.kinds import PointKind

    if not all(isinstance(x, str) and x for x in points) or len(set(points)) != len(points):
        raise corrupt(path, "/sweep points is not a list of unique non-empty names")
    if len(kinds) != len(points) or not all(isinstance(k, str) and k in PointKind._value2member_map_ for k in kinds):
        raise corrupt(path, "/sweep kinds is not one known capture kind per point")
    if len(points) != cols:
        raise corrupt(path, f"/sweep index says {cols} columns but points names {len(points)}")


def _read_columns(g: h5py.Group, members: dict[str, Any], n: int, cols: int, crcs: dict[str, int] | None,
                  path: Any, file_size: int, rows: dict[str, Any], matrices: dict[str, Any]) -> dict[str, np.ndarray]:
    """Exactly ``n`` rows of every dataset, checked (dtype, rank, storage, CRC-32 when sealed)."""
    out: dict[str, np.ndarray] = {}
    for name, dtype in {**rows, **matrices}.items():
        dt = np.dtype(dtype).newbyteorder("<")
        ds = members.get(name)
        if ds is None:
            if n == 0:
                out[name] = np.zeros((0,) if name in rows else (0, cols), dtype=dt)
                continue
            raise corrupt(path, f"/sweep/{name} is missing")
        what = f"/sweep/{name}"
        if not isinstance(ds, h5py.Dataset):
            raise corrupt(path, f"{what} is not a dataset")
        if crcs is not None:
            sealed(ds, path, what)
        if ds.dtype.newbyteorder("<") != dt:
            raise corrupt(path, f"{what} is {ds.dtype}, not {dt}")
        want_ndim = 1 if name in rows else 2
        if len(ds.shape) != want_ndim or ds.shape[0] < n or (want_ndim == 2 and ds.shape[1] != cols):
            raise corrupt(path, f"{what} has shape {ds.shape}; {n} rows" + (f" of {cols} columns" if want_ndim == 2 else "")
                          + " expected")
        _check_storage(ds, path, what, file_size)
        arr = np.asarray(ds[:n], dtype=dt)  # bounded: the committed rows only
        if crcs is not None and crc32_bytes(arr) != crcs.get(name, 0):
            raise corrupt(path, f"{what} fails its checksum (its first {n} rows)")
        out[name] = arr
    return out


def check_rows(c: dict[str, np.ndarray], params: dict[str, Any], cols: int, path: Any) -> None:
    """The value rules of the spec's dataset table, vectorised (linear in the rows).

    Raises:
        TracerError: the first row breaking a rule, named by its index.
    """
    def fail(mask: np.ndarray, rule: str) -> None:
        if mask.any():
            raise corrupt(path, f"row {int(np.argmax(mask))} breaks the rule {rule}")

    n = len(c["length"])
    if n == 0:
        return
    length, split, npos = c["length"], c["split_at"], c["n_positions"]
    fail(~np.isin(length, np.asarray(params["lengths"], dtype=np.int64)), "length in params.lengths")
    fail(~np.isin(c["block_size"], np.asarray(params["block_sizes"], dtype=np.int64)), "block_size in params.block_sizes")
    order = np.lexsort((c["block_size"], length))
    dup = np.zeros(n, dtype=bool)
    dup[order[1:]] = (np.diff(length[order]) == 0) & (np.diff(c["block_size"][order]) == 0)
    fail(dup, "(length, block_size) unique")
    fail((split < 0) | (split >= length), "0 <= split_at < length")
    fail(npos != length - split, "n_positions == length - split_at")
    fail((c["argmax_flips"] < 0) | (c["argmax_flips"] > npos), "0 <= argmax_flips <= n_positions")
    frac = c["last_layer_fraction"]
    fail(~((frac >= 0) & (frac <= 1)), "0 <= last_layer_fraction <= 1")
    fail(~(c["logits_max_abs_diff"] >= 0), "logits_max_abs_diff >= 0")
    fail(~(np.isfinite(c["wall_s"]) & (c["wall_s"] >= 0)), "wall_s finite and >= 0")
    nd, nt, mad = c["n_diff"], c["n_total"], c["max_abs_diff"]
    fail(((nd < 0) | (nd > nt)).any(axis=1), "0 <= n_diff <= n_total")
    fail((~(mad >= 0) | ((nd == 0) & (mad != 0))).any(axis=1), "max_abs_diff >= 0, and 0 where n_diff is 0")
    nonzero = nd != 0
    first = np.where(nonzero.any(axis=1), np.argmax(nonzero, axis=1), -1) if cols else np.full(n, -1)
    fail(c["first_divergent"] != first, "first_divergent is the first column whose n_diff is not 0")


def check_sweep(f: h5py.File, path: Any, rows: dict[str, Any], matrices: dict[str, Any]) -> SweepData:
    """Validate an open sweep file against the spec and return its committed content.

    Args:
        rows, matrices: the ``/sweep`` datasets, name → numpy dtype: the 1-D ones (one value per
            row) and the 2-D ones (one column per capture point) (``tracer.store.sweepfile.ROW_FIELDS``
            and ``MATRIX_FIELDS``).

    Raises:
        TracerError: not a sweep file, an unknown version, or one line naming the first problem
            (``sweep corrupt: ...``).
    """
    raw_version = None if is_variable_string(f, "format_version") else f.attrs.get("format_version")
    version = int(raw_version) if isinstance(raw_version, (int, np.integer)) and not isinstance(raw_version, bool) else None
    if "format" not in f.attrs or (version == 2 and is_variable_string(f, "format")):
        raise TracerError(f"{path} is not a tracer sweep file (no format={FORMAT!r} attribute); choose another --output")
    if attr_text(f.attrs.get("format")) != FORMAT:
        raise TracerError(f"{path} is not a tracer sweep file (no format={FORMAT!r} attribute); choose another --output")
    if version not in (1, 2):
        raise TracerError(f"{path} has sweep format_version {raw_version!r}; this tracer reads 1, 2; use a matching tracer")
    file_size = os.fstat(f.id.get_vfd_handle()).st_size if f.driver == "sec2" else os.path.getsize(path)
    seen: set = set()
    root = _members(f, path, "", seen)
    if version == 1:
        return _check_v1(f, root, path, file_size, seen, rows, matrices)
    sealed(f, path, "the root group", ("format", "format_version", "checksums", "created", "tool_version"))
    if attr_text(f.attrs["checksums"]) != CHECKSUMS:
        raise corrupt(path, f"unknown checksum scheme (this tracer knows {CHECKSUMS!r})")
    header, g = root.get("header"), root.get("sweep")
    if not isinstance(header, h5py.Group) or not isinstance(g, h5py.Group):
        raise corrupt(path, "/header or /sweep is missing or not a group")
    sealed(header, path, "/header", ("json",))
    load_json(header.attrs["json"], path, "/header json", dict)
    sealed(g, path, "/sweep", ("params", "points", "kinds", "index"))
    texts = {k: fixed_text(g, k, path, "/sweep") for k in ("params", "points", "kinds", "index")}
    params = load_json(texts["params"], path, "/sweep params", dict)
    points = load_json(texts["points"], path, "/sweep points", list)
    kinds = load_json(texts["kinds"], path, "/sweep kinds", list)
    index = load_json(texts["index"], path, "/sweep index", dict)
    _check_params(params, path)
    n, cols, crcs = _check_index(index, path, set(rows) | set(matrices))
    _check_names(points, kinds, cols, path)
    columns = _read_columns(g, _members(g, path, "/sweep", seen), n, cols, crcs, path, file_size, rows, matrices)
    check_rows(columns, params, cols, path)
    complete = f.attrs.get("complete")
    return SweepData(params, points, kinds, columns, n, bool(complete) if isinstance(complete, (bool, np.bool_)) else False,
                     2, index)


def _check_v1(f: h5py.File, root: dict[str, Any], path: Any, file_size: int, seen: set, rows: dict[str, Any],
              matrices: dict[str, Any]) -> SweepData:
    """A version-1 sweep (no checksums): read unverified, values still checked."""
    g = root.get("sweep")
    if not isinstance(g, h5py.Group):
        raise corrupt(path, "/sweep is missing or not a group")
    params = load_json(g.attrs.get("params"), path, "/sweep params", dict)
    points = load_json(g.attrs.get("points"), path, "/sweep points", list)
    kinds = load_json(g.attrs.get("kinds"), path, "/sweep kinds", list)
    raw_n = g.attrs.get("n_done")
    if not isinstance(raw_n, (int, np.integer)) or isinstance(raw_n, bool) or raw_n < 0:
        raise corrupt(path, "/sweep n_done is not an int >= 0")
    _check_params(params, path)
    _check_names(points, kinds, len(points), path)
    columns = _read_columns(g, _members(g, path, "/sweep", seen), int(raw_n), len(points), None, path, file_size,
                            rows, matrices)
    check_rows(columns, params, len(points), path)
    complete = f.attrs.get("complete")
    return SweepData(params, points, kinds, columns, int(raw_n), bool(complete) if isinstance(complete, (bool, np.bool_)) else False,
                     1, {})
