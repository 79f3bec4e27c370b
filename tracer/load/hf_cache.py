"""The KV-cache argument of an HF model's forward, across transformers versions, the state a
hybrid model's cache holds, and the KV contract of an HF cache that crosses devices (:func:`cache_contract`).

transformers 4.56-5.2x call it ``past_key_values`` (argument and output field); newer releases
(5.24 on this machine) rename both to ``cache`` and warn on every forward that still passes
``past_key_values`` (removed in 5.40). tracer asks the model which one its ``forward`` takes.
:func:`cached_state` reads a linear-attention layer's recurrent and conv state out of the cache.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from tracer.engines.table import REFERENCE
from tracer.errors import TracerError
from tracer.load.kv_contract import KVContract


@functools.lru_cache(maxsize=None)
def _kwarg_of(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters  # follows the deprecation wrapper's __wrapped__
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(model: nn.Module) -> str:
    """``"cache"`` when ``model.forward`` takes a ``cache`` argument, else ``"past_key_values"``."""
    return _kwarg_of(type(model))


def output_cache(out: Any) -> Any:
    """The KV cache an HF model output carries (``out.cache`` or ``out.past_key_values``); None if none."""
    fields = getattr(out, "__dataclass_fields__", {})
    if "cache" in fields:
        return out.cache
    return getattr(out, "past_key_values", None)


def cached_state(cache: Any, index: int, row: int, name: str) -> tuple[torch.Tensor, list[list[int]]]:
    """Layer ``index``'s linear-attention state in an HF cache, batch row ``row``, as one row.

    transformers (>= 5.2x) keeps it in the cache layer (``LinearAttentionLayer`` and the hybrid
    layers that subclass it) as ``recurrent_states[k]`` (GatedDeltaNet, Mamba:
    ``(B, heads, d_k, d_v)``-like, float32 from the torch kernels) and ``conv_states[k]`` (the last
    ``kernel`` inputs of the causal convolution, ``(B, channels, kernel)``, the model's dtype), for
    each of the layer's ``number_of_states`` states; a state never initialised (LFM2's conv layers
    have no recurrent state) is absent.

    Returns:
        ``(tensor, shapes)``: a new tensor ``(1, F)`` holding, for each state k, the recurrent
        state then the conv state, each flattened, in their promoted dtype (float32 for a bf16
        model: the conv state's values widen exactly), on the cache's device; and the per-row
        shapes of the parts, in that order.

    Raises:
        TracerError: the cache has no layer ``index`` or that layer holds no state.
    """
    try:
        layer = cache.layers[index]
        n_states = int(layer.number_of_states)
    except (IndexError, AttributeError, TypeError):
        raise TracerError(f"capture point {name}: the cache has no linear-attention state at layer {index}; "
                          "is this a hybrid model with transformers' LinearAttention cache layers (>= 5.2)?") from None
    parts: list[torch.Tensor] = []
    for k in range(n_states):
        for states in (layer.recurrent_states, layer.conv_states):
            t = states.get(k)
            if t is not None:
                parts.append(t[row])
    if not parts:
        raise TracerError(f"capture point {name}: cache layer {index} holds no state after the run")
    dtype = parts[0].dtype
    for t in parts[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    # a new tensor: the cache's own is updated in place by any later call
    flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in parts]).unsqueeze(0)
    return flat, [list(t.shape) for t in parts]


#: what crosses when tracer moves an HF cache to another device (``--scenario disaggregated``)
HF_TRANSFER = "HF cache layers' keys and values tensors, moved with torch .to(device) (bits unchanged)"
#: an HF cache layer's keys and values: (batch, kv_heads, tokens, head_dim) each, head-major
HF_LAYOUT, HF_PACKING = "HND", "keys and values as two tensors per layer"


def _attention_layers(cfg: Any) -> int:
    """The decoder layers of ``cfg`` that keep keys and values (``layer_types``: every kind but linear
    attention and state-space layers; else all ``num_hidden_layers``)."""
    kinds = getattr(cfg, "layer_types", None)
    if isinstance(kinds, (list, tuple)) and kinds:
        return sum(1 for k in kinds if "attention" in str(k) and "linear" not in str(k))
    return int(cfg.num_hidden_layers)


def cache_contract(model: nn.Module, cache: Any, device: Any, positions: tuple[int, int],
                   tokens_sha256: str) -> KVContract:
    """The KV contract of an HF cache crossing devices: with ``cache`` (the producer) what its layers
    hold (their keys' dtype and shape, the layers that hold keys); with ``cache`` None (the consumer)
    what ``model`` (its dtype and config) expects. ``device``: the side's device; ``positions``: ``[start,
    stop)`` held (producer) or looked for (consumer); ``tokens_sha256``: of those positions' ids."""
    import transformers

    cfg = model.config
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    model_dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    if cache is None:
        layers, kv_heads = _attention_layers(cfg), int(getattr(cfg, "num_key_value_heads", heads) or heads)
        head_dim, storage = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads), model_dtype
    else:
        held = [layer.keys for layer in getattr(cache, "layers", ()) if getattr(layer, "keys", None) is not None
                and layer.keys.numel()]
        layers = len(held)
        kv_heads, head_dim = (int(held[0].shape[1]), int(held[0].shape[-1])) if held else (0, 0)
        storage = str(held[0].dtype).replace("torch.", "") if held else model_dtype
    return KVContract(
        engine=REFERENCE, version=str(transformers.__version__), device=str(device), model_dtype=model_dtype,
        storage_dtype=storage, layout=HF_LAYOUT, transfer_unit="token", block_size=0, layers=layers,
        kv_heads=kv_heads, head_dim=head_dim, positions=(int(positions[0]), int(positions[1])),
        tokens_sha256=tokens_sha256, packing=HF_PACKING, transfer=HF_TRANSFER,
        cache_layout="HF cache layers: keys, values (batch, kv_heads, tokens, head_dim)",
        attention_backend=str(getattr(model.config, "_attn_implementation", "") or ""))
