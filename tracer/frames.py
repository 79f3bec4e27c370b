"""pandas DataFrames of results (pandas is the optional extra ``pandas``, imported lazily)."""

from __future__ import annotations

from typing import Any

from .errors import TracerError


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


def comparison_frame(comparison: Any):
    """One row per capture point in execution order, the logits last: the report's columns
    (:func:`tracer.report.rows`) plus ``index``, ``op``, ``origin`` and the ULP histogram bins
    (``ulp_0`` .. ``ulp_>16``, element counts).

    Raises:
        TracerError: pandas is not installed.
    """
    pd = pandas()
    from .metrics import ULP_BINS
    from .report import rows

    recs = rows(comparison)
    diffs = [p.diff for p in comparison.points] + ([comparison.logits.tensor] if comparison.logits is not None else [])
    ops = [p.op for p in comparison.points] + ([""] if comparison.logits is not None else [])
    origins = [bool(getattr(p, "origin", False)) for p in comparison.points] + ([False] if comparison.logits is not None else [])
    for i, (rec, d) in enumerate(zip(recs, diffs)):
        rec.setdefault("index", i)
        rec.setdefault("op", ops[i])
        rec.setdefault("origin", origins[i])
        for label, count in zip(ULP_BINS, d.ulp_hist):
            rec[f"ulp_{label}"] = count
    return pd.DataFrame.from_records(recs).set_index("index")
