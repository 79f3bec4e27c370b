"""One schema per result type (issue 22, item 1).

Every result dataclass is a :class:`tracer.schema.Record`: its document is derived from its fields,
so ``from_dict(to_dict(x))`` gives ``x`` back for every type, through JSON text as stored in a
trace, with the verdict and ``check()`` unchanged. Cases: generated from the fields' annotations
(a new field is covered with no edit here), real comparisons with skipped points, NaN payloads,
replays, op replays, tolerances, flips, empty tensors and inf, and real results of every loop on
tiny-llama (engine-dump comparisons, an RL comparison, an audit, a sweep, a benchmark). And no
second hand-written list of a result's fields may appear in the package.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import importlib
import json
import math
import pkgutil
import random
import typing
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import tracer
from tests.helpers import run_record
from tracer import schema
from tracer.store.trace import json_safe
from tracer.report.origins import origin_lines

PKG = Path(tracer.__file__).resolve().parent


def _all_records() -> list[type]:
    for m in pkgutil.walk_packages(tracer.__path__, "tracer."):
        if not m.name.endswith("__main__"):
            try:
                importlib.import_module(m.name)
            except ModuleNotFoundError as e:  # a module of an optional engine (vllm) not installed here
                if (e.name or "tracer").startswith("tracer"):
                    raise
    out, todo = set(), [schema.Record]
    while todo:
        for sub in todo.pop().__subclasses__():
            if dataclasses.is_dataclass(sub):  # not a base such as schema.Document
                out.add(sub)
            todo.append(sub)
    return sorted(out, key=lambda c: (c.__module__, c.__qualname__))


RECORDS = _all_records()
#: the result types issue 22 names (a type, not a field list): each must be a Record
RESULT_TYPES = ("Comparison", "PointResult", "SkipRecord", "TensorDiff", "LogitsDiff", "ArgmaxFlip", "NoiseVerdict",
                "Level", "Replay", "OpReplay", "RunError", "Consumes", "Audit", "AuditRow", "Check", "SweepResult",
                "SweepRow", "BenchResult", "Kept", "RLComparison", "TokenStep", "KnobResult")


def test_every_result_type_is_a_record():
    assert set(RESULT_TYPES) <= {c.__name__ for c in RECORDS}


# ---------------------------------------------------------------- equality that sees NaN and -0.0


def same(x, y, where="") -> None:
    """Assert ``y`` equals ``x`` field by field: NaN equals NaN, ``-0.0`` differs from ``0.0``,
    tuples stay tuples and enums their enum."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        assert type(x) is type(y), (where, type(x), type(y))
        for f in dataclasses.fields(x):
            same(getattr(x, f.name), getattr(y, f.name), f"{where}.{f.name}")
    elif isinstance(x, float) and not isinstance(x, bool):
        assert isinstance(y, (int, float)) and not isinstance(y, bool), (where, x, y)
        assert (math.isnan(x) and math.isnan(y)) or (x == y and math.copysign(1, x) == math.copysign(1, y)), (where, x, y)
    elif isinstance(x, (tuple, list)):
        assert type(x) is type(y) and len(x) == len(y), (where, x, y)
        for i, (u, v) in enumerate(zip(x, y)):
            same(u, v, f"{where}[{i}]")
    elif isinstance(x, dict):
        assert isinstance(y, dict) and list(x) == list(y), (where, x, y)
        for k in x:
            same(x[k], y[k], f"{where}.{k}")
    else:
        assert x == y and (type(x) is type(y) or not isinstance(x, enum.Enum)), (where, x, y)


def stored(x):
    """``x`` as :func:`tracer.pipeline.run_scenario` stores it: strict JSON text, then read back."""
    return json.loads(json.dumps(json_safe(x.to_dict()), allow_nan=False))


def round_trip(x) -> None:
    cls = type(x)
    for doc in (x.to_dict(), stored(x)):
        back = cls.from_dict(doc)
        same(x, back, cls.__name__)
        if "nan" not in json.dumps(json_safe(x.to_dict())):
            assert back == x
        same(x.to_dict(), back.to_dict(), "to_dict")  # the derived keys too (a verdict, a count)
    if callable(getattr(x, "check", None)):  # a Comparison: what it says of itself
        back = cls.from_dict(stored(x))
        assert back.verdict() == x.verdict()
        assert origin_lines(back) == origin_lines(x)
        for rule in ("default", None, "any", "flip") + (("tolerance",) if (x.atol, x.rtol) != (None, None) else ()):
            assert back.check(rule) == x.check(rule), rule


# ---------------------------------------------------------------- generated cases


class Gen:
    """Random values for a record's fields, by their annotations (hand-rolled, seeded)."""

    FLOATS = (0.0, -0.0, 1.0, -2.5, 0.1, 1e-300, 5e-324, 3.4e38, math.inf, -math.inf, math.nan)
    STRINGS = ("", "A", "model.layers.0.mlp", "é → ∆", 'q"uo\\te', "x" * 40)

    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)

    def finite(self) -> float:
        return self.r.choice((0.0, -0.0, 1.0, 0.1, -3.25, 1e-300, 5e-324, 3.4e38, self.r.uniform(-1e6, 1e6)))

    def json(self, depth: int = 0):
        """Plain JSON data (an ``Any`` field: facts, shapes): finite numbers, lists, objects."""
        pick = self.r.randrange(6 if depth < 2 else 4)
        if pick == 4:
            return [self.json(depth + 1) for _ in range(self.r.randrange(3))]
        if pick == 5:
            return {f"k{i}": self.json(depth + 1) for i in range(self.r.randrange(3))}
        return (None, self.r.randrange(-5, 10**12), self.finite(), self.r.choice(self.STRINGS))[pick]

    def value(self, tp, owner: str = "", name: str = ""):
        special = getattr(self, f"_{owner}_{name}", None)
        if special is not None:
            return special()
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if tp is typing.Any:
            return self.json()
        if origin is typing.Annotated:  # a value of the base type that passes the declared checks
            checks = [c for c in args[1:] if isinstance(c, schema.Check)]
            if checks and checks[0] is typing.get_args(schema.Span)[1]:
                a = self.r.randrange(10**6)
                return (a, a + self.r.randrange(10**6))
            for _ in range(500):
                v = self.value(args[0])
                if all(c.ok(v) for c in checks):
                    return v
            raise AssertionError(f"no generated {args[0]} passes {checks}")
        if origin in (typing.Union, __import__("types").UnionType):
            opts = [a for a in args if a is not type(None)]
            if type(None) in args and self.r.random() < 0.3:
                return None
            return self.value(self.r.choice(opts))
        if isinstance(tp, type) and issubclass(tp, schema.Record):
            return self.record(tp)
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return self.r.choice(list(tp))
        if tp is float:
            return self.r.choice(self.FLOATS)
        if tp is bool:
            return self.r.random() < 0.5
        if tp is int:
            return self.r.choice((0, 1, -1, 7, 2**31, 2**63 - 1, self.r.randrange(10**6)))
        if tp is str:
            return self.r.choice(self.STRINGS)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return tuple(self.value(a) for a in args)
        if origin in (tuple, list):
            return origin(self.value(args[0]) for _ in range(self.r.randrange(4)))
        if origin is dict:
            return {f"p{i}": self.value(args[1]) for i in range(self.r.randrange(3))}
        if typing.is_typeddict(tp):
            return {k: self.value(t) for k, t in typing.get_type_hints(tp).items()}
        raise AssertionError(f"no generator for {tp}")

    def record(self, cls):
        kw = {f.name: self.value(f.type, cls.__name__, f.name) for f in schema.fields_of(cls)}
        for base in cls.__mro__:  # values the record's schema_check constrains (subclasses too)
            kw = getattr(self, f"_kw_{base.__name__}", lambda k: k)(kw)
        fix = getattr(self, f"_fix_{cls.__name__}", None)
        return fix(kw) if fix else cls(**kw)

    # values a field's meaning constrains (the rest comes from the annotations)
    def calls(self):
        out = []
        for i in range(self.r.randrange(3)):
            s, m = self.r.randrange(40), self.r.randrange(1, 9)
            call = {"positions": [s, s + m], "in": [[1, m, 64]], "out": [[1, m, self.r.choice((64, 128))]]}
            if self.r.random() < 0.5:
                call["kernels"] = {"device": [{"name": self.r.choice(("nvjet_64x8", "gemm_32x64")), "count": 1}],
                                   "ops": [{"name": "aten::mm", "count": i + 1}]}
            out.append(call)
        return out

    _PointResult_calls_a = _PointResult_calls_b = calls

    def _Comparison_logits_calls(self):
        return (self.calls(), self.calls())

    def _Comparison_positions(self):
        s = self.r.randrange(50)
        return (s, s + self.r.randrange(0, 9))

    def _Comparison_facts(self):
        return self.r.choice(({}, {"dtype": "bfloat16", "chunks_a": [[0, 32], [32, 40]], "chunks_b": [[0, 40]],
                                   "notes": ["a note", "é"], "n_tokens": 40}))

    def _Comparison_atol(self):
        return self.r.choice((None, 0.0, 1e-3, 2.0))

    _Comparison_rtol = _Comparison_atol

    def _Comparison_fail_on(self):
        return self.r.choice((None, "any", "flip", "tolerance"))

    def _fix_Comparison(self, kw):
        from tracer.diff.result import Comparison

        if kw["logits"] is None:  # the logits' fields describe the logits: none without them
            kw.update(logits_name=None, logits_calls=([], []), logits_origin=False, logits_n_outside_tol=None,
                      logits_amplification=None, logits_cross_dtype=None)
        if kw["fail_on"] == "tolerance" and kw["atol"] is None and kw["rtol"] is None:
            kw["atol"] = 0.0
        return Comparison(**kw)

    def _kw_TensorDiff(self, kw):  # counts a comparison can give (TensorDiff.schema_check)
        from tracer.diff.metrics import ULP_BINS

        total = self.r.randrange(0, 10**6)
        hist = [self.r.randrange(0, total + 1) if total else 0 for _ in ULP_BINS[1:]]
        while sum(hist) > total:
            hist[self.r.randrange(len(hist))] //= 2
        kw.update(n_total=total, n_diff=sum(hist), ulp_hist=(total - sum(hist), *hist),
                  max_ulp=self.r.randrange(0, 2**40), max_abs_diff=math.inf if math.isnan(kw["max_abs_diff"])
                  else abs(kw["max_abs_diff"]), mean_abs_diff=math.inf if math.isnan(kw["mean_abs_diff"]) else abs(kw["mean_abs_diff"]),
                  **{k: self.r.randrange(0, total + 1) for k in ("n_nan_a", "n_nan_b", "n_inf_a", "n_inf_b", "n_nan_payload")})
        return kw

    def _kw_LogitsDiff(self, kw):  # flips inside the compared positions (LogitsDiff.schema_check)
        from dataclasses import replace

        flips = kw["argmax_flips"]
        n = self.r.randrange(max(1, len(flips)), 50)
        at = sorted(self.r.sample(range(n), len(flips)))  # one flip per position, at most n of them
        kw.update(n_positions=n, argmax_flips=tuple(replace(f, position=p) for f, p in zip(flips, at)))
        return kw

    def _RunPlan_chunks(self):  # chunks tile [0, N) in order (RunPlan.__post_init__)
        cuts = sorted(self.r.sample(range(1, 64), self.r.randrange(0, 3)))
        edges = [0, *cuts, 64]
        return tuple((a, b) for a, b in zip(edges, edges[1:]))

    def _KvTransfer_role(self):  # KvTransfer.schema_check: one of the boundaries
        from tracer.load.kv_contract import KV_TRANSFER_ROLES

        return self.r.choice(KV_TRANSFER_ROLES)

    def _KVContract_transfer_unit(self):  # KVContract.schema_check: token or block-row
        return self.r.choice(("token", "block-row"))

    def _kv_size(self):  # KVContract.schema_check: sizes >= 0
        return self.r.choice((0, 1, 32, self.r.randrange(10**6)))

    _KVContract_block_size = _KVContract_layers = _KVContract_kv_heads = _KVContract_head_dim = _kv_size

    def _KVContract_tp_degree(self):  # KVContract.schema_check: >= 1
        return self.r.choice((1, 2, 8))

    def _RunPlan_generate(self):  # gemm_m() lists one M per generated token
        return self.r.randrange(0, 8)

    def _fix_RunPlan(self, kw):
        from tracer.plan.plans import RunPlan

        if kw["devices"] is not None:
            kw["devices"] = tuple(self.r.choice(("cpu", "cuda:0")) for _ in kw["chunks"])
        if kw["batch"] is not None and (kw["generate"] or (kw["batch"].padding != "none" and len(kw["chunks"]) > 1)):
            kw["batch"] = None
        kw["engine_settings"] = tuple((f"k{i}", self.json()) for i in range(self.r.randrange(3)))
        return RunPlan(**kw)

    def _fix_Batch(self, kw):
        from tracer.plan.plans import Batch

        size = self.r.randrange(1, 5)
        return Batch(size, self.r.randrange(size), "none", (self.r.randrange(1, 100),) * size)

    def _fix_RLSpec(self, kw):
        from tracer.plan.rollout import ROLES, RLSpec, TRAIN_BATCHINGS

        k = self.r.randrange(1, 5)
        kw.update(role=self.r.choice(ROLES), rollouts=k, row=self.r.randrange(k), new_tokens=self.r.randrange(1, 9),
                  lengths=tuple(self.r.randrange(1, 50) for _ in range(k)), batching=self.r.choice(TRAIN_BATCHINGS))
        return RLSpec(**kw)

    def _Scenario_params(self):
        from tracer.plan.quant import FORMATS

        fmt = {"kv_block_format": self.r.choice(list(FORMATS.values()))[1].to_dict()} if self.r.random() < 0.3 else {}
        return {**{f"o{i}": self.json() for i in range(self.r.randrange(3))}, **fmt}

    def _fix_IndexEntry(self, kw):  # a shape of fewer than schema.BIG elements
        from tracer.store.validate import IndexEntry

        kw["shape"] = tuple(self.r.randrange(0, 5000) for _ in range(self.r.randrange(4)))
        return IndexEntry(**kw)

    def _AuditRow_status(self):
        from tracer.plan.hierarchy import STATUSES

        return self.r.choice(STATUSES)

    def _Check_level(self):
        return self.r.randrange(8)

    def _BenchResult_times(self):
        from tracer.loops.bench import MODES

        modes = MODES + (("peer_hf",) if self.r.random() < 0.5 else ())
        return {m: [self.r.uniform(0.01, 3.0) for _ in range(self.r.randrange(1, 4))] for m in modes}

    def _BenchResult_trace_bytes(self):
        return self.r.randrange(1, 1 << 40)


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_generated_records_round_trip(cls):
    for seed in range(25):
        round_trip(Gen(seed).record(cls))


def test_a_new_field_round_trips_with_no_other_edit():
    """A field added to a result type (here: a subclass with two more) is in the document and comes back."""
    from tracer.diff.metrics import TensorDiff

    @dataclasses.dataclass(frozen=True)
    class Wider(TensorDiff):
        n_subnormal: int = 0
        worst_at: tuple[int, ...] = ()

    x = replace(Gen(3).record(Wider), n_subnormal=5, worst_at=(2, 7))
    assert x.to_dict()["n_subnormal"] == 5 and x.to_dict()["worst_at"] == [2, 7]
    round_trip(x)
    # and in the CSV rows, beside every other field of the metrics (n_nan_payload included)
    import csv
    import io

    from tracer.report.tables import to_csv

    def wider(d, i):
        return Wider(**{f.name: getattr(d, f.name) for f in dataclasses.fields(d)}, n_subnormal=i)

    c = COMPARISONS["planted"]
    c = replace(c, points=tuple(replace(p, diff=wider(p.diff, i)) for i, p in enumerate(c.points)),
                logits=replace(c.logits, tensor=wider(c.logits.tensor, 99)))
    rows = list(csv.DictReader(io.StringIO(to_csv(c))))
    assert [r["n_subnormal"] for r in rows] == [str(i) for i in range(len(c.points))] + ["99"]
    assert [r["n_nan_payload"] for r in rows[:-1]] == [str(p.diff.n_nan_payload) for p in c.points]
    assert {f.name for f in dataclasses.fields(Wider)} - {"ulp_hist"} <= set(rows[0])


# ---------------------------------------------------------------- real comparisons


_run = functools.partial(run_record, ids=(1, 2, 3, 4, 5, 6), window=(2, 6), chunks=[[0, 2], [2, 6]])


def _nan(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32).item()


def _comparisons():
    """Real comparisons (compare_records) of hand-made runs with every edge the schema must keep."""
    from tracer.diff.compare import compare_records
    from tracer.diff.replay import replay_diff
    from tracer.diff.verdict import Level, NoiseVerdict, judge

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=g)
    kv = torch.randn(6, 8, generator=g)  # a KV cache over all 6 positions
    xb = x.clone()
    xb[1, 3] += 1e-3  # a small difference
    xb[2, 0] = math.inf  # inf in run B only
    nan_a, nan_b = x.clone(), x.clone()
    nan_a.view(torch.int32)[0, 1], nan_b.view(torch.int32)[0, 1] = 0x7FC00001, 0x7FC00002  # payloads differ
    kvb = kv.clone()
    kvb[0, 0] += 1.0  # before the window: born in the prefix pass
    lg = torch.tensor([[0.0, 1.0, 3.0, 2.0], [5.0, 1.0, 0.0, 4.9], [1.0, 1.0, 1.0, 1.0], [0.0, -1.0, 2.0, 2.5]])
    lb = lg.clone()
    lb[1, 3] = 5.5  # an argmax flip at position 3 (window start 2 + 1)
    calls = {"model.layers.0.self_attn.kv_cache": [{"positions": [0, 6], "in": [], "out": [[6, 8]]}],
             "lin": [{"positions": [2, 6], "in": [[1, 4, 8]], "out": [[1, 4, 8]],
                      "kernels": {"device": [{"name": "nvjet_64x8", "count": 1}], "ops": []}}]}
    empty = torch.empty(0, 8)
    a = _run("A", [("emb", "embedding", x), ("model.layers.0.self_attn.kv_cache", "kv_cache", kv),
                   ("lin", "linear", x), ("model.layers.0", "layer", nan_a), ("gone", "layer", x),
                   ("half", "norm", x), ("both_empty", "mlp", empty), ("head", "logits", lg)], calls=calls)
    b = _run("B", [("emb", "embedding", x.clone()), ("model.layers.0.self_attn.kv_cache", "kv_cache", kvb),
                   ("lin", "linear", xb), ("model.layers.0", "layer", nan_b), ("half", "norm", empty),
                   ("both_empty", "mlp", empty.clone()), ("head", "logits", lb)], calls=calls)
    out = {"planted": compare_records(a, b, scenario="s", model="m"),
           "tolerance": compare_records(a, b, scenario="s", model="m", atol=1e-2, rtol=0.0),
           "identical": compare_records(a, a, scenario="s", model="m", atol=0.0)}
    base = Level("bfloat16", 2**-7, 0.5, 8.0, False)
    verdict, reason, levels = judge(base, [Level("float32", 2**-23, 0.4, 7.9, False)])
    out["replay+noise"] = replace(out["planted"], fail_on="flip",
                                  replay=replay_diff([5, 6, 7], [5, 9, 7], "a b c", None),
                                  noise=NoiseVerdict(verdict, reason, "model.layers.0", levels))
    out["op_replay"] = replace(out["tolerance"], fail_on="tolerance", op_replay=_op_replays(out["tolerance"]))
    return out


def _op_replays(c):
    """The float64 replay of a real Linear for both runs, and one op that does not replay."""
    from tracer.diff.accuracy import replay_point
    from tracer.diff.dataflow import Consumes
    from tracer.diff.result import PointResult

    torch.manual_seed(0)
    net = nn.Module()
    net.lin = nn.Linear(8, 4, bias=True)
    xin = torch.randn(3, 8)
    with torch.no_grad():
        y = net.lin(xin)
    yb = y.clone()
    yb[0, 0] = torch.nextafter(yb[0, 0], torch.tensor(math.inf))
    point = PointResult("lin", "linear", "Linear", c.points[0].diff, consumes=Consumes(points=("x",)))
    good = replay_point(net, point, {"A": {"x": xin, "lin": y}, "B": {"x": xin, "lin": yb}})
    assert good.op == "Linear" and set(good.errors) == {"A", "B"}
    bad = replay_point(net, replace(point, name="virtual"), {"A": {}, "B": {}})
    assert bad.op is None and bad.reason
    return {"lin": good, "virtual": bad}


COMPARISONS = _comparisons()


def test_the_real_cases_hold_every_edge():
    c = COMPARISONS["planted"]
    points = {p.name: p for p in c.points}
    assert [s.reason for s in c.skipped] == ["missing in run B", "empty in run B"] and not c.identical
    assert c.verdict().startswith("diverges from")  # a divergence and skipped points
    assert points["model.layers.0"].diff.n_nan_payload == 1
    assert points["lin"].diff.n_inf_b == 1 and points["lin"].diff.max_abs_diff == math.inf
    assert points["both_empty"].diff.n_total == 0
    assert points["model.layers.0.self_attn.kv_cache"].n_diff_prefix == 1
    assert [f.position for f in c.logits.argmax_flips] == [1] and c.logits_calls == ([], [])
    assert COMPARISONS["tolerance"].points[0].n_outside_tol == 0 and COMPARISONS["tolerance"].check("tolerance")[0]
    assert COMPARISONS["op_replay"].op_replay["lin"].errors["A"].n == 12


@pytest.mark.parametrize("name", list(COMPARISONS))
def test_real_comparisons_round_trip(name):
    round_trip(COMPARISONS[name])
    for p in COMPARISONS[name].points:
        round_trip(p)


# ---------------------------------------------------------------- real results of every loop, on tiny-llama


@pytest.fixture(scope="module")
def real_results(tmp_path_factory):
    """One real result of each kind the issue names besides hand-made comparisons: an engine-dump
    comparison (a planted difference in the dump), an RL comparison with its mitigations, an audit,
    a sweep and a benchmark, all from tiny-llama on the CPU (about 10 s)."""
    import tracer
    from tracer.diff.compare_dump import compare_dump
    from tracer.loops.bench import bench
    from tracer.engines.dumps.sglang_writer import write_sglang_dump

    d = tmp_path_factory.mktemp("real")
    lm = tracer.load_model("tiny-llama", dtype="bfloat16", device="cpu", progress=False)
    tracer.run(lm, length=40, split_at=32, granularity="sublayers", output=str(d / "ref.h5"), progress=False)
    dump = write_sglang_dump(str(d / "ref.h5"), "B", d / "dump", tp=2, chunk=5)
    out = {"engine dump, identical": compare_dump((str(d / "ref.h5"), "B"), str(dump))}
    handle = lm.model.model.layers[1].mlp.register_forward_hook(lambda m, a, y: y + 0.25)  # the 'engine' differs
    try:
        tracer.run(lm, length=40, split_at=32, granularity="sublayers", output=str(d / "bad.h5"), progress=False)
    finally:
        handle.remove()
    dump = write_sglang_dump(str(d / "bad.h5"), "B", d / "bad", tp=2)
    out["engine dump, planted"] = compare_dump((str(d / "ref.h5"), "B"), str(dump), atol=1e-3, rtol=0.0)
    out["rl"] = tracer.run(lm, scenario="rollout-vs-train", length=12, new_tokens=3, rollouts=2, mitigations=True,
                           progress=False, store="none").comparison
    out["audit"] = tracer.audit(lm, levels="0,1,3", length=48, progress=False)
    out["sweep"] = tracer.sweep(lm, lengths="17:18", block_sizes=[8], progress=False, output=str(d / "sweep.h5"))
    out["bench"] = bench("tiny-llama", length=32, device="cpu", reps=1, warmup=0, outdir=str(d / "bench"))
    return out


def test_the_real_results_are_what_they_say(real_results):
    ident, planted = real_results["engine dump, identical"], real_results["engine dump, planted"]
    assert ident.identical and ident.facts["engine"] == planted.facts["engine"] == planted.run_b
    assert [p.name for p in planted.origins] == ["model.layers.1.mlp"] and (planted.atol, planted.rtol) == (1e-3, 0.0)
    rl = real_results["rl"].rl
    assert rl is not None and rl.steps and rl.mitigations and any(m.ran for m in rl.mitigations)
    assert {r.status for r in real_results["audit"].rows} >= {"passed", "skipped"}  # L3 block size: N=48 < 64
    assert len(real_results["sweep"].rows) == 2 and real_results["sweep"].complete
    assert real_results["bench"].times and real_results["bench"].trace_bytes > 0


@pytest.mark.parametrize("name", ["engine dump, identical", "engine dump, planted", "rl", "audit", "sweep", "bench"])
def test_real_results_of_every_kind_round_trip(real_results, name):
    x = real_results[name]
    round_trip(x)
    if name == "rl":
        for part in (x.rl, *x.rl.steps, *x.rl.mitigations):
            round_trip(part)
    if name == "audit":
        for row in x.rows:
            round_trip(row)
            round_trip(row.check)
    if name == "sweep":
        from tracer.loops.sweep import read_sweep

        assert read_sweep(x.path) == x  # the sweep file read back: the same result
        for row in x.rows:
            round_trip(row)


def test_skipped_only_is_not_comparable_after_the_round_trip():
    from tracer.diff.compare import compare_records

    x = torch.ones(4, 8)
    c = compare_records(_run("A", [("a", "layer", x), ("b", "layer", x)]), _run("B", [("a", "layer", x)]),
                        scenario="s", model="m")
    back = type(c).from_dict(stored(c))
    assert back.verdict().startswith("NOT comparable") and back.check("any")[0]


def test_documents_of_earlier_versions_still_read():
    """A document without the fields added since (skipped, op_replay, logits calls, n_nan_payload)
    reads with their defaults; the keys it has come back as written."""
    c = COMPARISONS["planted"]
    doc = stored(c)
    for key in ("skipped", "op_replay"):
        del doc[key]
    for key in ("calls", "amplification"):
        del doc["logits"][key]
    for layer in doc["layers"]:
        del layer["n_nan_payload"]
    back = type(c).from_dict(doc)
    assert back.skipped == () and back.op_replay is None and back.logits_calls == ([], [])
    assert all(p.diff.n_nan_payload == 0 for p in back.points)
    assert [p.name for p in back.points] == [p.name for p in c.points] and back.logits == c.logits


def test_a_malformed_document_is_one_line_naming_the_key():
    from tracer.diff.stored import comparison_from_dict
    from tracer.errors import TracerError

    doc = stored(COMPARISONS["planted"])
    doc["layers"][1]["n_diff"] = "many"
    with pytest.raises(TracerError, match=r"layers\[1\]|n_diff"):
        comparison_from_dict(doc)
    del doc["layers"]
    with pytest.raises(TracerError, match="layers: missing"):
        comparison_from_dict(doc)


# ---------------------------------------------------------------- no second list of a result's fields


def test_the_schema_is_the_dataclass_fields():
    for cls in RECORDS:
        assert [f.name for f in schema.fields_of(cls)] == [f.name for f in dataclasses.fields(cls)], cls
        assert "to_dict" not in vars(cls) and "from_dict" not in vars(cls), f"{cls.__name__} writes its own document"


def test_no_result_dataclass_in_diff_loops_store_writes_its_own_document():
    bad = []
    for stage in ("diff", "loops", "store"):
        for path in (PKG / stage).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                    own = [f.name for f in node.body if isinstance(f, ast.FunctionDef) and f.name in ("to_dict", "from_dict")]
                    bad += [f"{path.name}:{node.name}.{n}" for n in own]
    assert bad == []


def field_lists(source: str, records: list[type]) -> list[str]:
    """Literal tuples, lists, sets and dict keys of 3 or more strings that name more than half of a
    record's fields (and nothing else but its document keys): a hand-written copy of its schema."""
    names = {}
    for cls in records:
        fields = {f.name for f in dataclasses.fields(cls)}
        names[cls] = (fields, fields | {str(f.path[0]) for f in schema.fields_of(cls)})
    out = []
    for node in ast.walk(ast.parse(source)):
        elts = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None) if isinstance(
            node, (ast.Tuple, ast.List, ast.Set)) else None
        if not elts or not all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elts):
            continue
        strs = {e.value for e in elts}
        for cls, (fields, keys) in names.items():
            if len(strs) >= 3 and strs <= keys and len(strs & fields) > len(fields) / 2:
                out.append(f"line {node.lineno}: {cls.__name__} {sorted(strs)[:4]}...")
    return out


def test_the_detector_finds_the_old_hand_written_lists():
    old_tensor_fields = ('_TENSOR_FIELDS = ("n_total", "n_diff", "max_abs_diff", "mean_abs_diff", "max_ulp", "ulp_hist", '
                         '"rel_error", "cosine", "sqnr_db", "frac_rel_lt_1e3", "frac_rel_lt_5e3", "n_nan_a", "n_nan_b", '
                         '"n_inf_a", "n_inf_b", "max_ulp_mag")')
    old_consumes = 'd = {"points": list(self.points), "prefix": list(self.prefix), "rule": self.rule}'
    old_rows = 'ROW_FIELDS = {"length": 1, "block_size": 1, "split_at": 1, "n_positions": 1, "first_divergent": 1, "wall_s": 1, "argmax_flips": 1}'
    for src in (old_tensor_fields, old_consumes, old_rows):
        assert field_lists(src, RECORDS), src


def test_no_second_hand_written_list_of_a_results_fields():
    found = {str(p.relative_to(PKG.parent)): field_lists(p.read_text(), RECORDS) for p in PKG.rglob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}


# ---------------------------------------------------------------- PointKind


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_every_kind_a_model_has_is_a_point_kind(family):
    from tests.helpers import make_model
    from tracer.execute.points import discover_points
    from tracer.execute.kinds import PointKind

    kinds = {p.kind for g in ("layers", "sublayers") for p in discover_points(make_model(family), g)}
    assert kinds <= set(PointKind) and {"kv_cache", "attention_core", "linear", "logits"} <= kinds


def test_an_unknown_kind_is_refused_in_one_line():
    from tracer.diff.compare import compare_records
    from tracer.errors import TracerError

    x = torch.ones(4, 8)
    with pytest.raises(TracerError, match="kind 'gizmo', which this tracer does not know"):
        compare_records(_run("A", [("g", "gizmo", x)]), _run("B", [("g", "gizmo", x)]), scenario="s", model="m")


def test_a_list_or_object_against_a_union_with_an_enum_decodes_as_the_other_member():
    import enum
    from typing import Union

    from tracer.schema import decode_value

    class Mode(enum.Enum):
        A = "a"

    tp = Union[Mode, list[int]]
    assert decode_value([1, 2], tp, "x") == [1, 2] and decode_value("a", tp, "x") is Mode.A
    assert decode_value({"k": 1}, Union[Mode, dict[str, int]], "x") == {"k": 1}


def test_the_decoders_short_cuts_refuse_what_the_item_by_item_path_refuses():
    """A shape decodes as itself only when every dimension is an int in range, and a checked calls
    document is remembered by its JSON text: ``1`` and ``true`` are not the same document."""
    from tracer.errors import TracerError
    from tracer.execute.records import calls_problem
    from tracer.schema import Shape, decode_value

    assert decode_value([1, 128, 576], Shape, "s") == (1, 128, 576)
    for bad, place in (([1, True], r"s\[1\]: expected int, got True"), ([1, -1], r"s\[1\]: -1 is not a count"),
                       ([2.0], r"s\[0\]: expected int, got 2.0"), (list(range(17)), "at most 16 dimensions")):
        with pytest.raises(TracerError, match=place):
            decode_value(bad, Shape, "s")
    good = [{"positions": [0, 1], "out": [[1, 1, 8]]}]
    assert calls_problem(good) is None
    assert calls_problem([{"positions": [0, 1], "out": [[1, True, 8]]}]) == "calls[0].out[0][1]: expected int, got True"
    assert calls_problem([{"positions": [0, 1], "out": [[1, 1.0, 8]]}]) is not None
    assert calls_problem(good) is None


def test_a_refused_calls_document_is_named_by_its_own_values():
    """This stop's attacker: the calls check remembered refusals by JSON text, where a tuple and a
    list read alike, so a list was refused quoting the tuple checked before it; and a list nested
    too deep for ``json.dumps`` raised RecursionError instead of being decoded."""
    import json

    from tracer.execute.records import calls_problem

    assert calls_problem([{"positions": (3, 1)}]).startswith("calls[0].positions: (3, 1) is not")
    assert calls_problem([{"positions": [3, 1]}]).startswith("calls[0].positions: [3, 1] is not")
    nested: object = 0
    for _ in range(5000):
        nested = [nested]
    with pytest.raises(RecursionError):
        json.dumps(nested)
    assert calls_problem([{"zzz": nested}]) is None  # an unknown key is not the calls' business (as before)
