"""The engine seam: the one place where a run plan is executed.

An *engine* executes one :class:`~tracer.plan.scenarios.RunPlan` on the loaded model with capture
hooks attached and hands back what its modules computed as a
:class:`~tracer.execute.records.RunRecord` whose captures carry **HF module names**, whatever
the engine calls them internally. The pipeline (:func:`tracer.pipeline.run_scenario`) calls
:func:`execute_plan` and nothing else; which executor runs a plan is decided here, from the plan:

======================  =================================================================
executor                runs
======================  =================================================================
``hf``                  the HF model in this process (:func:`tracer.execute.runner.execute`)
``tp-distributed``      a ``--tp-mode distributed`` plan: K ranks over torch.distributed
                        (:func:`tracer.execute.tp_dist.execute_distributed`; under ``torchrun``
                        :func:`~tracer.execute.tp_dist.execute_joined`)
``vllm``                ``plan.engine == "vllm"``: vLLM in-process, eager
                        (:func:`tracer.execute.vllm_engine.execute`)
``hf-rollout``          an RL rollout plan (``plan.rl.role == "rollout"``) on ``hf``: K prompts
                        sampled token by token from a KV cache (:mod:`tracer.execute.rollout`)
``hf-train``            an RL trainer plan (``plan.rl.role == "train"``) on ``hf``: one
                        teacher-forced forward over run A's sequences; it also receives
                        ``rollout=`` (run A's record)
``vllm-rollout``        an RL rollout plan on ``vllm``: the K prompts sampled by vLLM, each
                        token's logprob as vLLM reports it (:mod:`tracer.execute.vllm_rollout`)
======================  =================================================================

An RL plan (``plan.rl`` set) goes to the executor ``<engine>-<role>`` (``hf-rollout``, ``hf-train``,
``vllm-rollout``). An engine without an executor for a role has its RL plans refused in one line.

Adding an engine means one module with an ``execute`` function of the signature below, one entry
in :data:`EXECUTORS`, and its name map in ``hooks/`` (``engine-<family>.toml``). Executors are
imported only when a plan needs them, so ``import tracer`` stays light and an optional engine's
package (vLLM) is needed only by runs that use it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable

from tracer.errors import TracerError
from tracer.plan.engines import ENGINES, PACKAGES

if TYPE_CHECKING:
    from tracer.execute.points import CapturePoint
    from tracer.load.models import LoadedModel
    from tracer.plan.scenarios import RunPlan

#: executor name → ``(module, function)``; the function is called as
#: ``fn(loaded, token_ids, plan, points, window, **options)`` and returns ``(run, partials)``
EXECUTORS: dict[str, tuple[str, str]] = {
    "hf": ("tracer.execute.runner", "execute_loaded"),
    "tp-distributed": ("tracer.execute.tp_dist", "execute_loaded"),
    "vllm": ("tracer.execute.vllm_engine", "execute_loaded"),
    "hf-rollout": ("tracer.execute.rollout", "execute_rollout"),
    "hf-train": ("tracer.execute.rollout", "execute_train"),
    "vllm-rollout": ("tracer.execute.vllm_rollout", "execute_rollout"),
}


def executor_name(plan: RunPlan) -> str:
    """Which executor runs ``plan``: ``tp-distributed`` for a ``--tp-mode distributed`` plan,
    ``<engine>-<role>`` for an RL plan (``plan.rl``: ``hf-rollout``, ``hf-train``), else the plan's
    engine (``hf``, ``vllm``).

    Raises:
        TracerError: an engine tracer does not know (listing the known ones), or an RL plan on an
            engine without an executor for its role.
    """
    if plan.tp is not None and plan.tp.mode == "distributed":
        return "tp-distributed"
    engine = getattr(plan, "engine", "hf") or "hf"
    if engine not in ENGINES:
        raise TracerError(f"unknown engine {engine!r}; use one of: {', '.join(ENGINES)}")
    rl = getattr(plan, "rl", None)
    if rl is not None:
        name = f"{engine}-{rl.role}"
        if name not in EXECUTORS:
            raise TracerError(f"engine {engine!r} has no {rl.role} executor for the rollout-vs-train scenario yet "
                              f"(no {name!r} in tracer.execute.engines.EXECUTORS); run its plans with engine 'hf'")
        return name
    return engine


def executor(plan: RunPlan) -> Callable[..., tuple[Any, Any]]:
    """The execute function of :func:`executor_name` (its module imported now).

    Raises:
        TracerError: unknown engine, or its package is not installed (one line naming it).
    """
    name = executor_name(plan)
    module, fn = EXECUTORS[name]
    try:
        return getattr(importlib.import_module(module), fn)
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        if missing == "tracer":
            raise TracerError(f"engine {name!r}: this tracer has no executor module {module}") from None
        how = PACKAGES[name][1] if name in PACKAGES else f"pip install -e '.[{name}]'"
        raise TracerError(f"engine {name!r} needs the package {missing!r}, which is not installed; "
                          f"install it in {how}, or use --engine hf") from None


def execute_plan(loaded: LoadedModel, token_ids: list[int], plan: RunPlan, points: list[CapturePoint], window: tuple[int, int],
                 **options: Any) -> tuple[Any, Any]:
    """Execute ``plan`` on ``loaded`` with the engine it names.

    Args:
        loaded: the :class:`~tracer.load.models.LoadedModel` (the HF model; other engines build
            their own from the same weights, ``loaded.info``).
        token_ids: the prompt, N ints.
        plan: the :class:`~tracer.plan.scenarios.RunPlan`.
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


def hf_contract(loaded: Any) -> dict[str, Any]:
    """The HF reference's numeric contract in the keys an engine's facts use
    (:meth:`tracer.execute.vllm_engine.VllmEngine.facts`): transformers version, attention
    implementation, norm, activation, GEMM (the library torch runs it on:
    :func:`tracer.execute.kernels.torch_gemm`), activation / logits / KV-cache dtypes."""
    import transformers

    from tracer.execute.kernels import torch_gemm

    model, info = loaded.model, loaded.info
    cfg = getattr(model.config, "get_text_config", lambda: model.config)()
    norm = next((type(m).__name__ for _n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")), None)
    head = model.get_output_embeddings()
    logits = str(getattr(getattr(head, "weight", None), "dtype", info.dtype)).replace("torch.", "")
    return {"engine": "hf", "version": transformers.__version__, "device": info.device, "dtype": info.dtype,
            "attention_backend": info.attn_implementation,
            "norm": (f"{norm} (PyTorch ops); the residual added in {info.dtype} first, the rounded sum normalized "
                     "in float32" if norm else "?"),
            "activation": f"{getattr(cfg, 'hidden_act', '?')} then * up (PyTorch ops)",
            "gemm": torch_gemm(info.device, info.dtype), "activation_dtype": info.dtype, "logits_dtype": logits,
            "kv_cache_dtype": info.dtype, "block_size": "none (a contiguous KV cache)",
            "max_num_batched_tokens": "none (each forward call computes what it is given)",
            "compilation_mode": 0, "cudagraph_mode": "NONE"}


def plan_contract(loaded: Any, plan: Any) -> dict[str, Any]:
    """The numeric contract of the engine ``plan`` runs on, before it runs (the trace header's
    ``engines``): :func:`hf_contract`, or the engine module's ``plan_facts(loaded, plan)`` (vLLM:
    the LLM for the plan's settings is built now, and reused by the run).

    Raises:
        TracerError: the engine's package is missing, or it cannot start.
    """
    engine = getattr(plan, "engine", "hf") or "hf"
    if engine == "hf":
        return hf_contract(loaded)
    module = EXECUTORS[engine][0]
    try:
        return importlib.import_module(module).plan_facts(loaded, plan)
    except ModuleNotFoundError as e:
        how = PACKAGES[engine][1] if engine in PACKAGES else f"pip install -e '.[{engine}]'"
        raise TracerError(f"engine {engine!r} needs the package {(e.name or '').split('.')[0]!r}, which is not "
                          f"installed; install it in {how}, or use --engine hf") from None


def uses_engines(scen: Any) -> bool:
    """Whether a plan of ``scen`` runs on an engine other than HF (``RunPlan.engine``)."""
    return any((getattr(p, "engine", "hf") or "hf") != "hf" for p in (scen.plan_a, scen.plan_b))


def engines_header(loaded: Any, scen: Any) -> dict[str, Any]:
    """The trace header's ``engines``: each run's engine contract, known before it runs
    (:func:`tracer.execute.engines.plan_contract`), when a plan runs on an engine other than HF; else {}."""
    if not uses_engines(scen):
        return {}
    return {"engines": {p.name: plan_contract(loaded, p) for p in (scen.plan_a, scen.plan_b)}}


__all__ = ["ENGINES", "EXECUTORS", "executor_name", "executor", "execute_plan", "hf_contract", "plan_contract",
           "uses_engines", "engines_header"]
