"""Tokens from logits, as engines and trainers pick and score them: the next token (greedy or
sampled at a temperature) and a token's logprob (``log_softmax(float32(logits) / τ)``)."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, tau: float) -> torch.Tensor:
    """``log_softmax(float32(logits) / tau)`` at ``tokens``: what an engine or trainer reports.

    Args:
        logits: ``(..., vocab)``, any float dtype.
        tokens: ``(...)`` int64 token ids.
        tau: temperature (> 0).

    Returns:
        ``(...)`` float32 logprobs.
    """
    lp = torch.log_softmax(logits.float() / tau, dim=-1)
    return lp.gather(-1, tokens.unsqueeze(-1).to(lp.device)).squeeze(-1)


def choose(logits: torch.Tensor, sample: bool, tau: float, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of every row: argmax (first among ties), or a sample of ``softmax(float32(logits) / tau)``.

    Args:
        logits: ``(K, vocab)``.
        generator: a CPU generator (sampling runs on the CPU, so a seed gives the same tokens on any device).

    Returns:
        ``(K,)`` int64 on the CPU.
    """
    if not sample:
        return torch.argmax(logits, dim=-1).cpu()
    probs = torch.softmax(logits.float().cpu() / tau, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


__all__ = ["token_logprobs", "choose"]
