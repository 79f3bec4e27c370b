"""Op-level accuracy replay in float64, against hand-checked cases."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from tracer.diff.accuracy import replay_point, run_error, ulp
from tracer.diff.dataflow import Consumes


@pytest.mark.parametrize("dtype,np_dtype", [(torch.float16, np.float16), (torch.float32, np.float32)])
def test_ulp_matches_numpy_spacing(dtype, np_dtype):
    vals = np.array([1.0, 1.5, 3.0, 1000.0, -7.25, 6.1e-5, 1e-7, 0.0], dtype=np_dtype)
    vals = vals[np.isfinite(vals)]
    want = np.abs(np.spacing(np.abs(vals)))
    got = ulp(torch.from_numpy(vals.astype(np.float64)), dtype).numpy()
    np.testing.assert_array_equal(got, want.astype(np.float64))


def test_ulp_bfloat16_by_hand():
    # bf16 has 7 stored mantissa bits: spacing 2^-7 in [1, 2), 2^-5 in [4, 8), 2^-133 subnormal
    x = torch.tensor([1.0, 1.99, 6.0, -5.0, 0.0], dtype=torch.float64)
    assert ulp(x, torch.bfloat16).tolist() == [2 ** -7, 2 ** -7, 2 ** -5, 2 ** -5, 2 ** -133]


class _Net(nn.Module):
    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.proj = lin


def _integer_linear(bias: bool):
    torch.manual_seed(0)
    lin = nn.Linear(16, 8, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randint(-3, 4, (8, 16)).to(torch.bfloat16))
        if bias:
            lin.bias.copy_(torch.randint(-5, 6, (8,)).to(torch.bfloat16))
    x = torch.randint(-3, 4, (5, 16)).to(torch.bfloat16)  # |sum| <= 16 * 9 + 5 < 256: exact in bf16
    with torch.no_grad():
        y = lin(x)
    return _Net(lin), x, y


def _point():
    return SimpleNamespace(name="proj", kind="linear", consumes=Consumes(points=("inp",)))


def _bump(y: torch.Tensor, index: int, ulps: int) -> torch.Tensor:
    """y with element ``index`` moved ``ulps`` steps away from zero on the bf16 integer line."""
    bits = y.reshape(-1).view(torch.int16).clone()
    bits[index] += ulps
    return bits.view(torch.bfloat16).reshape(y.shape)


@pytest.mark.parametrize("bias", [False, True])
def test_exact_integer_products_are_0_ulp(bias):
    net, x, y = _integer_linear(bias)
    r = replay_point(net, _point(), {"A": {"inp": x, "proj": y}, "B": {"inp": x, "proj": y.clone()}})
    assert r.op == "Linear"
    for e in r.errors.values():
        assert e.max_ulp == 0 and e.mean_ulp == 0 and e.correctly_rounded == 1.0 and not e.defect
    assert "neither is more accurate" in r.text and "not a defect" in r.text


def test_planted_one_ulp_change_is_one_ulp_on_that_element():
    net, x, y = _integer_linear(False)
    flat = y.reshape(-1)
    index = next(i for i, v in enumerate(flat.tolist()) if v > 0 and (int(v) & (int(v) - 1)) != 0)  # not a power of 2
    yb = _bump(y, index, 1)
    r = replay_point(net, _point(), {"A": {"inp": x, "proj": y}, "B": {"inp": x, "proj": yb}})
    eb = r.errors["B"]
    assert eb.max_ulp == 1.0 and eb.worst == index
    assert eb.correctly_rounded == pytest.approx(1 - 1 / flat.numel())
    assert r.errors["A"].max_ulp == 0
    assert not eb.defect and "not a defect" in r.text


def test_planted_large_error_is_a_defect():
    net, x, y = _integer_linear(True)
    flat = y.reshape(-1)
    index = next(i for i, v in enumerate(flat.tolist()) if abs(v) >= 8)
    yb = _bump(y, index, 37)
    r = replay_point(net, _point(), {"A": {"inp": x, "proj": y}, "B": {"inp": x, "proj": yb}})
    assert r.errors["B"].max_ulp >= 37 - 1e-9 and r.errors["B"].defect and not r.errors["A"].defect
    assert "run B is" in r.text and "defect suspected in run B" in r.text


def test_rmsnorm_and_activation_of_a_real_model_are_within_rounding():
    from tests.helpers import make_model

    model = make_model("llama", torch.bfloat16)
    torch.manual_seed(1)
    x = torch.randn(6, 64).to(torch.bfloat16)
    norm = model.get_submodule("model.layers.0.input_layernorm")
    act = model.get_submodule("model.layers.0.mlp.act_fn")
    with torch.no_grad():
        yn, ya = norm(x), act(x)
    for name, kind, y, op in (("model.layers.0.input_layernorm", "norm", yn, "RMSNorm"),
                              ("model.layers.0.mlp.act_fn", "activation", ya, None)):
        p = SimpleNamespace(name=name, kind=kind, consumes=Consumes(points=("inp",)))
        r = replay_point(model, p, {"A": {"inp": x, name: y}, "B": {"inp": x, name: y}})
        assert r.op is not None and (op is None or r.op == op)
        assert not r.errors["A"].defect and r.errors["A"].max_ulp <= 2, r.errors["A"]


def test_not_replayable_ops_say_why():
    model = nn.Sequential(nn.Conv1d(2, 2, 1))
    p = SimpleNamespace(name="0", kind="attention_core", consumes=Consumes(points=("inp",)))
    r = replay_point(model, p, {"A": {"inp": torch.ones(2, 2), "0": torch.ones(2, 2)},
                                "B": {"inp": torch.ones(2, 2), "0": torch.ones(2, 2)}})
    assert r.op is None and r.reason.startswith("not replayable")


def test_run_error_ignores_nothing_finite():
    y = torch.tensor([1.0, 2.0], dtype=torch.float32)
    e = torch.tensor([1.0, 2.0 + 2 ** -22], dtype=torch.float64)  # 1 ULP of float32 at 2 is 2^-22
    r = run_error(y, e)
    assert r.max_ulp == 1.0 and r.correctly_rounded == 0.5 and r.n == 2


IDS = [(13 * i + 7) % 500 for i in range(40)]


def _core_runs(dtype):
    from tests.helpers import make_model
    from tracer.execute.points import discover_points
    from tracer.diff.compare import compare_records
    from tracer.engines.hf.run import execute
    from tracer.plan.build import build

    model = make_model("llama", dtype)
    scen = build("prefix-cache", len(IDS), block_size=16)
    points = discover_points(model, "sublayers")
    a = execute(model, IDS, scen.plan_a, points, scen.window, sdpa_inputs=True)
    b = execute(model, IDS, scen.plan_b, points, scen.window, sdpa_inputs=True)
    return model, a, b, compare_records(a, b, scenario="s", model="m")


def _tensors(rec, p):
    return {n: rec.captures[n].tensor for n in (p.name, *p.consumes.points)}


def test_attention_core_replay_matches_a_float64_model():
    """In a float64 model the SDPA result itself is exact to float64 rounding: the replay from the
    recorded queries, mask and the kv_cache point must agree with it, in both runs (A: causal
    prefill of 40 tokens; B: 8 queries against 40 cached keys with a mask)."""
    from tracer.diff.accuracy import exact_attention

    model, a, b, c = _core_runs(torch.float64)
    cores = [p for p in c.points if p.kind == "attention_core"]
    assert cores
    for p in cores:
        kv = next(d for d in p.consumes.points if d.endswith(".kv_cache"))
        for rec in (a, b):
            y = rec.captures[p.name].tensor
            exact, _ = exact_attention(rec.extras["sdpa"][p.name], rec.captures[kv].tensor, y.shape[-1], y.dtype)
            assert (y - exact).abs().max() <= 1e-12 * y.abs().max(), p.name
        r = replay_point(model, p, {"A": _tensors(a, p), "B": _tensors(b, p)}, {"A": a.extras, "B": b.extras})
        assert r.op == "attention" and not r.errors["A"].defect and not r.errors["B"].defect, r.text


def test_attention_core_replay_bf16_is_rounding_noise_and_catches_a_planted_error():
    model, a, b, c = _core_runs(torch.bfloat16)
    p = next(p for p in c.points if p.kind == "attention_core")
    ta, tb = _tensors(a, p), _tensors(b, p)
    r = replay_point(model, p, {"A": ta, "B": tb}, {"A": a.extras, "B": b.extras})
    assert r.op == "attention" and not r.errors["A"].defect and not r.errors["B"].defect, r.text
    assert r.errors["A"].correctly_rounded > 0.5
    flat = tb[p.name].reshape(-1)
    index = int(flat.abs().argmax())
    tb = dict(tb, **{p.name: _bump(tb[p.name], index, 37)})
    r = replay_point(model, p, {"A": ta, "B": tb}, {"A": a.extras, "B": b.extras})
    assert r.errors["B"].defect and r.errors["B"].worst == index and "defect suspected in run B" in r.text
