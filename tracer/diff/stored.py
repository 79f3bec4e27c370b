"""A :class:`~tracer.diff.result.Comparison` rebuilt from its stored JSON document (no recomputation).

``tracer run`` and ``tracer audit`` store every comparison's :meth:`Comparison.to_dict` in the
trace (``/comparisons/<name>``); :func:`comparison_from_dict` turns that document back into the
result object, so reports and figures are drawn from the stored numbers without re-reading any
tensor (and from ``--store stats`` traces, which hold no tensors).
"""

from __future__ import annotations

import math
from dataclasses import replace
import os
from typing import Any

from tracer.diff.replay import Replay
from tracer.diff.result import Comparison, PointResult
from tracer.diff.dataflow import Consumes
from tracer.errors import TracerError
from tracer.diff.metrics import ArgmaxFlip, LogitsDiff, TensorDiff

_TENSOR_FIELDS = ("n_total", "n_diff", "max_abs_diff", "mean_abs_diff", "max_ulp", "ulp_hist", "rel_error", "cosine",
                  "sqnr_db", "frac_rel_lt_1e3", "frac_rel_lt_5e3", "n_nan_a", "n_nan_b", "n_inf_a", "n_inf_b",
                  "max_ulp_mag")


def _num(x: Any) -> Any:
    """Undo the strict-JSON encoding of non-finite floats (``"inf"``, ``"-inf"``, ``"nan"``; None → nan)."""
    if x is None:
        return math.nan
    if isinstance(x, str):
        return float(x)
    return x


def _tensor(d: dict[str, Any]) -> TensorDiff:
    kw = {k: _num(d[k]) for k in _TENSOR_FIELDS if k in d}
    kw["ulp_hist"] = tuple(int(v) for v in d.get("ulp_hist", ()))
    for k in ("n_total", "n_diff", "max_ulp", "n_nan_a", "n_nan_b", "n_inf_a", "n_inf_b"):
        kw[k] = int(kw[k])
    return TensorDiff(**kw)


def _point(d: dict[str, Any]) -> PointResult:
    cons = d.get("consumes") or {}
    return PointResult(
        name=d["name"], kind=d["kind"], op=d.get("op", ""), diff=_tensor(d),
        amplification=d.get("amplification"), growth=d.get("growth"),
        calls_a=list(d.get("shapes_a") or []), calls_b=list(d.get("shapes_b") or []),
        consumes=Consumes(points=tuple(cons.get("points", ())), prefix=tuple(cons.get("prefix", ())),
                          rule=cons.get("rule", "structure")),
        origin=bool(d.get("origin")), differing_inputs=tuple(d.get("differing_inputs", ())),
        n_diff_prefix=d.get("n_diff_prefix"), n_outside_tol=d.get("n_outside_tol"))


def _logits(d: dict[str, Any], start: int) -> LogitsDiff:
    flips = tuple(ArgmaxFlip(position=int(f["position"]) - start, token_a=int(f["token_a"]), token_b=int(f["token_b"]),
                             margin_a=_num(f["margin_a"]), margin_b=_num(f["margin_b"])) for f in d.get("flips", ()))
    return LogitsDiff(tensor=_tensor(d), n_positions=int(d["positions"]), argmax_flips=flips,
                      kl_mean=_num(d.get("kl_mean")), kl_max=_num(d.get("kl_max")),
                      top5_overlap=_num(d.get("top5_overlap")), top10_overlap=_num(d.get("top10_overlap")),
                      rank_of_a_top_in_b_max=int(d.get("rank_of_a_top_in_b_max") or 0))


def _noise(d: dict[str, Any] | None) -> Any:
    if not d:
        return None
    from tracer.diff.verdict import Level, NoiseVerdict

    levels = tuple(Level(dtype=lv["dtype"], eps=_num(lv["eps"]), logits_max_abs=_num(lv["logits_max_abs"]),
                         layer_max_abs=_num(lv["layer_max_abs"]), identical=bool(lv["identical"]),
                         exponents=None if lv.get("exponents") is None else {k: (None if v is None else _num(v))
                                                                             for k, v in lv["exponents"].items()},
                         judgement=lv.get("judgement")) for lv in d.get("levels", ()))
    return NoiseVerdict(verdict=d["verdict"], reason=d["reason"], layer=d.get("layer"), levels=levels)


def comparison_from_dict(doc: dict[str, Any]) -> Comparison:
    """The :class:`Comparison` whose :meth:`~Comparison.to_dict` is ``doc``.

    Raises:
        TracerError: ``doc`` is not a comparison document (a key is missing or malformed).
    """
    try:
        start, stop = (int(x) for x in doc["positions"])
        lg = doc.get("logits")
        replay = doc.get("replay")
        runs = doc.get("runs") or ["A", "B"]
        tol = doc.get("tolerance") or {}
        return Comparison(
            scenario=doc["scenario"], model=doc["model"], positions=(start, stop), run_a=runs[0], run_b=runs[1],
            points=tuple(_point(p) for p in doc["layers"]),
            logits_name=lg["name"] if lg else None, logits=_logits(lg, start) if lg else None,
            trace=doc.get("trace"), facts=dict(doc.get("facts") or {}),
            logits_origin=bool(lg.get("origin")) if lg else False,
            logits_n_outside_tol=lg.get("n_outside_tol") if lg else None,
            atol=tol.get("atol"), rtol=tol.get("rtol"),
            replay=Replay(tokens_a=tuple(replay["tokens_a"]), tokens_b=tuple(replay["tokens_b"]),
                          first_diff=replay.get("first_diff"), text_a=replay.get("text_a"),
                          text_b=replay.get("text_b")) if replay else None,
            noise=_noise(doc.get("noise_verdict")), fail_on=(doc.get("check") or {}).get("fail_on"),
            per_position=doc.get("per_position"))
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise TracerError(f"not a stored comparison document ({type(e).__name__}: {e}); "
                          "was the trace written by this version of tracer?") from None


def stored_comparison(path: str | os.PathLike, name: str | None = None) -> Comparison | None:
    """The comparison stored in trace ``path`` (``name``, or the only/first one), None when it stores none.

    Raises:
        TracerError: unreadable trace, or an unknown ``name`` (the message lists the stored ones).
    """
    from tracer.store.trace import TraceReader

    with TraceReader(path) as r:
        stored = r.comparisons()
    if not stored:
        return None
    if name is None:
        name = next(iter(stored))
    if name not in stored:
        raise TracerError(f"trace {path} stores no comparison {name!r}; stored: {', '.join(stored)}")
    return comparison_from_dict(stored[name])


def auto_comparison(path: str | os.PathLike, run_a: str | None, run_b: str | None) -> Comparison | None:
    """For a ``--store auto`` trace that dropped tensors, the comparison stored at run time of the
    two runs asked for (default: its first two), with a note; None when the trace keeps every
    point it compared, or stores no comparison of exactly these runs.

    Raises:
        TracerError: unreadable trace.
    """
    from tracer.store.trace import TraceReader

    with TraceReader(path) as r:
        runs = r.runs
        a = run_a or (runs[0] if runs else None)
        b = run_b or next((n for n in runs if n != a), None)
        if a not in runs or b not in runs:
            return None
        metas = [r.run(n, load_tensors=False).meta.get("store_auto") for n in (a, b)]
        if not any(isinstance(m, dict) and m.get("dropped") for m in metas):
            return None
        stored = r.comparisons()
    for doc in stored.values():
        if isinstance(doc, dict) and list(doc.get("runs") or []) == [a, b]:
            c = comparison_from_dict(doc)
            kept = metas[0] if isinstance(metas[0], dict) else {}
            note = (f"from the comparison made when the trace was written: --store auto kept full tensors of "
                    f"{len(kept.get('kept', []))} of {len(kept.get('kept', [])) + len(kept.get('dropped', []))} "
                    "points, so the others cannot be recomputed from the file")
            return replace(c, facts={**c.facts, "notes": list(c.facts.get("notes", [])) + [note]})
    return None
