"""Simulated tensor parallelism: row-parallel layers as K-sharded partial GEMMs plus an all-reduce.

In Megatron-style TP the attention output projection and the MLP down projection are
*row-parallel*: rank r holds the columns ``K_r`` of the weight ``W (N, K)`` and the matching slice
of the input, computes the partial product ``x[..., K_r] @ W[:, K_r].T`` (a GEMM with K/k in the
contraction dimension, output in the activation dtype) and an all-reduce sums the k partials.
The sum's order is the collective's:

``ring``
    ring all-reduce (reduce-scatter then all-gather): the output's N columns are split into k
    contiguous chunks; chunk c is accumulated around the ring starting at rank c+1:
    ``((p[c+1] + p[c+2]) + ...) + p[c]`` (ranks mod k), rounding after every addition.
``tree``
    a binary tree: ``(p0 + p1) + (p2 + p3)``, pairs of neighbours level by level (an odd one out
    is carried to the next level).

The additions run in the activation dtype (what NCCL does for a bf16 all-reduce) or in float32
(then cast back once). The bias, if any, is added by rank 0's GEMM. With k = 1 the result is
bit-identical to the unsharded layer.

:func:`tracer.execute.tp_sim.simulate_tp` swaps the ``forward`` of those modules (found by their
role in the model's family descriptor) for the duration of a ``with`` block and restores it on
exit, whatever happened inside; this module holds the arithmetic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tracer.errors import TracerError

if TYPE_CHECKING:  # torch is imported where partials are computed: --tp and --reduce are checked without it
    import torch

REDUCES = ("ring", "tree")
REDUCE_DTYPES = ("activation", "float32")


def check_tp(k: int, reduce: str, reduce_dtype: str) -> None:
    """Validate TP simulation parameters.

    Raises:
        TracerError: k < 1, unknown reduce order or reduce dtype.
    """
    if k < 1:
        raise TracerError(f"--tp must be a positive number of shards, got {k}")
    if reduce not in REDUCES:
        raise TracerError(f"unknown --reduce '{reduce}'; use one of: {', '.join(REDUCES)}")
    if reduce_dtype not in REDUCE_DTYPES:
        raise TracerError(f"unknown --reduce-dtype '{reduce_dtype}'; use one of: {', '.join(REDUCE_DTYPES)}")


def partials(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int) -> list[torch.Tensor]:
    """The k ranks' partial products: ``x (..., K)``, ``weight (N, K)`` → k tensors ``(..., N)`` in x's dtype.

    Raises:
        TracerError: K not divisible by k.
    """
    import torch

    kdim = weight.shape[1]
    if kdim % k:
        raise TracerError(f"--tp {k} does not divide the contraction dimension K = {kdim}; choose a divisor of {kdim}")
    step = kdim // k
    out = []
    for r in range(k):
        sl = slice(r * step, (r + 1) * step)
        out.append(torch.nn.functional.linear(x[..., sl], weight[:, sl], bias if r == 0 else None))
    return out


def _seq_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    import torch

    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


def all_reduce(parts: list[torch.Tensor], reduce: str = "ring", dtype: str = "activation") -> torch.Tensor:
    """Sum k same-shaped partials ``(..., N)`` in the order of a ``ring`` or ``tree`` all-reduce.

    Returns a tensor of the partials' dtype. See the module docstring for the orders.
    """
    import torch

    out_dtype = parts[0].dtype
    ps = [p.float() for p in parts] if dtype == "float32" else list(parts)
    k = len(ps)
    if reduce == "tree":
        level = ps
        while len(level) > 1:
            nxt = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
            if len(level) % 2:
                nxt.append(level[-1])
            level = nxt
        total = level[0]
    elif reduce == "ring":
        n = ps[0].shape[-1]
        bounds = [(n * c) // k for c in range(k + 1)]
        chunks = []
        for c in range(k):
            lo, hi = bounds[c], bounds[c + 1]
            order = [(c + 1 + j) % k for j in range(k)]  # starts at rank c+1, ends at rank c
            chunks.append(_seq_sum([ps[r][..., lo:hi] for r in order]))
        total = torch.cat(chunks, dim=-1)
    else:
        raise TracerError(f"unknown --reduce '{reduce}'; use one of: {', '.join(REDUCES)}")
    return total.to(out_dtype)
