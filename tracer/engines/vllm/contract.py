"""What a vLLM engine's model computes with, read from its modules: the numeric contract's op facts.

The norm (and which ``vllm.ir`` provider its fused residual add + RMSNorm dispatches to), the
activation, the rotary embedding, each Linear's GEMM, and the activation and logits dtypes, as
plain data for :meth:`tracer.engines.vllm.running.VllmEngine.facts`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn


def _custom_op(module: Any) -> str:
    """``Class.method`` a vLLM CustomOp dispatched to (``forward_native`` where the platform method is
    the base class's fallback to PyTorch ops)."""
    fn = getattr(module, "_forward_method", None)
    if fn is None:
        return type(module).__name__
    owner, name = getattr(fn, "__qualname__", "").split(".")[0], getattr(fn, "__name__", "?")
    if owner == "CustomOp" and name != "forward_native":
        name = "forward_native (PyTorch ops)"
    return f"{type(module).__name__}.{name}"


def _gemm(linear: Any) -> str:
    """The GEMM a vLLM Linear runs: the CPU dispatch (``cpu_linear``: oneDNN, sgl-kernel, zentorch,
    or torch on the library :func:`tracer.execute.gemm.torch_gemm` names) or, elsewhere, its
    quant method (unquantized: torch's, on the device's BLAS)."""
    from tracer.execute.gemm import torch_gemm

    weight = getattr(linear, "weight", None)
    device, dtype = (str(weight.device), str(weight.dtype).replace("torch.", "")) if weight is not None else ("cpu", "")
    fn = getattr(linear, "cpu_linear", None)
    if fn is None:
        method = type(getattr(linear, "quant_method", None)).__name__
        return torch_gemm(device, dtype) if method == "UnquantizedLinearMethod" else f"{method} (the device's GEMM library)"
    names = set(getattr(getattr(fn, "__code__", None), "co_names", ()))
    for key, text in (("onednn_mm", "oneDNN onednn_mm"), ("weight_packed_linear_cpu", "sgl-kernel weight_packed_linear"),
                      ("zentorch_linear_unary", "zentorch linear")):
        if key in names:
            return text
    return torch_gemm(device, dtype)


def op_facts(model: nn.Module, dtype: str) -> dict[str, Any]:
    """What vLLM's first decoder layer and LM head compute with: the norm (and which ``vllm.ir``
    provider its fused residual add + RMSNorm dispatches to), the activation, the rotary embedding,
    each Linear's GEMM, and the activation and logits dtypes (the logits processor returns the model
    dtype; the sampler casts to float32 afterwards)."""
    layer = model.model.layers[0]
    out: dict[str, Any] = {"activation_dtype": dtype, "logits_dtype": dtype,
                           "sampler": "logits_processor output cast to float32, then log_softmax / argmax / sampling"}
    norm = getattr(layer, "post_attention_layernorm", None)
    if norm is not None:
        text = _custom_op(norm)
        with contextlib.suppress(Exception):  # the provider vllm.ir picks for these arguments
            from vllm import ir

            w = norm.weight.data
            x = torch.zeros((1, w.shape[0]), dtype=w.dtype, device=w.device)
            provider = ir.ops.fused_add_rms_norm.dispatch(x, x.clone(), w, norm.variance_epsilon).provider
            text += (f"; residual add + RMSNorm fused (vllm.ir fused_add_rms_norm, provider {provider}: the residual "
                     "is added in float32 and the float32 sum is normalized)")
        out["norm"] = text
    for key, path in (("activation", "mlp.act_fn"), ("rotary", "self_attn.rotary_emb")):
        with contextlib.suppress(AttributeError):
            out[key] = _custom_op(layer.get_submodule(path))
    gemms = {}
    for path in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        with contextlib.suppress(AttributeError):
            gemms[path] = _gemm(layer.get_submodule(path))
    with contextlib.suppress(AttributeError):
        gemms["lm_head"] = _gemm(model.lm_head)
    out["gemm"] = gemms
    return out


__all__ = ["op_facts"]
