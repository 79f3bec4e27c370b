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
from tracer.store.integrity import check_space

FORMAT = "tracer-sweep"
FORMAT_VERSION = 1
READ_VERSIONS = (1,)
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
    """

    params: dict[str, Any]
    points: list[str]
    kinds: list[str]
    rows: list[SweepRow]
    path: str | None = None
    complete: bool = False

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

    Raises:
        TracerError: the path is a directory, an existing file is not a sweep (or a version
            this tracer does not read), or it holds a sweep with other parameters.
    """

    def __init__(self, path: str | Path, params: dict[str, Any], header: dict[str, Any], *,
                 overwrite: bool = False) -> None:
        import h5py

        self.path = Path(path)
        if self.path.is_dir():
            raise TracerError(f"--output {self.path} is a directory; give a file path ending in .h5")
        if self.path.exists() and overwrite:
            self.path.unlink()
        if self.path.exists():
            self.f = _open_sweep(self.path, "a")
            g = self.f["sweep"]
            old = json.loads(g.attrs["params"])
            if old != params:
                self.f.close()
                raise TracerError(
                    f"{self.path} holds a sweep with other parameters ({_describe_diff(old, params)}); "
                    "re-run with the same options to resume it, choose another --output, or pass --overwrite to start over")
            n = int(g.attrs["n_done"])
            for name in (*ROW_FIELDS, *MATRIX_FIELDS):  # drop a half-written row of a killed run
                if name in g and g[name].shape[0] != n:
                    g[name].resize(n, axis=0)
        else:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.f = h5py.File(self.path, "w")
            except OSError as e:
                raise TracerError(f"cannot create {self.path} ({e.strerror or e}); choose another --output") from None

            self.f.attrs["format"] = FORMAT
            self.f.attrs["format_version"] = np.int64(FORMAT_VERSION)
            self.f.attrs["created"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            self.f.attrs["tool_version"] = __version__
            self.f.attrs["complete"] = False
            self.f.create_group("header").attrs["json"] = json.dumps(header, default=str)
            g = self.f.create_group("sweep")
            g.attrs["params"] = json.dumps(params)
            g.attrs["points"] = json.dumps([])
            g.attrs["kinds"] = json.dumps([])
            g.attrs["n_done"] = np.int64(0)
            self.f.flush()
        self.params = params

    @property
    def group(self):
        return self.f["sweep"]

    def result(self) -> SweepResult:
        return _result_from_file(self.f, str(self.path))

    def done(self) -> set[tuple[int, int]]:
        """The ``(length, block_size)`` pairs already stored."""
        g = self.group
        n = int(g.attrs["n_done"])
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
        n = int(g.attrs["n_done"])
        points = json.loads(g.attrs["points"])
        if n == 0:
            g.attrs["points"] = json.dumps(names)
            g.attrs["kinds"] = json.dumps(kinds)
            c = len(names)
            for name, dt in ROW_FIELDS.items():
                g.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dt, chunks=(256,))
            for name, dt in MATRIX_FIELDS.items():
                g.create_dataset(name, shape=(0, c), maxshape=(None, c), dtype=dt, chunks=(64, c))
        elif points != names:
            raise TracerError(f"N={row.length} captured {len(names)} points but earlier points captured "
                              f"{len(points)} (another model, granularity or tracer version?); pass --overwrite to start the sweep over")
        values = {f: getattr(row, f) for f in (*ROW_FIELDS, *MATRIX_FIELDS)}
        for name in (*ROW_FIELDS, *MATRIX_FIELDS):
            ds = g[name]
            ds.resize(n + 1, axis=0)
            ds[n] = values[name]
        if runs_from is not None:
            import h5py

            key = f"N{row.length}_b{row.block_size}"
            tensors = self.f.require_group("tensors")
            if key in tensors:  # left by a killed run
                del tensors[key]
            with h5py.File(runs_from, "r") as src:
                src.copy(src["runs"], tensors, name=key)
        g.attrs["n_done"] = np.int64(n + 1)  # the row counts only once this is written
        self.f.flush()

    def finish(self, complete: bool) -> None:
        if complete:
            self.f.attrs["complete"] = True
        self.f.flush()

    def close(self) -> None:
        if self.f:
            self.f.close()


def _open_sweep(path: Path, mode: str):
    import h5py

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
    if f.attrs.get("format") != FORMAT:
        f.close()
        raise TracerError(f"{path} is not a tracer sweep file (no format={FORMAT!r} attribute); "
                          "choose another --output")
    try:
        version = int(f.attrs.get("format_version"))
    except (TypeError, ValueError):
        version = None
    if version not in READ_VERSIONS:
        f.close()
        raise TracerError(f"{path} has sweep format_version {version}; this tracer reads "
                          f"{', '.join(map(str, READ_VERSIONS))}; use a matching tracer")
    return f


def _result_from_file(f: Any, path: str) -> SweepResult:
    g = f["sweep"]
    n = int(g.attrs["n_done"])
    cols = {name: (g[name][:n] if name in g else np.zeros((0,))) for name in (*ROW_FIELDS, *MATRIX_FIELDS)}
    rows = [SweepRow.from_dict({name: col[i].tolist() for name, col in cols.items()}) for i in range(n)]
    return SweepResult(params=json.loads(g.attrs["params"]), points=json.loads(g.attrs["points"]),
                       kinds=json.loads(g.attrs["kinds"]), rows=rows, path=path,
                       complete=bool(f.attrs.get("complete", False)))


def read_sweep(path: str | Path) -> SweepResult:
    """Read a sweep file (finished or not) into a :class:`SweepResult`.

    Raises:
        TracerError: missing file, not a sweep file, unknown format version.
    """
    p = check_input_file(path, "sweep file")  # a FIFO or device would block the read
    f = _open_sweep(p, "r")
    try:
        return _result_from_file(f, str(p))
    finally:
        f.close()


def is_sweep_file(path: str | Path) -> bool:
    """True if ``path`` is an HDF5 file with ``format = "tracer-sweep"``."""
    import h5py

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # never open a FIFO or device: it would block
            return False
        with h5py.File(path, "r") as f:
            return f.attrs.get("format") == FORMAT
    except Exception:  # noqa: BLE001 - any unreadable file is "not a sweep file"
        return False

