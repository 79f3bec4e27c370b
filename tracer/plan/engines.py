"""Which engine executes a scenario's plans, as far as planning knows it: ``--engines`` parsed, an
engine's defaults for the scenario options, and ``--scenario engine`` (level 6). Plain data and pure
functions over the table of engines (:mod:`tracer.engines.table`; no torch, no engine import).

Every catalogue scenario is planned for the reference engine; an engine realises it (its plans'
``RunPlan.engine`` and ``engine_settings``) through the door, :func:`tracer.engines.door.realise`.
:func:`engine_scenario` is level 6 for real: run A on one engine, run B on another, the same weights
and token ids, every position compared (``--engines``; the default: the first two engines
``--engine`` chooses among).
"""

from __future__ import annotations

from typing import Any

from tracer.engines.table import check_engine, name_of, row, selectable
from tracer.errors import TracerError
from tracer.plan.plans import RunPlan, Scenario


def parse_engines(engines: Any) -> tuple[str, str]:
    """``"A,B"`` or a pair → ``(A, B)`` (each a known engine; installed or not: the run's validation
    checks that, :func:`tracer.engines.table.check_engine`).

    Raises:
        TracerError: not two engines, or one unknown.
    """
    if isinstance(engines, str):
        engines = tuple(e.strip() for e in engines.split(","))
    engines = tuple(engines)
    if len(engines) != 2 or not all(isinstance(e, str) and e for e in engines):
        raise TracerError(f"--engines needs two engines such as {','.join(selectable()[:2])}, got {list(engines)}")
    return check_engine(engines[0], "--engines", False), check_engine(engines[1], "--engines", False)


def engine_defaults(engine: str | None, accepted: Any, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with the engine's defaults (its table row's ``defaults``) for the options the builder
    accepts and the user left unset."""
    out = dict(params)
    for key, value in row(engine).defaults.items():
        if key in accepted and out.get(key) is None:
            out[key] = value
    return out


def engine_scenario(n_tokens: int, *, engines: Any = selectable()[:2]) -> Scenario:
    """Level 6: the prompt in one forward pass on engine A versus on engine B (same weights folder,
    same dtype, same token ids). Compared: all N positions; the logits where both engines computed
    them (an engine that computes them only where it samples: there). Each engine realises its plan
    (:func:`tracer.engines.door.realise`).

    Raises:
        TracerError: not two known engines.
    """
    a, b = parse_engines(engines)
    n = n_tokens
    plans = [RunPlan(name, ((0, n),), f"{row(e).label}: all {n} tokens in one forward pass", engine=name_of(e))
             for name, e in (("A", a), ("B", b))]
    return Scenario(name="engine", level=6, invariant=f"engine choice ({a} vs {b})", plan_a=plans[0], plan_b=plans[1],
                    window=(0, n), params={"n_tokens": n, "engines": [a, b]})


__all__ = ["check_engine", "parse_engines", "engine_defaults", "engine_scenario"]
