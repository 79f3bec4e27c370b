"""The tensor-parallel simulation: shards add up, k = 1 is the unsharded layer, reduce orders by hand."""

from __future__ import annotations

import pytest
import torch

from tracer.errors import TracerError
from tracer.execute.tp_sim import row_parallel_modules, simulate_tp
from tracer.plan.tp import all_reduce, partials


def test_tp1_is_bit_identical_to_the_unsharded_product():
    torch.manual_seed(0)
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    b = torch.randn(32, dtype=torch.bfloat16)
    for reduce in ("ring", "tree"):
        for dt in ("activation", "float32"):
            got = all_reduce(partials(x, w, b, 1), reduce, dt)
            assert torch.equal(got, torch.nn.functional.linear(x, w, b))


@pytest.mark.parametrize("k", [2, 4, 8])
def test_partials_add_up_to_the_product(k):
    torch.manual_seed(1)
    x = torch.randn(5, 64, dtype=torch.float64)
    w = torch.randn(48, 64, dtype=torch.float64)
    ps = partials(x, w, None, k)
    assert len(ps) == k and all(p.shape == (5, 48) for p in ps)
    exact = x @ w.T
    assert torch.allclose(sum(ps), exact, rtol=1e-12, atol=1e-12)
    xf, wf = x.float(), w.float()
    for reduce in ("ring", "tree"):
        got = all_reduce(partials(xf, wf, None, k), reduce)
        assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5)


def test_ring_and_tree_orders_by_hand():
    # fp16 ulp at 1.0 is 2^-10; 1 + 2^-11 is a tie that rounds to 1.0 (even)
    one, tiny = torch.full((1, 3), 1.0, dtype=torch.float16), torch.full((1, 3), 2.0 ** -11, dtype=torch.float16)
    parts = [one, tiny, tiny]
    # ring, k = 3: column chunk c sums ranks c+1, c+2, c
    # c=0: (p1 + p2) + p0 = 2^-10 + 1; c=1: (p2 + p0) + p1 = 1; c=2: (p0 + p1) + p2 = 1
    assert all_reduce(parts, "ring").tolist() == [[1 + 2.0 ** -10, 1.0, 1.0]]
    # tree: (p0 + p1) + p2 = 1 everywhere
    assert all_reduce(parts, "tree").tolist() == [[1.0, 1.0, 1.0]]
    # float32 accumulation keeps both halves: 1 + 2^-10 everywhere after the final cast
    assert all_reduce(parts, "tree", "float32").tolist() == [[1 + 2.0 ** -10] * 3]


def test_simulate_tp_swaps_only_row_parallel_layers_and_restores(tiny_llama):
    names = [n for n, _ in row_parallel_modules(tiny_llama)]
    assert names and all(n.endswith(("o_proj", "down_proj")) for n in names)
    ids = torch.arange(3, 23).unsqueeze(0)
    with torch.inference_mode():
        ref = tiny_llama(ids).logits
        with simulate_tp(tiny_llama, 1):
            same = tiny_llama(ids).logits
        with pytest.raises(RuntimeError):
            with simulate_tp(tiny_llama, 2, "tree"):
                assert all("forward" in m.__dict__ for _, m in row_parallel_modules(tiny_llama))
                raise RuntimeError("boom")
        assert all("forward" not in m.__dict__ for _, m in row_parallel_modules(tiny_llama))
        assert torch.equal(tiny_llama(ids).logits, ref)
    assert torch.equal(same, ref)
    with pytest.raises(TracerError, match="does not divide"):
        with simulate_tp(tiny_llama, 3):
            pass
