"""The bench's floor (mode a): a scenario's forward calls as a user writes them without tracer.

For ``prefix-cache`` at N tokens with the cached prefix P, the floor is, under ``torch.inference_mode()``::

    model(input_ids=ids)                                   # run A: cache miss, one pass
    out = model(input_ids=ids[:, :P])                      # run B: the earlier request's prefix
    model(input_ids=ids[:, P:], past_key_values=out.past_key_values)   # run B: the suffix, cache hit

(``cache=`` / ``out.cache`` where the installed transformers names the KV cache so, as
:mod:`tracer.load.hf_cache` detects; ``use_cache=True`` on every call). Every scenario whose two
plans are plain sequences of chunks (:data:`SCENARIOS`) is written the same way, one call per
chunk, each chunk after the first reading the KV cache of the one before. The ids live on the
model's device before the timing starts; no hooks, no pipeline, no plan objects, no host
synchronisation: the bench's one ``torch.cuda.synchronize()`` ends the timing.

The peers (:mod:`tracer.loops.peers`) make the same calls through :func:`forward_inputs`, each
with its own capture; ``tests/loops/test_floor.py`` checks, with a forward pre-hook on the model,
that the floor, tracer's run and every peer make the same forward calls with the same shapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from tracer.engines.table import is_reference
from tracer.errors import TracerError
from tracer.load.hf_cache import cache_kwarg

if TYPE_CHECKING:
    from tracer.plan.scenarios import RunPlan, Scenario

#: the scenarios whose run plans are plain sequences of chunks on one device: the ones the bench measures
SCENARIOS = ("prefix-cache", "repeat", "block-size", "chunked-prefill")

#: one plan as the floor runs it: ``(start, stop, input ids (1, stop - start) on the model's device)`` per call
Calls = list[tuple[int, int, torch.Tensor]]


def check_plain(scen: Scenario) -> None:
    """Refuse a scenario whose plans do more than run chunks one after another (the floor writes
    only chunked forward calls sharing a KV cache).

    Raises:
        TracerError: a plan with a batch, generation, KV transform, simulated TP, another attention,
            ``torch.compile``, device moves, deterministic mode, CUDA graphs, an engine other than hf, or RL.
    """
    for plan in (scen.plan_a, scen.plan_b):
        extra = [what for what, on in (
            ("a batch", plan.batch is not None), ("generation", bool(plan.generate) or plan.recompute),
            ("a KV-cache transform", plan.kv_transform is not None), ("simulated TP", plan.tp is not None),
            ("another attention implementation", plan.attn is not None), ("torch.compile", plan.compile),
            ("device moves", plan.devices is not None), ("deterministic mode", plan.deterministic),
            ("CUDA graphs", plan.cuda_graph), (f"engine {plan.engine}", not is_reference(plan.engine)),
            ("an RL step", plan.rl is not None)) if on]
        if extra:
            raise TracerError(f"the bench measures scenarios whose plans are plain forward calls ({', '.join(SCENARIOS)}); "
                              f"plan {plan.name} of scenario {scen.name} has {', '.join(extra)}")


def forward_inputs(ids: torch.Tensor, scen: Scenario) -> tuple[Calls, Calls]:
    """Both plans' forward calls: for each chunk ``[s, e)`` of the plan, ``(s, e, ids[:, s:e])``.

    Args:
        ids: ``(1, N)`` int64 prompt ids, on the model's device.
        scen: a scenario of :data:`SCENARIOS` (plain chunks; :func:`check_plain`).

    Raises:
        TracerError: a scenario whose plans are not plain chunks, or ids of another length.
    """
    check_plain(scen)
    if ids.dim() != 2 or ids.shape[1] != scen.plan_a.n_tokens:
        raise TracerError(f"the floor needs ids of shape (1, {scen.plan_a.n_tokens}); got {tuple(ids.shape)}")

    def calls(plan: RunPlan) -> Calls:
        return [(s, e, ids[:, s:e]) for s, e in plan.chunks]

    return calls(scen.plan_a), calls(scen.plan_b)


def plain_forwards(model: torch.nn.Module, ids: torch.Tensor, scen: Scenario) -> Callable[[], None]:
    """The floor: a callable running both plans' forward calls as the module docstring writes them.

    Args:
        model: an HF causal LM (eval mode), on one device.
        ids: ``(1, N)`` int64 prompt ids on the model's device.
        scen: a scenario of :data:`SCENARIOS`.

    Raises:
        TracerError: a scenario whose plans are not plain chunks (:func:`check_plain`).
    """
    plans = forward_inputs(ids, scen)
    kw = cache_kwarg(model)

    def run() -> None:
        with torch.inference_mode():
            for calls in plans:
                cache = None
                for _s, _e, x in calls:
                    out = model(input_ids=x, use_cache=True) if cache is None else \
                        model(input_ids=x, use_cache=True, **{kw: cache})
                    cache = getattr(out, kw)

    return run


def describe(scen: Scenario, cache_arg: str = "past_key_values") -> str:
    """What :func:`plain_forwards` runs, in one line (``m`` the model): e.g. ``A: m(ids); B: o = m(ids[:, :1008]),
    m(ids[:, 1008:], past_key_values=o.past_key_values)``."""
    n = scen.plan_a.n_tokens

    def one(plan: RunPlan) -> str:
        parts = []
        for i, (s, e) in enumerate(plan.chunks):
            cut = "ids" if (s, e) == (0, n) else f"ids[:, {s or ''}:{'' if e == n else e}]"
            call = f"m({cut})" if i == 0 else f"m({cut}, {cache_arg}=o.{cache_arg})"
            parts.append(("o = " if i + 1 < len(plan.chunks) else "") + call)
        return f"{plan.name}: " + ", ".join(parts)

    return f"{one(scen.plan_a)}; {one(scen.plan_b)}"


__all__ = ["SCENARIOS", "check_plain", "forward_inputs", "plain_forwards", "describe"]
