"""Capture contracts: is the other side holding *another quantity*, before anything is called numerics?

An engine dump can hold something other than what the HF point computes while looking like it: a
row-parallel output dumped per rank *before* the all-reduce (partial sums) where the full sum was
expected, or full sums that a ``tp:partial`` dims string makes tracer add up again (k copies: k× the
value, SGLang #28925 at TP 8: 8×, reported as rel_diff 0.75). Both are differences of the capture
contract, not numeric divergences, and are reported as such:

- **scaled**: B ≈ k·A (or A ≈ k·B) at nearly every element (:data:`SHARE` of the elements where A
  is not negligible, within :data:`REL_TOL`), k an integer ≥ 2 (the world size, when it is):
  :func:`scale_factor`;
- **rank sum**: the TP ranks of a point hold different values although it is replicated by its map
  and no dims mark it partial, and their sum matches the reference (:func:`matches`) while one
  rank alone does not: the ranks hold partial sums.

A point whose replicated ranks differ and whose sum does not match the reference is what it was
before: inconsistent shards (one line).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tracer import schema

#: share of the significant elements that must follow the pattern ("nearly every element")
SHARE = 0.95
#: relative tolerance of one element's ratio (bf16 rounding of k·a stays well inside)
REL_TOL = 0.02
#: elements whose |A| is below this fraction of max |A| carry no ratio
NEGLIGIBLE = 1e-3
#: fewest significant elements for a judgement
MIN_ELEMENTS = 8


@dataclass(frozen=True)
class ContractMismatch(schema.Record):
    """A capture point whose two sides hold different quantities (not a numeric divergence).

    Attributes:
        name: the capture point.
        how: ``scaled`` (B ≈ factor·A) or ``rank sum`` (B's ranks hold partial sums of A).
        factor: B / A (8.0: B is 8× A; 0.125: A is 8× B); for ``rank sum``, the number of ranks.
        share: the share of significant elements that follow the pattern.
        text: one line for the report.
    """

    name: str
    how: str
    factor: float
    share: float
    text: str


def _flat64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1).to(device="cpu", dtype=torch.float64)


def _ratio(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float] | None:
    """``(k, share)`` when b ≈ k·a (k an integer ≥ 2) at ``share`` ≥ :data:`SHARE` of the significant
    elements; else None."""
    ok = torch.isfinite(a) & torch.isfinite(b)
    if not bool(ok.any()):
        return None
    scale = float(a[ok].abs().max())
    if scale == 0:
        return None
    sig = ok & (a.abs() > NEGLIGIBLE * scale)
    if int(sig.sum()) < MIN_ELEMENTS:
        return None
    r = b[sig] / a[sig]
    k = round(float(r.median()))
    if k < 2:
        return None
    share = float(((r - k).abs() <= REL_TOL * k).to(torch.float64).mean())
    return (float(k), share) if share >= SHARE else None


def scale_factor(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float] | None:
    """``(B / A, share)`` when one side is an integer k ≥ 2 times the other at nearly every element
    (``8.0``: B = 8·A; ``0.125``: A = 8·B); None otherwise (identical or ordinary differences)."""
    fa, fb = _flat64(a), _flat64(b)
    if fa.numel() != fb.numel() or fa.numel() == 0:
        return None
    up = _ratio(fa, fb)
    if up is not None:
        return up
    down = _ratio(fb, fa)
    return (1.0 / down[0], down[1]) if down is not None else None


def matches(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of elements where B agrees with A within :data:`REL_TOL` (relative to max |A|·1e-3
    at least): how well a rank sum reproduces the reference."""
    fa, fb = _flat64(a), _flat64(b)
    if fa.numel() == 0:
        return 1.0
    ok = torch.isfinite(fa) & torch.isfinite(fb)
    scale = float(fa[ok].abs().max()) if bool(ok.any()) else 0.0
    close = ok & ((fa - fb).abs() <= REL_TOL * torch.maximum(fa.abs(), torch.full_like(fa, NEGLIGIBLE * scale)))
    return float(close.to(torch.float64).mean())


def check_scaled(name: str, a: torch.Tensor, b: torch.Tensor, world: int | None) -> ContractMismatch | None:
    """A ``scaled`` :class:`ContractMismatch` when B ≈ k·A (or A ≈ k·B) at nearly every element."""
    got = scale_factor(a, b)
    if got is None:
        return None
    f, share = got
    k = round(f if f >= 1 else 1 / f)
    side = f"the engine holds ×{k} the reference" if f >= 1 else f"the reference holds ×{k} the engine"
    ws = f" (k = the world size {world})" if world is not None and k == world else ""
    return ContractMismatch(name, "scaled", f, share,
                            f"capture contract differs (partial vs full sums, ×{k}) at {name}: {side} at "
                            f"{100 * share:.1f}% of its elements{ws}; fix the dump's dims (a full sum is not "
                            "'tp:partial'; per-rank partial sums are)")


def check_rank_sum(name: str, a: torch.Tensor, total: torch.Tensor, k: int) -> ContractMismatch | None:
    """A ``rank sum`` :class:`ContractMismatch` when the float64 sum of B's ``k`` ranks (``total``)
    matches the reference at nearly every element; None when it does not."""
    share = matches(a, total)
    if share < SHARE:
        return None
    return ContractMismatch(name, "rank sum", float(k), share,
                            f"capture contract differs (partial vs full sums, {k} ranks) at {name}: the dump's "
                            f"{k} TP ranks hold partial sums (their sum matches the reference at {100 * share:.1f}% "
                            "of its elements) but its dims do not say so; mark them 'h[tp:partial]'")
