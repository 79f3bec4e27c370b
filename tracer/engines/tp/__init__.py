"""Real tensor parallelism over torch.distributed: run B of a ``--tp-mode distributed`` plan on K
ranks, each holding a shard of the HF model and running the HF engine's forward on it.

=============  ==========================================================================
module         holds
=============  ==========================================================================
``dist``       the executor: K ranks spawned (or joined under ``torchrun``), their captures
               gathered and merged; the header's ``tensor_parallel`` facts; the checks
               made before anything is spawned
``launch``     a rank's first moments (tied to its parent's life, its job received)
``ranks``      one rank's run, and the parent watching its ranks
``shard``      sharding the model (column / row / vocab parallel), the collective, backends
=============  ==========================================================================
"""

from __future__ import annotations

from typing import Any

from tracer.engines.base import Engine, Executor


#: the most ranks :meth:`Tp.fit` tries above a check's own degree to find one the model shards to
MAX_TP_STEPS = 6


class Tp(Engine):
    """Chosen by ``--tp-mode distributed`` (its row's ``chosen_by``); builds on the HF engine."""

    name = "tp"

    def executor(self, role: str) -> Executor:
        """:func:`tracer.engines.tp.dist.execute_loaded` (plain runs only)."""
        from tracer.engines.tp.dist import execute_loaded

        return execute_loaded

    def facts(self, loaded: Any, plan: Any) -> dict[str, Any]:
        """The HF contract of the model its ranks shard (:func:`tracer.engines.hf.facts.hf_contract`)."""
        from tracer.engines.hf.facts import hf_contract

        return hf_contract(loaded)

    def check(self, plans: list[Any], device: str | None, *, verdict: bool = False, dispatched: bool = False,
              model: Any = None) -> None:
        """:func:`tracer.engines.tp.dist.check_distributed`."""
        from tracer.engines.tp.dist import check_distributed

        check_distributed(plans, device, verdict=verdict, dispatched=dispatched, model=model)

    def unavailable(self, options: dict[str, Any], device: str) -> str | None:
        """Why K = ``options["tp"]`` (default 2) ranks cannot start on ``device`` here
        (:func:`tracer.engines.tp.shard.check_world`), else None."""
        from tracer.engines.tp.shard import check_world
        from tracer.errors import TracerError

        try:
            check_world(int(options.get("tp", 2)), device)
        except TracerError as e:
            return str(e)
        return None

    def detail(self, device: str) -> str | None:
        """The collective's backend on ``device`` (gloo, nccl)."""
        from tracer.engines.tp.shard import backend_for

        return backend_for(device)

    def fit(self, options: dict[str, Any], model: Any) -> tuple[dict[str, Any], str | None]:
        """The smallest degree K from ``options["tp"]`` (default 2) up to :data:`MAX_TP_STEPS` more that
        divides the model's heads, KV heads and sharded dimensions (SmolLM2's 9 heads: TP-3, not
        TP-2; :func:`tracer.engines.tp.shard.check_shardable`), or why none does."""
        from tracer.engines.tp.shard import check_shardable
        from tracer.errors import TracerError

        k0 = int(options.get("tp", 2))
        first = None
        for k in range(k0, k0 + MAX_TP_STEPS + 1):
            try:
                check_shardable(model, k)
            except TracerError as e:
                first = first or str(e)
                continue
            return {**options, "tp": k}, None
        return options, f"{first} (nor does any degree up to {k0 + MAX_TP_STEPS})"

    def header(self, plans: list[Any], device: str) -> dict[str, Any]:
        """``{"tensor_parallel": ...}`` (:func:`tracer.engines.tp.dist.header_facts`)."""
        from tracer.engines.tp.dist import header_facts

        return {"tensor_parallel": header_facts(plans[0], device)}

    def follows(self, plan: Any) -> bool:
        """Under ``torchrun``, every rank but 0 only takes part in the distributed plan."""
        from tracer.engines.tp.dist import torchrun_rank

        return torchrun_rank() not in (None, 0)


ENGINE = Tp()

__all__ = ["Tp", "ENGINE"]
