"""Origin classes on planted cases: shape-driven kernel switch, same kernel with different bits, inherited."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import make_model
from tracer.execute.points import discover_points
from tracer.diff.compare import compare_records
from tracer.diff.provenance import classify
from tracer.engines.hf.run import execute
from tracer.plan.build import build
from tracer.report.origins import origin_lines

IDS = [(11 * i + 5) % 500 for i in range(40)]
TARGET = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def model():
    return make_model("llama", torch.bfloat16)


def _runs(model, scenario, patch_b=None, patch_both=None, **kw):
    scen = build(scenario, len(IDS), **kw)
    points = discover_points(model, "sublayers")
    lin = model.get_submodule(TARGET)
    out = []
    for i, plan in enumerate((scen.plan_a, scen.plan_b)):
        fwd = (patch_both(lin, i) if patch_both else (patch_b(lin) if (patch_b and i == 1) else None))
        if fwd is not None:
            lin.forward = fwd
        try:
            out.append(execute(model, IDS, plan, points, scen.window, kernels=True))
        finally:
            lin.__dict__.pop("forward", None)
    return compare_records(out[0], out[1], scenario=scenario, model="m")


def test_shape_driven_kernel_switch(model):
    """A Linear that, at the cache hit's M (8 rows), sums K in two halves rounded separately (other
    ops: two matmuls and an add): inputs identical, kernels differ, shapes differ."""
    def patch(lin):
        def forward(x):
            if x.shape[-2] != 8:
                return F.linear(x, lin.weight)
            k = x.shape[-1] // 2
            return F.linear(x[..., :k], lin.weight[:, :k]) + F.linear(x[..., k:], lin.weight[:, k:])
        return forward

    c = _runs(model, "prefix-cache", patch_b=patch, block_size=16)
    assert [o.name for o in c.origins] == [TARGET]
    info = classify(c.origins[0], c.positions)
    assert info["class"] == "shape-driven kernel switch", info
    assert "shape-driven kernel switch" in origin_lines(c)[0]
    doc = c.to_dict()
    row = next(r for r in doc["layers"] if r["name"] == TARGET)
    assert row["kernels_a"] and row["kernels_b"] and row["kernels_a"] != row["kernels_b"]


def test_same_kernel_different_bits(model):
    """The same plan twice, the same ops in both runs, but run B's result is offset by a
    run-dependent tiny amount (what an atomic/split-K reduction in another order does)."""
    def patch(lin, run):
        def forward(x):
            y = F.linear(x, lin.weight)
            return y + (torch.full_like(y, 2.0 ** -6) if run == 1 else torch.zeros_like(y))
        return forward

    c = _runs(model, "repeat", patch_both=patch)
    assert [o.name for o in c.origins] == [TARGET]
    info = classify(c.origins[0], c.positions)
    assert info["class"] == "same kernel, different bits", info
    assert info["compared_by"] == "ops"  # on the CPU: aten ops are what can be compared
    assert "same aten ops, different bits" in origin_lines(c)[0]


def test_perturbed_input_is_inherited(model):
    """Run B's gate input perturbed upstream: the Linear consuming it differs but is inherited."""
    h = None
    scen = build("repeat", len(IDS))
    points = discover_points(model, "sublayers")
    a = execute(model, IDS, scen.plan_a, points, scen.window, kernels=True)
    norm = model.get_submodule("model.layers.1.post_attention_layernorm")
    h = norm.register_forward_hook(lambda m, args, out: out * 1.5)
    try:
        b = execute(model, IDS, scen.plan_b, points, scen.window, kernels=True)
    finally:
        h.remove()
    c = compare_records(a, b, scenario="repeat", model="m")
    assert [o.name for o in c.origins] == ["model.layers.1.post_attention_layernorm"]
    gate = next(p for p in c.points if p.name == "model.layers.1.mlp.gate_proj")
    assert gate.diverged and classify(gate, c.positions)["class"] == "inherited"
    same = next(p for p in c.points if p.name == "model.layers.0.mlp.gate_proj")
    assert classify(same, c.positions) is None  # bit-identical: no class
