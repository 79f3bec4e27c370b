"""Recording what the attention core's SDPA call was given (for the float64 replay of an origin).

The attention core (the input of ``o_proj``) is computed by ``torch.nn.functional.scaled_dot_
product_attention`` inside the attention module, from queries after RoPE, which no capture point
keeps. :class:`SdpaRecorder` wraps that function while a run executes (restored on exit) and, for
every attention module that has an ``attention_core`` capture point, keeps per forward call:

- ``q``: the queries of the compared positions only, ``(heads, T, head_dim)``, storage dtype, CPU
  (memory proportional to the compared window, like the other captures);
- ``mask``: the rows of ``attn_mask`` for those queries, ``(1 or heads, T, S)`` (bool: True =
  attend; float: added to the scores), or None;
- ``is_causal``, ``scale``, ``dropout``, ``S`` (the key length passed), ``q_offset`` (the
  query index of the first kept row within the call), ``positions`` (absolute ``[lo, hi)``).

Keys and values are not copied: the replay reads them from the layer's ``kv_cache`` capture point
(all N positions, the same bits SDPA consumed, before any ``repeat_kv``). Calls whose query is
not ``(batch, heads, positions, head_dim)`` (HF's packed-GQA decode path) are skipped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tracer.execute.handles import Hooks
from tracer.execute.kinds import PointKind


class SdpaRecorder(Hooks):
    """Context manager: record the SDPA inputs of every attention core during one run.

    Args:
        model: the HF model.
        points: the capture points; those of kind ``attention_core`` name the modules to watch.
        capture: the entered :class:`~tracer.execute.capture.Capture` (its declared call gives the row,
            column offset and positions to keep).

    Attributes:
        calls: core capture name → list of per-call dicts (see the module docstring).
    """

    def __init__(self, model: nn.Module, points: list[Any], capture: Any) -> None:
        self.model, self.capture = model, capture
        self.cores = {p.module.rsplit(".", 1)[0]: p.name for p in points if p.kind == PointKind.ATTENTION_CORE}
        self.calls: dict[str, list[dict[str, Any]]] = {name: [] for name in self.cores.values()}
        self._stack: list[str] = []
        super().__init__()
        self._orig = None

    def install(self) -> None:
        """Hook every attention core's module, then wrap ``F.scaled_dot_product_attention``."""
        for path in self.cores:
            m = self.model.get_submodule(path)
            self.hook(m, lambda mod, args, p=path: self._stack.append(p), pre=True)
            self.hook(m, lambda mod, args, out: self._pop(), always_call=True)
        self._orig = F.scaled_dot_product_attention
        orig = self._orig

        def wrapper(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
            if self._stack and self.capture._call is not None:
                self._record(query, key, attn_mask, dropout_p, is_causal, scale, kw)
            return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, **kw)

        F.scaled_dot_product_attention = wrapper

    def __exit__(self, *exc: Any) -> None:
        if self._orig is not None:
            F.scaled_dot_product_attention = self._orig
            self._orig = None
        self.remove()

    def _pop(self) -> None:
        if self._stack:
            self._stack.pop()

    def _record(self, query, key, attn_mask, dropout_p, is_causal, scale, kw) -> None:
        start, stop, row, col = self.capture._call
        n = stop - start
        if query.dim() != 4 or query.shape[2] < col + n:
            return  # packed GQA (one query token spread over heads) or another layout: not replayable
        w0, w1 = self.capture.window
        lo, hi = max(start, w0), min(stop, w1)
        if lo >= hi:
            return
        a, b = col + lo - start, col + hi - start
        q = query[row, :, a:b].detach().to("cpu").clone()  # (heads, T, head_dim)
        mask = None
        if attn_mask is not None:
            m = attn_mask[row if attn_mask.shape[0] > 1 else 0]
            mask = (m[:, a:b] if m.shape[-2] > 1 else m).detach().to("cpu").clone()
        self.calls[self.cores[self._stack[-1]]].append({
            "positions": [lo, hi], "q": q, "mask": mask, "is_causal": bool(is_causal),
            "scale": None if scale is None else float(scale), "dropout": float(dropout_p), "S": int(key.shape[2]),
            "q_offset": a, "col": col, "enable_gqa": bool(kw.get("enable_gqa", False)),
        })
