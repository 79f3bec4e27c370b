"""Origin classification on a model with a divergence planted in one known op (run B only)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import make_model
from tracer.execute.points import discover_points
from tracer.diff.compare import compare_records
from tracer.diff.dataflow import dataflow
from tracer.execute.records import RunRecord
from tracer.engines.hf.run import execute
from tracer.plan.scenarios import prefix_cache
from tracer.report.origins import origin_lines

IDS = [(11 * i + 5) % 500 for i in range(40)]
SCEN = prefix_cache(len(IDS), block_size=16)  # N = 40, P = 32: window 32..39


@pytest.fixture(scope="module")
def model():
    return make_model("llama", torch.bfloat16, seed=3)


def _flip_one_ulp(position: int, feature: int):
    """Forward hook: +1 on the bit pattern of one element at absolute ``position`` (a 1-ULP change)."""
    def hook(module, args, output):
        start = hook.pos  # absolute position of the call's first token
        t = output.shape[1]
        hook.pos += t
        if start <= position < start + t:
            out = output.clone()
            out.view(torch.int16)[0, position - start, feature] += 1
            return out
        return None
    hook.pos = 0
    return hook


def _runs(model, granularity, module=None, hook=None, plan_a=SCEN.plan_a):
    points = discover_points(model, granularity)
    a = execute(model, IDS, plan_a, points, SCEN.window)
    handle = model.get_submodule(module).register_forward_hook(hook) if module else None
    try:
        b = execute(model, IDS, SCEN.plan_b, points, SCEN.window)
    finally:
        if handle is not None:
            handle.remove()
    return a, b


def _precondition_identical(model, granularity):
    a, b = _runs(model, granularity)
    c = compare_records(a, b, scenario="s", model="m")
    assert c.identical, "this test needs a model whose unperturbed runs agree bit for bit on this CPU"


@pytest.mark.parametrize("granularity", ["sublayers", "layers"])
def test_planted_ulp_in_up_proj_is_the_only_origin(model, granularity):
    _precondition_identical(model, granularity)
    target = "model.layers.1.mlp.up_proj"
    # sublayers: a 1-ULP flip; layers: a visible shift (1 ULP of one up_proj element may round away
    # in down_proj, leaving the layer output identical)
    plant = _flip_one_ulp(position=37, feature=9) if granularity == "sublayers" else _shifted(37, 0.5)
    a, b = _runs(model, granularity, target, plant)
    # independent oracle: which captures differ, from the raw bits
    differs = {n: not torch.equal(a.captures[n].tensor.view(torch.int16), b.captures[n].tensor.view(torch.int16))
               for n in a.captures}
    c = compare_records(a, b, scenario="s", model="m")
    names = [p.name for p in c.points]
    if granularity == "sublayers":
        assert [o.name for o in c.origins] == [target]
        assert differs[target] and not any(differs[n] for n in names[: names.index(target)])
        up = next(p for p in c.points if p.name == target)
        assert up.diff.n_diff == 1 and up.diff.max_ulp == 1
        line = origin_lines(c)[0]
        # GEMM M = tokens of the call that computed the window: 40 in A (one pass), 8 in B (suffix)
        assert line.startswith(f"{target} (Linear, GEMM M×N×K 40×128×64 in A vs 8×128×64 in B): 1 element, max 1 ULP")
    else:
        assert [o.name for o in c.origins] == ["model.layers.1"]
        assert "origin within model.layers.1 (use --granularity sublayers" in origin_lines(c)[0]
    for p in c.points:
        assert p.diverged == differs[p.name], p.name
        if p.diverged and not p.origin:
            assert p.differing_inputs and all(differs[d] for d in p.differing_inputs), p.name
    assert not c.logits_origin
    doc = c.to_dict()
    assert [o["name"] for o in doc["origins"]] == [o.name for o in c.origins]
    assert [r["name"] for r in doc["layers"] if r["origin"]] == [o.name for o in c.origins]


def _add_at(position: int, delta: float):
    """Forward hook adding ``delta`` to every feature at absolute ``position`` (keys of the prefix)."""
    return _shifted(position, delta)


def _shifted(position, delta):
    def hook(module, args, output):
        start = hook.pos
        t = output.shape[1]
        hook.pos += t
        if start <= position < start + t:
            out = output.clone()
            out[0, position - start] += delta
            return out
        return None
    hook.pos = 0
    return hook


def test_planted_prefix_key_makes_the_kv_cache_the_origin(model):
    """A perturbed key at a prefix position (outside the window): the window's k_proj rows agree,
    the attention core differs. The origin must be found (the layer's KV cache, before the window),
    never 'no origin'; the core is propagated from it."""
    _precondition_identical(model, "sublayers")
    a, b = _runs(model, "sublayers", "model.layers.1.self_attn.k_proj", _add_at(position=5, delta=0.5))
    c = compare_records(a, b, scenario="s", model="m")
    by = {p.name: p for p in c.points}
    assert not by["model.layers.1.self_attn.k_proj"].diverged  # only window rows are compared there
    kv = by["model.layers.1.self_attn.kv_cache"]
    # independent: the stored cache rows of position 5 differ, window rows do not
    ta, tb = a.captures[kv.name].tensor, b.captures[kv.name].tensor
    rows_differ = sorted({int(i) for i in torch.nonzero(ta.view(torch.int16) != tb.view(torch.int16))[:, 0]})
    assert rows_differ == [5]
    assert [o.name for o in c.origins] == [kv.name] and kv.n_diff_prefix == kv.diff.n_diff
    core = by["model.layers.1.self_attn.core"]
    assert core.diverged and not core.origin and core.differing_inputs == (kv.name,)
    assert "before the compared window" in origin_lines(c)[0]

    # without the KV-cache capture (e.g. a trace that lacks it) the core itself is the origin
    def drop_kv(r):
        return RunRecord(r.name, r.token_ids, r.plan, r.window,
                         {n: x for n, x in r.captures.items() if x.kind != "kv_cache"}, r.meta)

    c2 = compare_records(drop_kv(a), drop_kv(b), scenario="s", model="m")
    assert [o.name for o in c2.origins] == ["model.layers.1.self_attn.core"]


def test_prefix_divergence_propagates_through_the_caches(model):
    """A key perturbed in layer 0's prefix pass changes every later layer's prefix K/V: only layer 0's
    cache is an origin, the later caches are propagated (through the previous layer's cache)."""
    a, b = _runs(model, "layers", "model.layers.0.self_attn.k_proj", _add_at(position=3, delta=0.5))
    c = compare_records(a, b, scenario="s", model="m")
    kvs = [p for p in c.points if p.kind == "kv_cache"]
    assert kvs[0].origin and kvs[0].n_diff_prefix
    for p in kvs[1:]:
        if p.diverged:
            assert not p.origin and p.differing_inputs


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma", "phi3", "gpt2", "mistral", "qwen2"])
def test_dataflow_names_only_real_points_and_every_point(family):
    model = make_model(family)
    points = discover_points(model, "sublayers")
    names = [(p.name, p.kind) for p in points]
    flow = dataflow(names)
    assert set(flow) == {n for n, _ in names}
    known = {n for n, _ in names}
    for n, cons in flow.items():
        assert set(cons.points) <= known and n not in cons.points
        assert cons.rule == "structure", (n, cons)  # every module of these families is in the table
    core = next(n for n, k in names if k == "attention_core")
    assert any(d.endswith(".kv_cache") for d in flow[core].points)


def test_all_positions_locate_the_planted_prefix_key_op(model):
    """Comparing every prompt position (--positions all): the perturbed k_proj rows of the prefix
    pass are compared too, so k_proj itself is the only origin; shapes list both of B's calls."""
    points = discover_points(model, "sublayers")
    window = (0, len(IDS))
    a = execute(model, IDS, SCEN.plan_a, points, window)
    h = model.get_submodule("model.layers.1.self_attn.k_proj").register_forward_hook(_shifted(5, 0.5))
    try:
        b = execute(model, IDS, SCEN.plan_b, points, window)
    finally:
        h.remove()
    c = compare_records(a, b, scenario="s", model="m")
    assert [o.name for o in c.origins] == ["model.layers.1.self_attn.k_proj"]
    assert "GEMM M×N×K 40×32×64 in A vs 32×32×64 + 8×32×64 in B" in origin_lines(c)[0]
