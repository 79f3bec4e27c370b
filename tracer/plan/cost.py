"""What a run plan costs before it runs: forward passes, tokens, and what else it does that is slow.

Pure functions of the plan (metadata only), so ``tracer audit`` can show every check's cost before
running it and weigh its ETA by it. The unit of :func:`units` is "one forward pass over the whole
prompt": a pass costs a fixed part (every weight is read once, whatever M is) plus a part that
grows with its tokens; on a CPU the two are of the same order for prompts of ~100 tokens
(SmolLM2-135M on this 2-core machine: about 1.3 s + 6 ms per token of CPU time per pass), so each
counts half.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Cost:
    """The work of one or more run plans.

    Attributes:
        passes: forward passes (chunks, decode steps). tokens: token rows they compute (a batch
            counts every row, padding included; a decode step one token per row).
        extra: slow things the counts do not show (``torch.compile``, worker processes, a device
            move), one short text each.
    """

    passes: int = 0
    tokens: int = 0
    extra: tuple[str, ...] = ()

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.passes + other.passes, self.tokens + other.tokens,
                    tuple(dict.fromkeys(self.extra + other.extra)))

    def units(self, n_tokens: int) -> float:
        """Forward passes over the whole prompt this cost equals: half for each pass, half for each
        ``n_tokens`` tokens it computes."""
        return 0.5 * self.passes + 0.5 * self.tokens / max(1, n_tokens)

    def text(self) -> str:
        """``4 forward passes, 608 tokens + torch.compile``."""
        base = f"{self.passes} forward pass{'es' if self.passes != 1 else ''}, {self.tokens:,} tokens"
        return base + "".join(f" + {x}" for x in self.extra)


def plan_cost(plan: Any) -> Cost:
    """The :class:`Cost` of one :class:`~tracer.plan.scenarios.RunPlan`."""
    rows = plan.batch.size if plan.batch is not None else 1
    n = plan.chunks[-1][1] if plan.chunks else 0
    if plan.batch is not None:  # one padded batch: every row as wide as the longest
        passes, tokens = len(plan.chunks), plan.batch.width * rows * len(plan.chunks)
    else:
        passes, tokens = len(plan.chunks), sum(stop - start for start, stop in plan.chunks)
    if plan.generate:
        passes += plan.generate
        tokens += sum(n + t for t in range(1, plan.generate + 1)) if plan.recompute else plan.generate * rows
    extra: list[str] = []
    if plan.compile:
        extra.append("torch.compile (minutes on a CPU)")
    if plan.tp is not None and getattr(plan.tp, "mode", "simulated") == "distributed":
        extra.append(f"{plan.tp.k} worker processes")
    if plan.devices and len(set(plan.devices)) > 1:
        extra.append("moving the model between devices")
    return Cost(passes, tokens, tuple(extra))


def scenario_cost(scen: Any) -> Cost:
    """The :class:`Cost` of both plans of a :class:`~tracer.plan.scenarios.Scenario`."""
    return plan_cost(scen.plan_a) + plan_cost(scen.plan_b)
