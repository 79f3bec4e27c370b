"""The door to the engines: the one module the pipeline, the loops, validation and the API call to
realise a scenario on an engine, execute a run plan, or ask an engine for its facts.

An *engine* executes one :class:`~tracer.plan.plans.RunPlan` on the loaded model with capture hooks
attached and hands back what its modules computed as a :class:`~tracer.execute.records.RunRecord`
whose captures carry **HF module names**, whatever the engine calls them internally. Each engine is
a row of :mod:`tracer.engines.table` and a folder ``tracer/engines/<name>/`` whose package exports
``ENGINE`` (a :class:`tracer.engines.base.Engine`); this door imports the folder the first time a
plan needs it (:func:`engine`), so ``import tracer`` stays light and an optional engine's package is
needed only by runs that use it. Which engine runs a plan is decided here, from the plan
(:func:`engine_of`): the row chosen by its TP mode (``--tp-mode distributed``: ``tp``), else the
engine it names (``RunPlan.engine``; none: the reference). A plan's *executor* is the engine's
function for the plan's role (:func:`executor_name`: the engine's name, ``tp-distributed``, and for
an RL step ``<engine>-rollout`` / ``<engine>-train``); an engine without its role is refused in one line.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable

from tracer.engines.table import ENGINES, REFERENCE, is_reference, name_of, row, rows, selectable
from tracer.errors import TracerError
from tracer.plan.engines import with_engine_options

if TYPE_CHECKING:
    from tracer.engines.base import Engine
    from tracer.execute.points import CapturePoint
    from tracer.execute.records import RunRecord
    from tracer.load.models import LoadedModel
    from tracer.plan.plans import RunPlan, Scenario


def engine(name: str | None) -> Engine:
    """The :class:`~tracer.engines.base.Engine` of ``name`` (None: the reference): its folder's ``ENGINE``.

    Raises:
        TracerError: an engine not in the table, or a row without its folder.
    """
    r = row(name)
    folder = f"{__package__}.{r.name}"
    try:
        found = getattr(importlib.import_module(folder), "ENGINE", None)
    except ModuleNotFoundError as e:
        if e.name != folder:
            raise
        found = None
    if found is None:
        raise TracerError(f"engine {r.name!r} has a row in tracer/engines/table.py but no folder "
                          f"tracer/engines/{r.name}/ exporting ENGINE")
    return found


def _chosen(plan: RunPlan) -> str:
    """The name of the engine that runs ``plan`` (:func:`engine_of`)."""
    tp = getattr(plan, "tp", None)
    if tp is not None:
        by_mode = [r.name for r in ENGINES if r.chosen_by == f"--tp-mode {tp.mode}"]
        if by_mode:
            return by_mode[0]
    name = name_of(getattr(plan, "engine", None))
    if name not in selectable():
        raise TracerError(f"unknown engine {name!r}; use one of: {', '.join(selectable())}")
    return name


def engine_of(plan: RunPlan) -> Engine:
    """The engine that executes ``plan`` (module docstring).

    Raises:
        TracerError: an unknown engine.
    """
    return engine(_chosen(plan))


def _role(plan: RunPlan) -> str:
    rl = getattr(plan, "rl", None)
    return "run" if rl is None else rl.role


def executor_name(plan: RunPlan) -> str:
    """Which executor runs ``plan``: the engine's name for a plain run (``hf``), the engine and its TP
    mode for one chosen by ``--tp-mode`` (``tp-distributed``), ``<engine>-<role>`` for an RL plan
    (``hf-rollout``, ``hf-train``).

    Raises:
        TracerError: an engine tracer does not know (listing the known ones), or an RL plan on an
            engine without its role.
    """
    name = _chosen(plan)
    r, role = row(name), _role(plan)
    if r.chosen_by != "--engine":
        return f"{name}-{r.chosen_by.split()[-1]}"
    if role not in r.roles:
        raise TracerError(f"engine {name!r} has no {role} executor for the rollout-vs-train scenario yet (its roles in "
                          f"tracer/engines/table.py: {', '.join(r.roles)}); run its plans with engine {REFERENCE!r}")
    return name if role == "run" else f"{name}-{role}"


def _missing(name: str, e: ModuleNotFoundError) -> TracerError:
    """The one-line error for an engine whose package (``e.name``) is not installed."""
    missing = (e.name or "").split(".")[0]
    r = row(name)
    how = r.install or f"pip install -e '.[{name}]'"
    return TracerError(f"engine {name!r} needs the package {missing!r}, which is not installed; "
                       f"install it in {how}, or use --engine {REFERENCE}")


def executor(plan: RunPlan) -> Callable[..., tuple[Any, Any]]:
    """The execute function of :func:`executor_name` (its module imported now).

    Raises:
        TracerError: unknown engine, or its package is not installed (one line naming it).
    """
    executor_name(plan)  # refuses what no executor runs
    name = _chosen(plan)
    try:
        return engine(name).executor(_role(plan))
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "tracer":
            raise
        raise _missing(name, e) from None


def execute_plan(loaded: LoadedModel, token_ids: list[int], plan: RunPlan, points: list[CapturePoint], window: tuple[int, int],
                 **options: Any) -> tuple[RunRecord, RunRecord | None]:
    """Execute ``plan`` on ``loaded`` with the engine that runs it.

    Args:
        loaded: the :class:`~tracer.load.models.LoadedModel` (the HF model; other engines build
            their own from the same weights, ``loaded.info``).
        token_ids: the prompt, N ints.
        plan: the :class:`~tracer.plan.plans.RunPlan`.
        points: capture points under HF names (:func:`tracer.execute.points.discover_points`).
        window: the compared positions ``(start, stop)``.
        options: ``keep_on_device``, ``decode``, ``meta``, ``say``, ``kernels``, ``sdpa_inputs``; for a
            trainer plan of an RL step also ``rollout`` (run A's record).

    Returns:
        ``(run, partials)``: the :class:`~tracer.execute.records.RunRecord` and, for
        ``--tp-partials``, every rank's row-parallel partials as a record of their own (else None).

    Raises:
        TracerError: a plan this engine cannot execute here (each executor's own errors).
    """
    return executor(plan)(loaded, token_ids, plan, points, window, **options)


def realise(scen: Scenario, name: str | None) -> Scenario:
    """``scen`` with both plans executed by engine ``name`` (None: the reference, ``scen`` unchanged;
    ``rollout-vs-train``: run A only); the ``engine`` scenario's plans, which name their own engines,
    each realised by its engine. The engine options in ``scen.params`` (``--attention-backend``,
    ``--batch-invariant``) are then set in the settings of every plan whose engine takes them
    (:func:`tracer.plan.engines.with_engine_options`).

    Raises:
        TracerError: an unknown engine, a scenario outside its row's ``scenarios``, a mitigation it
            cannot apply, or what the engine itself refuses (one line each).
    """
    if scen.name == "engine":
        if not is_reference(name):
            raise TracerError("--engine does not combine with --scenario engine, whose two runs name their own "
                              f"engines; use --engines A,B (e.g. --engines {','.join(selectable()[:2])})")
        for e in dict.fromkeys(p.engine for p in (scen.plan_a, scen.plan_b) if not is_reference(p.engine)):
            scen = engine(e).realise(scen)
        return with_engine_options(scen, scen.params)
    if is_reference(name):
        if scen.params.get("engine_only"):  # a scenario that exists only inside an engine (its KV connectors)
            inside = [r.name for r in ENGINES if r.scenarios is not None and scen.name in r.scenarios]
            raise TracerError(f"scenario {scen.name} runs inside an engine, not in {REFERENCE}; add "
                              f"{' or '.join(f'--engine {e}' for e in inside)}")
        return scen
    r = row(name)
    if r.scenarios is not None and scen.name not in r.scenarios:
        raise TracerError(f"scenario {scen.name} does not run in {r.name}: it changes something {r.name} does not "
                          f"expose here; with --engine {r.name} use one of: {', '.join(r.scenarios)}")
    if r.deterministic and (scen.params.get("mitigation") == "deterministic" or scen.plan_a.deterministic
                            or scen.plan_b.deterministic):
        raise TracerError(f"--mitigation deterministic is not available in {r.name}: {r.deterministic}; use "
                          f"--mitigation aligned (prefix-cache) or --engine {REFERENCE}")
    return with_engine_options(engine(r.name).realise(scen), scen.params)


def facts(loaded: LoadedModel, plan: RunPlan) -> dict[str, Any]:
    """The numeric contract of the engine ``plan`` runs on, before it runs
    (:meth:`tracer.engines.base.Engine.facts`; an engine with a process of its own starts it now,
    and the run reuses it).

    Raises:
        TracerError: the engine's package is missing, or it cannot start.
    """
    name = _chosen(plan)
    try:
        return engine(name).facts(loaded, plan)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "tracer":
            raise
        raise _missing(name, e) from None


def scheduler_note(run: str, meta: dict[str, Any]) -> str | None:
    """What the scheduler of run ``run``'s engine (``meta["engine"]["engine"]``) did, in one line
    (:meth:`tracer.engines.base.Engine.scheduler_note`); None for an engine without one, or not in the table."""
    name = (meta.get("engine") or {}).get("engine") if isinstance(meta.get("engine"), dict) else None
    if name not in rows():
        return None
    return engine(name).scheduler_note(run, meta)


def comparison_note(comparison: Any, meta_a: dict[str, Any], meta_b: dict[str, Any]) -> str | None:
    """What run B's engine (``meta_b["engine"]["engine"]``) explains about ``comparison``, in one line
    (:meth:`tracer.engines.base.Engine.comparison_note`); None for an engine without it, or not in the table."""
    name = (meta_b.get("engine") or {}).get("engine") if isinstance(meta_b.get("engine"), dict) else None
    if name not in rows():
        return None
    return engine(name).comparison_note(comparison, meta_a, meta_b)


def uses_engines(scen: Scenario) -> bool:
    """Whether a plan of ``scen`` names an engine other than the reference (``RunPlan.engine``)."""
    return any(not is_reference(getattr(p, "engine", None)) for p in (scen.plan_a, scen.plan_b))


def engines_header(loaded: LoadedModel, scen: Scenario) -> dict[str, Any]:
    """The trace header's ``engines``: each run's engine contract, known before it runs
    (:func:`facts`), when a plan runs on an engine other than the reference; else {}."""
    if not uses_engines(scen):
        return {}
    return {"engines": {p.name: facts(loaded, p) for p in (scen.plan_a, scen.plan_b)}}


def _by_engine(scen: Scenario) -> dict[str, list[RunPlan]]:
    out: dict[str, list[RunPlan]] = {}
    for plan in (scen.plan_a, scen.plan_b):
        out.setdefault(_chosen(plan), []).append(plan)
    return out


def header(scen: Scenario, device: str) -> dict[str, Any]:
    """What the trace header records about the engines of ``scen``'s plans besides their facts
    (:meth:`tracer.engines.base.Engine.header`; ``--tp-mode distributed``: ``tensor_parallel``)."""
    out: dict[str, Any] = {}
    for name, plans in _by_engine(scen).items():
        out.update(engine(name).header(plans, device))
    return out


def check(scen: Scenario, device: str | None, *, verdict: bool = False, dispatched: bool = False,
          model: Any = None) -> None:
    """Refuse a scenario whose plans this machine or this run cannot execute, before anything is
    spawned (:meth:`tracer.engines.base.Engine.check`).

    Raises:
        TracerError: one line naming the problem and what to do.
    """
    for name, plans in _by_engine(scen).items():
        engine(name).check(plans, device, verdict=verdict, dispatched=dispatched, model=model)


def follower_plans(scen: Scenario) -> list[RunPlan]:
    """The plans of ``scen`` this process only takes part in (a follower rank, e.g. under ``torchrun``:
    the leader compares and writes); empty for a process that runs the scenario itself."""
    return [p for p in (scen.plan_a, scen.plan_b) if engine_of(p).follows(p)]


def run_bare(loaded: LoadedModel, token_ids: list[int], scen: Scenario, **options: Any) -> None:
    """Both plans of ``scen`` on their engine with no hooks and no comparison (the bench's floor;
    :meth:`tracer.engines.base.Engine.run_bare`).

    Raises:
        TracerError: an engine without a bare run.
    """
    engine_of(scen.plan_a).run_bare(loaded, token_ids, scen, **options)


def capture_object(obj: Any, points: Any, **options: Any) -> Any:
    """A capture context of a user's engine object (a table row's ``objects``: its class from that
    package, with that attribute), or None when ``obj`` is no engine's object.

    Raises:
        TracerError: an option that engine's capture does not take.
    """
    package = type(obj).__module__.split(".")[0]
    for r in ENGINES:
        if r.objects is not None and r.objects[0] == package and hasattr(obj, r.objects[1]):
            return engine(r.name).capture(obj, points, **options)
    return None


__all__ = ["engine", "engine_of", "executor_name", "executor", "execute_plan", "realise", "facts", "uses_engines",
           "engines_header", "header", "check", "follower_plans", "run_bare", "capture_object", "scheduler_note",
           "comparison_note"]
