"""The ``vllm`` executor: a run plan executed by a real vLLM engine, captured with hooks.

tracer builds ``vllm.LLM`` itself from the weights folder the HF model was loaded from (a built-in
recipe's cached checkpoint, any local HF folder, or a random-init recipe saved once), in the HF
model's dtype, eager (``enforce_eager=True``, compilation mode 0, no CUDA graphs: compiled
graphs hide modules from hooks), with the engine core in this process by default
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that ordinary forward hooks on vLLM's ``nn.Module`` fire
here; with ``VllmSettings(multiprocess=True)`` (or ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` in the
environment) the engine core runs in its own process and the same hooks run in its workers
(:mod:`tracer.engines.vllm.remote`; so do the ranks of ``VllmSettings(tensor_parallel_size=k)``, whose
captures are joined there). ``VllmSettings(compiled=True)`` builds vLLM's default
compilation instead, captured at layers through vLLM's own hidden-states output
(:mod:`tracer.engines.vllm.compiled`). One ``LLM`` is kept per :class:`VllmSettings` for the life
of the process (:func:`engine_for`; at most :data:`MAX_ENGINES` at once). Building the ``LLM``
(its arguments, weights folder, the environment vLLM is imported in): :mod:`tracer.engines.vllm.llm`;
the running engine and the kept engines: :mod:`tracer.engines.vllm.running`. This module executes
a run plan on one (:func:`execute_loaded`, :func:`run_bare`, :func:`plan_facts`); the public names
of those two modules stay importable from here.

A :class:`~tracer.plan.scenarios.RunPlan` becomes requests (``SamplingParams(max_tokens=1,
temperature=0)``, prompt token ids; the prefix cache reset before every run, so the run decides
what is cached):

==========================  =====================================================================
plan                        what vLLM is asked to do
==========================  =====================================================================
one chunk ``(0, N)``        one request of the prompt: a cache miss, one scheduler step
chunks, ``prefix-cache``    one request per chunk boundary ``s`` (the prompt's first ``s`` tokens),
                            then the prompt: each request hits the previous one's cached blocks
                            (boundaries must be multiples of the KV block size)
chunks, ``chunked``         one request; the LLM's ``max_num_batched_tokens`` is the chunk length,
                            so the scheduler splits the prefill (chunked prefill)
``batch``                   every row of the batch as its own request, added together: one step
                            (rows as :func:`tracer.engines.hf.run.batch_inputs` builds them; vLLM
                            flattens requests, so there is no padding)
==========================  =====================================================================

The chunks of a plan are ``prefix-cache`` unless ``engine_options["chunks"]`` says ``chunked``,
or the scenario is ``chunked-prefill``. What the scheduler actually did (each request's
``num_cached_tokens``, the steps and the traced positions in each) is recorded in the run's meta,
and a run that did not compute what its plan says (a different cached length, a prompt split
across steps that should be one) is refused. Captures: :mod:`tracer.engines.vllm.capture`.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

# first, as before the split: vLLM imported in the environment tracer sets (tracer.engines.vllm.llm);
# the names of llm and running used elsewhere stay importable from here (scripts, tests, notebooks)
from tracer.engines.vllm.llm import (_kv_state, _settings_for, check_head_size, platform, vllm,  # noqa: F401
                                     weights_folder)
from tracer.engines.vllm.running import MAX_ENGINES, VllmEngine, _ENGINES, _release, engine_for  # noqa: F401
from tracer.engines.vllm.contract import op_facts  # noqa: F401
from tracer.engines.vllm.kernels import recorder
from tracer.errors import TracerError
from tracer.execute.kinds import PointKind
from tracer.execute.points import CapturePoint
from tracer.execute.records import RunRecord, ScheduledRequest, SchedulerFacts, SchedulerStep
from tracer.engines.vllm.assemble import settle_records
from tracer.engines.vllm.layout import engine_map, ref_layout
from tracer.engines.vllm.plan import (CHUNK_MODES, VllmSettings, check_schedule, chunk_mode, refuse_unsupported, settings_of,
                                      waves)


def plan_facts(loaded: Any, plan: Any) -> dict[str, Any]:
    """The facts (:meth:`VllmEngine.facts`) of the engine ``plan`` will run on, built now if needed.

    Raises:
        TracerError: as :func:`engine_for`.
    """
    mode = chunk_mode(plan, {}, {})
    return engine_for(loaded, settings_of(plan, mode, {})).facts()


def run_bare(loaded: Any, token_ids: list[int], plan: Any, meta: dict[str, Any] | None = None) -> None:
    """``plan``'s requests through vLLM's own ``LLM.generate`` with no hooks (greedy, one token; the
    prefix cache reset first): the floor ``tracer bench --engine vllm`` measures capture against.

    Raises:
        TracerError: as :func:`execute_loaded` for a plan vLLM cannot realise.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    mode = chunk_mode(plan, {}, dict(meta or {}))
    eng = engine_for(loaded, settings_of(plan, mode, {}))
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    eng.reset_prefix_cache()
    for prompts, _traced in waves(token_ids, plan, mode, eng.kwargs["block_size"]):
        with eng.active():
            eng.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)


def execute_loaded(loaded: Any, token_ids: list[int], plan: Any, points: list[CapturePoint], window: tuple[int, int], *,
                   keep_on_device: bool = False, decode: int = 0, meta: dict[str, Any] | None = None,
                   say: Callable[[str], None] | None = None, kernels: bool = False, sdpa_inputs: bool = False,
                   engine_options: dict[str, Any] | None = None) -> tuple[RunRecord, None]:
    """The ``vllm`` executor of :mod:`tracer.engines.door`: execute ``plan`` in vLLM with hooks.

    Args:
        loaded: the HF :class:`~tracer.load.models.LoadedModel` (its weights folder and dtype are
            vLLM's; its model gives the HF layout the captures are mapped onto).
        token_ids: the prompt, N ints.
        plan: the run plan (see the module docstring for what vLLM is asked to do).
        points: capture points under HF names (:func:`tracer.execute.points.discover_points`).
        window: the compared positions ``(start, stop)``.
        keep_on_device: leave the captures on vLLM's device (the comparison runs there); else
            they are copied to the host once, after the run.
        decode: greedy-decode this many tokens in the traced request (not captured;
            ``meta["decode_tokens"]``).
        meta: merged into the run's meta.
        say: progress messages.
        kernels: record which kernels each capture point's vLLM module ran, step by step
            (:mod:`tracer.engines.vllm.kernels`; ``calls[k]["kernels"]``).
        sdpa_inputs: not available with vLLM (refused when True).
        engine_options: ``{"settings": VllmSettings or its fields as a dict, "chunks":
            "auto" | "prefix-cache" | "chunked"}``.

    Returns:
        ``(run, None)``: the :class:`RunRecord` with captures under HF names (``(T, *feature)``
        over the window in vLLM's dtype; ``kv_cache`` points ``(N, keys + values)``), and in
        ``meta``: ``engine`` (:meth:`VllmEngine.facts`), ``scheduler``
        (:class:`~tracer.execute.records.SchedulerFacts`: requests with vLLM's own
        ``num_cached_tokens``, scheduler steps, the traced positions computed in each step, the
        chunk mode, the HF ← vLLM mapping, notes), ``cached_tokens``, ``not_captured`` (HF name
        → reason) and ``logits`` (positions, dtype); ``extras["partial_logits"]``: HF logits name →
        ``(positions, (k, vocab) tensor)`` where vLLM computed logits at some compared positions only.

    Raises:
        TracerError: compilation/graphs on, plan features vLLM cannot realise here, a schedule
            that differs from the plan, hooks that saw nothing (one line each).
    """
    entered = time.perf_counter()
    meta, options = dict(meta or {}), dict(engine_options or {})
    if decode < 0:
        raise TracerError(f"--decode {decode} is negative; give a number of tokens to generate (0 = off)")
    if plan.n_tokens != len(token_ids):
        raise TracerError(f"run plan {plan.name} covers {plan.n_tokens} tokens but the prompt has {len(token_ids)}")
    refuse_unsupported(plan, kernels, sdpa_inputs)
    mode = chunk_mode(plan, options, meta)
    eng = engine_for(loaded, settings_of(plan, mode, options), say)
    if len(token_ids) + max(decode, 1) > eng.kwargs["max_model_len"]:
        raise TracerError(f"the prompt's {len(token_ids)} tokens (+{max(decode, 1)} generated) exceed vLLM's max_model_len "
                          f"{eng.kwargs['max_model_len']} (the model's positions, or the prompt's length rounded up to "
                          "1024 tokens); use fewer --decode tokens or a shorter prompt")
    plan_waves = waves(token_ids, plan, mode, eng.kwargs["block_size"])
    emap = engine_map(loaded.info.family)
    ref = ref_layout(loaded, points, token_ids, window)
    kv_points = {p.layer_index: p.name for p in points if p.kind == PointKind.KV_CACHE}
    requests: list[dict[str, Any]] = []
    eng.reset_prefix_cache()
    t0 = time.perf_counter()
    if eng.settings.compiled:
        if kernels:
            raise TracerError("--kernels records vLLM's modules with hooks, which a compiled vLLM never runs; run it eager")
        from tracer.engines.vllm.compiled import execute_compiled

        prepare = time.perf_counter() - entered
        run = execute_compiled(eng, loaded, token_ids, plan, points, window, ref, emap, decode=decode, meta=meta)
        run.meta["phases_s"]["prepare"] = prepare  # checks, the engine's lookup, the prefix cache emptied
        return run, None
    if kernels and eng.remote:
        raise TracerError("--kernels records the kernels of vLLM's modules in this process; with vLLM's engine core in "
                          "its own process run without --kernels (or set VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    cap = eng.new_capture(emap, ref, token_ids, window, kv_points)
    with torch.inference_mode(), cap, recorder(eng, cap, kernels) as rec_kernels:
        for w, (prompts, traced) in enumerate(plan_waves):
            last = w == len(plan_waves) - 1
            labels = eng.labels(len(prompts))
            for label, prompt, t in zip(labels, prompts, traced):
                if t:
                    cap.follow(label, prompt)
            ids = eng.start(prompts, max_tokens=max(decode, 1) if last else 1, labels=labels)
            done = eng.finish()
            for (ext, internal), prompt, t in zip(ids, prompts, traced):
                cap.close(ext)
                out = done[ext]
                requests.append(ScheduledRequest(ext, internal, len(prompt), t, int(out.num_cached_tokens or 0),
                                                 tuple(out.outputs[0].token_ids)).to_dict())
    wall = time.perf_counter() - t0
    check_schedule(plan, mode, requests, cap.steps)
    captures, info = cap.records(points, f"vLLM {vllm.__version__}")
    if rec_kernels is not None:
        rec_kernels.attach_vllm(captures, cap)
    captures, logits = settle_records(captures, info, window, keep_on_device)
    main = [r for r in requests if r["traced"]][-1]
    steps = [s for s in cap.steps if s["traced"]]
    facts = eng.facts()
    record_meta = {
        "wall_s": wall, "device": facts["device"], "gemm_m": [s["tokens"] for s in steps],
        "engine": facts, "cached_tokens": main["num_cached_tokens"],
        "scheduler": SchedulerFacts(
            mode, tuple(ScheduledRequest.from_dict(r) for r in requests), tuple(SchedulerStep.from_dict(s) for s in steps),
            tuple(tuple(t["positions"]) for s in steps for t in s["traced"] if t["request"] == main["request_id"]),
            info["mapping"], tuple(info["notes"]), cap.runner).to_dict(),
        "not_captured": info["not_captured"], "logits": logits, **meta}
    if rec_kernels is not None:
        record_meta["kernels"] = "recorded"
    if decode:
        record_meta["decode_tokens"] = main["generated"][:decode]
    return RunRecord(name=plan.name, token_ids=list(token_ids), plan=plan.to_dict(), window=(int(window[0]), int(window[1])),
                     captures=captures, meta=record_meta, extras={"partial_logits": info["partial_logits"]}), None


__all__ = ["VllmSettings", "VllmEngine", "engine_for", "check_head_size", "platform", "plan_facts", "op_facts", "run_bare", "weights_folder", "ref_layout", "execute_loaded",
           "MAX_ENGINES", "CHUNK_MODES"]
