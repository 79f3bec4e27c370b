"""The result types of a comparison: one point's metrics, a skipped point, the whole comparison.

:class:`Comparison` is the amplification table as data, and it says what it means: its verdict
(:meth:`Comparison.verdict`), its judgement by a ``--fail-on`` rule (:meth:`Comparison.check`) and
one line per origin (:meth:`Comparison.origin_lines`, from :func:`origin_line`: the op, the shapes
it saw in both runs, how much differs). The engine that builds it is :mod:`tracer.diff.compare`;
the origin analysis :mod:`tracer.diff.origins`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tracer import schema
from tracer.diff.accuracy import OpReplay
from tracer.diff.capture_contract import ContractMismatch
from tracer.diff.crossdtype import CrossDtype
from tracer.diff.dataflow import Consumes
from tracer.diff.metrics import LogitsDiff, TensorDiff
from tracer.diff.positions import PerPosition
from tracer.diff.provenance import class_text, classify, kernel_rows
from tracer.diff.replay import Replay
from tracer.diff.rl import RLComparison
from tracer.diff.verdict import NoiseVerdict
from tracer.errors import TracerError
from tracer.execute.kinds import CACHE_KINDS, PointKind, point_kind
from tracer.plan.checks import FAIL_ON, check_fail_on  # noqa: F401 - re-exported

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
        from tracer.store.fields import calls_problem

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
        facts: short facts for the report header (:func:`run_facts`).
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
    facts: dict[str, Any] = schema.field(default_factory=dict)
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

    def origin_lines(self) -> list[str]:
        """One line per origin: op type, shapes in both runs, how much differs (see :func:`origin_line`)."""
        return [origin_line(p, self) for p in self.origin_points()]

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
                return True, (f"{self.rl.argmax_flips} argmax flip(s) in the RL step's {self.rl.n_tokens} positions "
                              f"({flips} in the traced sequence)")
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
        flips = len(self.logits.argmax_flips) if self.logits is not None else 0
        n_logits = self.logits.n_positions if self.logits is not None else self.n_positions  # vLLM: where it samples
        tail = f", {flips} argmax flip{'s' if flips != 1 else ''} in {n_logits} position{'s' if n_logits != 1 else ''}"
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
        origins = [origin_record(p, self) for p in self.origin_points()]
        failed, reason = self.check()
        doc["check"].update(failed=failed, reason=reason)
        doc.update(origins=origins, first_divergent=self.first_divergent, identical=self.identical,
                   verdict=self.verdict())

    def schema_check(self) -> str | None:
        from tracer.store.fields import calls_problem, check_facts

        if not 0 <= self.positions[0] <= self.positions[1]:
            return f"positions {list(self.positions)} are not [first, last + 1]"
        problem = calls_problem(self.logits_calls[0]) or calls_problem(self.logits_calls[1])
        if problem:
            return f"logits calls: {problem}"
        try:
            check_facts(self.facts, TracerError)
        except TracerError as e:
            return str(e)
        return None

    @classmethod
    def schema_prepare(cls, doc: dict[str, Any]) -> dict[str, Any]:
        """The flips back at positions within the window."""
        lg = doc.get("logits")
        if not isinstance(lg, dict) or not isinstance(lg.get("flips"), list):
            return doc
        start = int((doc.get("positions") or [0])[0])
        flips = [{**f, "position": f["position"] - start} if isinstance(f, dict) and isinstance(f.get("position"), int)
                 else f for f in lg["flips"]]
        return {**doc, "logits": {**lg, "flips": flips}}


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
    ins, outs = ([ins] if ins and isinstance(ins[0], int) else ins), ([outs] if outs and isinstance(outs[0], int) else outs)
    ins, outs = [x for x in ins if x], [x for x in outs if x]  # one flat shape (the spec's example); no None
    if p.kind in CACHE_KINDS:
        return {"positions": list(call["positions"]), **({"parts": outs} if p.kind == PointKind.STATE else {})}
    if p.kind == PointKind.ATTENTION_CORE and ins:
        return {"queries": _prod(ins[0][:-1]), "keys": int(call["positions"][1]), "width": int(ins[0][-1])}
    if p.kind in (PointKind.LINEAR,) and ins and outs:
        return {"M": _prod(ins[0][:-1]), "N": int(outs[0][-1]), "K": int(ins[0][-1])}
    if p.kind == PointKind.LOGITS and ins and outs:
        return {"M": _prod(ins[0][:-1]), "N": int(outs[0][-1]), "K": int(ins[0][-1])}
    src = ins[0] if p.kind in (PointKind.ATTENTION_CORE, PointKind.MLP_HIDDEN) and ins else (outs[0] if outs else None)
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
    if p.kind == PointKind.KV_CACHE:
        first, stop = (a.get("positions") or [0, 0])
        text = f"positions {first}..{stop - 1}"
        if p.n_diff_prefix:
            ma = _chunk_of(c.facts.get("chunks_a"), first)
            mb = _chunk_of(c.facts.get("chunks_b"), first)
            if ma is not None and mb is not None:
                text += (f"; positions {first}..{c.positions[0] - 1} computed by a forward pass of "
                         f"{ma} tokens in {c.run_a} vs {mb} in {c.run_b}")
        return text
    if p.kind == PointKind.STATE:
        parts = " + ".join("×".join(map(str, x)) for x in a.get("parts") or [])
        return f"after position {(a.get('positions') or [0, 0])[1] - 1}" + (f", {parts}" if parts else "")
    if "rows" in a and "rows" in b:
        return f"rows {each(ea, 'rows')} vs {each(eb, 'rows')}, width {a['width']}"
    return ""


def origin_line(p: PointResult, c: Comparison) -> str:
    """``model.layers.21.post_attention_layernorm (RMSNorm, rows 250 vs 10, width 576): 8 elements, max 1 ULP``.

    Adds where the difference sits for a ``kv_cache`` point (before the window: born in the
    earlier forward pass, not traced op by op) and, for a decoder layer origin at layers
    granularity, the hint to re-run with ``--granularity sublayers``.
    """
    op = "KVCache" if p.kind == PointKind.KV_CACHE else p.op
    shapes = _shape_text(p, c)
    head = f"{p.name} ({op}{', ' + shapes if shapes else ''})"
    d = p.diff
    ulp = f"max {d.max_ulp} ULP" if d.max_ulp <= 16 else f"max {d.max_ulp_mag:.3g} ULP of the larger magnitude"
    body = f"{d.n_diff:,} element{'s' if d.n_diff != 1 else ''}, {ulp}, max |Δ| {d.max_abs_diff:.3g}"
    if d.nan_payload_only:
        body = f"{d.n_diff:,} element{'s' if d.n_diff != 1 else ''}: {NAN_PAYLOAD}"
    tail = ""
    if p.kind == PointKind.KV_CACHE and p.n_diff_prefix:
        inside = d.n_diff - p.n_diff_prefix
        tail = (f"; {p.n_diff_prefix:,} of them before the compared window: born in the forward pass that "
                f"computed those positions (not traced op by op)" + (f", {inside:,} inside it" if inside else ""))
    subs = [q for q in c.points if q.name.startswith(p.name + ".") and q.kind not in CACHE_KINDS]
    if p.kind == PointKind.LAYER and not subs:
        tail = f"; origin within {p.name} (" + ("sublayers need a family descriptor: hooks/README.md)"
                                               if c.facts.get("family_inferred") else
                                               "use --granularity sublayers to find the op)")
    if p.kind == PointKind.STATE:
        tail = ("; the recurrent state mixes every position, those of the prefix pass included"
                + ("" if [q for q in c.points if q.name.startswith(p.name.rsplit(".", 1)[0] + ".")
                          and q.kind not in CACHE_KINDS] else " (use --granularity sublayers for the mixer's ops)"))
    if p.kind == PointKind.KV_CACHE and not [q for q in c.points if q.name.startswith(p.name.rsplit(".", 1)[0] + ".")
                                     and q.kind not in (PointKind.KV_CACHE,)] and p.diff.n_diff - (p.n_diff_prefix or 0) > 0:
        tail += "; inside the window: origin within the layer's K/V projection (use --granularity sublayers)"
    info = classify(p, c.positions)
    if info is not None and (info["kernels_a"] != "-" or info["kernels_b"] != "-"):
        tail += f"; {class_text(info, c.run_a, c.run_b)}"
    if c.op_replay and p.name in c.op_replay:
        tail += f"; replay in float64: {c.op_replay[p.name].text}"
    return f"{head}: {body}{tail}"
