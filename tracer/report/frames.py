"""pandas DataFrames of results (pandas is the optional extra ``pandas``, imported lazily)."""

from __future__ import annotations

from typing import Any

from tracer.errors import TracerError


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
    (:func:`tracer.report.tables.rows`: counts, errors, ULP histogram ``ulp_*``, origin, ...) plus
    ``index`` and ``op``.

    Raises:
        TracerError: pandas is not installed.
    """
    pd = pandas()
    from tracer.report.tables import rows

    recs = rows(comparison)
    ops = [p.op for p in comparison.points] + ([""] if comparison.logits is not None else [])
    for i, rec in enumerate(recs):
        rec.setdefault("index", i)
        rec.setdefault("op", ops[i])
        rec.setdefault("origin", False)
    return pd.DataFrame.from_records(recs).set_index("index")
