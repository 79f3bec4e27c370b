"""Noise or defect? Re-running a scenario at higher precision and judging how the divergence scales.

Rounding-order noise (a GEMM tiled differently, a reduction split elsewhere) is a difference of
roughly one rounding error, amplified by the network: it scales with the dtype's machine epsilon
ε. A logic difference (a wrong mask, a padding bug, a stale or perturbed cache) does not: it is
there at any precision. :func:`tracer.pipeline.precision_ladder` runs the same scenario on the same model cast to
float32 (and float64 on the CPU), measures the divergence D at the logits and at the worst
decoder layer (the layer with the largest max abs diff in the original run), and compares the
drop with the drop of ε.

The rule (constants below). For a higher-precision level h against the base run b and each
measure (logits, worst layer), with D the max abs diff of A vs B:

- the *scaling exponent* ``s = log(D_b / D_h) / log(ε_b / ε_h)``: 1 when D falls exactly in
  proportion to ε, 0 when it does not fall at all; ``s = inf`` when D_h = 0 (bit-identical).
- a level is **noise-like** when every measure has ``s >= NOISE_MIN_EXPONENT`` (0.5: D fell
  by at least the square root of ε's drop: bf16 → fp32 is a factor 65536 in ε, so D must fall by
  256 or more), **defect-like** when some measure has ``s < DEFECT_MAX_EXPONENT`` (0.25: D fell by
  less than the fourth root of ε's drop, 16 for bf16 → fp32), otherwise in between.

Verdict: ``rounding noise`` when every level is noise-like; ``defect suspected`` when the most
precise level is defect-like (the divergence does not go away with precision); otherwise, or
when the base run shows no divergence, or a measure is NaN, ``inconclusive``. The numbers that
led to it are part of the result (:meth:`NoiseVerdict.lines`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tracer import schema
from tracer.errors import TracerError

NOISE_MIN_EXPONENT = 0.5
DEFECT_MAX_EXPONENT = 0.25
VERDICTS = ("rounding noise", "defect suspected", "inconclusive")


def epsilon(dtype: str) -> float:
    """Machine epsilon of a dtype name (``torch.finfo(dtype).eps``: 2^-7 for bfloat16)."""
    return float(torch.finfo(getattr(torch, dtype)).eps)


def higher_dtypes(base: str, device: str) -> tuple[str, ...]:
    """The dtypes the verdict re-runs at: float32 (if above ``base``), and float64 on the CPU.

    Raises:
        TracerError: nothing above ``base`` on this device.
    """
    out = tuple(d for d in ("float32", "float64") if epsilon(d) < epsilon(base)
                and (d != "float64" or str(device).startswith("cpu")))
    if not out:
        raise TracerError(f"--verdict needs a precision above {base} on {device}; run the scenario at "
                          "--dtype bfloat16/float16, or on --device cpu (float64)")
    return out


@dataclass(frozen=True)
class Level(schema.Record):
    """The divergence of one re-run.

    Attributes:
        dtype: the model dtype of the re-run (``float32``).
        eps: its machine epsilon.
        logits_max_abs: max abs diff of the logits, A vs B (logit units).
        layer_max_abs: max abs diff at the worst layer, A vs B (residual stream units).
        identical: every compared tensor bit-identical at this dtype.
        exponents: ``{"logits": s, "layer": s}`` against the base level (None for the base).
        judgement: ``noise-like``, ``defect-like``, ``in between`` (None for the base).
    """

    dtype: str
    eps: float
    logits_max_abs: float
    layer_max_abs: float
    identical: bool
    exponents: dict[str, float | None] | None = None
    judgement: str | None = None


@dataclass(frozen=True)
class NoiseVerdict(schema.Record):
    """Result of :func:`tracer.pipeline.precision_ladder`.

    Attributes:
        verdict: one of :data:`VERDICTS`.
        reason: one line: the numbers behind it.
        layer: the worst layer's name (the layer measure).
        levels: the base run first, then each re-run.
    """

    verdict: str
    reason: str
    layer: str | None
    levels: tuple[Level, ...]

    def lines(self) -> list[str]:
        """Lines for people: one per level, then the verdict with its reason."""
        out = [f"noise or defect: divergence vs machine epsilon (worst layer {self.layer}):"]
        for lv in self.levels:
            s = ""
            if lv.exponents is not None:
                s = "  scaling exponent " + ", ".join(
                    f"{k} {'inf (bit-identical)' if v == math.inf else 'n/a' if v is None else f'{v:.2f}'}"
                    for k, v in lv.exponents.items()) + f" → {lv.judgement}"
            out.append(f"  {lv.dtype:<9} ε={lv.eps:.3g}  logits max|Δ| {lv.logits_max_abs:.3g}  "
                       f"layer max|Δ| {lv.layer_max_abs:.3g}{s}")
        out.append(f"noise verdict: {self.verdict}: {self.reason}")
        return out

    def schema_extras(self, doc: dict[str, Any]) -> None:
        doc["rule"] = {"noise_min_exponent": NOISE_MIN_EXPONENT, "defect_max_exponent": DEFECT_MAX_EXPONENT}


def measure(c: Any, layer: str | None) -> tuple[float, float]:
    """``(logits max abs diff, max abs diff at capture point ``layer``)`` of a comparison (NaN where absent)."""
    logits = c.logits.tensor.max_abs_diff if c.logits is not None else math.nan
    lay = next((p.diff.max_abs_diff for p in c.points if p.name == layer), math.nan)
    return float(logits), float(lay)


def _exponent(d_b: float, d_h: float, eps_b: float, eps_h: float) -> float | None:
    if math.isnan(d_b) or math.isnan(d_h) or d_b == 0:
        return None
    if d_h == 0:
        return math.inf
    if math.isinf(d_b) or math.isinf(d_h):
        return None
    return math.log(d_b / d_h) / math.log(eps_b / eps_h)


def judge(base: Level, others: list[Level]) -> tuple[str, str, tuple[Level, ...]]:
    """Apply the rule of the module docstring.

    Returns:
        ``(verdict, reason, levels)`` where ``levels`` carry their exponents and judgements.
    """
    if base.identical:
        return "inconclusive", f"the runs are bit-identical at {base.dtype}: there is no divergence to judge", (base, *others)
    judged = []
    for lv in others:
        ex = {"logits": _exponent(base.logits_max_abs, lv.logits_max_abs, base.eps, lv.eps),
              "layer": _exponent(base.layer_max_abs, lv.layer_max_abs, base.eps, lv.eps)}
        known = [v for v in ex.values() if v is not None]
        if not known:
            j = "in between"
        elif any(v < DEFECT_MAX_EXPONENT for v in known):
            j = "defect-like"
        elif all(v >= NOISE_MIN_EXPONENT for v in known):
            j = "noise-like"
        else:
            j = "in between"
        judged.append(Level(lv.dtype, lv.eps, lv.logits_max_abs, lv.layer_max_abs, lv.identical, ex, j))
    levels = (base, *judged)
    top = judged[-1]

    def nums(lv: Level) -> str:
        return f"logits max|Δ| {base.logits_max_abs:.3g} → {lv.logits_max_abs:.3g} from {base.dtype} to {lv.dtype} (ε ×{lv.eps / base.eps:.2g})"

    if top.judgement == "defect-like":
        return ("defect suspected", f"{nums(top)}: the divergence does not shrink with precision "
                f"(scaling exponent below {DEFECT_MAX_EXPONENT})", levels)
    if all(lv.judgement == "noise-like" for lv in judged):
        return ("rounding noise", f"{nums(top)}: it falls with machine epsilon "
                f"(scaling exponent >= {NOISE_MIN_EXPONENT} at every precision)", levels)
    return "inconclusive", f"{nums(top)}: between the thresholds ({DEFECT_MAX_EXPONENT}..{NOISE_MIN_EXPONENT})", levels
