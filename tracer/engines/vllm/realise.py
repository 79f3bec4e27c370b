"""How vLLM realises a catalogue scenario: each plan's engine settings (its KV block size, how its
chunks become requests) and its description, or a one-line refusal. Plain data and pure functions
(no torch, no vLLM import):

==================  ===================================================================================
scenario            in vLLM (both plans run in vLLM; :mod:`tracer.engines.vllm.engine` executes them)
==================  ===================================================================================
repeat              the same request twice, the prefix cache reset before each
batch               the prompt alone vs scheduled in one step with the other rows (vLLM has no padding)
prefix-cache        a miss vs a hit: a request of the first P tokens, then the prompt (P a multiple of
                    the KV block size); ``--mitigation aligned``: the miss is chunked at P by the
                    scheduler's token budget, so both runs compute the suffix in a step of N - P tokens
block-size          a hit at KV block size b1 vs b2 (two engines)
chunked-prefill     one step vs the prompt split by ``max_num_batched_tokens`` = the chunk size
rollout-vs-train    run A (the rollout) in vLLM; run B, the trainer, stays HF
compile             eager vs vLLM's default compilation (torch.compile; CUDA graphs on GPUs), the same
                    request in one step, both engines writing vLLM's hidden-states output (the same
                    speculative config); run B's layers come from that output
                    (:mod:`tracer.engines.vllm.compiled`: no sublayer point, no KV cache)
prefill-decode      one consumer LLM: alone (a miss) vs loading a producer LLM's KV cache handed over
                    with vLLM's ExampleConnector (:mod:`tracer.engines.vllm.connector`)
tensor-parallel     ``tensor_parallel_size`` 1 vs ``--tp`` k: the same request in one step, both engine
                    cores in their own processes; each rank's capture joined by the engine map's TP
                    rules (:func:`tracer.engines.vllm.ranks.gather_ranks`); vLLM's own all-reduce
                    (``--reduce``, ``--reduce-dtype`` and ``--tp-mode distributed`` are refused)
engine              the plan of ``--engines`` that names vLLM: the prompt in one step (KV block 32;
                    ``vllm:BACKEND``: that attention backend)
==================  ===================================================================================

The other scenarios change something vLLM does not expose here (HF attention implementations,
KV formats applied between chunks, devices, HF generation): the door
refuses them from the table's ``scenarios``, and ``--mitigation deterministic`` from its
``deterministic``: vLLM's own batch-invariant mode (``VLLM_BATCH_INVARIANT=1``, CUDA/ROCm/XPU) is
the engine option ``--batch-invariant``, set with ``--attention-backend`` in the plans' settings by
the door (:func:`tracer.plan.engines.with_engine_options`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tracer.engines.table import REFERENCE, default
from tracer.errors import TracerError
from tracer.plan.plans import RunPlan, Scenario

NAME = "vllm"
#: vLLM's default KV block size (the table's; its CPU attention needs a multiple of 32)
BLOCK = default(NAME, "block_size")


def realise(scen: Scenario) -> Scenario:
    """``scen`` with both plans executed by vLLM (``rollout-vs-train``: run A only; ``engine``: the
    plans that name vLLM), each with the engine settings the scenario needs (module docstring).

    Raises:
        TracerError: a mitigation vLLM cannot apply, or a cached prefix off its KV block grid (one line each).
    """
    if scen.name == "engine":
        return replace(scen, **{k: replace(p, engine_settings=tuple(sorted({**dict(p.engine_settings or ()),
                                                                          "block_size": BLOCK}.items())))
                                for k, p in (("plan_a", scen.plan_a), ("plan_b", scen.plan_b)) if p.engine == NAME})
    p = scen.params
    if scen.name == "rollout-vs-train":
        spec = scen.plan_a.rl
        if p.get("mitigations"):
            raise TracerError("--mitigations changes the rollout's LM head dtype and deterministic mode, which the vLLM "
                              f"rollout does not expose; use it with --engine {REFERENCE}")
        how = f"sampled at τ={spec.temperature:g}, seeds {spec.seed}..{spec.seed + spec.rollouts - 1}" if spec.sample \
            else "greedy"
        a = replace(scen.plan_a, engine=NAME, engine_settings=(("block_size", int(p.get("block_size") or BLOCK)),),
                    description=f"rollout in vLLM: {spec.rollouts} request(s) of {list(spec.lengths)} tokens prefilled in "
                                f"one step (flattened, no padding), then {spec.new_tokens - 1} decode steps, {how}; "
                                "each token's logprob as vLLM reports it")
        return replace(scen, plan_a=a, params={**p, "engine": NAME})
    if scen.name == "tensor-parallel":
        return _tensor_parallel(scen)
    sizes = {"plan_a": p.get("block_size", BLOCK), "plan_b": p.get("block_size", BLOCK)}
    if scen.name == "block-size":
        sizes = dict(zip(("plan_a", "plan_b"), p["block_sizes"]))
    plans = {}
    for key in ("plan_a", "plan_b"):
        plan: RunPlan = getattr(scen, key)
        settings: dict[str, Any] = {"block_size": int(sizes[key])}
        if len(plan.chunks) > 1:
            aligned = scen.name == "prefix-cache" and key == "plan_a"  # --mitigation aligned: the miss, chunked at P
            if aligned and plan.chunks[1][1] - plan.chunks[1][0] > plan.chunks[0][1]:
                raise TracerError(f"--mitigation aligned in vLLM chunks the miss by a token budget of P = "
                                  f"{plan.chunks[0][1]} tokens, which splits the {plan.n_tokens - plan.chunks[0][1]}-token "
                                  "suffix again; use a cached prefix of at least half the prompt (--split-at)")
            settings["chunks"] = "chunked" if scen.name == "chunked-prefill" or aligned else "prefix-cache"
            if settings["chunks"] == "prefix-cache":
                _check_grid(scen.name, plan, settings["block_size"])
        description = _describe(plan, settings, aligned=scen.name == "prefix-cache" and settings.get("chunks") == "chunked")
        if scen.name == "compile":  # both engines write vLLM's hidden-states output: only the compilation differs
            settings["hidden_states"] = True
        if plan.compile:  # ``compile``: run B is vLLM's own compiled forward, captured through its hidden-states output
            settings["compiled"] = True
            plan = replace(plan, compile=False)
            description = (f"in vLLM (KV block {settings['block_size']}): vLLM's default compilation (torch.compile; "
                           "CUDA graphs on GPUs), layers captured through vLLM's hidden-states output")
        plans[key] = replace(plan, engine=NAME, engine_settings=tuple(sorted(settings.items())), description=description)
    return replace(scen, plan_a=plans["plan_a"], plan_b=plans["plan_b"], params={**p, "engine": NAME})


def _tensor_parallel(scen: Scenario) -> Scenario:
    """``tensor-parallel`` in vLLM: TP 1 vs TP k, both engine cores in their own processes.

    Raises:
        TracerError: an option of the HF engine's simulated or torch.distributed TP (one line)."""
    p = scen.params
    if p.get("tp_mode") == "distributed" or p.get("reduce", "ring") != "ring" \
            or p.get("reduce_dtype", "activation") != "activation":
        raise TracerError("in vLLM, --scenario tensor-parallel runs vLLM's own TP ranks and all-reduce; drop "
                          "--tp-mode distributed, --reduce and --reduce-dtype (they choose the HF engine's TP)")
    if int(p["tp"]) < 2:
        raise TracerError(f"--tp {p['tp']}: in vLLM, --scenario tensor-parallel compares TP 1 (run A) with --tp ranks "
                          "(run B), so TP 1 on both sides is the control; use --tp 2 or more")
    plans = {}
    for key, k in (("plan_a", 1), ("plan_b", int(p["tp"]))):
        settings = {"block_size": int(p.get("block_size") or BLOCK), "multiprocess": True, "tensor_parallel_size": k}
        text = (f"in vLLM (KV block {settings['block_size']}): tensor_parallel_size={k}, "
                + ("one worker" if k == 1 else f"{k} worker processes, vLLM's all-reduce; each rank's capture joined "
                                               "by the engine map's TP rules") + ", the prompt in one step")
        plans[key] = replace(getattr(scen, key), engine=NAME, tp=None, engine_settings=tuple(sorted(settings.items())),
                             description=text)
    return replace(scen, plan_a=plans["plan_a"], plan_b=plans["plan_b"], params={**p, "engine": NAME})


def _check_grid(name: str, plan: RunPlan, block_size: int) -> None:
    bad = [s for s, _e in plan.chunks[1:] if s % block_size]
    if bad:
        raise TracerError(f"scenario {name}: vLLM caches whole KV blocks, and the cached prefix of {bad[0]} tokens is not "
                          f"a multiple of the block size {block_size}; give --split-at a multiple of {block_size}, or "
                          f"--block-size B (a multiple of {BLOCK} on the CPU) to cache the last full block")


def _describe(plan: RunPlan, settings: dict[str, Any], aligned: bool = False) -> str:
    """The plan's description as vLLM realises it (``aligned``: prefix-cache's miss under
    ``--mitigation aligned``, named so as the reference's is: the report does not suggest it again)."""
    bs = settings["block_size"]
    mode = settings.get("chunks")
    if mode == "chunked":
        size = plan.chunks[0][1]
        return (f"in vLLM (KV block {bs}): {'cache miss, aligned: ' if aligned else ''}one request, split by the "
                f"scheduler's budget of {size} tokens per step "
                f"(chunked prefill: {' + '.join(str(e - s) for s, e in plan.chunks)} tokens)")
    if mode == "prefix-cache":
        p = plan.chunks[-1][0]
        return (f"in vLLM (KV block {bs}): a request of the first {p} tokens, then the prompt: a prefix-cache hit "
                f"of {p} tokens (num_cached_tokens), the {plan.n_tokens - p}-token suffix computed")
    if plan.batch is not None:
        return (f"in vLLM (KV block {bs}): the prompt scheduled in one step with {plan.batch.size - 1} other "
                f"request(s) (lengths {list(plan.batch.lengths)}; vLLM flattens requests, no padding)")
    return f"in vLLM (KV block {bs}): one request, all {plan.n_tokens} tokens in one step (prefix cache empty)"


__all__ = ["realise", "BLOCK"]
