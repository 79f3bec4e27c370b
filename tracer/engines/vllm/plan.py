"""How a run plan becomes vLLM requests, and the engine settings: importable without vLLM.

:class:`VllmSettings` is the configuration one ``vllm.LLM`` is built with;
:func:`waves` turns a :class:`~tracer.plan.scenarios.RunPlan` into the requests added to vLLM
together (see :mod:`tracer.engines.vllm.engine` for the table); :func:`check_schedule` refuses a
run whose scheduling (vLLM's own ``num_cached_tokens``, the steps the prompt took) is not what
the plan says.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tracer.engines.vllm.realise import BLOCK
from tracer.errors import TracerError

#: how a plan's chunks can be realised in vLLM (``engine_options["chunks"]``)
CHUNK_MODES = ("auto", "prefix-cache", "chunked")
#: vLLM's ``max_model_len`` when no request of the plan needs more (at most the model's positions)
DEFAULT_MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class VllmSettings:
    """The engine configuration one ``vllm.LLM`` is built with (one LLM per distinct settings).

    Attributes:
        block_size: KV-cache block size in tokens (the CPU attention backend needs a multiple of 32).
        max_num_batched_tokens: the scheduler's token budget per step (chunked prefill splits a
            longer prompt); None: 4096, or more for a longer ``max_model_len``.
        enable_prefix_caching: vLLM's automatic prefix caching.
        max_model_len: longest sequence; None: the model's positions, at most 2048
            (:func:`settings_of` raises it for a plan whose requests are longer).
        kv_cache_memory_bytes: the KV cache's size; None: room for 4 sequences of ``max_model_len``
            (a few hundred MiB for SmolLM2-135M), instead of vLLM's share of the machine's RAM.
        gpu_memory_utilization: on the CPU backend, the share of RAM vLLM may reserve.
        enforce_eager: must be True (no CUDA graphs).
        compilation_mode: must be 0 (no torch.compile).
        seed: vLLM's seed (greedy sampling does not use it).
        logprobs_mode: what vLLM reports as a token's logprob: ``raw_logprobs`` (log_softmax of
            the float32 logits) or ``processed_logprobs`` (after the temperature: a sampled rollout).
        attention_backend: vLLM's attention backend by name (``TRITON_ATTN``, ``FLEX_ATTENTION``,
            ``FLASH_ATTN``, ``FLASHINFER``, ``CPU_ATTN``, ...); None: vLLM's own choice.
        batch_invariant: vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``, set before the
            LLM is built; :mod:`tracer.engines.vllm.environment`).
        multiprocess: vLLM's engine core in a process of its own (vLLM's default; the capture is
            installed in its workers, :mod:`tracer.engines.vllm.remote`) or in this one; None:
            ``VLLM_ENABLE_V1_MULTIPROCESSING`` of the environment (tracer's default 0: this process).
        compiled: vLLM's default compilation (torch.compile; CUDA graphs on GPUs) instead of eager,
            captured at layers through vLLM's own hidden-states output
            (:mod:`tracer.engines.vllm.compiled`); ``enforce_eager`` and ``compilation_mode`` are
            then vLLM's own.
        cudagraph_mode: with ``compiled``, vLLM's ``compilation_config["cudagraph_mode"]``
            (``NONE``: compiled without CUDA graphs; ``PIECEWISE``, ``FULL_AND_PIECEWISE``, ...);
            None: vLLM's default (``FULL_AND_PIECEWISE`` on GPUs, ``NONE`` on CPUs).
        cudagraph_capture_sizes: with ``compiled``, the token counts vLLM records CUDA graphs for
            (``compilation_config["cudagraph_capture_sizes"]``; a step of n tokens replays the
            graph of the next size up, its rows padded to it); None: vLLM's default sizes.
        hidden_states: vLLM also writes its own hidden-states output (the embedding and every
            layer's output per request, :mod:`tracer.engines.vllm.hidden_states`; on with ``compiled``).
        dtype: the model dtype vLLM computes in; None: the HF model's.
        kv_cache_dtype: vLLM's ``kv_cache_dtype`` (``auto``: the model dtype; ``fp8_e4m3``, ...).
        kv_role, kv_path: a KV connector (vLLM's ExampleConnector) in this role (``kv_producer`` or
            ``kv_consumer``) over this folder (:mod:`tracer.engines.vllm.connector`); None: none.
        tensor_parallel_size: vLLM's TP ranks, each a worker process of its own (the engine core
            then in its own process too); the capture is installed in every rank and the ranks'
            rows joined by the engine map's TP rules (:func:`tracer.engines.vllm.ranks.gather_ranks`).
    """

    block_size: int = BLOCK
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.12
    enforce_eager: bool = True
    compilation_mode: int = 0
    seed: int = 0
    logprobs_mode: str = "raw_logprobs"
    attention_backend: str | None = None
    batch_invariant: bool = False
    multiprocess: bool | None = None
    compiled: bool = False
    cudagraph_mode: str | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    hidden_states: bool = False
    dtype: str | None = None
    kv_cache_dtype: str = "auto"
    kv_role: str | None = None
    kv_path: str | None = None
    tensor_parallel_size: int = 1

    def check(self) -> "VllmSettings":
        """Raises:
            TracerError: compilation or CUDA graphs switched on, or a bad size."""
        if not self.compiled and (not self.enforce_eager or self.compilation_mode != 0):
            raise TracerError(f"vLLM with {'CUDA graphs' if not self.enforce_eager else 'torch.compile'} on "
                              f"(enforce_eager={self.enforce_eager}, compilation mode {self.compilation_mode}) hides "
                              "its modules from tracer's hooks; run it eager (enforce_eager=True, compilation mode 0), or compiled "
                              "at layers (compiled=True: vLLM's hidden-states output)")
        if (self.cudagraph_mode is not None or self.cudagraph_capture_sizes is not None) and not self.compiled:
            raise TracerError(f"vLLM cudagraph_mode / cudagraph_capture_sizes need compiled=True (an eager engine has no "
                              "CUDA graphs); set compiled=True or leave them None")
        if self.kv_role and (self.compiled or self.hidden_states):
            raise TracerError("a KV connector hand-over (prefill-decode) and vLLM's hidden-states output (compiled) "
                              "both need vLLM's one KV connector slot: run them separately")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise TracerError(f"vLLM tensor_parallel_size {self.tensor_parallel_size!r} must be a positive number of ranks")
        if self.tensor_parallel_size > 1 and (self.compiled or self.kv_role):
            raise TracerError("tracer captures vLLM with several TP ranks eager and without a KV connector; run the "
                              "compiled or prefill-decode engine with tensor_parallel_size=1")
        if self.block_size < 1 or (self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1):
            raise TracerError(f"vLLM block size {self.block_size} and token budget {self.max_num_batched_tokens} "
                              "must be positive numbers of tokens")
        return self


def check_architecture(loaded: Any, folder: Any) -> None:
    """Refuse a weights folder on which vLLM would run another model than the HF reference: vLLM
    picks its model class by ``config.json``'s ``architectures``, HF's ``AutoModelForCausalLM`` by
    ``model_type``; a folder saying ``GemmaForCausalLM`` with ``model_type`` llama runs Gemma's
    forward in vLLM and Llama's in HF on the same weights. Checked before vLLM starts.

    Raises:
        TracerError: the two differ, or config.json is unreadable (one line).
    """
    import json
    from pathlib import Path

    from tracer.files import read_text_file

    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(read_text_file(path, "config.json"))
    except ValueError as e:
        raise TracerError(f"{path} is not JSON ({e}); vLLM cannot read it either") from None
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    hf = type(loaded.model).__name__
    if isinstance(archs, list) and archs and archs[0] != hf:
        raise TracerError(f"{path} names architecture {archs[0]} (vLLM's model class) but HF loaded {hf} (model_type "
                          f"{cfg.get('model_type')!r}): the two engines would run different models on these weights; "
                          f"make architectures and model_type agree")


def check_tp_heads(plans: list[Any], model: Any) -> None:
    """Refuse, before any engine starts, a plan whose ``tensor_parallel_size`` k does not divide the
    HF model's attention heads and KV heads (vLLM refuses the first only after the other plan's
    engine started: "Total number of attention heads (9) must be divisible by tensor parallel size
    (2)"; with fewer KV heads than ranks it copies them, which tracer's join of disjoint shards
    does not take).

    Raises:
        TracerError: the first such plan (one line).
    """
    if model is None:
        return
    cfg = getattr(model.config, "get_text_config", lambda: model.config)()
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    kv = int(getattr(cfg, "num_key_value_heads", heads) or heads)
    for plan in plans:
        k = int(dict(getattr(plan, "engine_settings", ()) or ()).get("tensor_parallel_size", 1))
        if k > 1 and (heads % k or kv % k):
            raise TracerError(f"run plan {plan.name}: vLLM's {k} TP ranks need attention heads ({heads}) and KV heads "
                              f"({kv}) divisible by {k}; use a --tp that divides both, or another model")


def chunk_mode(plan: Any, options: dict[str, Any], meta: dict[str, Any]) -> str:
    """How the plan's chunks are realised: ``one-step`` (one chunk), else ``prefix-cache`` or
    ``chunked`` from ``options["chunks"]``, the plan's ``engine_settings`` (set by
    :func:`tracer.engines.vllm.realise.realise`), or the scenario (``chunked-prefill``: chunked).

    Raises:
        TracerError: an unknown mode.
    """
    mode = options.get("chunks") or dict(getattr(plan, "engine_settings", ()) or ()).get("chunks", "auto")
    if mode not in CHUNK_MODES:
        raise TracerError(f"unknown vLLM chunk mode {mode!r}; use one of: {', '.join(CHUNK_MODES)}")
    if len(plan.chunks) == 1:
        return "one-step"
    if mode == "auto":
        return "chunked" if meta.get("scenario") == "chunked-prefill" else "prefix-cache"
    return mode


def refuse_unsupported(plan: Any, kernels: bool, sdpa_inputs: bool) -> None:
    """Raises TracerError for plan features the vLLM executor cannot realise (one line each)."""
    if plan.compile:
        raise TracerError(f"run plan {plan.name} asks for torch.compile, which hides vLLM's modules from tracer's "
                          "hooks; the vllm engine runs eager only")
    unsupported = [(plan.tp is not None, "tensor parallelism"), (plan.kv_transform is not None, "a KV-cache transform"),
                   (plan.attn is not None, "an attention implementation"), (plan.devices is not None, "per-chunk devices"),
                   (bool(plan.generate), "generation"), (plan.deterministic, "torch's deterministic mode"),
                   (sdpa_inputs, "--op-replay")]
    what = [w for bad, w in unsupported if bad]
    if what:
        raise TracerError(f"run plan {plan.name}: {', '.join(what)} is not available with the vllm engine yet; "
                          "run it with --engine hf")


def settings_of(plan: Any, mode: str, options: dict[str, Any]) -> VllmSettings:
    """The :class:`VllmSettings` a plan runs with: the plan's ``engine_settings`` (KV block size), then
    ``options["settings"]`` (a VllmSettings or a dict of its fields) over them; chunked mode sets
    the token budget to the chunk size; a plan whose longest request (+ 1 sampled token) exceeds
    :data:`DEFAULT_MAX_MODEL_LEN` gets a ``max_model_len`` with room for it (a multiple of 1024).

    Raises:
        TracerError: chunks that a token budget cannot produce, a batch over the budget, an unknown setting.
    """
    from dataclasses import fields

    known = {f.name for f in fields(VllmSettings)}
    planned = {k: v for k, v in dict(getattr(plan, "engine_settings", ()) or ()).items()
               if k not in ("chunks", "kv_transfer", "producer")}  # how chunks become requests; a KV hand-over
    given = options.get("settings") or {}
    given = {f.name: getattr(given, f.name) for f in fields(VllmSettings)} if isinstance(given, VllmSettings) else dict(given)
    unknown = sorted(k for k in {**planned, **given} if k not in known)
    if unknown:
        raise TracerError(f"unknown vLLM setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    base = VllmSettings(**{**planned, **given})
    longest = max([plan.n_tokens, *(plan.batch.lengths if plan.batch is not None else ())]) + 1  # + the sampled token
    if base.max_model_len is None and longest > DEFAULT_MAX_MODEL_LEN:
        # room for the plan's longest request, rounded up to 1024 tokens (room for --decode); the
        # model's positions cap it where the LLM is built
        base = replace(base, max_model_len=-(-longest // 1024) * 1024)
    if mode == "chunked":
        sizes = [e - s for s, e in plan.chunks]
        if any(x != sizes[0] for x in sizes[:-1]) or sizes[-1] > sizes[0]:
            raise TracerError(f"run plan {plan.name}: chunks {sizes} are not one size C (the last no longer); vLLM "
                              "splits a prefill by its token budget only")
        return replace(base, max_num_batched_tokens=sizes[0])
    if plan.batch is not None:
        total = sum(plan.batch.lengths)
        if base.max_num_batched_tokens is not None and base.max_num_batched_tokens < total:
            raise TracerError(f"a batch of {total} tokens does not fit vLLM's budget of {base.max_num_batched_tokens} "
                              "tokens per step; raise max_num_batched_tokens")
        if total > 4096 and base.max_num_batched_tokens is None:
            return replace(base, max_num_batched_tokens=total)
    return base


def batch_rows(token_ids: list[int], batch: Any) -> list[list[int]]:
    """The batch's rows as :func:`tracer.engines.hf.run.batch_inputs` builds them, without padding."""
    n, out = len(token_ids), []
    for j, length in enumerate(batch.lengths):
        if j == batch.row:
            out.append(list(token_ids))
        else:
            rot = (37 * j + 11) % n
            base = token_ids[rot:] + token_ids[:rot]
            out.append((base * (-(-length // n)))[:length])
    return out


def waves(token_ids: list[int], plan: Any, mode: str, block_size: int) -> list[tuple[list[list[int]], list[bool]]]:
    """The requests of a run, in waves added together: ``(prompts, traced?)`` per wave; the
    traced prompt's own request is the last traced one.

    Raises:
        TracerError: a prefix-cache boundary that is not a multiple of the KV block size.
    """
    if plan.batch is not None:
        rows = batch_rows(token_ids, plan.batch)
        return [(rows, [j == plan.batch.row for j in range(len(rows))])]
    if mode != "prefix-cache":
        return [([list(token_ids)], [True])]
    bounds = [s for s, _e in plan.chunks[1:]]
    bad = [s for s in bounds if s % block_size]
    if bad:
        raise TracerError(f"run plan {plan.name}: cached prefix of {bad[0]} tokens is not a multiple of vLLM's KV block "
                          f"size {block_size} (vLLM caches whole blocks); use a block size that divides it "
                          f"(--block-size {block_size} plans the split at a block boundary)")
    return [([list(token_ids[:s])], [True]) for s in bounds] + [([list(token_ids)], [True])]


def check_schedule(plan: Any, mode: str, requests: list[dict[str, Any]], steps: list[dict[str, Any]]) -> None:
    """Refuse a run whose scheduling is not what its plan says (one line naming what vLLM did).

    Raises:
        TracerError: another cached length than planned, or the prompt split across steps
            (or batched with fewer requests) where the plan has one step.
    """
    traced = [r for r in requests if r["traced"]]
    main = traced[-1]
    want = [0] + [s for s, _e in plan.chunks[1:]] if mode == "prefix-cache" else [0]
    got = [r["num_cached_tokens"] for r in traced]
    if got != want[:len(got)]:
        raise TracerError(f"run plan {plan.name}: vLLM reported num_cached_tokens {got} for the traced requests, the plan "
                          f"needs {want}; the prefix cache did not hold what the run put there")
    main_steps = [t["positions"] for s in steps for t in s["traced"] if t["request"] == main["request_id"]]
    if mode in ("one-step", "prefix-cache") and len(main_steps) != 1:
        raise TracerError(f"run plan {plan.name}: vLLM split the prompt into {len(main_steps)} steps ({main_steps}); "
                          "raise max_num_batched_tokens to at least the prompt's length")
    if plan.batch is not None:
        n_req = max((s["requests"] for s in steps if any(t["request"] == main["request_id"] for t in s["traced"])), default=0)
        if n_req != plan.batch.size:
            raise TracerError(f"run plan {plan.name}: vLLM scheduled the traced prompt with {n_req} request(s), the "
                              f"batch has {plan.batch.size}; raise max_num_batched_tokens or max_num_seqs")
