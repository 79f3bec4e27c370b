"""The ``vllm-rollout`` executor: run A of ``rollout-vs-train`` sampled by a real vLLM in this process.

The K prompts (the traced one at ``spec.row``; the others as :func:`tracer.engines.hf.run.batch_inputs`
builds them, without padding: vLLM flattens requests) are added to vLLM together, each a request of
``max_tokens = min_tokens = T`` with ``ignore_eos`` (every sequence gets T tokens, as the HF rollout),
greedy (``temperature=0``) or sampled at ``τ`` with the per-request seed ``spec.seed + j``, and
``logprobs=0``: vLLM reports the sampled token's logprob itself (``raw_logprobs``: log_softmax of the
float32 logits; sampled: ``processed_logprobs``, after the temperature, as the trainer computes it).
vLLM schedules them: one prefill step (GEMM M = Σ prompt lengths), then T - 1 decode steps (M = K).

Captured (:class:`~tracer.engines.vllm.capture.VllmCapture`): the traced request's activations at
positions N-1 .. N+T-2, from the prefill step (N-1) and its decode steps (N ..), mapped onto HF
names; its KV cache over the N + T - 1 positions vLLM computed. A forward hook on the logits
processor keeps every request's logits where vLLM sampled (``extras["rl_logits"]``, ``(K, T, vocab)``
in vLLM's dtype) for the full-vocabulary RL metrics. The trainer (run B) stays HF
(:func:`tracer.engines.hf.rollout.execute_train` recomputes these sequences).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable

import torch

from tracer.errors import TracerError
from tracer.execute.kinds import PointKind
from tracer.execute.points import CapturePoint
from tracer.execute.records import RunRecord, ScheduledRequest, SchedulerFacts, SchedulerStep
from tracer.engines.vllm.llm import vllm
from tracer.engines.vllm.running import engine_for
from tracer.engines.vllm.layout import engine_map, ref_layout
from tracer.engines.vllm.plan import batch_rows, settings_of
from tracer.plan.plans import Batch


def _params(spec: Any) -> list[Any]:
    from vllm import SamplingParams

    t = spec.new_tokens
    common = dict(max_tokens=t, min_tokens=t, ignore_eos=True, logprobs=0)
    if not spec.sample:
        return [SamplingParams(temperature=0.0, **common) for _ in range(spec.rollouts)]
    return [SamplingParams(temperature=float(spec.temperature), top_p=1.0, top_k=0, seed=int(spec.seed) + j, **common)
            for j in range(spec.rollouts)]


def execute_rollout(loaded: Any, token_ids: list[int], plan: Any, points: list[CapturePoint], window: tuple[int, int], *,
                    keep_on_device: bool = False, decode: int = 0, meta: dict[str, Any] | None = None,
                    say: Callable[[str], None] | None = None, kernels: bool = False,
                    sdpa_inputs: bool = False) -> tuple[RunRecord, None]:
    """Run A of ``rollout-vs-train`` in vLLM (module docstring).

    Args:
        loaded: the HF :class:`~tracer.load.models.LoadedModel` (vLLM loads its weights folder).
        token_ids: the traced prompt, N ints.
        plan: a plan whose ``rl`` is a ``rollout`` :class:`~tracer.plan.rollout.RLSpec`, ``engine`` vllm.
        points, window: capture points (HF names) and the kept positions (N-1 .. N+T-2).
        keep_on_device, meta, say: as the other executors; ``kernels``/``sdpa_inputs``/``decode``
            are refused.

    Returns:
        ``(record, None)``: token ids = the traced prompt + its response (N + T); ``meta["rollout"]``
        as :func:`tracer.engines.hf.rollout.execute_rollout` writes it (``tokens``, ``logprobs`` as vLLM
        reported them, ``sequences``, ``lengths``, ``row``, ``tau``), ``meta["engine"]`` and
        ``meta["scheduler"]`` (:class:`~tracer.execute.records.SchedulerFacts`: requests, steps);
        ``extras["rl_logits"]``: ``(K, T, vocab)``.

    Raises:
        TracerError: not a rollout plan, an option vLLM cannot realise, vLLM returning fewer tokens
            or logprobs than asked, hooks that saw no response position.
    """
    spec = plan.rl
    if spec is None or spec.role != "rollout":
        raise TracerError(f"run plan {plan.name} is not the rollout side of an RL step; use the plan's own executor")
    if decode or kernels or sdpa_inputs or plan.deterministic or spec.lm_head_fp32:
        what = ("--decode" if decode else "--kernels" if kernels else "--op-replay" if sdpa_inputs
                else "--mitigation deterministic" if plan.deterministic else "an fp32 LM head")
        raise TracerError(f"{what} is not available for a vLLM rollout; run the rollout with --engine hf")
    n, t, k, r = len(token_ids), spec.new_tokens, spec.rollouts, spec.row
    if spec.lengths[r] != n:
        raise TracerError(f"run plan {plan.name} was planned for a {spec.lengths[r]}-token prompt, the prompt has {n}")
    prompts = batch_rows(list(token_ids), Batch(k, r, "left" if len(set(spec.lengths)) > 1 else "none", tuple(spec.lengths)))
    settings = replace(settings_of(plan, "one-step", {}), logprobs_mode="processed_logprobs" if spec.sample else "raw_logprobs")
    eng = engine_for(loaded, settings, say)
    if max(spec.lengths) + t > eng.kwargs["max_model_len"]:
        raise TracerError(f"prompts of up to {max(spec.lengths)} tokens + {t} response tokens exceed vLLM's max_model_len "
                          f"{eng.kwargs['max_model_len']}; use fewer --new-tokens or a shorter prompt")
    placeholder = list(token_ids) + [0] * t  # the response is known once vLLM has sampled it
    ref = ref_layout(loaded, points, placeholder, window)
    kv_points = {p.layer_index: p.name for p in points if p.kind == PointKind.KV_CACHE}
    emap = engine_map(loaded.info.family)
    cap = eng.new_capture(emap, ref, placeholder, window, kv_points, kv_positions=n + t - 1)
    eng.reset_prefix_cache()
    t0 = time.perf_counter()
    with torch.inference_mode(), cap:
        labels = eng.labels(len(prompts))
        for j, (label, p) in enumerate(zip(labels, prompts)):
            cap.follow(label, p, traced=j == r)  # every rollout's logits; the traced one's activations
        ids = eng.start(prompts, params=_params(spec), labels=labels)
        done = eng.finish()
        for label in labels:
            cap.close(label)
    wall = time.perf_counter() - t0
    tokens, logprobs = [], []
    for j, (ext, _internal) in enumerate(ids):
        out = done[ext].outputs[0]
        toks = list(out.token_ids)
        lps = [d[tok].logprob if d is not None and tok in d else None for tok, d in zip(toks, out.logprobs or [])]
        if len(toks) != t or len(lps) != t or None in lps:
            raise TracerError(f"vLLM returned {len(toks)} tokens and {len(lps)} logprobs for rollout {j}, not {t}; "
                              "this vLLM version ignores min_tokens/ignore_eos or logprobs=0")
        tokens.append(toks)
        logprobs.append([float(x) for x in lps])
    sequences = [list(p) + tokens[j] for j, p in enumerate(prompts)]
    cap = getattr(cap, "local", None) or cap  # the engine core in its own process: the rows read back here
    cap.token_ids = sequences[r]
    cap.ref = replace(cap.ref, token_ids=sequences[r])
    captures, info = cap.records(points, f"vLLM {vllm.__version__}")
    rows = [[row for _p, row in cap.logits_of(ext)] for ext, _internal in ids]
    if any(len(x) != t for x in rows):
        raise TracerError(f"the logits processor computed {[len(x) for x in rows]} rows per request, not {t}; "
                          "vLLM sampled elsewhere than the hooks saw")
    steps = [s for s in cap.steps if s["traced"]]
    record_meta = {
        "wall_s": wall, "device": eng.facts()["device"], "gemm_m": [s["tokens"] for s in cap.steps], **(meta or {}),
        "engine": eng.facts(), "cached_tokens": int(done[ids[r][0]].num_cached_tokens or 0),
        "scheduler": SchedulerFacts(
            "rollout", tuple(ScheduledRequest(ext, internal, len(p), j == r, int(done[ext].num_cached_tokens or 0))
                             for j, ((ext, internal), p) in enumerate(zip(ids, prompts))),
            tuple(SchedulerStep.from_dict(s) for s in steps),
            tuple(tuple(tr["positions"]) for s in steps for tr in s["traced"]), info["mapping"],
            tuple(info["notes"]), cap.runner).to_dict(),
        "not_captured": info["not_captured"],
        "rollout": {"tokens": tokens, "logprobs": logprobs, "row": r, "lengths": list(spec.lengths),
                    "sequences": sequences, "tau": spec.tau, "logprobs_from": f"vLLM ({settings.logprobs_mode})"}}
    extras = {"rl_logits": torch.stack([torch.stack(x) for x in rows]), "partial_logits": info["partial_logits"]}
    if not keep_on_device:  # the records leave the device once, at the end
        captures = {name: replace(c, tensor=c.tensor.cpu()) for name, c in captures.items()}
        extras = {"rl_logits": extras["rl_logits"].cpu(),
                  "partial_logits": {k: (ps, x.cpu()) for k, (ps, x) in extras["partial_logits"].items()}}
    return RunRecord(name=plan.name, token_ids=sequences[r], plan=plan.to_dict(), window=(int(window[0]), int(window[1])),
                     captures=captures, meta=record_meta, extras=extras), None


__all__ = ["execute_rollout"]
