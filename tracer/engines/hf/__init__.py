"""The HF reference engine: a run plan executed on the Hugging Face model in this process.

=============  ==========================================================================
module         holds
=============  ==========================================================================
``run``        a plan's forward passes with capture hooks (chunks, KV cache, batch rows,
               CUDA graphs, KV formats), greedy decode, the bare run ``tracer bench``
               measures against
``context``    what a plan changes about the model for its run, undone on exit (attention
               implementation, torch.compile, simulated TP, deterministic mode, devices)
``rollout``    an RL step's rollout (K prompts sampled from a KV cache) and trainer (one
               teacher-forced forward) executors
``facts``      its numeric contract (transformers version, attention, norm, GEMM, dtypes)
=============  ==========================================================================
"""

from __future__ import annotations

from typing import Any

from tracer.engines.base import Engine, Executor


class Hf(Engine):
    """The reference: every catalogue scenario as planned, run, rollout and train."""

    name = "hf"

    def executor(self, role: str) -> Executor:
        """``run``: :func:`tracer.engines.hf.run.execute_loaded`; ``rollout`` / ``train``:
        :func:`tracer.engines.hf.rollout.execute_rollout` / ``execute_train``."""
        if role == "run":
            from tracer.engines.hf.run import execute_loaded

            return execute_loaded
        from tracer.engines.hf import rollout

        return {"rollout": rollout.execute_rollout, "train": rollout.execute_train}[role]

    def facts(self, loaded: Any, plan: Any) -> dict[str, Any]:
        """:func:`tracer.engines.hf.facts.hf_contract`."""
        from tracer.engines.hf.facts import hf_contract

        return hf_contract(loaded)

    def run_bare(self, loaded: Any, token_ids: list[int], scen: Any, **options: Any) -> None:
        """:func:`tracer.engines.hf.run.run_bare` (``options``: ``extra``, ``on_output``, ``wrap``)."""
        from tracer.engines.hf.run import run_bare

        run_bare(loaded, token_ids, scen, **options)


ENGINE = Hf()

__all__ = ["Hf", "ENGINE"]
