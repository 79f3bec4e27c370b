"""vLLM in-process: a ``vllm.LLM`` built from the weights folder HF loads, run eager in this process,
its modules captured with hooks and mapped onto HF names (``hooks/engine-vllm.toml``).

================  ==========================================================================
module            holds
================  ==========================================================================
``realise``       how a catalogue scenario becomes vLLM requests' settings (no vLLM import)
``plan``          a plan's settings, requests in waves, and the check of what the scheduler did
``engine``        the ``LLM`` per settings, its facts, the executor, the bare floor
``facts``         what its scheduler did, in words (no vLLM import)
``environment``   vLLM's log file, its attention backend and batch-invariant mode checked
``contract``      the numeric contract's op facts read from vLLM's modules
``requests``      the followed requests found in each step by their token ids at their positions
``capture``       hooks on vLLM's modules (no model-runner reads), the rows kept on vLLM's device
``assemble``      a capture's rows assembled into HF-named records
``kernels``       ``--kernels`` on vLLM's modules
``captured``      ``tracer.capture(llm)``: a user's own ``vllm.LLM`` captured
``rollout``       an RL step's rollout sampled by vLLM, each token's logprob as vLLM reports it
``remote``        the capture in the workers of an engine core in its own process (vLLM's default)
``ranks``         the TP ranks' capture states joined into one by the engine map's TP rules
``compiled``      compiled vLLM captured at layers through vLLM's own hidden-states output
``hidden_states`` that output's connector, writing on any device, and the LLM settings for it
``layout``        the HF reference layout a capture maps onto; the engine map per family
``engine_facts``  the engine's facts, read in this process or from its worker
``connector``     prefill on a producer, decode on a consumer: settings and KV contracts (no vLLM import)
``transfer``      the KV cache handed over with vLLM's ExampleConnector, the consumer captured
================  ==========================================================================

A new vLLM capability (another runner, a process of its own, KV connectors) is a new module here,
reached from :class:`Vllm` below. Only :mod:`tracer.engines.vllm.realise` is imported with this
package: ``vllm`` itself when a plan runs.
"""

from __future__ import annotations

from typing import Any

from tracer.engines.base import Engine, Executor
from tracer.engines.vllm.realise import NAME, realise
from tracer.errors import TracerError


class Vllm(Engine):
    """vLLM in this process (eager; table row ``vllm``)."""

    name = NAME

    def executor(self, role: str) -> Executor:
        """``run``: :func:`tracer.engines.vllm.engine.execute_loaded` (a KV hand-over's plans:
        :func:`tracer.engines.vllm.transfer.execute_transfer`); ``rollout``:
        :func:`tracer.engines.vllm.rollout.execute_rollout`.

        Raises:
            ModuleNotFoundError: vllm is not installed.
        """
        if role == "rollout":
            from tracer.engines.vllm.rollout import execute_rollout

            return execute_rollout
        from tracer.engines.vllm.transfer import execute_run

        return execute_run

    def realise(self, scen: Any) -> Any:
        """:func:`tracer.engines.vllm.realise.realise` (``prefill-decode``:
        :func:`tracer.engines.vllm.connector.realise_prefill_decode`)."""
        if scen.name == "prefill-decode":
            from tracer.engines.vllm.connector import realise_prefill_decode

            return realise_prefill_decode(scen)
        return realise(scen)

    def facts(self, loaded: Any, plan: Any) -> dict[str, Any]:
        """:func:`tracer.engines.vllm.engine.plan_facts` (the LLM for the plan's settings is built now,
        and reused by the run)."""
        from tracer.engines.vllm.connector import role

        if role(plan) is not None:  # a KV hand-over's plans run on the consumer: its engine, connector and all
            from tracer.engines.vllm.transfer import consumer_facts

            return consumer_facts(loaded, plan)
        from tracer.engines.vllm.engine import plan_facts

        return plan_facts(loaded, plan)

    def scheduler_note(self, run: str, meta: dict[str, Any]) -> str | None:
        """:func:`tracer.engines.vllm.facts.scheduler_note`."""
        from tracer.engines.vllm.facts import scheduler_note

        return scheduler_note(run, meta)

    def comparison_note(self, comparison: Any, meta_a: dict[str, Any], meta_b: dict[str, Any]) -> str | None:
        """``prefill-decode``'s control that is not bit-identical, said why
        (:func:`tracer.engines.vllm.facts.control_note`); None otherwise."""
        from tracer.engines.vllm.facts import control_note
        from tracer.execute.kinds import PointKind

        kv = {p.name: p.n_diff_prefix for p in comparison.points if p.kind == PointKind.KV_CACHE}
        return control_note(dict(comparison.facts), comparison.first_divergent, meta_b.get("kv_transfer"), kv)

    def check(self, plans: list[Any], device: str | None, *, verdict: bool = False, dispatched: bool = False,
              model: Any = None) -> None:
        """Refuse batch-invariant mode (a plan's ``engine_settings``) where this vLLM does not implement
        it (:func:`tracer.engines.vllm.environment.check_batch_invariant`; vLLM is imported then).

        Raises:
            TracerError: the mode asked for on a platform without it, or a KV hand-over whose two sides
                would disagree on what the cache's bytes mean
                (:func:`tracer.engines.vllm.connector.check_before_start`), TP ranks that do not divide
                the model's heads (:func:`tracer.engines.vllm.plan.check_tp_heads`; one line each).
        """
        from tracer.engines.vllm.connector import check_before_start
        from tracer.engines.vllm.plan import check_tp_heads

        check_before_start(plans, model, device)
        check_tp_heads(plans, model)
        if any(dict(p.engine_settings or ()).get("batch_invariant") for p in plans):
            from tracer.engines.vllm.llm import platform
            from tracer.engines.vllm.environment import check_batch_invariant

            check_batch_invariant(True, platform())

    def run_bare(self, loaded: Any, token_ids: list[int], scen: Any, **options: Any) -> None:
        """Each plan's requests through vLLM's own ``generate`` (:func:`tracer.engines.vllm.engine.run_bare`;
        ``options``: ``meta``)."""
        from tracer.engines.vllm.engine import run_bare

        for plan in (scen.plan_a, scen.plan_b):
            run_bare(loaded, token_ids, plan, options.get("meta"))

    def capture(self, obj: Any, points: Any, *, reference: Any = None, cuda_graphs: bool = False,
                keep_on_device: bool = False) -> Any:
        """``tracer.capture(llm)``: a :class:`~tracer.engines.vllm.captured.VllmCaptured` of a user's
        eager ``vllm.LLM`` (``keep_on_device``: its captures left on vLLM's device).

        Raises:
            TracerError: ``cuda_graphs`` (not available there).
        """
        if cuda_graphs:
            raise TracerError("tracer.capture(vllm.LLM, cuda_graphs=True: tracer captures a vLLM LLM only eager (hooks "
                              "do not fire in vLLM's CUDA graphs); drop the option")
        from tracer.engines.vllm.captured import VllmCaptured

        return VllmCaptured(obj, points, reference=reference, keep_on_device=keep_on_device)


ENGINE = Vllm()

__all__ = ["Vllm", "ENGINE"]
