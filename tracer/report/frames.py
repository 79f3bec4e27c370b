"""pandas DataFrames of results (pandas is the optional extra ``pandas``, imported lazily)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tracer.diff.provenance import call_shapes
from tracer.errors import TracerError
from tracer.report.rl import summary_dict, token_records
from tracer.report.tables import rows

if TYPE_CHECKING:
    from pandas import DataFrame

    from tracer.diff.result import Comparison
    from tracer.diff.rl import RLComparison
    from tracer.store.sweepfile import SweepResult


def pandas():
    """The pandas module.

    Raises:
        TracerError: pandas is not installed (names the fix).
    """
    try:
        import pandas as pd
    except ImportError:
        raise TracerError("pandas is not installed; pip install 'tracer[pandas]' (or pandas) to get DataFrames") from None
    return pd


def comparison_frame(comparison: Comparison) -> DataFrame:
    """One row per capture point in execution order, the logits last: the report's columns
    (:func:`tracer.report.tables.rows`: counts, errors, ULP histogram ``ulp_*``, origin, ...) plus
    ``index``, ``op`` and ``shapes_a``/``shapes_b``: the shapes the op saw in each run for the
    compared positions (``M 18 K 576 N 1536`` for a Linear; :func:`tracer.diff.provenance.call_shapes`).

    Raises:
        TracerError: pandas is not installed.
    """
    pd = pandas()

    recs = rows(comparison)
    ops = [p.op for p in comparison.points] + ([""] if comparison.logits is not None else [])
    shapes = [(call_shapes(p, p.calls_a, comparison.positions), call_shapes(p, p.calls_b, comparison.positions))
              for p in comparison.points] + ([({}, {})] if comparison.logits is not None else [])
    for i, rec in enumerate(recs):
        rec.setdefault("index", i)
        rec.setdefault("op", ops[i])
        rec.setdefault("origin", False)
        rec["shapes_a"], rec["shapes_b"] = (_shape_text(s) for s in shapes[i])
    frame = pd.DataFrame.from_records(recs).set_index("index")
    if getattr(comparison, "rl", None) is not None:  # rollout-vs-train: the RL summary rides along
        frame.attrs["rl"] = rl_frame(comparison.rl).attrs["rl"]
    return frame


def rl_frame(rl: RLComparison) -> DataFrame:
    """The RL metrics per response token: one row per token of every sequence (K × T), columns
    ``sequence, step, token, logp_a, logp_b, dlogp, ratio, vocab_kl, traced``
    (:func:`tracer.report.rl.token_records`); the summary (:func:`tracer.report.rl.summary_dict`) and
    the knob rows in ``frame.attrs["rl"]``.

    Raises:
        TracerError: pandas is not installed.
    """
    pd = pandas()

    frame = pd.DataFrame.from_records(token_records(rl))
    frame.attrs["rl"] = {**summary_dict(rl), "mitigations": [m.to_dict() for m in rl.mitigations]}
    return frame


def _shape_text(shape: dict) -> str:
    """``{"M": 18, "K": 576, "N": 1536}`` → ``M 18 K 576 N 1536`` ("" when unknown)."""
    return " ".join(f"{k} {v}" for k, v in shape.items())


def sweep_frame(result: SweepResult) -> DataFrame:
    """One DataFrame row per finished point: the scalar fields plus ``first_divergent_name``.

    Raises:
        TracerError: pandas is not installed.
    """
    pd = pandas()
    recs = []
    for r in result.rows:
        recs.append({
            "length": r.length, "block_size": r.block_size, "split_at": r.split_at,
            "n_positions": r.n_positions, "diverged": r.diverged,
            "first_divergent": result.point_name(r.first_divergent),
            "first_divergent_index": r.first_divergent,
            "last_layer_fraction": r.last_layer_fraction,
            "logits_max_abs_diff": r.logits_max_abs_diff, "argmax_flips": r.argmax_flips,
            "wall_s": r.wall_s,
        })
    return pd.DataFrame.from_records(recs, columns=[
        "length", "block_size", "split_at", "n_positions", "diverged", "first_divergent",
        "first_divergent_index", "last_layer_fraction", "logits_max_abs_diff", "argmax_flips", "wall_s"])

