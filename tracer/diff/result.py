"""The result types of a comparison: one point's metrics, a skipped point, the whole comparison.

:class:`Comparison` is the amplification table as data, and it says what it means: its verdict
(:meth:`Comparison.verdict`) and its judgement by a ``--fail-on`` rule (:meth:`Comparison.check`);
each origin is data (:func:`tracer.diff.provenance.origin_facts`: the op, the shapes it saw in
both runs, how much differs), said in a sentence by :func:`tracer.report.origins.origin_line`. The
engine that builds it is :mod:`tracer.diff.compare`; the origin analysis :mod:`tracer.diff.origins`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracer import schema
from tracer.diff.accuracy import OpReplay
from tracer.diff.capture_contract import ContractMismatch
from tracer.diff.crossdtype import CrossDtype
from tracer.diff.dataflow import Consumes
from tracer.diff.metrics import LogitsDiff, TensorDiff, flips_phrase
from tracer.diff.positions import PerPosition
from tracer.diff.provenance import classify, kernel_rows, origin_facts
from tracer.diff.replay import Replay
from tracer.diff.rl import RLComparison
from tracer.diff.verdict import NoiseVerdict
from tracer.errors import TracerError
from tracer.execute.kinds import CACHE_KINDS, PointKind, point_kind
from tracer.execute.records import EngineFacts, calls_problem
from tracer.plan.checks import FAIL_ON, check_fail_on  # noqa: F401 - re-exported
from tracer.plan.quant import BlockFormat

#: how a difference of NaN payloads alone (NaN at the same elements in both runs) is reported
NAN_PAYLOAD = "NaN in both runs (payload differs)"


@dataclass(frozen=True)
class PointResult(schema.Record):
    """The comparison at one capture point.

    Its document (:meth:`to_dict`) holds the metrics' keys beside its own, the shapes under
    ``shapes_a``/``shapes_b``, and the derived ``fraction`` (differing / total).

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
        cross_dtype: when the runs hold this point in different dtypes, how it was compared
            (:class:`~tracer.diff.crossdtype.CrossDtype`: values in the wider dtype, the ULP
            fields of ``diff`` in the coarser one); None when the dtypes are equal.
    """

    name: str
    kind: PointKind
    op: str
    diff: TensorDiff = schema.field(flatten=True)
    amplification: float | None = None
    calls_a: list[dict[str, Any]] = schema.field(key="shapes_a", default_factory=list)
    calls_b: list[dict[str, Any]] = schema.field(key="shapes_b", default_factory=list)
    growth: float | None = None
    consumes: Consumes = Consumes(points=())
    origin: bool = False
    differing_inputs: tuple[str, ...] = ()
    n_diff_prefix: int | None = None
    n_outside_tol: int | None = None
    cross_dtype: CrossDtype | None = None

    @property
    def diverged(self) -> bool:
        return self.diff.n_diff > 0

    def schema_check(self) -> str | None:
        problem = calls_problem(self.calls_a) or calls_problem(self.calls_b)
        return f"shapes of {self.name}: {problem}" if problem else None

    def schema_extras(self, doc: dict[str, Any]) -> None:
        doc["fraction"] = self.diff.n_diff / self.diff.n_total if self.diff.n_total else 0.0


@dataclass(frozen=True)
class SkipRecord(schema.Record):
    """A capture point that could not be compared, kept in the result (never dropped).

    Attributes:
        name, kind: the capture point.
        reason: one line, e.g. ``missing in run B`` or ``empty in run A``.
        fails: True when it makes the comparison not identical (``--fail-on any`` fails); False
            only for a ``kv_cache`` point empty in a run that keeps no KV cache (it recomputes).
    """

    name: str
    kind: PointKind
    reason: str
    fails: bool = True


def skip_record(name: str, kind: str, run: str, missing: bool) -> SkipRecord:
    """The :class:`SkipRecord` of a point missing (or empty) in ``run``: failing, except a KV cache
    left empty by a run that recomputes without one.

    Raises:
        TracerError: a kind tracer does not know.
    """
    kind = point_kind(kind, name)
    if missing:
        return SkipRecord(name, kind, f"missing in run {run}")
    if kind in CACHE_KINDS:
        return SkipRecord(name, kind, f"no {'KV cache' if kind == PointKind.KV_CACHE else 'cached state'} in run "
                                      f"{run} (it keeps none)", fails=False)
    return SkipRecord(name, kind, f"empty in run {run}")


#: GEMM M of a run: one value, or one per forward pass
GemmM = schema.Count | tuple[schema.Count, ...]


@dataclass(frozen=True)
class ComparisonFacts(schema.Document):
    """The short facts shown above a comparison's table (:func:`tracer.diff.facts.run_facts` and the
    engine-dump comparisons build them): a record that reads like its document (``facts["notes"]``),
    with a fact that is not known left out. A comparison built with a plain dict of facts gets this
    record made from it (:func:`tracer.schema.build`: a key not declared here is an error, never dropped).

    Attributes:
        dtype, device, device_name, attn: the model's dtype, device (and its name), attention.
        isa: the instruction set the kernels dispatched to (:func:`tracer.store.environment.isa_summary`).
        model_argument: how a suggested command names the model (:func:`tracer.load.models.model_argument`).
        family_inferred: True when no family descriptor fits the model (layer-level points inferred).
        n_tokens: N; plan_a, plan_b: the plans' descriptions; gemm_m_a, gemm_m_b: GEMM M per
            forward pass; chunks_a, chunks_b: each plan's ``[start, stop)`` chunks.
        sliding_layers, sliding_window: a model's sliding-window layers and window (tokens);
            layers_path, attention_path: its decoder layers' and attention's module paths.
        generated_a, generated_b, first_token_difference: ``generate-cache``'s tokens and the
            first step at which they differ.
        kv_block_format: ``kv-quant``'s format (:class:`~tracer.plan.quant.BlockFormat`).
        engine_a, engine_b: each run's engine facts (:class:`~tracer.execute.records.EngineFacts`);
            engine_differences: label → ``[A's, B's]``; cached_tokens_a/_b: the engine's own
            count of the traced prompt's cached tokens.
        logits_positions: where both runs had logits, when an engine computed them at some
            positions only.
        versions_differ, device_differs, isa_differs, contract_differs: runs of two traces: what
            differs in their versions, devices (a CPU and a GPU, two GPU models), instruction sets
            and numeric contracts.
        engine, engine_path, engine_path_b, reference, mapping, mapping_b, tp_size, steps,
            step_tokens: an engine dump compared with a reference run (or two dumps): the
            engine(s), the dump(s), the reference run, HF name → engine name(s), the dump's TP
            size, steps and tokens per step.
        sublayers_bytes: about how many bytes the trace of this run again at ``--granularity
            sublayers`` takes (:func:`tracer.diff.facts.sublayers_bytes`), for the suggestion that says so.
        notes: one line each, shown under the table.
    """

    dtype: str | None = None
    device: str | None = None
    device_name: str | None = None
    isa: str | None = None
    model_argument: str | None = None
    family_inferred: bool | None = None
    attn: str | None = None
    n_tokens: schema.Count | None = None
    plan_a: str | None = None
    plan_b: str | None = None
    gemm_m_a: GemmM | None = None
    gemm_m_b: GemmM | None = None
    chunks_a: tuple[schema.Span, ...] | None = None
    chunks_b: tuple[schema.Span, ...] | None = None
    sliding_layers: tuple[schema.Count, ...] | None = None
    sliding_window: schema.Count | None = None
    layers_path: str | None = None
    attention_path: str | None = None
    generated_a: tuple[int, ...] | None = None
    generated_b: tuple[int, ...] | None = None
    first_token_difference: schema.Count | None = None
    kv_block_format: BlockFormat | None = None
    engine_a: EngineFacts | None = None
    engine_b: EngineFacts | None = None
    engine_differences: dict[str, tuple[str, str]] | None = None
    cached_tokens_a: schema.Count | None = None
    cached_tokens_b: schema.Count | None = None
    logits_positions: tuple[schema.Count, ...] | None = None
    sublayers_bytes: schema.Count | None = None
    versions_differ: tuple[str, ...] | None = None
    device_differs: str | None = None
    isa_differs: tuple[str, ...] | None = None
    contract_differs: tuple[str, ...] | None = None
    engine: str | None = None
    engine_path: str | None = None
    engine_path_b: str | None = None
    reference: str | None = None
    mapping: dict[str, str] | None = None
    mapping_b: dict[str, str] | None = None
    tp_size: schema.Count | None = None
    steps: tuple[int, ...] | None = None
    step_tokens: GemmM | None = None
    notes: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Comparison(schema.Record):
    """Run A versus run B of one scenario: the amplification table as data.

    Its document (:meth:`to_dict`, the JSON of ``tracer run --format json``, stored in traces
    under ``/comparisons/<name>``) keeps the layout users know: the points under ``layers``, the
    run names under ``runs``, the logits' fields with the logits, tolerances under ``tolerance``,
    flips at absolute positions; plus the derived ``origins``, ``first_divergent``, ``identical``,
    ``verdict``, ``check`` and, per layer, its kernels and origin class. :meth:`from_dict` reads
    it back, as every field is in it (:mod:`tracer.schema`).

    Attributes:
        scenario, model: names, for the report.
        positions: ``(first, last + 1)``: the compared absolute token positions.
        run_a, run_b: run names.
        points: one :class:`PointResult` per non-logits capture point, in execution order.
        logits_name: the logits capture point (HF path of the LM head), or None if not captured.
        logits: :class:`~tracer.diff.metrics.LogitsDiff` of the logits, or None.
        trace: the trace file path, if stored.
        facts: short facts for the report header (:class:`ComparisonFacts`; a dict given here
            becomes one).
        logits_amplification: the logits' max abs diff over the first divergent point's (None
            when nothing before the logits differs).
        per_position: max |A − B| and differing count per capture point and compared position
            (:meth:`tracer.diff.positions.PositionStats.result`; the position heat map's data), or None.
        logits_calls: the shapes the LM head saw in each run.
        logits_origin, logits_n_outside_tol: the logits as an origin; their elements outside the tolerance.
        atol, rtol: the tolerance the comparison was made with (None: none).
        replay: the decode replay (``--decode``), or None.
        noise: the noise-or-defect verdict (``--verdict``), or None.
        fail_on: the ``--fail-on`` rule :meth:`check` judges by by default.
        op_replay: capture name → the float64 replay of that origin op (``--op-replay``), or None.
        skipped: the points that could not be compared (missing or empty in one run).
        rl: ``rollout-vs-train``: the RL metrics (:class:`tracer.diff.rl.RLComparison`), else None.
        logits_cross_dtype: the logits' :class:`~tracer.diff.crossdtype.CrossDtype` when the runs'
            logits dtypes differ (an engine's float32 logits vs a bf16 reference), else None.
        contract: points whose two sides hold different quantities (an engine dump's partial vs
            full sums: :mod:`tracer.diff.capture_contract`); the verdict names them first.
        unverified: the trace files this comparison was read from that carry no checksums (written
            before tracer stored them, or stripped): their bytes were not verified, and every
            output format says so beside the verdict.
    """

    scenario: str
    model: str
    positions: tuple[int, int]
    run_a: str = schema.field(key=("runs", 0))
    run_b: str = schema.field(key=("runs", 1))
    points: tuple[PointResult, ...] = schema.field(key="layers")
    logits_name: str | None = schema.field(key=("logits", "name"), default=None)
    logits: LogitsDiff | None = schema.field(rename={"n_positions": "positions", "argmax_flips": "flips"},
                                             inline=("tensor",), default=None)
    logits_calls: tuple[list[dict[str, Any]], list[dict[str, Any]]] = schema.field(key=("logits", "calls"),
                                                                                  default=([], []))
    trace: str | None = None
    facts: ComparisonFacts = schema.field(default_factory=ComparisonFacts)
    logits_origin: bool = schema.field(key=("logits", "origin"), default=False)
    logits_n_outside_tol: int | None = schema.field(key=("logits", "n_outside_tol"), default=None)
    atol: float | None = schema.field(key=("tolerance", "atol"), default=None)
    rtol: float | None = schema.field(key=("tolerance", "rtol"), default=None)
    replay: Replay | None = None
    noise: NoiseVerdict | None = schema.field(key="noise_verdict", default=None)
    fail_on: str | None = schema.field(key=("check", "fail_on"), default=None)
    logits_amplification: float | None = schema.field(key=("logits", "amplification"), default=None)
    per_position: PerPosition | None = None
    op_replay: dict[str, OpReplay] | None = None
    skipped: tuple[SkipRecord, ...] = ()
    rl: RLComparison | None = None
    logits_cross_dtype: CrossDtype | None = schema.field(key=("logits", "cross_dtype"), default=None)
    contract: tuple[ContractMismatch, ...] = ()
    unverified: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.facts, ComparisonFacts):  # built with a plain dict of facts
            object.__setattr__(self, "facts", schema.build(ComparisonFacts, dict(self.facts or {})))

    @property
    def cross_dtypes(self) -> dict[str, CrossDtype]:
        """Capture point (logits included) → how it was compared, for every point whose runs' dtypes differ."""
        out = {p.name: p.cross_dtype for p in self.points if p.cross_dtype is not None}
        if self.logits_cross_dtype is not None and self.logits_name:
            out[self.logits_name] = self.logits_cross_dtype
        return out

    @property
    def not_compared(self) -> tuple[SkipRecord, ...]:
        """The skipped points that count against identity (missing or empty in one run)."""
        return tuple(s for s in self.skipped if s.fails)

    @property
    def origins(self) -> tuple[PointResult, ...]:
        """The origin points in execution order (the logits are an origin via :attr:`logits_origin`)."""
        return tuple(p for p in self.points if p.origin)

    def origin_points(self) -> tuple[PointResult, ...]:
        """:attr:`origins`, and the logits as a point (op ``LM head``) when they are an origin."""
        if not (self.logits_origin and self.logits is not None):
            return self.origins
        return self.origins + (PointResult(self.logits_name or "logits", PointKind.LOGITS, "LM head", self.logits.tensor,
                                           calls_a=self.logits_calls[0], calls_b=self.logits_calls[1]),)


    def check(self, fail_on: str | None = "default") -> tuple[bool, str]:
        """Judge the comparison by a ``--fail-on`` rule.

        Args:
            fail_on: the rule (default: the comparison's own ``fail_on``). None (report only: always passes), ``any`` (fails on any bitwise
                difference; of an RL step: in any of its sequences' logprobs too), ``flip`` (fails on
                an argmax flip at the logits; of an RL step: at any of its K × T positions), ``tolerance``
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
            if self.identical and self.rl is not None and not self.rl.identical:  # another sequence of the RL step
                return True, (f"the traced sequence is bit-identical, but {self.rl.n_tokens - self.rl.n_equal} of the RL "
                              f"step's {self.rl.n_tokens} logprobs differ")
            return (not self.identical), ("bit-identical" if self.identical else f"differs from {self.first_divergent}")
        if fail_on == "flip":
            flips = len(self.logits.argmax_flips) if self.logits is not None else 0
            if self.rl is not None and self.rl.argmax_flips:  # every sequence of an RL step, the traced one included
                return True, (f"{flips_phrase(self.rl.argmax_flips)} in the RL step's {self.rl.n_tokens} positions "
                              f"({flips} in the traced sequence)")
            return flips > 0, flips_phrase(flips)
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
        flips = len(self.logits.argmax_flips) if self.logits is not None else 0
        n_logits = self.logits.n_positions if self.logits is not None else self.n_positions  # an engine that samples: there
        tail = f", {flips} argmax flip{'s' if flips != 1 else ''} in {n_logits} position{'s' if n_logits != 1 else ''}"
        if self.rl is not None:  # an RL step: the logits compared are the traced sequence's (its summary counts all K)
            tail += f" of the traced sequence (row {self.rl.row})"
        if self.contract:  # another quantity on one side: said before anything is called numerics
            odd = {m.name for m in self.contract}
            rest = next((p.name for p in self.points if p.diverged and p.name not in odd), None)
            more = f" (and {len(self.contract) - 1} more point(s))" if len(self.contract) > 1 else ""
            return (f"{self.contract[0].text}{more}: not a numeric divergence; "
                    + (f"numerics diverge from {rest}" if rest else "every other compared point agrees")
                    + (tail if self.logits is not None else ""))
        cross = self.cross_dtypes
        if self.identical and cross:
            one = next(iter(cross.values()))
            return (f"identical values: all {n_points} capture points agree at positions {self.positions[0]}.."
                    f"{self.positions[1] - 1}, bit for bit except at {len(cross)} point(s) whose dtypes differ, "
                    f"where the values are equal ({one.text(self.run_a, self.run_b)})")
        if self.identical:
            return (f"bit-identical: all {n_points} capture points agree bit for bit at positions "
                    f"{self.positions[0]}..{self.positions[1] - 1}")
        first = next((p.diff for p in self.points if p.name == self.first_divergent), None)
        if first is None and self.logits is not None and self.first_divergent == self.logits_name:
            first = self.logits.tensor
        what = f": {NAN_PAYLOAD}" if first is not None and first.nan_payload_only else ""
        if self.first_divergent in cross:
            what += f" ({cross[self.first_divergent].text(self.run_a, self.run_b)})"
        return f"diverges from {self.first_divergent}{what}{tail if self.logits is not None else ''}"

    def schema_extras(self, doc: dict[str, Any]) -> None:
        """The derived keys of the document, and the logits' flips at absolute positions."""
        for rec, p in zip(doc["layers"], self.points):
            rec.update(kernels_a=kernel_rows(p.calls_a, self.positions), kernels_b=kernel_rows(p.calls_b, self.positions),
                       **{"class": (classify(p, self.positions) or {}).get("class")})
        if doc.get("logits") is not None:
            doc["logits"]["argmax_flips"] = len(self.logits.argmax_flips)
            doc["logits"]["flips"] = [{**f, "position": self.positions[0] + f["position"]} for f in doc["logits"]["flips"]]
        origins = [origin_facts(p, self) for p in self.origin_points()]
        failed, reason = self.check()
        doc["check"].update(failed=failed, reason=reason)
        doc.update(origins=origins, first_divergent=self.first_divergent, identical=self.identical,
                   verdict=self.verdict())

    def schema_check(self) -> str | None:
        if not 0 <= self.positions[0] <= self.positions[1]:
            return f"positions {list(self.positions)} are not [first, last + 1]"
        problem = calls_problem(self.logits_calls[0]) or calls_problem(self.logits_calls[1])
        if problem:
            return f"logits calls: {problem}"
        return None

    @classmethod
    def schema_prepare(cls, doc: dict[str, Any]) -> dict[str, Any]:
        """The flips back at positions within the window."""
        lg = doc.get("logits")
        if not isinstance(lg, dict) or not isinstance(lg.get("flips"), list):
            return doc
        first = (doc.get("positions") or [0])[0] if isinstance(doc.get("positions"), (list, tuple)) else None
        if not isinstance(first, int) or isinstance(first, bool):
            return doc  # the record's own check says what is wrong with its positions
        start = first
        flips = [{**f, "position": f["position"] - start} if isinstance(f, dict) and isinstance(f.get("position"), int)
                 else f for f in lg["flips"]]
        return {**doc, "logits": {**lg, "flips": flips}}
