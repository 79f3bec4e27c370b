"""Sweeps: one scenario over many prompt lengths (and KV block sizes), one summary row per point.

``tracer sweep`` loads the model once and runs the scenario for every prompt length ``N`` in
``--lengths`` (prefixes of one long prompt) and every block size in ``--block-sizes``, keeping
only a small summary per point (first divergent capture point, per-point diff counts, logits
max |diff|, argmax flips). Each finished point is appended to an HDF5 *sweep file* and flushed,
so an interrupted sweep continues where it stopped when re-run with the same output. The file
layout (``format = "tracer-sweep"``) is specified in ``traces/README.md``.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from .errors import TracerError

FORMAT = "tracer-sweep"
FORMAT_VERSION = 1
READ_VERSIONS = (1,)
#: per-row 1-D datasets of ``/sweep`` (name → numpy dtype)
ROW_FIELDS = {
    "length": np.int64,            # N, prompt tokens
    "block_size": np.int64,        # KV block size in tokens
    "split_at": np.int64,          # P, first compared position
    "n_positions": np.int64,       # N - P compared positions
    "first_divergent": np.int64,   # index into the `points` attribute; -1 = bit-identical
    "last_layer_fraction": np.float64,  # differing fraction of the last decoder layer output
    "logits_max_abs_diff": np.float64,  # max |logit_A - logit_B| over the compared positions
    "argmax_flips": np.int64,      # compared positions whose top-1 token differs
    "wall_s": np.float64,          # seconds this point took (not part of the result)
}
#: per-row 2-D datasets of ``/sweep``, one column per capture point (logits last)
MATRIX_FIELDS = {"n_diff": np.int64, "n_total": np.int64, "max_abs_diff": np.float64}


# ---------------------------------------------------------------- parsing the axes


#: the largest value and the most values one --lengths / --block-sizes list may hold
MAX_VALUE = 1 << 24
MAX_POINTS = 100_000


def parse_int_list(spec: str, what: str = "--lengths") -> list[int]:
    """Expand ``"17:512"``, ``"16:1024:8"``, ``"100,200,300"`` or a mix (``"17:64,100"``).

    A range is ``start:stop[:step]`` with **stop inclusive** (``17:512`` is 17, 18, ..., 512;
    ``16:64:16`` is 16, 32, 48, 64); step defaults to 1. Duplicates are dropped, order kept.

    Raises:
        TracerError: malformed item, step < 1, stop < start, a value < 1, or an empty list.
    """
    out: list[int] = []
    seen: set[int] = set()
    for item in str(spec).split(","):
        item = item.strip()
        if not item:
            continue
        parts = item.split(":")
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            raise TracerError(f"{what} item {item!r} is not an int or start:stop[:step] range; e.g. 17:512 or 64,128") from None
        if len(nums) == 1:
            values = nums
        elif len(nums) in (2, 3):
            start, stop, step = nums[0], nums[1], (nums[2] if len(nums) == 3 else 1)
            if step < 1 or stop < start:
                raise TracerError(f"{what} range {item!r} must have start <= stop and step >= 1 (stop is inclusive)")
            if stop > MAX_VALUE or (stop - start) // step >= MAX_POINTS:  # before anything is allocated
                raise TracerError(f"{what} range {item!r} is too large: at most {MAX_POINTS} values up to {MAX_VALUE}")
            values = list(range(start, stop + 1, step))
        else:
            raise TracerError(f"{what} item {item!r} has too many ':'; use start:stop[:step]")
        for v in values:
            if not 1 <= v <= MAX_VALUE:
                raise TracerError(f"{what} holds {v if len(str(v)) < 24 else str(v)[:12] + '...'}; values must be positive, at most {MAX_VALUE}")
            if v not in seen:
                seen.add(v)
                out.append(v)
    if not out:
        raise TracerError(f"{what} is empty; give e.g. 17:512 or 64,128")
    return out


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


@dataclass(frozen=True)
class SweepRow:
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
    wall_s: float = field(default=0.0, compare=False)

    @property
    def diverged(self) -> bool:
        return self.first_divergent >= 0


@dataclass
class SweepResult:
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

    def summary_lines(self) -> list[str]:
        """A few lines for people: per block size, which lengths diverge, from where, how much."""
        lines = []
        for b in self.params.get("block_sizes", []):
            rows = [r for r in self.rows if r.block_size == b]
            if not rows:
                lines.append(f"block size {b}: no finished points")
                continue
            div = [r for r in rows if r.diverged]
            flips = [r for r in rows if r.argmax_flips]
            lines.append(f"block size {b}: {len(div)} of {len(rows)} lengths diverge, "
                         f"{len(flips)} with argmax flips")
            if div:
                lines.append(f"  diverging lengths: {compress_ranges([r.length for r in div])}")
                counts: dict[str, int] = {}
                for r in div:
                    name = self.point_name(r.first_divergent) or "?"
                    counts[name] = counts.get(name, 0) + 1
                common = sorted(counts.items(), key=lambda kv: (-kv[1], self.points.index(kv[0]) if kv[0] in self.points else 0))
                lines.append("  first divergent at: " + ", ".join(f"{n} ({c})" for n, c in common[:6])
                             + (f", ... ({len(common)} points)" if len(common) > 6 else ""))
                worst = max(div, key=lambda r: r.logits_max_abs_diff)
                lines.append(f"  max |logit diff| {worst.logits_max_abs_diff:.4g} at N={worst.length}; "
                             f"last-layer differing fraction up to {max(r.last_layer_fraction for r in div):.3g}")
            if flips:
                lines.append(f"  argmax flips at: {compress_ranges([r.length for r in flips])}")
        return lines

    def to_pandas(self):
        """One DataFrame row per finished point: the scalar fields plus ``first_divergent_name``.

        Raises:
            TracerError: pandas is not installed.
        """
        from .frames import pandas

        pd = pandas()
        recs = []
        for r in self.rows:
            recs.append({
                "length": r.length, "block_size": r.block_size, "split_at": r.split_at,
                "n_positions": r.n_positions, "diverged": r.diverged,
                "first_divergent": self.point_name(r.first_divergent),
                "first_divergent_index": r.first_divergent,
                "last_layer_fraction": r.last_layer_fraction,
                "logits_max_abs_diff": r.logits_max_abs_diff, "argmax_flips": r.argmax_flips,
                "wall_s": r.wall_s,
            })
        return pd.DataFrame.from_records(recs, columns=[
            "length", "block_size", "split_at", "n_positions", "diverged", "first_divergent",
            "first_divergent_index", "last_layer_fraction", "logits_max_abs_diff", "argmax_flips", "wall_s"])

    def plot(self, **kwargs: Any):
        """The divergence map as a matplotlib Figure (see :func:`tracer.plot.sweep_figure`)."""
        from .plot import sweep_figure

        return sweep_figure(self, **kwargs)

    def __repr__(self) -> str:
        n_div = sum(r.diverged for r in self.rows)
        return f"SweepResult({len(self.rows)} points, {n_div} diverge, path={self.path!r})"


def row_from_comparison(c: Any, *, length: int, block_size: int, wall_s: float) -> tuple[SweepRow, list[str], list[str]]:
    """Summarise a :class:`~tracer.compare.Comparison` into a :class:`SweepRow` (+ point names, kinds)."""
    names = [p.name for p in c.points]
    kinds = [p.kind for p in c.points]
    n_diff = [p.diff.n_diff for p in c.points]
    n_total = [p.diff.n_total for p in c.points]
    mad = [float(p.diff.max_abs_diff) for p in c.points]
    if c.logits is not None:
        names.append(c.logits_name)
        kinds.append("logits")
        n_diff.append(c.logits.tensor.n_diff)
        n_total.append(c.logits.tensor.n_total)
        mad.append(float(c.logits.tensor.max_abs_diff))
    first = next((i for i, n in enumerate(n_diff) if n), -1)
    layer_idx = [i for i, k in enumerate(kinds) if k == "layer"]
    last = layer_idx[-1] if layer_idx else None
    frac = (n_diff[last] / n_total[last]) if last is not None and n_total[last] else 0.0
    row = SweepRow(
        length=int(length), block_size=int(block_size), split_at=int(c.positions[0]),
        n_positions=int(c.positions[1] - c.positions[0]), first_divergent=first,
        n_diff=tuple(n_diff), n_total=tuple(n_total), max_abs_diff=tuple(mad),
        last_layer_fraction=float(frac),
        logits_max_abs_diff=float(c.logits.tensor.max_abs_diff) if c.logits is not None else 0.0,
        argmax_flips=len(c.logits.argmax_flips) if c.logits is not None else 0,
        wall_s=float(wall_s),
    )
    return row, names, kinds


# ---------------------------------------------------------------- the sweep file


def default_output(model: str, scenario: str, root: str | Path = "traces") -> Path:
    """``traces/sweep-<model>-<scenario>.h5``: a fixed name, so re-running a sweep resumes it."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("_") or "model"
    return Path(root) / f"sweep-{safe}-{scenario}.h5"


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
            from . import __version__

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
            TracerError: the point's capture points differ from the earlier points'.
        """
        from .integrity import check_space

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
    rows = []
    for i in range(n):
        rows.append(SweepRow(
            length=int(cols["length"][i]), block_size=int(cols["block_size"][i]),
            split_at=int(cols["split_at"][i]), n_positions=int(cols["n_positions"][i]),
            first_divergent=int(cols["first_divergent"][i]),
            n_diff=tuple(int(x) for x in cols["n_diff"][i]), n_total=tuple(int(x) for x in cols["n_total"][i]),
            max_abs_diff=tuple(float(x) for x in cols["max_abs_diff"][i]),
            last_layer_fraction=float(cols["last_layer_fraction"][i]),
            logits_max_abs_diff=float(cols["logits_max_abs_diff"][i]),
            argmax_flips=int(cols["argmax_flips"][i]), wall_s=float(cols["wall_s"][i]),
        ))
    return SweepResult(params=json.loads(g.attrs["params"]), points=json.loads(g.attrs["points"]),
                       kinds=json.loads(g.attrs["kinds"]), rows=rows, path=path,
                       complete=bool(f.attrs.get("complete", False)))


def read_sweep(path: str | Path) -> SweepResult:
    """Read a sweep file (finished or not) into a :class:`SweepResult`.

    Raises:
        TracerError: missing file, not a sweep file, unknown format version.
    """
    from .files import check_input_file

    p = check_input_file(path, "sweep file")  # a FIFO or device would block the read
    f = _open_sweep(p, "r")
    try:
        return _result_from_file(f, str(p))
    finally:
        f.close()


def is_sweep_file(path: str | Path) -> bool:
    """True if ``path`` is an HDF5 file with ``format = "tracer-sweep"``."""
    import h5py
    import stat

    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # never open a FIFO or device: it would block
            return False
        with h5py.File(path, "r") as f:
            return f.attrs.get("format") == FORMAT
    except Exception:  # noqa: BLE001 - any unreadable file is "not a sweep file"
        return False


# ---------------------------------------------------------------- running a sweep


def plan_points(lengths: list[int], block_sizes: list[int]) -> list[tuple[int, int]]:
    """The ``(length, block_size)`` grid in run order: block size outer, length inner."""
    return [(n, b) for b in block_sizes for n in lengths]


def sweep(model: str = "smollm2-135m", *, lengths: str | list[int] = "17:512",
          block_sizes: str | list[int] = (16,), scenario: str = "prefix-cache",
          mitigation: str | None = None, prompt: str | None = None, prompt_file: str | None = None,
          token_ids: list[int] | None = None, token_ids_file: str | None = None, chat: bool = False,
          dtype: str = "bfloat16", device: str | None = None, attn: str = "sdpa", gguf: str | None = None,
          granularity: str = "layers", output: str | Path | None = None, store: bool = True,
          overwrite: bool = False, keep_tensors: bool = False, loaded: Any = None,
          progress: bool = True, on_point: Callable[[SweepRow], None] | None = None) -> SweepResult:
    """Run ``scenario`` for every prompt length × block size; one summary row per point.

    The prompts are prefixes of one token sequence: the text prompt (default: the built-in one)
    tokenized and repeated to the longest length, or the ids of ``token_ids``/``token_ids_file``
    (which must be at least that long). Each point is an in-memory :func:`tracer.api.run`
    (``store=False``) on the model loaded once.

    Args:
        lengths: prompt lengths N: ``"17:512"`` (start:stop[:step], stop inclusive), ``"64,128"``,
            or a list of ints. Every N must exceed every block size (a cache hit needs one full block).
        block_sizes: KV block sizes, same syntax (``"16,32,64"``) or a list.
        output: the sweep file (default ``traces/sweep-<model>-<scenario>.h5``). An existing
            sweep file with the same parameters is resumed; with other parameters it is an error
            unless ``overwrite``. ``store=False`` keeps everything in memory.
        keep_tensors: also store both runs' captured tensors of every point (large).
        on_point: called with each finished row (after it is flushed).

    Returns:
        a :class:`SweepResult` with every row of the file (earlier sessions' rows included).

    Raises:
        TracerError: bad axes, prompt too short, a file of other parameters, and every bad input
            of :func:`tracer.api.run` (checked before the model is loaded).
    """
    import time

    from . import models as _models
    from .api import read_prompt, run, tokenize
    from .capture import GRANULARITIES
    from .scenarios import SCENARIOS, check_mitigation
    from .store import collect_environment

    ns = parse_int_list(lengths, "--lengths") if isinstance(lengths, str) else [int(x) for x in lengths]
    bs = parse_int_list(block_sizes, "--block-sizes") if isinstance(block_sizes, str) else [int(x) for x in block_sizes]
    if not ns or not bs:
        raise TracerError("a sweep needs at least one length and one block size")
    if min(bs) < 1:
        raise TracerError(f"--block-size must be a positive number of tokens, got {min(bs)}")
    if min(ns) <= max(bs):
        raise TracerError(f"--lengths starts at {min(ns)}, but a cache hit needs more than one KV block "
                          f"({max(bs)} tokens); start the lengths at {max(bs) + 1} or more")
    if scenario not in SCENARIOS:
        raise TracerError(f"unknown scenario '{scenario}'; use one of: {', '.join(SCENARIOS)}")
    if granularity not in GRANULARITIES:
        raise TracerError(f"unknown granularity '{granularity}'; use one of: {', '.join(GRANULARITIES)}")
    check_mitigation(mitigation)
    text, ids = (None, list(token_ids)) if token_ids is not None else read_prompt(prompt, prompt_file, token_ids_file)
    if ids is not None and len(ids) < max(ns):
        raise TracerError(f"the token ids hold {len(ids)} tokens but --lengths goes up to {max(ns)}; "
                          "give a longer --token-ids-file or lower the lengths")
    if loaded is None:
        _models.resolve_dtype(dtype)
        dev = _models.resolve_device(device)
        _models.check_attn(attn)
    out = None
    if store:
        from .integrity import check_name_length

        out = check_name_length(output if output is not None else default_output(model, scenario), "--output")
        if out.is_dir():
            raise TracerError(f"--output {out} is a directory; give a file path ending in .h5")
        from .integrity import check_output_path

        check_output_path(out, overwrite, "--output", resume=True)  # before is_sweep_file opens it
        if out.exists() and not overwrite and not is_sweep_file(out):
            raise TracerError(f"{out} exists and is not a sweep file; choose another --output")

    if loaded is None:
        loaded = _models.load_model(model, dtype=dtype, device=dev, attn=attn, gguf=gguf, progress=progress)
    info = loaded.info
    all_ids = tokenize(loaded.tokenizer, text, ids, chat=chat, vocab_size=info.vocab_size, length=max(ns))
    params = {
        "model": info.name, "scenario": scenario, "mitigation": mitigation, "granularity": granularity,
        "dtype": info.dtype, "device": info.device, "attn": info.attn_implementation,
        "lengths": ns, "block_sizes": bs, "keep_tensors": bool(keep_tensors),
        "prompt_sha256": hashlib.sha256(json.dumps(all_ids).encode()).hexdigest(),
    }
    header = collect_environment(info.device, extra={"model": info.to_dict(), "sweep": params})
    sf = SweepFile(out, params, header, overwrite=overwrite) if store else None
    try:
        done = sf.done() if sf is not None else set()
        rows: list[SweepRow] = []
        names: list[str] = []
        kinds: list[str] = []
        todo = [pt for pt in plan_points(ns, bs) if pt not in done]
        with _progress(progress, len(done), len(done) + len(todo)) as advance:
            for n, b in todo:
                t0 = time.perf_counter()
                kw = dict(loaded=loaded, token_ids=all_ids[:n], scenario=scenario, block_size=b,
                          mitigation=mitigation, granularity=granularity, progress=False)
                tmp = sf.path.with_name(f".{sf.path.stem}.point-{os.getpid()}.h5") if keep_tensors and sf else None
                try:  # tensors go through a temporary trace, copied into the sweep file
                    res = run(info.name, store="tensors" if tmp else "none", output=tmp, overwrite=True, **kw)
                    row, names, kinds = row_from_comparison(res.comparison, length=n, block_size=b,
                                                            wall_s=time.perf_counter() - t0)
                    if sf is not None:
                        sf.append(row, names, kinds, runs_from=tmp)
                finally:
                    if tmp is not None and tmp.exists():
                        tmp.unlink()
                rows.append(row)
                advance(n, b, row)
                if on_point is not None:
                    on_point(row)
        if sf is not None:
            sf.finish(complete=True)
            return sf.result()
        return SweepResult(params=params, points=names, kinds=kinds, rows=rows, complete=True)
    finally:
        if sf is not None:
            sf.close()


class _progress:
    """A rich progress bar with ETA on stderr (or nothing), yielding ``advance(n, b, row)``."""

    def __init__(self, enabled: bool, done: int, total: int) -> None:
        self.enabled, self.done, self.total = enabled, done, total

    def __enter__(self) -> Callable[[int, int, SweepRow], None]:
        if not self.enabled:
            return lambda n, b, row: None
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.bar = Progress(TextColumn("[bold]sweep"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                            console=Console(stderr=True), transient=False)
        self.bar.__enter__()
        self.task = self.bar.add_task("", total=self.total, completed=self.done)

        def advance(n: int, b: int, row: SweepRow) -> None:
            state = "[red]diverges[/]" if row.diverged else "[green]identical[/]"
            self.bar.update(self.task, advance=1, description=f"N={n} b={b} {state}")

        return advance

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self.bar.__exit__(*exc)


def iter_rows(result: SweepResult, block_size: int | None = None) -> Iterator[SweepRow]:
    """Rows of ``result`` at ``block_size`` (all when None), sorted by length."""
    yield from sorted((r for r in result.rows if block_size is None or r.block_size == block_size),
                      key=lambda r: (r.block_size, r.length))
