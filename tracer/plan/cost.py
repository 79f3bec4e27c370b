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


#: the fixed work of the slow things a pass count does not show, in forward passes over the whole
#: prompt (the unit of :meth:`Cost.units`), measured on SmolLM2-135M at N = 96 on this 2-core CPU
#: (CPU seconds of the audit's checks, ``benchmarks/audit_cost.py``): torch.compile's first compilation
#: of the model (inductor, a warm kernel cache makes it cheaper), a worker process's start and model
#: load (per rank), a move of the model between devices
EXTRA_UNITS = {"compile": 40.0, "worker": 6.0, "move": 1.0}


@dataclass(frozen=True)
class Cost:
    """The work of one or more run plans.

    Attributes:
        passes: forward passes (chunks, decode steps). tokens: token rows they compute (a batch
            counts every row, padding included; a decode step one token per row).
        extra: slow things the counts do not show (``torch.compile``, worker processes, a device
            move), one short text each.
        fixed: their work in forward passes over the whole prompt (:data:`EXTRA_UNITS`).
    """

    passes: int = 0
    tokens: int = 0
    extra: tuple[str, ...] = ()
    fixed: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        extra = tuple(dict.fromkeys(self.extra + other.extra))
        same = set(self.extra) & set(other.extra)  # one compile, one set of workers per scenario: counted once
        fixed = self.fixed + other.fixed if not same else max(self.fixed, other.fixed)
        return Cost(self.passes + other.passes, self.tokens + other.tokens, extra, fixed)

    def units(self, n_tokens: int) -> float:
        """Forward passes over the whole prompt this cost equals: half for each pass, half for each
        ``n_tokens`` tokens it computes, plus the fixed work of its extras."""
        return 0.5 * self.passes + 0.5 * self.tokens / max(1, n_tokens) + self.fixed

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
    fixed = 0.0
    if plan.compile:
        extra.append("torch.compile (minutes on a CPU)")
        fixed += EXTRA_UNITS["compile"]
    if plan.tp is not None and getattr(plan.tp, "mode", "simulated") == "distributed":
        extra.append(f"{plan.tp.k} worker processes")
        fixed += EXTRA_UNITS["worker"] * plan.tp.k
    if plan.devices and len(set(plan.devices)) > 1:
        extra.append("moving the model between devices")
        fixed += EXTRA_UNITS["move"]
    return Cost(passes, tokens, tuple(extra), fixed)


def scenario_cost(scen: Any) -> Cost:
    """The :class:`Cost` of both plans of a :class:`~tracer.plan.scenarios.Scenario`."""
    return plan_cost(scen.plan_a) + plan_cost(scen.plan_b)


#: bytes of a stored run pair's statistics per capture point (the stored comparison's metrics and
#: per-position maxima, the runs' indexes and metadata; measured on the audit's parts of tiny-llama and
#: SmolLM2-135M: 2 to 4 kB per point at N = 96)
STATS_BYTES_PER_POINT = 4096


def stats_bytes(info: Any, granularity: str = "layers", kv_cache: bool = True) -> int:
    """About how many bytes a stored run pair's statistics take (:data:`STATS_BYTES_PER_POINT` per
    capture point: the embedding, the layers, their KV caches, the final norm, the logits; ``sublayers``
    about fifteen more per layer)."""
    per_layer = 1 + bool(kv_cache) + (15 if granularity == "sublayers" else 0)
    return STATS_BYTES_PER_POINT * (3 + per_layer * info.n_layers)


def trace_bytes(info: Any, n_tokens: int, granularity: str = "layers", kv_cache: bool = True) -> int:
    """Bytes of every tensor of a run pair at ``layers`` granularity over all ``n_tokens`` positions (an
    upper bound: a scenario that compares a window stores fewer rows): the embedding, each layer's
    output and KV cache, the final norm and the logits, in the model's dtype (``info``: a
    :class:`~tracer.load.models.ModelInfo`). ``sublayers`` adds about six hidden-wide points per layer."""
    from tracer.dtypes import FLOATS, canonical

    h, layers, vocab = info.hidden_size, info.n_layers, info.vocab_size
    kv = 2 * (info.n_kv_heads or 0) * (info.head_dim or 0) if kv_cache else 0
    per_token = h * (layers + 2) + layers * kv + vocab + (6 * h * layers if granularity == "sublayers" else 0)
    return 2 * n_tokens * per_token * FLOATS[canonical(info.dtype)].bits // 8
