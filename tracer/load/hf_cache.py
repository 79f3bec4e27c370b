"""The KV-cache argument of an HF model's forward, across transformers versions, and the state a
hybrid model's cache holds.

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

from tracer.errors import TracerError


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
