"""The KV-cache argument of an HF model's forward, across transformers versions.

transformers 4.56-5.2x call it ``past_key_values`` (argument and output field); newer releases
(5.24 on this machine) rename both to ``cache`` and warn on every forward that still passes
``past_key_values`` (removed in 5.40). tracer asks the model which one its ``forward`` takes.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import nn


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
