"""Aligning two runs and comparing them capture point by capture point.

The comparison streams: it holds one capture point's two tensors at a time, whether they come
from in-memory :class:`~tracer.records.RunRecord` objects or from a stored trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

from .errors import TracerError
from .metrics import LogitsDiff, TensorDiff, logits_diff, tensor_diff
from .records import RunRecord


@dataclass(frozen=True)
class PointResult:
    """The comparison at one capture point.

    Attributes:
        name: HF module path.
        kind, op: capture kind and module class.
        diff: the metrics (:class:`~tracer.metrics.TensorDiff`).
        amplification: ``max_abs_diff`` divided by the first divergent point's ``max_abs_diff``
            (None before divergence starts).
        calls_a, calls_b: the shapes the module saw in each run (see ``CaptureRecord.calls``).
    """

    name: str
    kind: str
    op: str
    diff: TensorDiff
    amplification: float | None = None
    calls_a: list[dict[str, Any]] = field(default_factory=list)
    calls_b: list[dict[str, Any]] = field(default_factory=list)

    @property
    def diverged(self) -> bool:
        return self.diff.n_diff > 0

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "kind": self.kind, "op": self.op}
        d.update(self.diff.to_dict())
        d["fraction"] = self.diff.n_diff / self.diff.n_total if self.diff.n_total else 0.0
        d["amplification"] = self.amplification
        d["shapes_a"] = self.calls_a
        d["shapes_b"] = self.calls_b
        return d


@dataclass(frozen=True)
class Comparison:
    """Run A versus run B of one scenario: the amplification table as data.

    Attributes:
        scenario, model: names, for the report.
        positions: ``(first, last + 1)``: the compared absolute token positions.
        run_a, run_b: run names.
        points: one :class:`PointResult` per non-logits capture point, in execution order.
        logits_name: the logits capture point (HF path of the LM head), or None if not captured.
        logits: :class:`~tracer.metrics.LogitsDiff` of the logits, or None.
        trace: the trace file path, if stored.
        facts: short facts for the report header (dtype, device, plans).
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
    def identical(self) -> bool:
        return self.first_divergent is None

    @property
    def n_positions(self) -> int:
        return self.positions[1] - self.positions[0]

    def verdict(self) -> str:
        """One line: ``bit-identical ...`` or ``diverges from X, K argmax flips in T positions``."""
        n_points = len(self.points) + (self.logits is not None)
        if self.identical:
            return (f"bit-identical: all {n_points} capture points agree bit for bit at positions "
                    f"{self.positions[0]}..{self.positions[1] - 1}")
        flips = len(self.logits.argmax_flips) if self.logits is not None else 0
        tail = f", {flips} argmax flip{'s' if flips != 1 else ''} in {self.n_positions} positions"
        return f"diverges from {self.first_divergent}{tail if self.logits is not None else ''}"

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
        return {
            "scenario": self.scenario,
            "model": self.model,
            "positions": list(self.positions),
            "runs": [self.run_a, self.run_b],
            "layers": [p.to_dict() for p in self.points],
            "logits": logits,
            "first_divergent": self.first_divergent,
            "identical": self.identical,
            "verdict": self.verdict(),
            "trace": self.trace,
            "facts": self.facts,
        }


def _pairs_from_records(a: RunRecord, b: RunRecord) -> Iterator[tuple[str, str, str, torch.Tensor, torch.Tensor, list, list]]:
    for name, ra in a.captures.items():
        rb = b.captures.get(name)
        if rb is None:
            continue
        yield name, ra.kind, ra.op, ra.tensor, rb.tensor, ra.calls, rb.calls


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


def compare_pairs(pairs: Iterable[tuple[str, str, str, torch.Tensor, torch.Tensor, list, list]], *,
                  scenario: str, model: str, positions: tuple[int, int], run_a: str = "A",
                  run_b: str = "B", trace: str | None = None,
                  facts: dict[str, Any] | None = None) -> Comparison:
    """Compare an ordered stream of ``(name, kind, op, tensor_a, tensor_b, calls_a, calls_b)``.

    Tensors of one pair must have equal shapes ``(T, *feature)``; the logits pair ``(T, vocab)``.
    Only one pair is held at a time.

    Raises:
        TracerError: a capture point whose tensors have different shapes or dtypes in the two runs.
    """
    points: list[PointResult] = []
    logits = None
    logits_name = None
    logits_calls: tuple[list, list] = ([], [])
    first_max: float | None = None
    for name, kind, op, ta, tb, ca, cb in pairs:
        if ta.shape != tb.shape or ta.dtype != tb.dtype:
            raise TracerError(
                f"capture point {name} has {tuple(ta.shape)} {ta.dtype} in run {run_a} but {tuple(tb.shape)} "
                f"{tb.dtype} in run {run_b}; the runs used different models or dtypes"
            )
        if kind == "logits":
            logits = logits_diff(ta.reshape(-1, ta.shape[-1]) if ta.dim() > 1 else ta, tb.reshape(-1, tb.shape[-1]) if tb.dim() > 1 else tb)
            logits_name = name
            logits_calls = (ca, cb)
            continue
        d = tensor_diff(ta, tb)
        amp = None
        if first_max is None and d.n_diff > 0:
            first_max = d.max_abs_diff
        if first_max is not None:
            amp = d.max_abs_diff / first_max if first_max > 0 else None
        points.append(PointResult(name=name, kind=kind, op=op, diff=d, amplification=amp,
                                  calls_a=ca, calls_b=cb))
    return Comparison(scenario=scenario, model=model, positions=tuple(positions), run_a=run_a,
                      run_b=run_b, points=tuple(points), logits_name=logits_name, logits=logits,
                      logits_calls=logits_calls, trace=trace, facts=dict(facts or {}))


def compare_records(a: RunRecord, b: RunRecord, *, scenario: str, model: str,
                    trace: str | None = None, facts: dict[str, Any] | None = None) -> Comparison:
    """Compare two in-memory runs (see :func:`compare_pairs`).

    Raises:
        TracerError: the runs processed different prompts or windows.
    """
    check_alignable(a.name, a.token_ids, a.window, b.name, b.token_ids, b.window)
    return compare_pairs(_pairs_from_records(a, b), scenario=scenario, model=model,
                         positions=a.window, run_a=a.name, run_b=b.name, trace=trace, facts=facts)


def compare_trace(path: str, run_a: str | None = None, run_b: str | None = None) -> Comparison:
    """Compare two runs stored in one trace file, one capture point at a time.

    ``run_a``/``run_b`` default to the first two runs of the file.

    Raises:
        TracerError: missing/corrupt trace, unknown run names, runs of different prompts.
    """
    return compare_runs((path, run_a), (path, run_b))


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
    runs = [first[1]] if first[1] is not None else []
    runs += refs[1:]
    if len(runs) > 2:
        raise TracerError("give at most two run names: TRACE RUN_A RUN_B or TRACE:RUN_A TRACE2:RUN_B")
    runs += [None] * (2 - len(runs))
    return (first[0], runs[0]), (first[0], runs[1])


def compare_runs(ref_a: tuple[str, str | None], ref_b: tuple[str, str | None]) -> Comparison:
    """Compare run ``ref_a = (file, run)`` with ``ref_b``, from one trace or two (e.g. made on two
    machines), one capture point at a time. A run of None is resolved as in :func:`resolve_refs`.

    Raises:
        TracerError: missing/corrupt trace, unknown run names, runs of different prompts or windows.
    """
    from .store import TraceReader

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
        names_in_b = set(reader_b.capture_names(run_b))
        if not reader_a.capture_names(run_a) and not reader_b.capture_names(run_b):
            raise TracerError(
                f"trace {path_a} holds no tensors (written with --store {header.get('store', 'stats')}); "
                f"'tracer show {path_a}' prints its stored comparison"
            )

        def pairs():
            for name in reader_a.capture_names(run_a):
                if name not in names_in_b:
                    continue
                ia, ib = reader_a.capture_info(run_a, name), reader_b.capture_info(run_b, name)
                yield (name, ia["kind"], ia.get("op", ""), reader_a.tensor(run_a, name),
                       reader_b.tensor(run_b, name), ia.get("calls", []), ib.get("calls", []))

        scen = header.get("scenario", {})
        scen_name = scen.get("name", "?") if isinstance(scen, dict) else str(scen)
        facts = facts_from_header(header, ra, rb)
        if not same:
            hb = reader_b.header
            facts["notes"] = [f"A: {path_a} ({header.get('hostname')}, {header.get('device_name')}, torch {header.get('torch')}); "
                              f"B: {path_b} ({hb.get('hostname')}, {hb.get('device_name')}, torch {hb.get('torch')})"]
        return compare_pairs(
            pairs(), scenario=ra.meta.get("scenario", scen_name),
            model=header.get("model", {}).get("name", "?") if isinstance(header.get("model"), dict) else str(header.get("model", "?")),
            positions=tuple(ra.window), run_a=label_a, run_b=label_b, trace=str(path_a) if same else f"{path_a} + {path_b}",
            facts=facts,
        )


def facts_from_header(header: dict[str, Any], a: RunRecord, b: RunRecord) -> dict[str, Any]:
    """Short facts shown above the table: model dtype/device, the two plans' GEMM M."""
    model = header.get("model", {}) if isinstance(header.get("model"), dict) else {}
    return {
        "dtype": model.get("dtype"),
        "device": model.get("device"),
        "attn": model.get("attn_implementation"),
        "device_name": header.get("device_name"),
        "n_tokens": len(a.token_ids),
        "plan_a": a.plan.get("description", ""),
        "plan_b": b.plan.get("description", ""),
        "gemm_m_a": a.plan.get("gemm_m"),
        "gemm_m_b": b.plan.get("gemm_m"),
    }
