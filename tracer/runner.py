"""Executing a run plan on the model with capture hooks attached.

One run = the plan's chunks as successive forward passes sharing one KV cache (HF's
``DynamicCache``), under ``torch.inference_mode``. Positions come from the cache length, as in
HF ``generate``: chunk ``[s, e)`` is computed at positions ``s..e-1``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from .capture import Capture, CapturePoint
from .errors import TracerError
from .records import RunRecord
from .scenarios import RunPlan


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's input embedding (where ``input_ids`` must go)."""
    emb = model.get_input_embeddings()
    return emb.weight.device


def forward_chunks(model: nn.Module, ids: torch.Tensor, plan: RunPlan,
                   capture: Capture | None = None) -> Any:
    """Run the plan's chunks on ``ids`` (shape ``(1, N)``, int64) and return the final KV cache.

    Each chunk ``[s, e)`` is one ``model(input_ids=ids[:, s:e], past_key_values=cache)`` call.
    """
    return prefill(model, ids, plan, capture)[0]


def prefill(model: nn.Module, ids: torch.Tensor, plan: RunPlan,
            capture: Capture | None = None) -> tuple[Any, torch.Tensor]:
    """Like :func:`forward_chunks`, returning ``(cache, last_logits)``.

    ``last_logits``: ``(V,)`` logits of the last prompt position (model dtype, model device).
    """
    cache = None
    out = None
    for start, stop in plan.chunks:
        kwargs: dict[str, Any] = {"input_ids": ids[:, start:stop], "use_cache": True}
        if cache is not None:
            kwargs["past_key_values"] = cache
        if capture is not None:
            with capture.forward_call(start, stop):
                out = model(**kwargs)
        else:
            out = model(**kwargs)
        cache = out.past_key_values
    assert out is not None, "a run plan has at least one chunk"
    return cache, out.logits[0, -1]


def greedy_decode(model: nn.Module, cache: Any, last_logits: torch.Tensor, steps: int) -> list[int]:
    """Greedy-decode ``steps`` tokens continuing a prefilled KV cache (the cache is extended).

    Args:
        cache: the KV cache after the prompt's N positions.
        last_logits: ``(V,)`` logits of position N-1; the first generated token is their argmax.
        steps: number of tokens to generate (0 gives ``[]``).

    Returns:
        the generated token ids (``steps`` ints), each the argmax (first index among ties) of the
        previous step's logits; one ``model(input_ids=(1, 1), past_key_values=cache)`` call per
        token after the first. No capture hooks record these calls.
    """
    tokens: list[int] = []
    logits = last_logits
    device = model_device(model)
    for step in range(steps):
        tok = int(torch.argmax(logits))
        tokens.append(tok)
        if step + 1 == steps:
            break
        out = model(input_ids=torch.tensor([[tok]], dtype=torch.long, device=device),
                    past_key_values=cache, use_cache=True)
        cache, logits = out.past_key_values, out.logits[0, -1]
    return tokens


def execute(model: nn.Module, token_ids: list[int], plan: RunPlan, points: list[CapturePoint],
            window: tuple[int, int], *, meta: dict[str, Any] | None = None,
            keep_on_device: bool = False, decode: int = 0) -> RunRecord:
    """Execute one run plan with capture hooks and return what they saw.

    Args:
        model: an HF causal LM (eval mode).
        token_ids: the prompt, N ints; the plan's chunks must tile ``[0, N)``.
        plan: the run plan.
        points: capture points (:func:`tracer.capture.discover_points`).
        window: the compared positions ``(start, stop)`` kept by the hooks.
        keep_on_device: leave the captures on the model's device (online comparison) instead
            of copying them to the host.
        decode: greedy-decode this many tokens from the run's final KV cache after the capture
            (``meta["decode_tokens"]``); the hooks are removed by then, and the ``kv_cache``
            points are read before decoding extends the cache.

    Returns:
        a :class:`RunRecord` whose captures hold ``(stop - start, *feature)`` tensors on the CPU
        in the model's dtype (``kv_cache`` points: all positions), with wall time and GEMM M
        per chunk in ``meta``.

    Raises:
        TracerError: the plan does not cover the prompt, or ``decode < 0``.
    """
    if decode < 0:
        raise TracerError(f"--decode {decode} is negative; give a number of tokens to generate (0 = off)")
    n = len(token_ids)
    if plan.n_tokens != n:
        raise TracerError(f"run plan {plan.name} covers {plan.n_tokens} tokens but the prompt has {n}")
    device = model_device(model)
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)  # (1, N)
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        with Capture(model, points, window, keep_on_device=keep_on_device) as cap:
            cache, last = prefill(model, ids, plan, cap)
            cap.add_cache(cache)
            _sync(device)
        wall = time.perf_counter() - t0
        tokens = greedy_decode(model, cache, last, decode) if decode else None
    info = {"wall_s": wall, "device": str(device), "gemm_m": plan.gemm_m()}
    if tokens is not None:
        info["decode_tokens"] = tokens
    info.update(meta or {})
    return RunRecord(name=plan.name, token_ids=list(token_ids), plan=plan.to_dict(),
                     window=(int(window[0]), int(window[1])), captures=cap.records(), meta=info)
