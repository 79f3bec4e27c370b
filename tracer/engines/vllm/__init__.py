"""vLLM in-process: a ``vllm.LLM`` built from the weights folder HF loads, run eager in this process,
its modules captured with hooks and mapped onto HF names (``hooks/engine-vllm.toml``).

=============  ==========================================================================
module         holds
=============  ==========================================================================
``realise``    how a catalogue scenario becomes vLLM requests' settings (no vLLM import)
``plan``       a plan's settings, requests in waves, and the check of what the scheduler did
``engine``     the ``LLM`` per settings, its facts, the executor, the bare floor
``facts``      what its scheduler did, in words (no vLLM import)
``capture``    hooks on vLLM's modules, its flattened steps cut back to the traced prompt
``captured``   ``tracer.capture(llm)``: a user's own ``vllm.LLM`` captured
``rollout``    an RL step's rollout sampled by vLLM, each token's logprob as vLLM reports it
=============  ==========================================================================

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
        """``run``: :func:`tracer.engines.vllm.engine.execute_loaded`; ``rollout``:
        :func:`tracer.engines.vllm.rollout.execute_rollout`.

        Raises:
            ModuleNotFoundError: vllm is not installed.
        """
        if role == "rollout":
            from tracer.engines.vllm.rollout import execute_rollout

            return execute_rollout
        from tracer.engines.vllm.engine import execute_loaded

        return execute_loaded

    def realise(self, scen: Any) -> Any:
        """:func:`tracer.engines.vllm.realise.realise`."""
        return realise(scen)

    def facts(self, loaded: Any, plan: Any) -> dict[str, Any]:
        """:func:`tracer.engines.vllm.engine.plan_facts` (the LLM for the plan's settings is built now,
        and reused by the run)."""
        from tracer.engines.vllm.engine import plan_facts

        return plan_facts(loaded, plan)

    def scheduler_note(self, run: str, meta: dict[str, Any]) -> str | None:
        """:func:`tracer.engines.vllm.facts.scheduler_note`."""
        from tracer.engines.vllm.facts import scheduler_note

        return scheduler_note(run, meta)

    def run_bare(self, loaded: Any, token_ids: list[int], scen: Any, **options: Any) -> None:
        """Each plan's requests through vLLM's own ``generate`` (:func:`tracer.engines.vllm.engine.run_bare`;
        ``options``: ``meta``)."""
        from tracer.engines.vllm.engine import run_bare

        for plan in (scen.plan_a, scen.plan_b):
            run_bare(loaded, token_ids, plan, options.get("meta"))

    def capture(self, obj: Any, points: Any, *, reference: Any = None, cuda_graphs: bool = False,
                keep_on_device: bool = False) -> Any:
        """``tracer.capture(llm)``: a :class:`~tracer.engines.vllm.captured.VllmCaptured` of a user's
        eager ``vllm.LLM``.

        Raises:
            TracerError: ``cuda_graphs`` or ``keep_on_device`` (not available there).
        """
        for bad, what in ((cuda_graphs, "cuda_graphs=True: tracer captures a vLLM LLM only eager (hooks do not fire "
                                        "in vLLM's CUDA graphs)"),
                          (keep_on_device, "keep_on_device=True: a vLLM capture is copied to the host as each step "
                                           "runs")):
            if bad:
                raise TracerError(f"tracer.capture(vllm.LLM, {what}; drop the option")
        from tracer.engines.vllm.captured import VllmCaptured

        return VllmCaptured(obj, points, reference=reference)


ENGINE = Vllm()

__all__ = ["Vllm", "ENGINE"]
