"""Simulated tensor parallelism in one process: the row-parallel layers of the model (the roles
``o_proj`` and ``down_proj`` of its family descriptor) compute as K-sharded partial GEMMs plus an
all-reduce in a chosen order (the arithmetic: :mod:`tracer.plan.tp`)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from tracer.errors import TracerError
from tracer.execute.family import role_modules
from tracer.execute.roles import ROW_PARALLEL_ROLES
from tracer.plan.tp import all_reduce, check_tp, partials


def row_parallel_modules(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """``(path, module)`` of every row-parallel ``nn.Linear``: the modules playing the roles
    :data:`~tracer.execute.roles.ROW_PARALLEL_ROLES` in the model's family descriptor, and a hybrid
    model's ``linear_out_proj`` (its input is sharded by heads in a serving engine's TP).

    Raises:
        TracerError: no family descriptor fits the model.
    """
    roles = (*ROW_PARALLEL_ROLES, "linear_out_proj")  # a hybrid's linear-attention output projection too
    return [(path, m) for path, _, m in role_modules(model, roles) if isinstance(m, nn.Linear)]


@contextlib.contextmanager
def simulate_tp(model: nn.Module, k: int, reduce: str = "ring", dtype: str = "activation") -> Iterator[list[str]]:
    """Within the block, every row-parallel Linear computes as k shards plus an all-reduce.

    Yields the module paths that were swapped. Forward hooks still fire (only ``forward`` is
    replaced, on the instance). Restored on exit, even on exceptions.

    Raises:
        TracerError: bad parameters, no row-parallel layer found, K not divisible by k.
    """
    check_tp(k, reduce, dtype)
    mods = row_parallel_modules(model)
    if not mods:
        raise TracerError(f"{type(model).__name__} has no row-parallel Linear (roles {'/'.join(ROW_PARALLEL_ROLES)} "
                          "of its family descriptor); the tensor-parallel simulation does not apply to this model")
    for name, m in mods:
        if m.in_features % k:
            raise TracerError(f"--tp {k} does not divide K = {m.in_features} of {name}; choose a divisor of {m.in_features}")
    swapped: list[nn.Linear] = []
    try:
        for _, m in mods:
            def fwd(x: torch.Tensor, _m: nn.Linear = m) -> torch.Tensor:
                return all_reduce(partials(x, _m.weight, _m.bias, k), reduce, dtype)

            m.forward = fwd  # instance attribute shadows the class method
            swapped.append(m)
        yield [name for name, _ in mods]
    finally:
        for m in swapped:
            del m.forward
