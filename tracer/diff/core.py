"""Aligning two runs and comparing them capture point by capture point.

The comparison streams: it holds one capture point's two tensors at a time, whether they come
from in-memory :class:`~tracer.execute.records.RunRecord` objects or from a stored trace.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator

import torch

from tracer.diff.dataflow import Consumes, dataflow
from tracer.errors import TracerError
from tracer.diff.metrics import DiffBatch, LogitsAccumulator, LogitsDiff, TensorDiff, amplification, logits_diff
from tracer.execute.records import RunRecord
from tracer.load.contract import attention_facts, contract_differences
from tracer.diff.positions import PositionStats
from tracer.diff.provenance import class_text, classify, kernel_rows

#: the rules of ``--fail-on`` (None: report only)
FAIL_ON = ("any", "flip", "tolerance")
#: how a difference of NaN payloads alone (NaN at the same elements in both runs) is reported
NAN_PAYLOAD = "NaN in both runs (payload differs)"


@dataclass(frozen=True)
class PointResult:
    """The comparison at one capture point.

    Attributes:
        name: HF module path.
        kind, op: capture kind and module class.
        diff: the metrics (:class:`~tracer.diff.metrics.TensorDiff`).
        amplification: ``max_abs_diff`` divided by the first divergent point's ``max_abs_diff``
            (None before divergence starts).
        calls_a, calls_b: the shapes the module saw in each run (see ``CaptureRecord.calls``).
        growth: layer-to-layer amplification: ``max_abs_diff`` divided by that of the same
            point in the previous decoder layer (``model.layers.4.mlp`` over
            ``model.layers.3.mlp``; a layer over the previous layer); None outside the layers,
            for layer 0, or when the previous one did not differ.
        consumes: the capture points it consumes (:mod:`tracer.diff.dataflow`).
        origin: True when it differs although everything it consumed was bit-identical.
        differing_inputs: the consumed points that differed (why it is *propagated*).
        n_diff_prefix: for ``kv_cache`` points: differing elements at positions before the
            compared window (computed by an earlier forward pass); None for other points.
        n_outside_tol: elements outside ``atol + rtol * |a|`` (None when no tolerance was given).
    """

    name: str
    kind: str
    op: str
    diff: TensorDiff
    amplification: float | None = None
    calls_a: list[dict[str, Any]] = field(default_factory=list)
    calls_b: list[dict[str, Any]] = field(default_factory=list)
    growth: float | None = None
    consumes: Consumes = Consumes(points=())
    origin: bool = False
    differing_inputs: tuple[str, ...] = ()
    n_diff_prefix: int | None = None
    n_outside_tol: int | None = None

    @property
    def diverged(self) -> bool:
        return self.diff.n_diff > 0

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "kind": self.kind, "op": self.op}
        d.update(self.diff.to_dict())
        d["fraction"] = self.diff.n_diff / self.diff.n_total if self.diff.n_total else 0.0
        d["amplification"] = self.amplification
        d["growth"] = self.growth
        d["origin"] = self.origin
        d["consumes"] = self.consumes.to_dict()
        d["differing_inputs"] = list(self.differing_inputs)
        d["n_diff_prefix"] = self.n_diff_prefix
        d["n_outside_tol"] = self.n_outside_tol
        d["shapes_a"] = self.calls_a
        d["shapes_b"] = self.calls_b
        return d


@dataclass(frozen=True)
class SkipRecord:
    """A capture point that could not be compared, kept in the result (never dropped).

    Attributes:
        name, kind: the capture point.
        reason: one line, e.g. ``missing in run B`` or ``empty in run A``.
        fails: True when it makes the comparison not identical (``--fail-on any`` fails); False
            only for a ``kv_cache`` point empty in a run that keeps no KV cache (it recomputes).
    """

    name: str
    kind: str
    reason: str
    fails: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "reason": self.reason, "fails": self.fails}


def skip_record(name: str, kind: str, run: str, missing: bool) -> SkipRecord:
    """The :class:`SkipRecord` of a point missing (or empty) in ``run``: failing, except a KV cache
    left empty by a run that recomputes without one."""
    if missing:
        return SkipRecord(name, kind, f"missing in run {run}")
    if kind == "kv_cache":
        return SkipRecord(name, kind, f"no KV cache in run {run} (it keeps none)", fails=False)
    return SkipRecord(name, kind, f"empty in run {run}")


@dataclass(frozen=True)
class Comparison:
    """Run A versus run B of one scenario: the amplification table as data.

    Attributes:
        scenario, model: names, for the report.
        positions: ``(first, last + 1)``: the compared absolute token positions.
        run_a, run_b: run names.
        points: one :class:`PointResult` per non-logits capture point, in execution order.
        logits_name: the logits capture point (HF path of the LM head), or None if not captured.
        logits: :class:`~tracer.diff.metrics.LogitsDiff` of the logits, or None.
        trace: the trace file path, if stored.
        facts: short facts for the report header (:func:`run_facts`).
        logits_amplification: the logits' max abs diff over the first divergent point's (None
            when nothing before the logits differs).
        per_position: max |A − B| and differing count per capture point and compared position
            (:meth:`tracer.diff.positions.PositionStats.result`; the position heat map's data), or None.
        rl: ``rollout-vs-train``: the RL metrics (:class:`tracer.diff.rl.RLComparison`), else None.
    """

    scenario: str
    model: str
    positions: tuple[int, int]
    run_a: str
    run_b: str
    points: tuple[PointResult, ...]
    logits_name: str | None
    logits: LogitsDiff | None
    logits_calls: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
    trace: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    logits_origin: bool = False
    logits_n_outside_tol: int | None = None
    atol: float | None = None
    rtol: float | None = None
    replay: Any = None
    noise: Any = None
    fail_on: str | None = None
    logits_amplification: float | None = None
    per_position: dict[str, Any] | None = None
    op_replay: Any = None  # capture name -> tracer.diff.accuracy.OpReplay (origins replayed in float64)
    skipped: tuple[SkipRecord, ...] = ()
    rl: Any = None  # tracer.diff.rl.RLComparison of a rollout-vs-train run

    @property
    def not_compared(self) -> tuple[SkipRecord, ...]:
        """The skipped points that count against identity (missing or empty in one run)."""
        return tuple(s for s in self.skipped if s.fails)

    @property
    def origins(self) -> tuple[PointResult, ...]:
        """The origin points in execution order (the logits are an origin via :attr:`logits_origin`)."""
        return tuple(p for p in self.points if p.origin)

    def origin_lines(self) -> list[str]:
        """One line per origin: op type, shapes in both runs, how much differs (see :func:`origin_line`)."""
        lines = [origin_line(p, self) for p in self.origins]
        if self.logits_origin and self.logits is not None:
            lines.append(origin_line(PointResult(self.logits_name or "logits", "logits", "LM head", self.logits.tensor,
                                                 calls_a=self.logits_calls[0], calls_b=self.logits_calls[1]), self))
        return lines

    def check(self, fail_on: str | None = "default") -> tuple[bool, str]:
        """Judge the comparison by a ``--fail-on`` rule.

        Args:
            fail_on: the rule (default: the comparison's own ``fail_on``). None (report only: always passes), ``any`` (fails on any bitwise
                difference), ``flip`` (fails on an argmax flip at the logits), ``tolerance``
                (fails when an element of any capture point or the logits lies outside
                ``atol + rtol * |a|``; needs the comparison made with a tolerance).

        Returns:
            ``(failed, one-line reason)``.

        Raises:
            TracerError: unknown rule, or ``tolerance`` without atol/rtol.
        """
        if fail_on == "default":
            fail_on = self.fail_on
        check_fail_on(fail_on, self.atol, self.rtol)
        if fail_on is None:
            return False, "report only (no --fail-on)"
        if fail_on == "any":
            if self.first_divergent is None and self.nan_point is not None:
                return True, f"NaN in both runs, first at {self.nan_point} (bit-identical, but not a number)"
            if self.not_compared:
                s = self.not_compared[0]
                return True, f"{len(self.not_compared)} capture point(s) not compared, first {s.name} ({s.reason})"
            return (not self.identical), ("bit-identical" if self.identical else f"differs from {self.first_divergent}")
        if fail_on == "flip":
            flips = len(self.logits.argmax_flips) if self.logits is not None else 0
            return flips > 0, f"{flips} argmax flip{'s' if flips != 1 else ''}"
        bad = [(p.name, p.n_outside_tol) for p in self.points if p.n_outside_tol]
        if self.logits_n_outside_tol:
            bad.append((f"{self.logits_name} (logits)", self.logits_n_outside_tol))
        tol = f"atol {self.atol or 0:g}, rtol {self.rtol or 0:g}"
        if not bad:
            return False, f"every capture point within {tol}"
        return True, f"{len(bad)} capture point(s) outside {tol}, first {bad[0][0]} ({bad[0][1]} elements)"

    @property
    def first_divergent(self) -> str | None:
        """The first capture point in execution order with a bitwise difference (logits included)."""
        for p in self.points:
            if p.diverged:
                return p.name
        if self.logits is not None and self.logits.tensor.n_diff:
            return self.logits_name
        return None

    @property
    def nan_point(self) -> str | None:
        """The first capture point (logits included) holding a NaN in either run, or None."""
        for p in self.points:
            if p.diff.has_nan:
                return p.name
        if self.logits is not None and self.logits.tensor.has_nan:
            return self.logits_name
        return None

    @property
    def identical(self) -> bool:
        """No bitwise difference and no point missing or empty in one run."""
        return self.first_divergent is None and not self.not_compared

    @property
    def n_positions(self) -> int:
        return self.positions[1] - self.positions[0]

    def verdict(self) -> str:
        """One line: ``bit-identical ...`` or ``diverges from X, K argmax flips in T positions``."""
        n_points = len(self.points) + (self.logits is not None)
        if self.first_divergent is None and self.not_compared:
            s = self.not_compared[0]
            return (f"NOT comparable: {len(self.not_compared)} capture point(s) missing or empty in one run "
                    f"(first {s.name}: {s.reason}); the {n_points} compared points agree bit for bit")
        nan = self.nan_point
        if self.identical and nan is not None:
            return (f"NaN: both runs hold NaN from {nan} on (the {n_points} capture points agree bit for bit, "
                    "but the values are not numbers)")
        if self.identical:
            return (f"bit-identical: all {n_points} capture points agree bit for bit at positions "
                    f"{self.positions[0]}..{self.positions[1] - 1}")
        flips = len(self.logits.argmax_flips) if self.logits is not None else 0
        tail = f", {flips} argmax flip{'s' if flips != 1 else ''} in {self.n_positions} positions"
        first = next((p.diff for p in self.points if p.name == self.first_divergent), None)
        if first is None and self.logits is not None and self.first_divergent == self.logits_name:
            first = self.logits.tensor
        what = f": {NAN_PAYLOAD}" if first is not None and first.nan_payload_only else ""
        return f"diverges from {self.first_divergent}{what}{tail if self.logits is not None else ''}"

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of ``tracer run --format json``."""
        logits = None
        if self.logits is not None:
            lt = self.logits
            logits = {
                "name": self.logits_name,
                **lt.tensor.to_dict(),
                "argmax_flips": len(lt.argmax_flips),
                "positions": lt.n_positions,
                "flips": [
                    {**f.to_dict(), "position": self.positions[0] + f.position} for f in lt.argmax_flips
                ],
                **{k: v for k, v in lt.to_dict().items() if k not in ("tensor", "argmax_flips", "n_positions")},
            }
        if logits is not None:
            logits["origin"] = self.logits_origin
            logits["n_outside_tol"] = self.logits_n_outside_tol
        origins = [origin_record(p, self) for p in self.origins]
        if self.logits_origin and self.logits is not None:
            origins.append({"name": self.logits_name, "op": "LM head", "text": self.origin_lines()[-1]})
        return {
            "scenario": self.scenario,
            "model": self.model,
            "positions": list(self.positions),
            "runs": [self.run_a, self.run_b],
            "origins": origins,
            "layers": [dict(p.to_dict(), kernels_a=kernel_rows(p.calls_a, self.positions),
                            kernels_b=kernel_rows(p.calls_b, self.positions),
                            **{"class": (classify(p, self.positions) or {}).get("class")}) for p in self.points],
            "logits": logits,
            "first_divergent": self.first_divergent,
            "skipped": [s.to_dict() for s in self.skipped],
            "identical": self.identical,
            "verdict": self.verdict(),
            "tolerance": {"atol": self.atol, "rtol": self.rtol},
            "check": dict(zip(("failed", "reason"), self.check()), fail_on=self.fail_on),
            "replay": self.replay.to_dict() if self.replay is not None else None,
            "noise_verdict": self.noise.to_dict() if self.noise is not None else None,
            "trace": self.trace,
            "facts": self.facts,
            "per_position": self.per_position,
            "rl": self.rl.to_dict() if self.rl is not None else None,
        }


def _pairs_from_records(a: RunRecord, b: RunRecord) -> Iterator[tuple[str, str, str, torch.Tensor, torch.Tensor, list, list]]:
    for name, ra in a.captures.items():
        rb = b.captures.get(name)
        if rb is None:
            continue
        yield name, ra.kind, ra.op, ra.tensor, rb.tensor, ra.calls, rb.calls


def missing_points(kinds_a: dict[str, str], kinds_b: dict[str, str], run_a: str, run_b: str) -> list[SkipRecord]:
    """A :class:`SkipRecord` for every capture point of one run absent from the other
    (``kinds_x``: capture name → kind, in execution order)."""
    out = [skip_record(n, k, run_b, missing=True) for n, k in kinds_a.items() if n not in kinds_b]
    return out + [skip_record(n, k, run_a, missing=True) for n, k in kinds_b.items() if n not in kinds_a]


def check_alignable(name_a: str, ids_a: list[int], window_a, name_b: str, ids_b: list[int], window_b) -> None:
    """Refuse to compare runs of different prompts or windows.

    Raises:
        TracerError: different token ids or compared windows.
    """
    if list(ids_a) != list(ids_b):
        first = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
        raise TracerError(
            f"runs {name_a} and {name_b} processed different token ids ({len(ids_a)} vs {len(ids_b)} tokens, "
            f"first difference at position {first}); compare runs of the same prompt"
        )
    if tuple(window_a) != tuple(window_b):
        raise TracerError(
            f"runs {name_a} and {name_b} kept different positions ({list(window_a)} vs {list(window_b)}); "
            "compare runs of the same scenario"
        )


def check_fail_on(fail_on: str | None, atol: float | None, rtol: float | None) -> None:
    """Validate ``--fail-on`` and the tolerances (before any model is loaded).

    Raises:
        TracerError: unknown rule, negative/NaN tolerance, or ``tolerance`` without atol/rtol.
    """
    if fail_on is not None and fail_on not in FAIL_ON:
        raise TracerError(f"unknown --fail-on '{fail_on}'; use one of: {', '.join(FAIL_ON)}")
    for opt, v in (("--atol", atol), ("--rtol", rtol)):
        if v is not None and not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
            raise TracerError(f"{opt} {v} is not a finite number >= 0; give e.g. {opt} 1e-3")
    if fail_on == "tolerance" and atol is None and rtol is None:
        raise TracerError("--fail-on tolerance needs --atol and/or --rtol (e.g. --atol 1e-2)")


def _prefix_rows(kind: str, calls: list, window_start: int) -> int | None:
    """Rows of a ``kv_cache`` tensor that lie before the compared window (None for other kinds)."""
    if kind != "kv_cache" or not calls:
        return None
    first = int(calls[-1]["positions"][0])
    return max(0, window_start - first)


@dataclass(frozen=True)
class RowBlocks:
    """A capture point read in row blocks, in place of its two tensors in :func:`compare_pairs`'s
    pairs (a point larger than memory, streamed from a trace).

    The pair's ``tensor_a`` is a RowBlocks whose ``blocks`` yields ``(first row, rows of A, rows
    of B)`` front to back (same rows on both sides, on the compute device); ``tensor_b`` is a
    RowBlocks of run B's shape and dtype with ``blocks`` None. The blocks' buffers may be reused
    after the next block is requested: nothing of a block is kept.

    Attributes:
        shape: the whole tensor's shape ``(rows, *feature)``.
        dtype: its torch dtype.
        blocks: the iterator of blocks (side A), or None (side B).
        equal_hint: the runs' stored CRC-32s of the point are equal, so its bits are probably
            equal: each block's bits are compared as integers and, if all agree, the point is
            recorded as equal without float64 work (the numbers a full comparison gives).
        reread: a function giving the blocks again (fresh buffers), for the one case the hint is
            wrong (two different tensors with one CRC-32): the point is then compared in full.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    blocks: Iterator[tuple[int, torch.Tensor, torch.Tensor]] | None = None
    equal_hint: bool = False
    reread: Callable[[], Iterator[tuple[int, torch.Tensor, torch.Tensor]]] | None = None

    def numel(self) -> int:
        return math.prod(self.shape)


def _equal_pair(batch: DiffBatch, kind: str, ta: RowBlocks, split: int | None
                ) -> tuple[int, LogitsAccumulator | None, torch.device] | None:
    """Check a pair hinted equal block by block (bits as integers, NaN/inf counted only where the
    bits show some); when every block agrees, record it with :meth:`DiffBatch.add_equal` and return
    ``(index, logits accumulator, device)``; else read its remaining blocks (their CRC-32 checks)
    and return None."""
    from tracer.diff.metrics import bits_equal, has_nonfinite

    shape = tuple(ta.shape)
    acc = LogitsAccumulator(shape[1]) if kind == "logits" and len(shape) == 2 else None
    n_nan = n_inf = 0
    device = torch.device("cpu")
    for _r0, xa, xb in ta.blocks:
        device = xa.device
        if not bits_equal(xa, xb):
            for _ in ta.blocks:
                pass
            return None
        if has_nonfinite(xa):
            n_nan += int(torch.isnan(xa).sum())
            n_inf += int(torch.isinf(xa).sum())
            if acc is not None:
                acc.add(xa, xb)  # rows with a NaN/inf: as any
        elif acc is not None:
            acc.add_equal(xa.shape[0])
    return batch.add_equal(math.prod(shape), n_nan, n_inf, split=split), acc, device


def _stream_pair(batch: DiffBatch, stats: PositionStats, name: str, kind: str, ta: RowBlocks,
                 split_rows: int | None) -> tuple[int, LogitsAccumulator | None]:
    """Feed a pair given in row blocks to the batch, the per-position statistics and (logits) a
    :class:`LogitsAccumulator`; returns its batch index and the accumulator."""
    shape = tuple(ta.shape)
    row = math.prod(shape[1:]) if shape else 1
    split = split_rows * row if split_rows else None
    pos = stats.rows(name, kind, shape, ta.dtype)
    blocks = ta.blocks
    if ta.equal_hint:
        equal = _equal_pair(batch, kind, ta, split)
        if equal is not None:
            index, acc, device = equal
            if pos is not None:
                pos.equal(device)
                pos.finish()
            return index, acc
        blocks = ta.reread()  # the hint was wrong: compare the point in full, read again
    acc = LogitsAccumulator(shape[1]) if kind == "logits" and len(shape) == 2 else None
    index = None
    for r0, xa, xb in blocks:
        if index is None:
            index = batch.add(xa, xb, split=split, more=True)
        else:
            batch.extend(index, xa, xb)
        if pos is not None:
            pos.add(r0, xa, xb)
        if acc is not None:
            acc.add(xa, xb)
    if index is None:  # no rows: an empty pair
        empty = torch.empty(shape, dtype=ta.dtype)
        index = batch.add(empty, empty, split=split)
    batch.close(index)
    if pos is not None:
        pos.finish()
    return index, acc


def compare_pairs(pairs: Iterable[tuple[str, str, str, torch.Tensor, torch.Tensor, list, list]], *,
                  scenario: str, model: str, positions: tuple[int, int], run_a: str = "A",
                  run_b: str = "B", trace: str | None = None,
                  facts: dict[str, Any] | None = None, atol: float | None = None,
                  rtol: float | None = None, skipped: Iterable[SkipRecord] = ()) -> Comparison:
    """Compare an ordered stream of ``(name, kind, op, tensor_a, tensor_b, calls_a, calls_b)``.

    Tensors of one pair must have equal shapes ``(T, *feature)``; the logits pair ``(T, vocab)``;
    ``kv_cache`` pairs ``(S, features)`` over all cached positions. The pairs go through one
    :class:`~tracer.diff.metrics.DiffBatch`, which holds at most one chunk's worth of pending
    tensors (only the logits pair is kept until the end, for its per-position statistics).
    Afterwards every differing point is classified origin/propagated (:func:`classify_origins`). ``atol``/``rtol`` (either may be None = 0 when the other is
    given) count the elements outside ``atol + rtol * |a|`` per point. A pair empty in one run
    only, and every point in ``skipped`` (missing in one run), is kept as a :class:`SkipRecord`.

    Raises:
        TracerError: a capture point whose tensors have different shapes or dtypes in the two
            runs, or a bad tolerance.
    """
    check_fail_on(None, atol, rtol)
    tol = None if atol is None and rtol is None else (float(atol or 0.0), float(rtol or 0.0))
    logits_tol = None
    logits = None
    logits_name = None
    logits_calls: tuple[list, list] = ([], [])
    logits_pair = None
    # every pair goes into one batch: kernels for many points at once, and the
    # tensors are released as soon as their chunk is computed (see DiffBatch)
    batch = DiffBatch(tolerance=tol)
    per_position = PositionStats(positions)
    queued: list[tuple[int, str, str, str, list, list, int | None]] = []
    skips = list(skipped)
    logits_acc = None
    for name, kind, op, ta, tb, ca, cb in pairs:
        if (ta.numel() == 0) != (tb.numel() == 0):  # captured in one run only: reported, never dropped
            skips.append(skip_record(name, kind, run_a if ta.numel() == 0 else run_b, missing=False))
            continue
        if tuple(ta.shape) != tuple(tb.shape) or ta.dtype != tb.dtype:
            raise TracerError(
                f"capture point {name} has {tuple(ta.shape)} {ta.dtype} in run {run_a} but {tuple(tb.shape)} "
                f"{tb.dtype} in run {run_b}; the runs used different models or dtypes"
            )
        if isinstance(ta, RowBlocks):  # streamed in row blocks: the same numbers, bounded memory
            index, acc = _stream_pair(batch, per_position, name, kind, ta, _prefix_rows(kind, ca, positions[0]))
            if kind == "logits":
                logits_acc, logits_pair, logits_name, logits_calls = acc, (index, None, None), name, (ca, cb)
            else:
                queued.append((index, name, kind, op, ca, cb, _prefix_rows(kind, ca, positions[0])))
            continue
        per_position.add(name, kind, ta, tb)
        if kind == "logits":  # element-wise statistics in the batch; per-position ones below
            logits_pair = (batch.add(ta, tb), ta, tb)
            logits_name = name
            logits_calls = (ca, cb)
            continue
        rows = _prefix_rows(kind, ca, positions[0])
        split = rows * (ta[0].numel() if ta.dim() else 1) if rows else None
        queued.append((batch.add(ta, tb, split=split), name, kind, op, ca, cb, rows))
        del ta, tb
    diffs = batch.results()
    if logits_acc is not None:
        logits = logits_acc.result(diffs[logits_pair[0]])
        logits_tol = batch.outside_tolerance(logits_pair[0]) if tol is not None else None
    elif logits_pair is not None:
        index, ta, tb = logits_pair
        rows_a = ta.reshape(-1, ta.shape[-1]) if ta.dim() > 1 else ta
        rows_b = tb.reshape(-1, tb.shape[-1]) if tb.dim() > 1 else tb
        logits = logits_diff(rows_a, rows_b, tensor=diffs[index])
        logits_tol = batch.outside_tolerance(index) if tol is not None else None
        del logits_pair, ta, tb, rows_a, rows_b
    points: list[PointResult] = []
    first_max: float | None = None
    for index, name, kind, op, ca, cb, rows in queued:
        d = diffs[index]
        n_prefix = None if rows is None else (batch.n_diff_before(index) if rows else 0)
        if first_max is None and d.n_diff > 0:
            first_max = d.max_abs_diff
        amp = None if first_max is None else amplification(first_max, d.max_abs_diff)
        n_tol = batch.outside_tolerance(index) if tol is not None else None
        points.append(PointResult(name=name, kind=kind, op=op, diff=d, amplification=amp,
                                  calls_a=ca, calls_b=cb, n_diff_prefix=n_prefix, n_outside_tol=n_tol))
    c = Comparison(scenario=scenario, model=model, positions=tuple(positions), run_a=run_a,
                   run_b=run_b, points=tuple(points), logits_name=logits_name, logits=logits,
                   logits_calls=logits_calls, trace=trace, facts=dict(facts or {}),
                   logits_n_outside_tol=logits_tol, atol=atol, rtol=rtol,
                   logits_amplification=amplification(first_max, logits.tensor.max_abs_diff)
                   if logits is not None and first_max is not None else None,
                   per_position=per_position.result(), skipped=tuple(skips))
    return classify_origins(c)


def _growth(points: list[PointResult]) -> list[float | None]:
    """Layer-to-layer amplification of each point (see ``PointResult.growth``)."""
    layers = [p.name for p in points if p.kind == "layer"]
    by_name = {p.name: p for p in points}
    out: list[float | None] = []
    for p in points:
        owner = max((lay for lay in layers if p.name == lay or p.name.startswith(lay + ".")), key=len, default=None)
        g = None
        if owner is not None and layers.index(owner) > 0:
            prev_layer = layers[layers.index(owner) - 1]
            prev = by_name.get(prev_layer + p.name[len(owner):])
            if prev is not None:
                g = amplification(prev.diff.max_abs_diff, p.diff.max_abs_diff)
        out.append(g)
    return out


def classify_origins(c: Comparison) -> Comparison:
    """Mark every differing capture point as origin or propagated, and fill ``growth``.

    A differing point is an **origin** when every capture point it consumes
    (:func:`tracer.diff.dataflow.dataflow`) was bit-identical in both runs: the op itself computed
    differently. Otherwise it is **propagated** and ``differing_inputs`` names the culprits.
    A ``kv_cache`` point is judged per part: its rows inside the compared window against its
    K/V producers, its rows before the window (computed by an earlier forward pass) against the
    previous layer's cache rows there. The logits are an origin when they differ while the final
    norm (their input) did not.

    Returns:
        a new :class:`Comparison` with ``origin``, ``differing_inputs``, ``consumes`` and
        ``growth`` set on its points and ``logits_origin`` set.
    """
    names = [(p.name, p.kind) for p in c.points]
    if c.logits_name is not None:
        names.append((c.logits_name, "logits"))
    flow = dataflow(names)
    by_name = {p.name: p for p in c.points}

    def diverged(n: str) -> bool:
        return n in by_name and by_name[n].diverged

    def prefix_diverged(n: str) -> bool:
        q = by_name.get(n)
        return q is not None and bool(q.n_diff_prefix if q.n_diff_prefix is not None else q.diverged)

    out = []
    for p, growth in zip(c.points, _growth(list(c.points))):
        cons = flow[p.name]
        origin, bad = False, ()
        if p.diverged:
            bad_w = tuple(d for d in cons.points if diverged(d))
            if p.n_diff_prefix is not None:
                in_window = p.diff.n_diff - p.n_diff_prefix > 0
                bad_p = tuple(d for d in cons.prefix if prefix_diverged(d))
                origin = (in_window and not bad_w) or (p.n_diff_prefix > 0 and not bad_p)
                bad = tuple(dict.fromkeys((bad_w if in_window else ()) + (bad_p if p.n_diff_prefix else ())))
            else:
                origin, bad = not bad_w, bad_w
        out.append(replace(p, consumes=cons, origin=origin, differing_inputs=bad, growth=growth))
    logits_origin = False
    if c.logits is not None and c.logits.tensor.n_diff and c.logits_name in flow:
        logits_origin = not any(diverged(d) for d in flow[c.logits_name].points)
    return replace(c, points=tuple(out), logits_origin=logits_origin)


def _window_call(calls: list[dict[str, Any]], positions: tuple[int, int]) -> dict[str, Any] | None:
    """The (last) forward call that computed positions of the compared window."""
    hit = [c for c in calls if c.get("positions") and c["positions"][0] < positions[1] and c["positions"][1] > positions[0]]
    return hit[-1] if hit else (calls[-1] if calls else None)


def _prod(xs: list[int]) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def call_shapes(p: PointResult, calls: list[dict[str, Any]], positions: tuple[int, int]) -> dict[str, Any]:
    """The shapes the op of ``p`` saw in the call that computed the compared window.

    Returns:
        ``{}`` if unknown; for a Linear ``{"M", "N", "K"}`` (GEMM: M = product of the input's
        leading dims, K its last, N the output's last); for the attention core ``{"queries",
        "keys", "width"}``; for a ``kv_cache`` ``{"positions": [first, stop]}``; otherwise
        ``{"rows", "width"}`` of the captured tensor's source.
    """
    call = _window_call(calls, positions)
    if call is None:
        return {}
    ins, outs = call.get("in") or [], call.get("out") or []
    if p.kind == "kv_cache":
        return {"positions": list(call["positions"])}
    if p.kind == "attention_core" and ins:
        return {"queries": _prod(ins[0][:-1]), "keys": int(call["positions"][1]), "width": int(ins[0][-1])}
    if p.kind in ("linear",) and ins and outs:
        return {"M": _prod(ins[0][:-1]), "N": int(outs[0][-1]), "K": int(ins[0][-1])}
    if p.kind == "logits" and ins and outs:
        return {"M": _prod(ins[0][:-1]), "N": int(outs[0][-1]), "K": int(ins[0][-1])}
    src = ins[0] if p.kind in ("attention_core", "mlp_hidden") and ins else (outs[0] if outs else None)
    if not src:
        return {}
    return {"rows": _prod(src[:-1]), "width": int(src[-1])}


def _chunk_of(chunks: list | None, pos: int) -> int | None:
    for start, stop in chunks or []:
        if start <= pos < stop:
            return stop - start
    return None


def origin_record(p: PointResult, c: Comparison) -> dict[str, Any]:
    """The JSON record of one origin: name, op, shapes in both runs, counts, the one-line text."""
    return {"name": p.name, "kind": p.kind, "op": p.op,
            "shapes_a": call_shapes(p, p.calls_a, c.positions), "shapes_b": call_shapes(p, p.calls_b, c.positions),
            "n_diff": p.diff.n_diff, "n_diff_prefix": p.n_diff_prefix, "max_ulp": p.diff.max_ulp,
            "max_ulp_mag": p.diff.max_ulp_mag, "max_abs_diff": p.diff.max_abs_diff, "text": origin_line(p, c),
            "class": (classify(p, c.positions) or {}).get("class"),
            "kernels_a": kernel_rows(p.calls_a, c.positions), "kernels_b": kernel_rows(p.calls_b, c.positions),
            "replay": (c.op_replay[p.name].to_dict() if c.op_replay and p.name in c.op_replay else None)}


def _each_call(p: PointResult, calls: list[dict[str, Any]], positions: tuple[int, int]) -> list[dict[str, Any]]:
    """:func:`call_shapes` of every call that computed compared positions (several with --positions all)."""
    hit = [cl for cl in calls if cl.get("positions") and cl["positions"][0] < positions[1] and cl["positions"][1] > positions[0]]
    return [call_shapes(p, [cl], positions) for cl in hit] or [call_shapes(p, calls, positions)]


def _shape_text(p: PointResult, c: Comparison) -> str:
    a, b = call_shapes(p, p.calls_a, c.positions), call_shapes(p, p.calls_b, c.positions)
    ea, eb = _each_call(p, p.calls_a, c.positions), _each_call(p, p.calls_b, c.positions)

    def gemm(xs: list[dict[str, Any]]) -> str:
        return " + ".join(f"{x.get('M', '?')}×{x.get('N', '?')}×{x.get('K', '?')}" for x in xs)

    def each(xs: list[dict[str, Any]], key: str) -> str:
        return "+".join(str(x.get(key, "?")) for x in xs)

    if "M" in a and "M" in b:
        return f"GEMM M×N×K {gemm(ea)} in {c.run_a} vs {gemm(eb)} in {c.run_b}"
    if "queries" in a and "queries" in b:
        return (f"queries {each(ea, 'queries')} vs {each(eb, 'queries')}, keys {each(ea, 'keys')} vs "
                f"{each(eb, 'keys')}, width {a['width']}")
    if p.kind == "kv_cache":
        first, stop = (a.get("positions") or [0, 0])
        text = f"positions {first}..{stop - 1}"
        if p.n_diff_prefix:
            ma = _chunk_of(c.facts.get("chunks_a"), first)
            mb = _chunk_of(c.facts.get("chunks_b"), first)
            if ma is not None and mb is not None:
                text += (f"; positions {first}..{c.positions[0] - 1} computed by a forward pass of "
                         f"{ma} tokens in {c.run_a} vs {mb} in {c.run_b}")
        return text
    if "rows" in a and "rows" in b:
        return f"rows {each(ea, 'rows')} vs {each(eb, 'rows')}, width {a['width']}"
    return ""


def origin_line(p: PointResult, c: Comparison) -> str:
    """``model.layers.21.post_attention_layernorm (RMSNorm, rows 250 vs 10, width 576): 8 elements, max 1 ULP``.

    Adds where the difference sits for a ``kv_cache`` point (before the window: born in the
    earlier forward pass, not traced op by op) and, for a decoder layer origin at layers
    granularity, the hint to re-run with ``--granularity sublayers``.
    """
    op = "KVCache" if p.kind == "kv_cache" else p.op
    shapes = _shape_text(p, c)
    head = f"{p.name} ({op}{', ' + shapes if shapes else ''})"
    d = p.diff
    ulp = f"max {d.max_ulp} ULP" if d.max_ulp <= 16 else f"max {d.max_ulp_mag:.3g} ULP of the larger magnitude"
    body = f"{d.n_diff:,} element{'s' if d.n_diff != 1 else ''}, {ulp}, max |Δ| {d.max_abs_diff:.3g}"
    if d.nan_payload_only:
        body = f"{d.n_diff:,} element{'s' if d.n_diff != 1 else ''}: {NAN_PAYLOAD}"
    tail = ""
    if p.kind == "kv_cache" and p.n_diff_prefix:
        inside = d.n_diff - p.n_diff_prefix
        tail = (f"; {p.n_diff_prefix:,} of them before the compared window: born in the forward pass that "
                f"computed those positions (not traced op by op)" + (f", {inside:,} inside it" if inside else ""))
    subs = [q for q in c.points if q.name.startswith(p.name + ".") and q.kind != "kv_cache"]
    if p.kind == "layer" and not subs:
        tail = f"; origin within {p.name} (use --granularity sublayers to find the op)"
    if p.kind == "kv_cache" and not [q for q in c.points if q.name.startswith(p.name.rsplit(".", 1)[0] + ".")
                                     and q.kind not in ("kv_cache",)] and p.diff.n_diff - (p.n_diff_prefix or 0) > 0:
        tail += "; inside the window: origin within the layer's K/V projection (use --granularity sublayers)"
    info = classify(p, c.positions)
    if info is not None and (info["kernels_a"] != "-" or info["kernels_b"] != "-"):
        tail += f"; {class_text(info, c.run_a, c.run_b)}"
    if c.op_replay and p.name in c.op_replay:
        tail += f"; replay in float64: {c.op_replay[p.name].text}"
    return f"{head}: {body}{tail}"


def compare_records(a: RunRecord, b: RunRecord, *, scenario: str, model: str,
                    trace: str | None = None, facts: dict[str, Any] | None = None,
                    atol: float | None = None, rtol: float | None = None) -> Comparison:
    """Compare two in-memory runs (see :func:`compare_pairs`).

    Raises:
        TracerError: the runs processed different prompts or windows.
    """
    check_alignable(a.name, a.token_ids, a.window, b.name, b.token_ids, b.window)
    return compare_pairs(_pairs_from_records(a, b), scenario=scenario, model=model,
                         positions=a.window, run_a=a.name, run_b=b.name, trace=trace, facts=facts,
                         atol=atol, rtol=rtol,
                         skipped=missing_points({n: r.kind for n, r in a.captures.items()},
                                                {n: r.kind for n, r in b.captures.items()}, a.name, b.name))


def compare_trace(path: str, run_a: str | None = None, run_b: str | None = None, *,
                  atol: float | None = None, rtol: float | None = None, device: str | None = None) -> Comparison:
    """Compare two runs stored in one trace file, one capture point at a time.

    ``run_a``/``run_b`` default to the first two runs of the file; ``atol``/``rtol`` as in
    :func:`compare_pairs`; ``device`` as in :func:`compare_runs`. A replay (``--decode``) stored
    in the runs' meta is compared too.

    Raises:
        TracerError: missing/corrupt trace, unknown run names, runs of different prompts, an
            unavailable device.
    """
    return compare_runs((path, run_a), (path, run_b), atol=atol, rtol=rtol, device=device)


#: bytes of one row block of a stored capture point (per run): ``compare`` reads every point in
#: row blocks of about this size into reused buffers, so host memory does not grow with the trace
BLOCK_BYTES = 32 << 20
#: row blocks (per run) read ahead of the comparison, on one background thread (0: in turn)
READ_AHEAD = 2


class _Ring:
    """``count`` reusable byte buffers of ``nbytes`` each (pinned for a GPU), handed out in turn
    (allocated on first use)."""

    def __init__(self, count: int, nbytes: int, pin: bool) -> None:
        self.count, self.nbytes, self.pin = count, nbytes, pin
        self.bufs: list = []
        self.i = 0

    def next(self):
        if len(self.bufs) < self.count:
            self.bufs.append(torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.pin).numpy())
            return self.bufs[-1]
        self.i = (self.i + 1) % self.count
        return self.bufs[self.i]


class _Raised:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _ReadAhead:
    """Items of ``gen`` produced on one background thread, at most ``depth`` ahead of the consumer
    (``depth`` 0: produced in turn on the calling thread); an error is raised where its item would
    have come. :meth:`close` stops the thread."""

    def __init__(self, gen: Iterator[Any], depth: int) -> None:
        import queue
        import threading

        self.gen, self.depth, self.stop = gen, depth, False
        self.done = False
        if depth > 0:
            self.q: queue.Queue = queue.Queue(maxsize=depth)
            self.thread = threading.Thread(target=self._run, name="tracer-read", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        try:
            for item in self.gen:
                if self.stop:
                    return
                self.q.put(item)
            self.q.put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, in order
            self.q.put(_Raised(e))

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self.done:
            raise StopIteration
        if self.depth <= 0:
            return next(self.gen)
        item = self.q.get()
        if item is _END:
            self.done = True
            raise StopIteration
        if isinstance(item, _Raised):
            self.done = True
            raise item.error
        return item

    def close(self) -> None:
        self.stop = True
        if self.depth > 0 and self.thread.is_alive():
            while self.thread.is_alive():  # let a put() blocked on a full queue finish
                try:
                    self.q.get(timeout=0.05)
                except Exception:  # noqa: BLE001 - queue.Empty: the thread is finishing
                    pass
            self.thread.join()


class _StoredPairs:
    """The pairs of :func:`compare_pairs` for points of two stored runs: every point as
    :class:`RowBlocks`, read front to back in row blocks of about :data:`BLOCK_BYTES` into reused
    buffers, :data:`READ_AHEAD` blocks ahead on one thread (reads release the GIL), each point's
    CRC-32 checked after its last block. A point whose shape or dtype differ between the runs (or
    that is empty in one) is given by its shapes alone: :func:`compare_pairs` reports it unread.
    Host memory: the ring of buffers, whatever the trace size."""

    def __init__(self, names: list[str], caps_a: dict, caps_b: dict, dev: torch.device) -> None:
        from tracer.dtypes import DTYPES
        from tracer.store.trace import stored_crc

        self.dev = dev
        self.items = []
        biggest = 1
        for name in names:
            (ia, ha), (ib, hb) = caps_a[name], caps_b[name]
            same = list(ia["shape"]) == list(ib["shape"]) and ia["dtype"] == ib["dtype"]
            crc_a = stored_crc(ha) if same else None
            hint = crc_a is not None and crc_a == stored_crc(hb)
            self.items.append((name, ia, ib, ha, hb, same, DTYPES[ia["dtype"]], DTYPES[ib["dtype"]], hint))
            if same:
                biggest = max(biggest, int(ha.nbytes), int(hb.nbytes))
        size = min(BLOCK_BYTES, biggest)
        pin = dev.type == "cuda"
        self.rings = (_Ring(READ_AHEAD + 2, size, pin), _Ring(READ_AHEAD + 2, size, pin))
        self.ahead = _ReadAhead(self._produce(), READ_AHEAD)

    def _produce(self) -> Iterator[tuple]:
        from tracer.store.trace import read_row_blocks

        for _name, ia, _ib, ha, hb, same, _da, _db, _hint in self.items:
            if not same:
                continue
            yield from self._read(ia, ha, hb, self.rings[0].next, self.rings[1].next)
            yield None, None, None  # the end of this point

    @staticmethod
    def _read(ia: dict, ha: Any, hb: Any, buf_a: Callable | None, buf_b: Callable | None) -> Iterator[tuple]:
        from tracer.store.trace import read_row_blocks

        shape = tuple(ia["shape"])
        rows = shape[0] if shape else 1
        row_bytes = max(1, int(max(ha.nbytes, hb.nbytes)) // max(1, rows))
        per_block = max(1, BLOCK_BYTES // row_bytes)
        ga = read_row_blocks(ha, per_block, buf_a)
        gb = read_row_blocks(hb, per_block, buf_b)
        for (r0, xa), (_, xb) in zip(ga, gb):
            yield r0, xa, xb
        for _ in gb:  # run B's CRC-32 is checked when its blocks are exhausted (A's already was)
            pass

    def _again(self, ia: dict, ha: Any, hb: Any) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        for r0, xa, xb in self._read(ia, ha, hb, None, None):
            yield r0, xa.to(self.dev), xb.to(self.dev)

    def _blocks(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        for r0, xa, xb in self.ahead:
            if r0 is None:
                return
            yield r0, xa.to(self.dev), xb.to(self.dev)  # a blocking copy: the buffer is reused later

    def __iter__(self) -> Iterator[tuple]:
        for name, ia, ib, ha, hb, same, da, db, hint in self.items:
            sa, sb = tuple(ia["shape"]), tuple(ib["shape"])
            blocks = self._blocks() if same else None
            again = functools.partial(self._again, ia, ha, hb)
            yield name, ia["kind"], ia.get("op", ""), RowBlocks(sa, da, blocks, hint, again), RowBlocks(sb, db), \
                ia.get("calls", []), ib.get("calls", [])
            for _ in blocks or ():  # what the comparison did not take (a point it skipped)
                pass

    def close(self) -> None:
        self.ahead.close()


def _stored_pairs(names: list[str], caps_a: dict, caps_b: dict, dev: torch.device) -> _StoredPairs:
    return _StoredPairs(names, caps_a, caps_b, dev)


def _prefetched(items: list, load: Callable[[Any], Any], depth: int = 2) -> Iterator[Any]:
    """``load(item)`` for each item in order, loading up to ``depth`` items ahead on one thread
    (``depth=0``: in turn, on the calling thread)."""
    import collections
    from concurrent.futures import ThreadPoolExecutor

    if depth <= 0:
        for item in items:
            yield load(item)
        return

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tracer-read") as pool:
        queue: collections.deque = collections.deque()
        it = iter(items)
        for item in it:
            queue.append(pool.submit(load, item))
            if len(queue) >= depth:
                break
        try:
            while queue:
                value = queue.popleft().result()
                nxt = next(it, _END)
                if nxt is not _END:
                    queue.append(pool.submit(load, nxt))
                yield value
                del value
        finally:
            for fut in queue:
                fut.cancel()


_END = object()


def _is_file_ref(ref: str) -> bool:
    from pathlib import Path

    return Path(ref).is_file() or (":" in ref and Path(ref.rsplit(":", 1)[0]).is_file())


def split_ref(ref: str) -> tuple[str, str | None]:
    """``FILE`` → ``(FILE, None)``; ``FILE:RUN`` → ``(FILE, RUN)`` (a path that exists as a file wins)."""
    from pathlib import Path

    if Path(ref).exists() or ":" not in ref:
        return ref, None
    path, run = ref.rsplit(":", 1)
    return path, run or None


def resolve_refs(refs: list[str]) -> tuple[tuple[str, str | None], tuple[str, str | None]]:
    """The two runs named by ``tracer compare``'s arguments.

    ``TRACE`` (its first two runs) · ``TRACE RUN_A [RUN_B]`` (runs of one file) ·
    ``TRACE[:RUN] TRACE2[:RUN]`` (a run of each file; a file without ``:RUN`` uses the run of the
    other side's name, else its first run).

    Raises:
        TracerError: no or too many arguments.
    """
    if not 1 <= len(refs) <= 3:
        raise TracerError("give TRACE [RUN_A [RUN_B]] or TRACE[:RUN] TRACE2[:RUN]")
    first = split_ref(refs[0])
    if len(refs) == 2 and _is_file_ref(refs[1]):
        return first, split_ref(refs[1])
    if len(refs) == 1 and first[1] is not None:
        return first, (first[0], None)
    for ref in refs[1:]:  # a run name never looks like a file: a missing second trace is named as such
        path = split_ref(ref)[0]
        if path.lower().endswith((".h5", ".hdf5")) or "/" in path:
            raise TracerError(f"trace file {path} not found; give an existing trace (or a run name of {refs[0]})")
    runs = [first[1]] if first[1] is not None else []
    runs += refs[1:]
    if len(runs) > 2:
        raise TracerError("give at most two run names: TRACE RUN_A RUN_B or TRACE:RUN_A TRACE2:RUN_B")
    runs += [None] * (2 - len(runs))
    return (first[0], runs[0]), (first[0], runs[1])


def compare_runs(ref_a: tuple[str, str | None], ref_b: tuple[str, str | None], *,
                 atol: float | None = None, rtol: float | None = None,
                 device: str | None = None) -> Comparison:
    """Compare run ``ref_a = (file, run)`` with ``ref_b``, from one trace or two (e.g. made on two
    machines), streaming capture point by capture point. A run of None is resolved as in
    :func:`resolve_refs`; ``atol``/``rtol`` as in :func:`compare_pairs`. A replay (``--decode``)
    stored in the runs' meta is compared too.

    Every point is read front to back in row blocks of about :data:`BLOCK_BYTES` into a few reused
    buffers, :data:`READ_AHEAD` blocks ahead of the comparison on one background thread (a version-2
    trace is read with ``preadv``, which releases the GIL), and compared block by block with the
    numbers of a whole-tensor comparison (:class:`RowBlocks`); each point's CRC-32 is checked after
    its last block, before anything is reported. ``device``: where the metrics are computed
    (``cpu``, ``cuda``, ``cuda:N``; None: cuda if available); on a GPU the buffers are pinned. Host
    memory: the buffers (2 × (READ_AHEAD + 2) × BLOCK_BYTES at most) plus the metrics' chunk
    temporaries, whatever the trace size.

    Raises:
        TracerError: missing/corrupt trace, unknown run names, runs of different prompts or
            windows, an unavailable device.
    """
    from tracer.load.models import resolve_device
    from tracer.store.trace import TraceReader, read_tensor

    (path_a, run_a), (path_b, run_b) = ref_a, ref_b
    same = str(path_a) == str(path_b)
    with TraceReader(path_a) as reader_a, TraceReader(path_b) as reader_b:
        names_a, names_b = reader_a.runs, reader_b.runs
        if same and (run_a is None or run_b is None):
            if len(names_a) < 2:
                raise TracerError(f"trace {path_a} holds {len(names_a)} run(s); a comparison needs two")
            run_a = run_a or names_a[0]
            run_b = run_b or next(n for n in names_a if n != run_a)
        run_a = run_a or (run_b if run_b in names_a else names_a[0] if names_a else None)
        run_b = run_b or (run_a if run_a in names_b else names_b[0] if names_b else None)
        ra = reader_a.run(run_a, load_tensors=False)
        rb = reader_b.run(run_b, load_tensors=False)
        label_a, label_b = (run_a, run_b) if same else (f"{path_a}:{run_a}", f"{path_b}:{run_b}")
        check_alignable(label_a, ra.token_ids, ra.window, label_b, rb.token_ids, rb.window)
        header = reader_a.header
        caps_a, caps_b = reader_a.captures(run_a), reader_b.captures(run_b)  # name -> (info, dataset)
        for path, reader, run, caps in ((path_a, reader_a, run_a, caps_a), (path_b, reader_b, run_b, caps_b)):
            if not caps:
                raise TracerError(
                    f"trace {path} holds no tensors for run {run} (written with --store "
                    f"{reader.header.get('store', 'stats')}); 'tracer show {path}' prints its stored comparison"
                )
        names = [n for n in caps_a if n in caps_b]
        skipped = missing_points({n: i["kind"] for n, (i, _) in caps_a.items()},
                                 {n: i["kind"] for n, (i, _) in caps_b.items()}, label_a, label_b)
        # --store auto dropped these points' tensors: not compared here, never reported as identical
        autos = [r.meta["store_auto"] for r in (ra, rb) if isinstance(r.meta.get("store_auto"), dict)]
        kinds = {n: k for a in autos if isinstance(a.get("kinds"), dict) for n, k in a["kinds"].items()}
        dropped = [n for a in autos for n in a.get("dropped") or [] if isinstance(n, str)]
        skipped += [SkipRecord(n, str(kinds.get(n, "layer")), "not stored (--store auto kept statistics only; "
                               "'tracer report' shows the run-time comparison)")
                    for n in dict.fromkeys(dropped) if n not in caps_a or n not in caps_b]
        dev = torch.device(resolve_device(device))
        scen = header.get("scenario", {})
        scen_name = scen.get("name", "?") if isinstance(scen, dict) else str(scen)
        facts = run_facts(header, ra, rb)
        if not same:
            hb = reader_b.header
            facts["notes"] = facts.get("notes", []) + [f"A: {path_a} ({header.get('hostname')}, {header.get('device_name')}, torch {header.get('torch')}); "
                              f"B: {path_b} ({hb.get('hostname')}, {hb.get('device_name')}, torch {hb.get('torch')})"]
            facts["versions_differ"] = version_differences(header, hb)
            facts["notes"].append("versions that differ: " + ("; ".join(facts["versions_differ"]) or "none"))
            facts["contract_differs"] = contract_differences(header, hb)
            if facts["contract_differs"]:
                facts["notes"].append("warning: the numeric contract differs: " + "; ".join(facts["contract_differs"]))
        pairs = _stored_pairs(names, caps_a, caps_b, dev)
        try:
            c = compare_pairs(
                pairs, scenario=ra.meta.get("scenario", scen_name),
                model=header.get("model", {}).get("name", "?") if isinstance(header.get("model"), dict) else str(header.get("model", "?")),
                positions=tuple(ra.window), run_a=label_a, run_b=label_b, trace=str(path_a) if same else f"{path_a} + {path_b}",
                facts=facts, atol=atol, rtol=rtol, skipped=skipped,
            )
        finally:
            pairs.close()
        if "decode_tokens" in ra.meta and "decode_tokens" in rb.meta:
            c = replace(c, replay=replay_diff(ra.meta["decode_tokens"], rb.meta["decode_tokens"],
                                              ra.meta.get("decode_text"), rb.meta.get("decode_text")))
        return c


#: header keys naming a version of something the numbers depend on (compared across two traces)
VERSION_KEYS = ("tracer_version", "python", "torch", "transformers", "numpy", "h5py", "cuda", "hip", "cudnn", "cublas",
                "driver", "device_name", "cpu", "platform")


def version_differences(header_a: dict[str, Any], header_b: dict[str, Any]) -> list[str]:
    """``["torch 2.13.0+cpu (A) vs 2.11.0+cu130 (B)", ...]``: every :data:`VERSION_KEYS` entry
    whose value differs between two trace headers (a key missing on one side counts as differing)."""
    out = []
    for k in VERSION_KEYS:
        a, b = header_a.get(k), header_b.get(k)
        if a != b:
            out.append(f"{k} {a} (A) vs {b} (B)")
    return out


def run_facts(header: dict[str, Any], a: RunRecord, b: RunRecord) -> dict[str, Any]:
    """The short facts shown above the table, from a trace header and the two runs (one builder for a
    run in memory and a trace read back).

    Returns:
        ``dtype``, ``device``, ``attn``: the model's dtype, device and attention implementation;
        ``device_name``: the GPU/CPU name (None when the header has none); ``n_tokens``: N;
        ``plan_a``/``plan_b``: the plans' descriptions; ``gemm_m_a``/``gemm_m_b``: GEMM M per
        forward pass; ``chunks_a``/``chunks_b``: the ``[start, stop)`` chunks of each plan; and,
        where the scenario has them, ``generated_a``/``generated_b``/``first_token_difference``
        (``generate-cache``), ``kv_block_format`` (``kv-quant``), ``sliding_layers`` /
        ``sliding_window`` (a model with sliding-window attention layers, from the header's
        ``numeric_contract``: decoder-layer indices and the window in tokens) and ``notes`` (a
        line each).
    """
    model = header.get("model", {}) if isinstance(header.get("model"), dict) else {}
    facts: dict[str, Any] = {
        "dtype": model.get("dtype"),
        "device": model.get("device"),
        "attn": model.get("attn_implementation"),
        "device_name": header.get("device_name"),
        "n_tokens": len(a.token_ids),
        "plan_a": a.plan.get("description", ""),
        "plan_b": b.plan.get("description", ""),
        "gemm_m_a": a.plan.get("gemm_m"),
        "gemm_m_b": b.plan.get("gemm_m"),
        "chunks_a": [list(c) for c in a.plan.get("chunks") or ()],
        "chunks_b": [list(c) for c in b.plan.get("chunks") or ()],
        **attention_facts(header.get("numeric_contract") or {}),
    }
    scenario = header.get("scenario") if isinstance(header.get("scenario"), dict) else {}
    notes = []
    gen_a, gen_b = a.meta.get("generated"), b.meta.get("generated")
    if gen_a is not None and gen_b is not None:
        first = next((i for i, (x, y) in enumerate(zip(gen_a, gen_b)) if x != y), None)
        facts.update(generated_a=gen_a, generated_b=gen_b, first_token_difference=first)
        notes.append(f"generated tokens: A {gen_a}, B {gen_b}; " + (
            f"identical for all {len(gen_a)} steps" if first is None else
            f"first different at step {first} (position {a.window[0] + first}); later steps compare different contexts"))
    fmt = (scenario.get("params") or {}).get("kv_block_format")
    if fmt is not None:
        facts["kv_block_format"] = fmt
        notes.append(f"KV format {fmt['name']}: {fmt['element']} elements, block {fmt['block_size'] or '-'}, scale {fmt['scale']}")
    auto = a.meta.get("store_auto") or {}
    if auto.get("dropped"):  # a stored run of --store auto: the table covers the kept points only
        logits = auto.get("logits") in auto["dropped"]
        notes.append(f"--store auto kept full tensors of {len(auto.get('kept', []))} of "
                     f"{len(auto.get('kept', [])) + len(auto['dropped'])} points; the other {len(auto['dropped'])}"
                     + (" (the logits among them)" if logits else "")
                     + " were compared when the trace was written: 'tracer report TRACE' renders that comparison, "
                     "'tracer show TRACE --json' prints it")
    if notes:
        facts["notes"] = notes
    return facts


@dataclass(frozen=True)
class Replay:
    """Greedy continuations of both runs from their own KV caches (``--decode T``).

    Attributes:
        tokens_a, tokens_b: the T generated token ids of each run.
        first_diff: index (0-based, among the generated tokens) of the first position whose ids
            differ, or None when the continuations are identical.
        text_a, text_b: the continuations decoded to text (None if no tokenizer was at hand).
    """

    tokens_a: tuple[int, ...]
    tokens_b: tuple[int, ...]
    first_diff: int | None
    text_a: str | None = None
    text_b: str | None = None

    def line(self) -> str:
        """One line for people."""
        n = len(self.tokens_a)
        if self.first_diff is None:
            return f"replay: the {n} greedy tokens after the prompt are identical in both runs"
        return f"replay: the greedy continuations differ from generated token {self.first_diff} of {n}"

    def to_dict(self) -> dict[str, Any]:
        return {"steps": len(self.tokens_a), "first_diff": self.first_diff, "tokens_a": list(self.tokens_a),
                "tokens_b": list(self.tokens_b), "text_a": self.text_a, "text_b": self.text_b}


def replay_diff(tokens_a: list[int], tokens_b: list[int], text_a: str | None = None,
                text_b: str | None = None) -> Replay:
    """Compare two greedy continuations token by token (see :class:`Replay`).

    Raises:
        TracerError: the continuations have different lengths.
    """
    if len(tokens_a) != len(tokens_b):
        raise TracerError(f"the runs decoded {len(tokens_a)} and {len(tokens_b)} tokens; replay both with the same --decode")
    first = next((i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y), None)
    return Replay(tuple(int(t) for t in tokens_a), tuple(int(t) for t in tokens_b), first, text_a, text_b)
