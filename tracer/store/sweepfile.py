"""Sweep files: one scenario over many prompt lengths × KV block sizes, one summary row per point.

A sweep file (``format = "tracer-sweep"``, specified in ``traces/README.md``) holds the sweep's
parameters, the capture point names, and per finished point a row of scalars plus per-point
differing counts and max |diff|; each row is flushed as it finishes, so an interrupted sweep
resumes where it stopped. :class:`SweepResult` is the file's content as data.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import re
import stat
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tracer import __version__, schema
from tracer.errors import TracerError
from tracer.files import check_input_file
from tracer.store.crc import crc32_bytes
from tracer.store.integrity import check_space, seal, set_text

FORMAT = "tracer-sweep"
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
# ---------------------------------------------------------------- parsing the axes


@dataclass(frozen=True)
class SweepRow(schema.Record):
    """The summary of one sweep point (one prompt length at one block size).

    Attributes:
        length: N, prompt tokens. block_size: KV block size. split_at: P (compared: P..N-1).
        n_positions: N - P.
        first_divergent: index into :attr:`SweepResult.points` of the first capture point that
            differs bitwise (-1: all bit-identical).
        n_diff, n_total, max_abs_diff: per capture point (logits last), as in the comparison.
        last_layer_fraction: differing fraction of the last decoder layer's output.
        logits_max_abs_diff: max |logit diff| (0.0 when identical; ``inf`` for NaN/inf mismatches).
        argmax_flips: number of compared positions whose top-1 token differs.
        wall_s: seconds the point took (excluded from equality checks of results).
    """

    length: int
    block_size: int
    split_at: int
    n_positions: int
    first_divergent: int
    n_diff: tuple[int, ...]
    n_total: tuple[int, ...]
    max_abs_diff: tuple[float, ...]
    last_layer_fraction: float
    logits_max_abs_diff: float
    argmax_flips: int
    wall_s: float = schema.field(default=0.0, compare=False)

    @property
    def diverged(self) -> bool:
        return self.first_divergent >= 0


def _columns() -> tuple[dict[str, Any], dict[str, Any]]:
    """The datasets of ``/sweep``, derived from :class:`SweepRow`'s fields: a scalar field is a 1-D
    dataset (int → int64, float → float64), a per-point tuple a 2-D one (one column per capture
    point, logits last)."""
    rows, matrix = {}, {}
    for f in schema.fields_of(SweepRow):
        item = (typing.get_args(f.type) or (f.type,))[0]
        (matrix if typing.get_origin(f.type) is tuple else rows)[f.name] = np.int64 if item is int else np.float64
    return rows, matrix


#: the per-row 1-D datasets of ``/sweep`` (name → numpy dtype: SweepRow's scalars) and the per-row
#: 2-D datasets, one column per capture point (SweepRow's tuples)
ROW_FIELDS, MATRIX_FIELDS = _columns()


@dataclass
class SweepResult(schema.Record):
    """A sweep: its parameters, capture point names, and one :class:`SweepRow` per finished point.

    Attributes:
        params: the sweep parameters (model, scenario, lengths, block_sizes, ...), as stored.
        points: capture point names in execution order, logits last (the columns of
            ``n_diff``/``max_abs_diff``); empty before the first point finished.
        kinds: the capture kinds of ``points``.
        rows: finished points in the order they ran (block size outer, length inner).
        path: the sweep file, or None.
        complete: every planned point has a row.
        verified: read from a checksummed file (format 2); False for a format-1 file, read
            unverified (its values range-checked only).
    """

    params: dict[str, Any]
    points: list[str]
    kinds: list[str]
    rows: list[SweepRow]
    path: str | None = None
    complete: bool = False
    verified: bool = True

    def diverging_lengths(self, block_size: int | None = None) -> list[int]:
        """Prompt lengths whose runs differ anywhere (at ``block_size``, default: any)."""
        return [r.length for r in self.rows if r.diverged and (block_size is None or r.block_size == block_size)]

    def point_name(self, index: int) -> str | None:
        return self.points[index] if 0 <= index < len(self.points) else None

    def summary_rows(self) -> list[dict[str, Any]]:
        """One dict per row (``tracer sweep --format json/csv``): the row's scalar result fields
        (those compared; not the timing), ``first_divergent`` as the point's name."""
        out = []
        for r in self.rows:
            d = {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.compare and not isinstance(getattr(r, f.name), tuple)}
            out.append({**d, "first_divergent": self.point_name(r.first_divergent)})
        return out

    def summary(self) -> dict[str, Any]:
        """The document of ``tracer sweep --format json``: :meth:`to_dict` with :meth:`summary_rows` as its rows."""
        return {**self.to_dict(), "rows": self.summary_rows()}

    def rows_at(self, block_size: int | None = None) -> list[SweepRow]:
        """Rows at ``block_size`` (all when None), sorted by block size, then length."""
        return sorted((r for r in self.rows if block_size is None or r.block_size == block_size),
                      key=lambda r: (r.block_size, r.length))

    def __repr__(self) -> str:
        n_div = sum(r.diverged for r in self.rows)
        return f"SweepResult({len(self.rows)} points, {n_div} diverge, path={self.path!r})"


def default_output(model: str, scenario: str, root: str | Path = "traces") -> Path:
    """``traces/sweep-<model>-<scenario>.h5``: a fixed name, so re-running a sweep resumes it."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("_") or "model"
    return Path(root) / f"sweep-{safe}-{scenario}.h5"


def compress_ranges(values: list[int]) -> str:
    """``[17, 18, 19, 33, 40, 41]`` → ``"17-19, 33, 40-41"`` (sorted)."""
    vals = sorted(set(values))
    parts: list[str] = []
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        parts.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    return ", ".join(parts)


# ---------------------------------------------------------------- result objects


def _describe_diff(old: dict, new: dict) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))

    def show(v: Any) -> str:
        if isinstance(v, list) and len(v) > 6:
            return f"[{compress_ranges(v) if all(isinstance(x, int) for x in v) else '...'}]"
        return json.dumps(v)

    return "; ".join(f"{k} {show(old.get(k))} in the file vs {show(new.get(k))} now" for k in keys[:3])


class SweepFile:
    """An open sweep file: created, or reopened to resume; appends one row per finished point.

    The file is the version-2 layout of ``traces/README.md`` ("Sweep files"): fixed-length texts,
    every attribute sealed, and per dataset the CRC-32 of its committed rows in ``/sweep``'s
    ``index``, carried from row to row (a row's CRC extends the previous one), written with the
    seal after the row's data: the commit marker.

    Raises:
        TracerError: the path is a directory, an existing file is not a sweep (or a version
            this tracer does not resume), it fails validation, or it holds a sweep with other
            parameters.
    """

    def __init__(self, path: str | Path, params: dict[str, Any], header: dict[str, Any], *,
                 overwrite: bool = False) -> None:
        import h5py

        from tracer.store.integrity import seal, set_text

        self.path = Path(path)
        if self.path.is_dir():
            raise TracerError(f"--output {self.path} is a directory; give a file path ending in .h5")
        from tracer.store.integrity import clean_stale_partials

        clean_stale_partials(self.path)  # hidden point traces and partials of sweeps killed earlier
        if self.path.exists() and overwrite:
            self.path.unlink()
        if self.path.exists():
            self.f, data = _open_sweep(self.path, "a")
            if data.version != FORMAT_VERSION:
                self.f.close()
                raise TracerError(f"{self.path} is a sweep of format version {data.version} (no checksums), which "
                                  "this tracer reads but does not resume; pass --overwrite or choose another --output")
            if data.params != params:
                self.f.close()
                raise TracerError(
                    f"{self.path} holds a sweep with other parameters ({_describe_diff(data.params, params)}); "
                    "re-run with the same options to resume it, choose another --output, or pass --overwrite to start over")
            g = self.f["sweep"]
            for name in (*ROW_FIELDS, *MATRIX_FIELDS):  # drop a half-written row of a killed run
                if name in g and g[name].shape[0] != data.n_done:
                    g[name].resize(data.n_done, axis=0)
            self.index = data.index
        else:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.f = h5py.File(self.path, "w", libver=("v108", "v110"))
            except OSError as e:
                raise TracerError(f"cannot create {self.path} ({e.strerror or e}); choose another --output") from None

            for key, text in (("format", FORMAT), ("created", _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")),
                              ("tool_version", __version__), ("checksums", "crc32")):
                set_text(self.f, key, text)
            self.f.attrs["format_version"] = np.int64(FORMAT_VERSION)
            seal(self.f)
            self.f.attrs["complete"] = False
            head = self.f.create_group("header")
            set_text(head, "json", json.dumps(header, default=str))
            seal(head)
            g = self.f.create_group("sweep")
            set_text(g, "params", json.dumps(params))
            set_text(g, "points", "[]")
            set_text(g, "kinds", "[]")
            self.index = {"n_done": 0, "columns": 0, "crc32": {}}
            self._commit(g)
        self.params = params

    def _commit(self, g: Any) -> None:
        """Write the index and the seal of ``/sweep``, and flush: the row counts from here on."""
        from tracer.store.integrity import seal, set_text

        set_text(g, "index", json.dumps(self.index, sort_keys=True))
        seal(g)
        self.f.flush()

    @property
    def group(self):
        return self.f["sweep"]

    def result(self) -> SweepResult:
        from tracer.store.sweepcheck import check_sweep

        return _result(check_sweep(self.f, str(self.path), ROW_FIELDS, MATRIX_FIELDS), str(self.path))

    def done(self) -> set[tuple[int, int]]:
        """The ``(length, block_size)`` pairs already stored."""
        g = self.group
        n = int(self.index["n_done"])
        if n == 0:
            return set()
        return set(zip((int(x) for x in g["length"][:n]), (int(x) for x in g["block_size"][:n])))

    def append(self, row: SweepRow, names: list[str], kinds: list[str], runs_from: Path | None = None) -> None:
        """Append one finished point and flush; the runs of trace ``runs_from`` are copied in when given.

        Raises:
            TracerError: the point's capture points differ from the earlier points', or the disk
                has no room for it.
        """
        # writes happen in place: a failing one would break HDF5 and the file, so check first
        check_space(self.path, (runs_from.stat().st_size if runs_from is not None else 0) + (1 << 20),
                    f"sweep file {self.path}")
        g = self.group
        n = int(self.index["n_done"])
        if n == 0:
            set_text(g, "points", json.dumps(names))
            set_text(g, "kinds", json.dumps([str(k) for k in kinds]))
            c = len(names)
            for name, dt in ROW_FIELDS.items():
                if name in g:  # left by a run killed before its first commit
                    del g[name]
                seal(g.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(256,)))
            for name, dt in MATRIX_FIELDS.items():
                if name in g:
                    del g[name]
                seal(g.create_dataset(name, shape=(0, c), maxshape=(None, c), dtype=dt, chunks=(64, max(1, c))))
            self.index = {"n_done": 0, "columns": c, "crc32": {}}
        elif json.loads(g.attrs["points"]) != names:
            raise TracerError(f"N={row.length} captured {len(names)} points but earlier points captured "
                              f"{self.index['columns']} (another model, granularity or tracer version?); pass --overwrite "
                              "to start the sweep over")
        crcs = dict(self.index["crc32"])
        for name, dt in {**ROW_FIELDS, **MATRIX_FIELDS}.items():
            value = np.asarray(getattr(row, name), dtype=dt)
            ds = g[name]
            ds.resize(n + 1, axis=0)
            ds[n] = value
            crcs[name] = crc32_bytes(value.astype(np.dtype(dt).newbyteorder("<")).reshape(-1), crcs.get(name, 0))
        if runs_from is not None:
            import h5py

            key = f"N{row.length}_b{row.block_size}"
            tensors = self.f.require_group("tensors")
            if key in tensors:  # left by a killed run
                del tensors[key]
            with h5py.File(runs_from, "r") as src:
                src.copy(src["runs"], tensors, name=key)
        self.index = {"n_done": n + 1, "columns": self.index["columns"], "crc32": crcs}
        self._commit(g)  # the row counts only once this is written

    def finish(self, complete: bool) -> None:
        if complete:
            self.f.attrs["complete"] = True
        self.f.flush()

    def close(self) -> None:
        if self.f:
            self.f.close()


def _open_sweep(path: Path, mode: str) -> tuple[Any, Any]:
    """The open file and its validated content (:func:`tracer.store.sweepcheck.check_sweep`).

    Raises:
        TracerError: unopenable, not a sweep file, an unknown version, or invalid.
    """
    import h5py

    from tracer.store.sweepcheck import check_sweep

    try:
        f = h5py.File(path, mode)
    except OSError:
        f = None
        if mode == "r":  # a running sweep holds the write lock; its flushed rows are still readable
            try:
                f = h5py.File(path, mode, locking=False)
            except (OSError, TypeError):
                f = None
        if f is None:
            raise TracerError(f"cannot open {path}: another sweep is writing it, or it is not HDF5 (truncated or "
                              "corrupt?); wait for that sweep, choose another --output, or pass --overwrite") from None
    try:
        from tracer.store.heap import check_heap

        check_heap(f, path, "sweep file")  # format 1's variable-length texts only after a probe (a damaged heap hangs HDF5)
        return f, check_sweep(f, str(path), ROW_FIELDS, MATRIX_FIELDS)
    except TracerError:
        f.close()
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as e:  # HDF5 on a damaged file
        f.close()
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise TracerError(f"sweep corrupt: {path}: HDF5 cannot read it ({first}); the file is damaged, "
                          "re-run the sweep with --overwrite") from None


def _result(data: Any, path: str) -> SweepResult:
    """A :class:`SweepResult` of validated file content."""
    cols = data.columns
    rows = [SweepRow.from_dict({name: col[i].tolist() for name, col in cols.items()}) for i in range(data.n_done)]
    return SweepResult(params=data.params, points=data.points, kinds=data.kinds, rows=rows, path=path,
                       complete=data.complete, verified=data.version >= 2)


def read_sweep(path: str | Path) -> SweepResult:
    """Read a sweep file (finished or not) into a :class:`SweepResult`, validated against the spec
    first (checksums, types, ranges; :mod:`tracer.store.sweepcheck`).

    Raises:
        TracerError: missing file, not a sweep file, unknown format version, or a damaged file.
    """
    p = check_input_file(path, "sweep file")  # a FIFO or device would block the read
    f, data = _open_sweep(p, "r")
    try:
        return _result(data, str(p))
    finally:
        f.close()


def is_sweep_file(path: str | Path) -> bool:
    """True if ``path`` is a regular HDF5 file with ``format = "tracer-sweep"`` (not validated)."""
    import h5py

    from tracer.store.sweepcheck import is_variable_string

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # never open a FIFO or device: it would block
            return False
        with h5py.File(path, "r") as f:
            if is_variable_string(f, "format") and "checksums" in f.attrs:
                return False
            if is_variable_string(f, "format"):  # format 1: read the text only once the heap is known to be sound
                from tracer.store.heap import check_heap

                try:
                    check_heap(f, path, "file")
                except TracerError:
                    return True  # a damaged file that claims no checksums: read_sweep says what is wrong
            raw = f.attrs.get("format")
            return (raw.decode("utf-8", "replace") if isinstance(raw, (bytes, np.bytes_)) else raw) == FORMAT
    except Exception:  # noqa: BLE001 - any unreadable file is "not a sweep file"
        return False
