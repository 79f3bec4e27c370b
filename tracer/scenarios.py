"""The scenario catalogue: pairs of run plans a correct engine would treat as equivalent.

A :class:`RunPlan` says how one run computes the prompt: as a sequence of forward passes
(*chunks*) over token positions ``[start, stop)`` that share one KV cache. A cache-miss prefill
is one chunk ``(0, N)``; a cache hit is the cached prefix ``(0, P)`` (computed by the earlier
request's own forward pass) followed by the suffix ``(P, N)``. The GEMM M dimension of every
projection in a chunk is its length, which is what changes the kernels' tiling.

A :class:`Scenario` pairs plan A with plan B and names the compared window (the positions both
runs computed in their final state). User-defined scenarios are plain instances of these two
classes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import TracerError

MITIGATIONS = ("aligned",)


@dataclass(frozen=True)
class RunPlan:
    """How one run computes the prompt.

    Attributes:
        name: the run's label (``A`` or ``B``).
        chunks: successive forward passes over absolute token positions ``[start, stop)``, sharing
            one KV cache; they must tile ``[0, N)`` in order. A chunk of length ``M`` runs every
            projection as a GEMM with M = ``M`` rows (batch 1).
        description: one line for people (``cache miss: all 250 tokens in one pass``).
    """

    name: str
    chunks: tuple[tuple[int, int], ...]
    description: str = ""

    def __post_init__(self) -> None:
        pos = 0
        for start, stop in self.chunks:
            if start != pos or stop <= start:
                raise TracerError(
                    f"run plan {self.name}: chunks {list(self.chunks)} must tile [0, N) in order without gaps"
                )
            pos = stop

    @property
    def n_tokens(self) -> int:
        return self.chunks[-1][1] if self.chunks else 0

    def gemm_m(self) -> list[int]:
        """The GEMM M dimension of each forward pass (its number of tokens)."""
        return [stop - start for start, stop in self.chunks]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["chunks"] = [list(c) for c in self.chunks]
        d["gemm_m"] = self.gemm_m()
        return d


@dataclass(frozen=True)
class Scenario:
    """Two run plans of one prompt and the positions compared between them.

    Attributes:
        name: catalogue name (``prefix-cache``).
        level: level of the seed's determinism hierarchy (0-7).
        invariant: what a correct engine would keep invariant (``cache hit vs miss``).
        plan_a, plan_b: the two runs.
        window: ``(start, stop)``: the compared absolute positions.
        params: the scenario's parameters (block size, split point, mitigation), recorded in the
            trace header.
    """

    name: str
    level: int
    invariant: str
    plan_a: RunPlan
    plan_b: RunPlan
    window: tuple[int, int]
    params: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "level": self.level,
            "invariant": self.invariant,
            "plan_a": self.plan_a.to_dict(),
            "plan_b": self.plan_b.to_dict(),
            "window": list(self.window),
            "params": dict(self.params),
        }


def default_split(n_tokens: int, block_size: int) -> int:
    """The cached prefix length of a prefix-cache hit: the largest multiple of ``block_size`` below N.

    Raises:
        TracerError: ``block_size < 1``, or N ≤ block size (no full block can be cached).
    """
    if block_size < 1:
        raise TracerError(f"--block-size must be a positive number of tokens, got {block_size}")
    split = ((n_tokens - 1) // block_size) * block_size
    if split < 1:
        raise TracerError(
            f"the prompt has {n_tokens} tokens, but a cache hit needs more than one KV block "
            f"({block_size} tokens); use a longer prompt, a smaller --block-size, or --split-at"
        )
    return split


def check_split(n_tokens: int, split_at: int) -> int:
    """Validate an explicit split point P (1 ≤ P ≤ N-1).

    Raises:
        TracerError: P outside 1..N-1.
    """
    if not 1 <= split_at <= n_tokens - 1:
        raise TracerError(
            f"--split-at {split_at} is outside 1..{n_tokens - 1} for a prompt of {n_tokens} tokens; "
            "choose a split point inside the prompt"
        )
    return split_at


def check_mitigation(mitigation: str | None) -> str | None:
    """Validate a mitigation name (None = no mitigation)."""
    if mitigation is not None and mitigation not in MITIGATIONS:
        raise TracerError(f"unknown mitigation '{mitigation}'; use one of: {', '.join(MITIGATIONS)}")
    return mitigation


def prefix_cache(n_tokens: int, *, block_size: int = 16, split_at: int | None = None,
                 mitigation: str | None = None) -> Scenario:
    """Level 2: cache miss (whole prompt in one pass) versus cache hit (prefix, then suffix).

    Run A computes all N tokens in one forward pass (GEMM M = N). Run B computes the cached
    prefix of P tokens in its own forward pass, as the earlier request did, then the N−P suffix
    tokens with that KV cache (GEMM M = N−P). The compared positions are P..N−1.
    With ``mitigation="aligned"`` run A is also split at P (vLLM PR #34046's deterministic
    prefix caching), so both runs compute the suffix with the same M.

    Raises:
        TracerError: bad block size or split point (see :func:`default_split`, :func:`check_split`).
    """
    check_mitigation(mitigation)
    p = check_split(n_tokens, split_at) if split_at is not None else default_split(n_tokens, block_size)
    n = n_tokens
    if mitigation == "aligned":
        plan_a = RunPlan("A", ((0, p), (p, n)),
                         f"cache miss, aligned: {p} + {n - p} tokens (split at the block boundary)")
    else:
        plan_a = RunPlan("A", ((0, n),), f"cache miss: all {n} tokens in one pass")
    plan_b = RunPlan("B", ((0, p), (p, n)), f"cache hit: {p} cached tokens, then the {n - p}-token suffix")
    return Scenario(
        name="prefix-cache",
        level=2,
        invariant="cache hit vs miss",
        plan_a=plan_a,
        plan_b=plan_b,
        window=(p, n),
        params={"block_size": block_size, "split_at": p, "mitigation": mitigation,
                "n_tokens": n, "split_points_a": [c[0] for c in plan_a.chunks[1:]],
                "split_points_b": [c[0] for c in plan_b.chunks[1:]]},
    )


#: name → (level, invariant, builder) for the CLI's --scenario
SCENARIOS = {
    "prefix-cache": prefix_cache,
}


def build(name: str, n_tokens: int, **params: Any) -> Scenario:
    """Build the named scenario for a prompt of ``n_tokens`` tokens.

    Raises:
        TracerError: unknown scenario name (listing the known ones) or bad parameters.
    """
    if name not in SCENARIOS:
        raise TracerError(f"unknown scenario '{name}'; use one of: {', '.join(SCENARIOS)}")
    return SCENARIOS[name](n_tokens, **params)
