"""Per-position statistics (the heat map's data) against a plain numpy oracle, for pairs reduced
one by one and pairs batched together (small pairs share one concatenated reduction)."""

from __future__ import annotations

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
