"""The HF reference's numeric contract, in the keys every engine's facts use
(:meth:`tracer.engines.base.Engine.facts`)."""

from __future__ import annotations

from typing import Any

from tracer.execute.gemm import torch_gemm
from tracer.execute.records import EngineFacts


def hf_contract(loaded: Any) -> dict[str, Any]:
    """The HF reference's numeric contract, the document of a :class:`~tracer.execute.records.EngineFacts`
    as every engine reports it (``loaded``: a :class:`~tracer.load.models.LoadedModel`): transformers
    version, attention implementation, norm, activation, GEMM (the library torch runs it on:
    :func:`tracer.execute.gemm.torch_gemm`), activation / logits / KV-cache dtypes;
    KV block size and token budget 0 (a contiguous KV cache, no per-step budget)."""
    import transformers

    model, info = loaded.model, loaded.info
    cfg = getattr(model.config, "get_text_config", lambda: model.config)()
    norm = next((type(m).__name__ for _n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")), None)
    head = model.get_output_embeddings()
    logits = str(getattr(getattr(head, "weight", None), "dtype", info.dtype)).replace("torch.", "")
    return EngineFacts(
        engine="hf", version=transformers.__version__, device=info.device, dtype=info.dtype,
        attention_backend=info.attn_implementation,
        norm=(f"{norm} (PyTorch ops); the residual added in {info.dtype} first, the rounded sum normalized "
              "in float32" if norm else "?"),
        activation=f"{getattr(cfg, 'hidden_act', '?')} then * up (PyTorch ops)",
        gemm=torch_gemm(info.device, info.dtype), activation_dtype=info.dtype, logits_dtype=logits, kv_cache_dtype=info.dtype,
        block_size=0, max_num_batched_tokens=0,  # a contiguous KV cache; each forward call computes what it is given
        compilation_mode=0, cudagraph_mode="NONE").to_dict()


__all__ = ["hf_contract"]
