"""Per-position statistics (the heat map's data) against a plain numpy oracle, for pairs reduced
one by one and pairs batched together (small pairs share one concatenated reduction)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from tracer.diff import positions
from tracer.diff.positions import PositionStats


def _oracle(a: torch.Tensor, b: torch.Tensor) -> tuple[list[float], list[int]]:
    """Per row: max |a - b| (float64) over bitwise-differing elements, and their count."""
    t = a.shape[0]
    ia = a.reshape(t, -1).view(torch.int16).numpy()
    ib = b.reshape(t, -1).view(torch.int16).numpy()
    fa = a.reshape(t, -1).to(torch.float64).numpy()
    fb = b.reshape(t, -1).to(torch.float64).numpy()
    differ = ia != ib
    d = np.where(differ, np.abs(fa - fb), 0.0)
    return d.max(axis=1).tolist(), differ.sum(axis=1).tolist()


@pytest.mark.parametrize("small", [1 << 20, 1])  # batched, and every pair reduced alone
def test_position_stats_match_numpy(monkeypatch, small):
    monkeypatch.setattr(positions, "SMALL_ELEMENTS", small)
    g = torch.Generator().manual_seed(7)
    t = 6
    stats = PositionStats((10, 10 + t))
    pairs = []
    for i, feat in enumerate([(32,), (32,), (4, 8), (48,), (32,)]):
        a = torch.randn((t, *feat), generator=g).to(torch.bfloat16)
        b = a.clone()
        # plant: point i differs at row i % t in i + 1 elements, by i + 1 ULP
        row = b[i % t].reshape(-1)
        row.view(torch.int16)[: i + 1] += i + 1
        pairs.append((f"p{i}", a, b))
    kv_a = torch.randn(10 + t, 16, generator=g).to(torch.bfloat16)  # a KV cache over all positions
    kv_b = kv_a.clone()
    kv_b[12].view(torch.int16)[3] += 2
    pairs.append(("kv", kv_a, kv_b))
    for name, a, b in pairs:
        stats.add(name, "layer", a, b)
    r = stats.result()
    assert r["names"] == [n for n, _, _ in pairs]
    for k, (name, a, b) in enumerate(pairs):
        if name == "kv":
            a, b = a[10:], b[10:]
        mx, nd = _oracle(a, b)
        assert r["n_diff"][k] == nd, name
        assert r["max_abs_diff"][k] == pytest.approx(mx, rel=0, abs=0), name


def test_one_device_moves_the_host_side_to_the_accelerator():
    """Two runs on two devices are compared on one: the accelerator's (here the ``meta`` device
    stands for it; no data moves); runs on one device are left where they are."""
    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    assert positions.one_device(a, b)[0] is a and positions.one_device(a, b)[1] is b
    for x, y in ((a, b.to("meta")), (a.to("meta"), b)):
        xa, yb = positions.one_device(x, y)
        assert xa.device.type == yb.device.type == "meta" and xa.shape == yb.shape == (2, 3)


def test_every_comparison_entry_point_puts_both_sides_on_one_device(monkeypatch):
    """Every function that reads both runs' tensors with one kernel goes through one_device with
    that pair: the per-point comparison (records), the per-position statistics (whole pairs and row
    blocks), the logits where an engine sampled, and the RL metrics' logits. A GPU run against a
    CPU run then never reaches a kernel with two devices (the crash of HF vs vLLM on CUDA)."""
    from tracer.diff import compare as compare_mod, engine as engine_mod, rl as rl_mod
    from tests.helpers import planted_pair

    seen: list[str] = []
    real = positions.one_device

    def spy(x, y):
        seen.append(sys._getframe(1).f_code.co_name)
        return real(x, y)

    for mod in (positions, compare_mod, engine_mod, rl_mod):
        monkeypatch.setattr(mod, "one_device", spy)
    a, b, _ = planted_pair()
    compare_mod.compare_records(a, b, scenario="s", model="m")
    assert {"compare_pairs", "add", "position_reduce"} <= set(seen)
    seen.clear()
    stats = PositionStats((0, 2))
    rows = stats.rows("x", "layer", (2, 4), torch.float32)
    rows.add(0, torch.zeros(2, 4), torch.ones(2, 4))
    assert "add" in seen
    seen.clear()
    a.extras["partial_logits"] = {"head": ([3], a.captures.pop("head").tensor[1:])}
    b.extras["partial_logits"] = {"head": ([3], b.captures.pop("head").tensor[1:])}
    c = compare_mod.compare_records(a, b, scenario="s", model="m")
    engine_mod.sampled_logits(c, a, b)
    assert "sampled_logits" in seen
    seen.clear()
    logits = torch.randn(1, 2, 5)
    rl_mod.rl_metrics([[1, 2]], [[-1.0, -2.0]], [[-1.0, -2.0]], tau=1.0, sample=False, row=0, is_cap=2.0,
                      mask_threshold=2.0, logits_a=logits, logits_b=logits.clone())
    assert "rl_metrics" in seen


def test_a_replaced_bmm_is_seen_and_gpu_comparisons_move_to_the_cpu(monkeypatch):
    """vLLM's batch-invariant mode rebinds torch.bmm and re-registers the GPU's matmul, softmax and mean
    (mean in float32 only; bmm raised KeyError: torch.float64 in tracer's float64 statistics on the H200):
    tracer sees the rebinding and compares a GPU run's tensors on the CPU, where torch's own kernels run."""
    import torch

    from tracer.diff.positions import one_device, torch_replaced

    assert not torch_replaced()
    original = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b, **kw: original(a, b, **kw))
    assert torch_replaced()
    a, b = torch.ones(2, 3), torch.zeros(2, 3)
    assert one_device(a, b)[0] is a  # CPU tensors stay as they are
    if torch.cuda.is_available():
        ga, gb = one_device(a.cuda(), b.cuda())
        assert ga.device.type == gb.device.type == "cpu" and torch.equal(ga, a)


def test_the_statistics_use_torchs_own_bmm_whatever_torch_bmm_is_bound_to(monkeypatch):
    """On the H200 vLLM's batch-invariant mode rebinds torch.bmm to a kernel without float64 (KeyError:
    torch.float64 inside tracer's statistics, on any device); tracer's float64 Gram matrix calls torch's own."""
    import torch

    from tracer.diff.metrics import element_stats

    a = torch.randn(4 * 2048, dtype=torch.bfloat16)
    b = a.clone()
    b[::7] += 1
    m = a != b
    expected = element_stats(a, b, m, (4, 2048))  # the dense form: the Gram matrix of each block

    def refuse(*args, **kwargs):
        raise KeyError(torch.float64)

    monkeypatch.setattr(torch, "bmm", refuse)
    assert all(torch.equal(x, y) for x, y in zip(element_stats(a, b, m, (4, 2048)), expected))
