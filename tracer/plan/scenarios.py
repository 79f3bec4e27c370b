"""The scenario catalogue: pairs of run plans a correct engine would treat as equivalent.

A :class:`RunPlan` says how one run computes the prompt: as a sequence of forward passes
(*chunks*) over token positions ``[start, stop)`` that share one KV cache. A cache-miss prefill
is one chunk ``(0, N)``; a cache hit is the cached prefix ``(0, P)`` (computed by the earlier
request's own forward pass) followed by the suffix ``(P, N)``. The GEMM M dimension of every
projection in a chunk is its length, which is what changes the kernels' tiling.

Every other level of the determinism hierarchy is a field of the plan, so each level is a pair
of plans that differ in one field: ``batch`` (the prompt as one row of a padded batch),
``kv_transform`` (a KV cache format applied between chunks), ``tp`` (simulated tensor-parallel
reduction), ``attn`` (attention implementation), ``compile``, ``devices`` (the device of each
chunk, the KV cache moved between them), ``generate`` (greedy decoding with or without the
cache) and ``deterministic`` (torch's deterministic mode).

A :class:`Scenario` pairs plan A with plan B and names the compared window (the positions both
runs computed in their final state). User-defined scenarios are plain instances of these
classes, e.g. ``Scenario("mine", 1, "batch size", RunPlan("A", ((0, n),)),
RunPlan("B", ((0, n),), batch=Batch(size=4, row=2, lengths=(n,) * 4)), window=(0, n))``.
:data:`SCENARIOS` names the builders; :func:`tracer.plan.build.build` builds one by name from a
run's options.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from tracer.engines.table import default
from tracer.errors import TracerError, did_you_mean
from tracer.plan.engines import engine_scenario, prefill_decode
from tracer.plan.plans import MITIGATIONS, PADDINGS, TP_MODES, Batch, RunPlan, Scenario, TPSpec
from tracer.plan.quant import FORMATS, check_format
from tracer.plan.rollout import DEFAULT_IS_CAP, DEFAULT_MASK_THRESHOLD, check_rl_options, rl_specs
from tracer.plan.tp import check_tp

#: the reference engine's KV block size, and the block-size scenario's two sizes (:mod:`tracer.engines.table`)
KV_BLOCK: int = default(None, "block_size")
KV_BLOCKS: tuple[int, int] = default(None, "block_sizes")


def default_split(n_tokens: int, block_size: int) -> int:
    """The cached prefix length of a prefix-cache hit: the largest multiple of ``block_size`` below N.

    Raises:
        TracerError: ``block_size < 1``, or N ≤ block size (no full block can be cached).
    """
    if block_size < 1:
        raise TracerError(f"--block-size must be a positive number of tokens, got {block_size}")
    split = ((n_tokens - 1) // block_size) * block_size
    if split < 1:
        raise TracerError(
            f"the prompt has {n_tokens} tokens, but a cache hit needs more than one KV block "
            f"({block_size} tokens); use a longer prompt, a smaller --block-size, or --split-at"
        )
    return split


def check_split(n_tokens: int, split_at: int) -> int:
    """Validate an explicit split point P (1 ≤ P ≤ N-1).

    Raises:
        TracerError: P outside 1..N-1.
    """
    if not 1 <= split_at <= n_tokens - 1:
        raise TracerError(
            f"--split-at {split_at} is outside 1..{n_tokens - 1} for a prompt of {n_tokens} tokens; "
            "choose a split point inside the prompt"
        )
    return split_at


def check_mitigation(mitigation: str | None) -> str | None:
    """Validate a mitigation name (None = no mitigation)."""
    if mitigation is not None and mitigation not in MITIGATIONS:
        close = did_you_mean(str(mitigation).lower(), MITIGATIONS)
        raise TracerError(f"unknown mitigation '{mitigation}'; use one of: {', '.join(MITIGATIONS)}"
                          + (f" (did you mean {close}?)" if close else ""))
    return mitigation


def prefix_cache(n_tokens: int, *, block_size: int = KV_BLOCK, split_at: int | None = None,
                 mitigation: str | None = None) -> Scenario:
    """Level 2: cache miss (whole prompt in one pass) versus cache hit (prefix, then suffix).

    Run A computes all N tokens in one forward pass (GEMM M = N). Run B computes the cached
    prefix of P tokens in its own forward pass, as the earlier request did, then the N−P suffix
    tokens with that KV cache (GEMM M = N−P). The compared positions are P..N−1.
    With ``mitigation="aligned"`` run A is also split at P (the deterministic prefix caching of
    :data:`tracer.plan.hierarchy.ALIGNED_SOURCE`), so both runs compute the suffix with the same M.

    Raises:
        TracerError: bad block size or split point (see :func:`default_split`, :func:`check_split`).
    """
    check_mitigation(mitigation)
    p = check_split(n_tokens, split_at) if split_at is not None else default_split(n_tokens, block_size)
    n = n_tokens
    if mitigation == "aligned":
        plan_a = RunPlan("A", ((0, p), (p, n)),
                         f"cache miss, aligned: {p} + {n - p} tokens (split at the block boundary)")
    else:
        plan_a = RunPlan("A", ((0, n),), f"cache miss: all {n} tokens in one pass")
    plan_b = RunPlan("B", ((0, p), (p, n)), f"cache hit: {p} cached tokens, then the {n - p}-token suffix")
    scen = Scenario(
        name="prefix-cache",
        level=2,
        invariant="cache hit vs miss",
        plan_a=plan_a,
        plan_b=plan_b,
        window=(p, n),
        params={"block_size": block_size, "split_at": p, "mitigation": mitigation,
                "n_tokens": n, "split_points_a": [c[0] for c in plan_a.chunks[1:]],
                "split_points_b": [c[0] for c in plan_b.chunks[1:]]},
    )
    return with_mitigation(scen, mitigation) if mitigation == "deterministic" else scen


def _window_scenario(name: str, level: int, invariant: str, a: RunPlan, b: RunPlan,
                     window: tuple[int, int], **params: Any) -> Scenario:
    return Scenario(name=name, level=level, invariant=invariant, plan_a=a, plan_b=b, window=window,
                    params={"n_tokens": a.n_tokens, **params})


def repeat(n_tokens: int) -> Scenario:
    """Level 0: the same forward pass twice (catches split-K atomics and other run-to-run noise)."""
    n = n_tokens
    return _window_scenario("repeat", 0, "repeating the identical call",
                            RunPlan("A", ((0, n),), f"all {n} tokens in one pass"),
                            RunPlan("B", ((0, n),), f"the same call again: all {n} tokens in one pass"), (0, n))


def batch_lengths(n_tokens: int, size: int, row: int, padding: str) -> tuple[int, ...]:
    """Row lengths of a batch holding the prompt (N tokens) at ``row``.

    ``none``: every row has N tokens. ``left``/``right``: the other rows alternate between
    longer and shorter than N (N + s, N - s, N + 2s, ...; s = max(1, N // 8), at least 1 token),
    so the traced row is padded whenever the batch has 2 or more rows.
    """
    if padding == "none":
        return (n_tokens,) * size
    step = max(1, n_tokens // 8)
    others = []
    for j in range(size - 1):
        d = (j // 2 + 1) * step
        others.append(n_tokens + d if j % 2 == 0 else max(1, n_tokens - d))
    return tuple(others[:row]) + (n_tokens,) + tuple(others[row:])


def batch(n_tokens: int, *, batch_size: int = 4, padding: str = "none", batch_row: int | None = None) -> Scenario:
    """Level 1: the prompt alone versus the prompt as row ``batch_row`` of a batch of ``batch_size``.

    With ``padding="none"`` every row has N tokens (no mask needed); with ``left``/``right`` the
    rows have different lengths (:func:`batch_lengths`), padded to the longest with an attention
    mask, positions counted from each row's first real token. Compared: all N positions.

    Raises:
        TracerError: batch size < 1, row outside the batch, unknown padding.
    """
    if batch_size < 1:
        raise TracerError(f"--batch-size must be at least 1, got {batch_size}")
    if padding not in PADDINGS:
        raise TracerError(f"unknown --padding '{padding}'; use one of: {', '.join(PADDINGS)}")
    n = n_tokens
    row = batch_size // 2 if batch_row is None else batch_row
    lengths = batch_lengths(n, batch_size, row, padding) if 0 <= row < batch_size else (n,) * batch_size
    spec = Batch(size=batch_size, row=row, padding=padding, lengths=lengths)
    pad = "" if padding == "none" else f", {padding}-padded to {spec.width} with an attention mask"
    return _window_scenario(
        "batch", 1, "batch size",
        RunPlan("A", ((0, n),), f"the prompt alone: batch 1 x {n} tokens"),
        RunPlan("B", ((0, n),), f"row {row} of a batch of {batch_size} (lengths {list(lengths)}{pad})", batch=spec),
        (0, n), batch_size=batch_size, padding=padding, batch_row=row, lengths=list(lengths))


def generate_cache(n_tokens: int, *, new_tokens: int = 8) -> Scenario:
    """Level 2: greedy generation with the KV cache versus recomputing the whole sequence each step.

    Both runs prefill the N-token prompt, then generate ``new_tokens`` tokens greedily: A feeds
    one token per step with the cache (GEMM M = 1), B recomputes all N + t tokens without a cache.
    Compared: the logits of every step (positions N-1 .. N+T-2), token by token.

    Raises:
        TracerError: new_tokens < 1.
    """
    if new_tokens < 1:
        raise TracerError(f"--new-tokens must be at least 1, got {new_tokens}")
    n, t = n_tokens, new_tokens
    return _window_scenario(
        "generate-cache", 2, "cache hit vs miss (generation)",
        RunPlan("A", ((0, n),), f"greedy generation of {t} tokens with the KV cache", generate=t),
        RunPlan("B", ((0, n),), f"greedy generation of {t} tokens recomputing the sequence each step",
                generate=t, recompute=True),
        (n - 1, n - 1 + t), new_tokens=t)


def block_size_scenario(n_tokens: int, *, block_sizes: tuple[int, int] = KV_BLOCKS) -> Scenario:
    """Level 3: a cache hit with block size b1 versus b2 (cached prefix = last block boundary below N).

    Compared: the positions both runs compute in the suffix, max(P1, P2)..N-1.

    Raises:
        TracerError: not two block sizes, or a prompt too short for the larger one.
    """
    if len(block_sizes) != 2:
        raise TracerError(f"--block-sizes needs two sizes such as 16,64, got {list(block_sizes)}")
    n = n_tokens
    (b1, b2) = block_sizes
    p1, p2 = default_split(n, b1), default_split(n, b2)
    return _window_scenario(
        "block-size", 3, "KV block size",
        RunPlan("A", ((0, p1), (p1, n)), f"cache hit at block size {b1}: {p1} cached, {n - p1}-token suffix"),
        RunPlan("B", ((0, p2), (p2, n)), f"cache hit at block size {b2}: {p2} cached, {n - p2}-token suffix"),
        (max(p1, p2), n), block_sizes=[b1, b2], split_points_a=[p1], split_points_b=[p2])


def chunked_prefill(n_tokens: int, *, chunk_size: int = 32) -> Scenario:
    """Level 3: the whole prompt in one pass versus chunks of C tokens (C = 1: token by token).

    Raises:
        TracerError: chunk size < 1.
    """
    if chunk_size < 1:
        raise TracerError(f"--chunk-size must be at least 1 token, got {chunk_size}")
    n = n_tokens
    chunks = tuple((s, min(s + chunk_size, n)) for s in range(0, n, chunk_size))
    return _window_scenario(
        "chunked-prefill", 3, "chunked prefill",
        RunPlan("A", ((0, n),), f"full prefill: all {n} tokens in one pass"),
        RunPlan("B", chunks, f"prefill in {len(chunks)} chunks of {chunk_size} tokens"),
        (0, n), chunk_size=chunk_size, split_points_b=[c[0] for c in chunks[1:]])


def tensor_parallel(n_tokens: int, *, tp: int = 2, reduce: str | None = None, reduce_dtype: str | None = None,
                    tp_mode: str = "simulated", tp_partials: bool = False,
                    tp_vocab_parallel: bool = False) -> Scenario:
    """Level 4: unsharded (TP-1) versus TP-k.

    ``tp_mode="simulated"``: the row-parallel layers as k K-shards reduced in one process in the
    ``reduce`` order and ``reduce_dtype`` (:mod:`tracer.plan.tp`). ``"distributed"``: run B on k processes
    with torch.distributed (:mod:`tracer.engines.tp.dist`): column-parallel q/k/v/gate/up, row-parallel
    o/down with a real all_reduce; ``tp_partials`` keeps every rank's partials, ``tp_vocab_parallel``
    shards the embedding and LM head too.

    Raises:
        TracerError: bad k, mode, reduce order or reduce dtype; simulated-only options with
            ``distributed`` or distributed-only options with ``simulated``.
    """
    if tp_mode not in TP_MODES:
        raise TracerError(f"unknown --tp-mode '{tp_mode}'; use one of: {', '.join(TP_MODES)}")
    n = n_tokens
    if tp_mode == "distributed":
        if reduce is not None or reduce_dtype is not None:
            raise TracerError("--reduce/--reduce-dtype choose the simulated reduction; with --tp-mode distributed the "
                              "collective sums (drop them, or use --mitigation deterministic for a fixed order)")
        if tp < 1:
            raise TracerError(f"--tp must be a positive number of ranks, got {tp}")
        spec = TPSpec(tp, mode="distributed", partials=bool(tp_partials), vocab_parallel=bool(tp_vocab_parallel))
        vocab = ", vocab-parallel embedding/lm_head" if tp_vocab_parallel else ""
        return _window_scenario(
            "tensor-parallel", 4, "parallelism degree",
            RunPlan("A", ((0, n),), "unsharded (TP-1, this process)"),
            RunPlan("B", ((0, n),), f"TP-{tp} over torch.distributed: q/k/v/gate/up column-parallel, o/down "
                    f"row-parallel + all_reduce{vocab}", tp=spec),
            (0, n), tp=tp, tp_mode="distributed", tp_partials=bool(tp_partials),
            tp_vocab_parallel=bool(tp_vocab_parallel))
    if tp_partials or tp_vocab_parallel:
        raise TracerError("--tp-partials and --tp-vocab-parallel apply to --tp-mode distributed only")
    reduce, reduce_dtype = reduce or "ring", reduce_dtype or "activation"
    check_tp(tp, reduce, reduce_dtype)
    spec = TPSpec(tp, reduce, reduce_dtype)
    return _window_scenario(
        "tensor-parallel", 4, "parallelism degree",
        RunPlan("A", ((0, n),), "unsharded"),
        RunPlan("B", ((0, n),), f"o_proj/down_proj as {tp} K-shards, {reduce} all-reduce in {reduce_dtype} dtype", tp=spec),
        (0, n), tp=tp, reduce=reduce, reduce_dtype=reduce_dtype, tp_mode="simulated")


def kv_quant(n_tokens: int, *, kv_format: str = "fp8-e4m3", block_size: int = KV_BLOCK,
             split_at: int | None = None) -> Scenario:
    """Level 5: a cache hit reading a bf16 KV cache versus one quantize-dequantized as ``kv_format``.

    Both runs prefill the prefix P, then the suffix; in B the KV entries each chunk writes are
    rounded through the format before the next pass reads them. Compared: P..N-1. The block
    format is recorded in ``params["kv_block_format"]`` (the trace header).

    Raises:
        TracerError: unknown format, bad split.
    """
    check_format(kv_format)
    n = n_tokens
    p = check_split(n, split_at) if split_at is not None else default_split(n, block_size)
    chunks = ((0, p), (p, n))
    return _window_scenario(
        "kv-quant", 5, "quantization scheme",
        RunPlan("A", chunks, f"cache hit, KV cache in the model dtype: {p} cached, {n - p}-token suffix"),
        RunPlan("B", chunks, f"cache hit, KV cache stored as {kv_format}: {p} cached, {n - p}-token suffix",
                kv_transform=kv_format),
        (p, n), kv_format=kv_format, kv_block_format=FORMATS[kv_format][1].to_dict(), block_size=block_size, split_at=p)


def attention(n_tokens: int, *, attn_a: str = "eager", attn_b: str = "sdpa") -> Scenario:
    """Level 6: attention implementation ``attn_a`` versus ``attn_b`` (eager, sdpa, flash_attention_2)."""
    n = n_tokens
    return _window_scenario(
        "attention", 6, "engine choice (attention kernel)",
        RunPlan("A", ((0, n),), f"attention {attn_a}", attn=attn_a),
        RunPlan("B", ((0, n),), f"attention {attn_b}", attn=attn_b), (0, n), attn_a=attn_a, attn_b=attn_b)


def compile_scenario(n_tokens: int) -> Scenario:
    """Level 6: the eager model versus ``torch.compile(model)``."""
    n = n_tokens
    return _window_scenario("compile", 6, "engine choice (compiler)",
                            RunPlan("A", ((0, n),), "eager PyTorch"),
                            RunPlan("B", ((0, n),), "torch.compile", compile=True), (0, n))


def cuda_graph_scenario(n_tokens: int) -> Scenario:
    """Level 6: eager execution versus the same forward pass recorded in a CUDA graph and replayed
    (the capture copies recorded into the graph: :mod:`tracer.execute.graphs`). Needs a CUDA GPU."""
    n = n_tokens
    return _window_scenario("cuda-graph", 6, "execution mode (CUDA-graph replay)",
                            RunPlan("A", ((0, n),), f"eager: all {n} tokens in one pass"),
                            RunPlan("B", ((0, n),), "the same pass recorded in a CUDA graph, replayed",
                                    cuda_graph=True), (0, n))


def _two_devices(devices: tuple[str, ...] | list[str] | str) -> tuple[str, str]:
    if isinstance(devices, str):
        devices = tuple(d.strip() for d in devices.split(","))
    if len(devices) != 2 or not all(devices):
        raise TracerError(f"--devices needs two devices such as cpu,cuda, got {list(devices)}")
    return devices[0], devices[1]


def device(n_tokens: int, *, devices: tuple[str, str] | str = ("cpu", "cuda")) -> Scenario:
    """Level 7: the same run on device X versus device Y."""
    x, y = _two_devices(devices)
    n = n_tokens
    return _window_scenario("device", 7, "hardware",
                            RunPlan("A", ((0, n),), f"on {x}", devices=(x,)),
                            RunPlan("B", ((0, n),), f"on {y}", devices=(y,)), (0, n), devices=[x, y])


def disaggregated(n_tokens: int, *, devices: tuple[str, str] | str = ("cpu", "cuda"), block_size: int = KV_BLOCK,
                  split_at: int | None = None) -> Scenario:
    """Level 7: prefix and suffix on device Y versus prefix KV computed on X, moved to Y, suffix on Y."""
    x, y = _two_devices(devices)
    n = n_tokens
    p = check_split(n, split_at) if split_at is not None else default_split(n, block_size)
    chunks = ((0, p), (p, n))
    return _window_scenario(
        "disaggregated", 7, "hardware (disaggregated prefill)",
        RunPlan("A", chunks, f"prefix ({p}) and suffix ({n - p}) on {y}", devices=(y, y)),
        RunPlan("B", chunks, f"prefix KV ({p}) on {x}, moved to {y}, suffix ({n - p}) on {y}", devices=(x, y)),
        (p, n), devices=[x, y], block_size=block_size, split_at=p)


def rollout_vs_train(n_tokens: int, *, rollouts: int = 4, new_tokens: int = 16, sample: bool = False,
                     temperature: float | None = None, seed: int | None = None, batch_row: int | None = None,
                     train_batching: str = "padded", train_attn: str | None = None, lm_head_fp32: bool = False,
                     train_dtype: str | None = None, is_cap: float = DEFAULT_IS_CAP,
                     mask_threshold: float = DEFAULT_MASK_THRESHOLD, mitigations: bool = False) -> Scenario:
    """Level 2, RL: a rollout sampling the response from a KV cache versus the trainer recomputing it
    teacher-forced (:mod:`tracer.plan.rollout`).

    Run A: ``rollouts`` prompts (lengths :func:`batch_lengths` ``left``; the traced prompt at
    ``batch_row``, default ``rollouts // 2``) prefilled as one left-padded batch, then
    ``new_tokens`` tokens each, one decode step at a time (GEMM M = K), greedy or ``sample``-d at
    ``temperature`` with ``seed``. Run B: one teacher-forced forward over prompt + response of the
    K sequences, ``train_batching`` ``padded`` or ``packed``, attention ``train_attn`` (None: as
    loaded), ``lm_head_fp32``, ``train_dtype``. Compared: positions N-1 .. N+T-2 (whose logits
    give the T response tokens). ``is_cap`` (TIS cap C) and ``mask_threshold`` (MIS/IcePop band
    [1/β, β]) set what the RL metrics count as clipped and masked; ``mitigations`` re-runs the
    scenario with each knob of :data:`tracer.plan.rollout.KNOBS` changed.

    Raises:
        TracerError: bad counts, thresholds, batching or dtype; ``temperature``/``seed`` without ``sample``.
    """
    check_rl_options(rollouts=rollouts, new_tokens=new_tokens, sample=sample, temperature=temperature, seed=seed,
                     train_batching=train_batching, train_dtype=train_dtype, is_cap=is_cap,
                     mask_threshold=mask_threshold)
    n, t = n_tokens, new_tokens
    row = rollouts // 2 if batch_row is None else batch_row
    lengths = batch_lengths(n, rollouts, row, "left") if 0 <= row < rollouts else (n,) * rollouts
    a, b = rl_specs(n_tokens=n, lengths=lengths, row=row, new_tokens=t, sample=sample,
                    temperature=1.0 if temperature is None else temperature, seed=0 if seed is None else seed,
                    train_batching=train_batching, lm_head_fp32=lm_head_fp32, train_dtype=train_dtype)
    return _window_scenario(
        "rollout-vs-train", 2, "rollout vs trainer (RL logprobs)",
        RunPlan("A", ((0, n),), a.describe(), rl=a),
        RunPlan("B", ((0, n + t),), b.describe(train_attn), attn=train_attn, rl=b),
        (n - 1, n - 1 + t), rollouts=rollouts, new_tokens=t, batch_row=row, lengths=list(lengths),
        sample=bool(sample), temperature=a.temperature, seed=a.seed, train_batching=train_batching,
        train_attn=train_attn, lm_head_fp32=bool(lm_head_fp32), train_dtype=train_dtype, is_cap=float(is_cap),
        mask_threshold=float(mask_threshold), mitigations=bool(mitigations))


def with_mitigation(scen: Scenario, mitigation: str | None) -> Scenario:
    """``scen`` with a mitigation applied to both plans (``deterministic``); ``aligned`` is
    prefix-cache's own (see :func:`prefix_cache`).

    Raises:
        TracerError: unknown mitigation, or ``aligned`` on another scenario.
    """
    check_mitigation(mitigation)
    if mitigation == "aligned" and scen.name != "prefix-cache":
        raise TracerError(f"--mitigation aligned applies to prefix-cache only, not to {scen.name}; "
                          "use --mitigation deterministic")
    if mitigation != "deterministic":
        return scen
    a = replace(scen.plan_a, deterministic=True, description=scen.plan_a.description + " (deterministic)")
    b = replace(scen.plan_b, deterministic=True, description=scen.plan_b.description + " (deterministic)")
    return replace(scen, plan_a=a, plan_b=b, params={**scen.params, "mitigation": "deterministic"})


#: name → builder ``f(n_tokens, **options) -> Scenario`` for the CLI's --scenario
SCENARIOS: dict[str, Callable[..., Scenario]] = {
    "repeat": repeat,
    "batch": batch,
    "prefix-cache": prefix_cache,
    "generate-cache": generate_cache,
    "block-size": block_size_scenario,
    "chunked-prefill": chunked_prefill,
    "tensor-parallel": tensor_parallel,
    "kv-quant": kv_quant,
    "attention": attention,
    "compile": compile_scenario,
    "cuda-graph": cuda_graph_scenario,
    "device": device,
    "disaggregated": disaggregated,
    "prefill-decode": prefill_decode,
    "rollout-vs-train": rollout_vs_train,
    "engine": engine_scenario,
}


__all__ = ["MITIGATIONS", "PADDINGS", "TP_MODES", "Batch", "TPSpec", "RunPlan", "Scenario", "SCENARIOS",
           "default_split", "check_split", "check_mitigation", "batch_lengths", "with_mitigation"]
