"""The engine protocol: what every engine folder's ``ENGINE`` does, reached only through the door.

An engine (one folder ``tracer/engines/<name>/`` and one row of :mod:`tracer.engines.table`)
subclasses :class:`Engine` in its package's ``__init__.py`` and sets ``ENGINE = <its class>()``.
Three things make an engine; the rest have defaults:

- :meth:`Engine.realise`: a catalogue scenario (planned for the reference) with both plans handed
  to this engine, each with the settings it needs (``RunPlan.engine_settings``), or refused in one
  line (the door has already refused a scenario outside its row's ``scenarios``);
- :meth:`Engine.executor`: the function that executes a plan of a role (``run``, ``rollout``,
  ``train``) into a :class:`~tracer.execute.records.RunRecord` whose captures carry **HF module
  names**, called as ``fn(loaded, token_ids, plan, points, window, **options)`` and returning
  ``(run, partials)``; its module (and the engine's package) is imported only then;
- :meth:`Engine.facts`: its numeric contract for a plan, before it runs (the trace header's
  ``engines``, the comparison's engine facts).

An engine's package ``__init__.py`` imports nothing heavy: ``import tracer`` and a run on another
engine never load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from tracer.engines.table import EngineRow, row
from tracer.errors import TracerError

if TYPE_CHECKING:
    from tracer.execute.records import RunRecord
    from tracer.load.models import LoadedModel
    from tracer.plan.plans import RunPlan, Scenario

#: an executor: ``fn(loaded, token_ids, plan, points, window, **options) -> (run, partials)``
Executor = Callable[..., "tuple[RunRecord, RunRecord | None]"]


class Engine:
    """One engine (subclassed in ``tracer/engines/<name>/__init__.py``; ``name`` is its table row's).

    Attributes:
        name: the engine's name, its row in :data:`tracer.engines.table.ENGINES` and its folder.
    """

    name: str = ""

    @property
    def row(self) -> EngineRow:
        """The engine's row of the table."""
        return row(self.name)

    def executor(self, role: str) -> Executor:
        """The execute function of a plan of ``role`` (the row's ``roles``), its module imported now.

        Raises:
            ModuleNotFoundError: the engine's package is not installed (the door names it).
        """
        raise NotImplementedError

    def realise(self, scen: Scenario) -> Scenario:
        """``scen`` (planned for the reference) with its plans executed by this engine; the reference
        returns it unchanged.

        Raises:
            TracerError: a scenario or option this engine cannot realise (one line).
        """
        return scen

    def facts(self, loaded: LoadedModel, plan: RunPlan) -> dict[str, Any]:
        """The engine's numeric contract for ``plan``, known before it runs: ``engine``, ``version``,
        ``device``, ``dtype``, ``attention_backend``, ``norm``, ``activation``, ``gemm``,
        ``activation_dtype``, ``logits_dtype``, ``kv_cache_dtype``, ``block_size``,
        ``max_num_batched_tokens``, ``compilation_mode``, ``cudagraph_mode``.

        Raises:
            TracerError: the engine cannot start.
        """
        raise NotImplementedError

    def scheduler_note(self, run: str, meta: dict[str, Any]) -> str | None:
        """One line on what this engine's scheduler did for run ``run`` (its record's ``meta``), or None."""
        return None

    def comparison_note(self, comparison: Any, meta_a: dict[str, Any], meta_b: dict[str, Any]) -> str | None:
        """One line on what this engine's runs explain about ``comparison`` (a
        :class:`~tracer.diff.result.Comparison` of its runs A and B, their records' ``meta``), or None."""
        return None

    def check(self, plans: list[RunPlan], device: str | None, *, verdict: bool = False, dispatched: bool = False,
              model: Any = None) -> None:
        """Refuse, before anything loads or is spawned, ``plans`` (this engine's plans of a scenario)
        that this machine or this run cannot execute (``verdict``: ``--verdict`` asked; ``dispatched``:
        the model is spread by ``--device-map``; ``model``: the loaded model, when it is).

        Raises:
            TracerError: one line naming the problem and what to do.
        """

    def unavailable(self, options: dict[str, Any], device: str) -> str | None:
        """Why this machine cannot run this engine with scenario ``options`` (its package missing,
        too few devices), in a few words; None when it can (``tracer audit`` skips a check with it)."""
        r = self.row
        if r.package is not None:
            import importlib.util

            if importlib.util.find_spec(r.package) is None:
                return f"{r.product} is not installed (it needs {r.install})"
        return None

    def detail(self, device: str) -> str | None:
        """A few words on how this engine runs on ``device`` (e.g. its collective's backend), or None."""
        return None

    def fit(self, options: dict[str, Any], model: Any) -> tuple[dict[str, Any], str | None]:
        """Scenario ``options`` adjusted to what ``model`` allows in this engine (real TP: the smallest
        degree from the asked one up that the model shards to), and why none does (else None).
        The default: ``options`` as they are."""
        return options, None

    def header(self, plans: list[RunPlan], device: str) -> dict[str, Any]:
        """What the trace header records about this engine's ``plans`` besides its facts (else {})."""
        return {}

    def follows(self, plan: RunPlan) -> bool:
        """Whether this process only takes part in ``plan`` (a follower rank of a multi-process engine),
        leaving the comparison and the trace to the leader."""
        return False

    def run_bare(self, loaded: LoadedModel, token_ids: list[int], scen: Scenario, **options: Any) -> None:
        """Both plans of ``scen`` with no hooks and no comparison: the floor ``tracer bench`` measures
        capture against.

        Raises:
            TracerError: this engine has no bare floor.
        """
        raise TracerError(f"tracer bench has no bare run for engine {self.name!r}")

    def capture(self, obj: Any, points: Any, **options: Any) -> Any:
        """A capture context of a user's engine object (the row's ``objects``), as ``tracer.capture(obj)``.

        Raises:
            TracerError: this engine captures no object of its own, or an option it does not take.
        """
        raise TracerError(f"tracer.capture takes no {self.name} object")


__all__ = ["Engine", "Executor"]
