"""Tensor-parallel sharding of an HF model, Megatron-style, inside each rank (``--tp-mode distributed``).

- column-parallel ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/``up_proj``: rank r keeps the
  output rows ``[r N/K, (r+1) N/K)`` (whole heads: K must divide the attention heads and the KV
  heads);
- row-parallel ``o_proj``/``down_proj``: rank r keeps the input columns ``[r K_in/K, ...)``, computes
  the partial product ``x_r @ W_r.T`` (its *partial*, in the activation dtype) and a
  :class:`Reducer` sums the K partials (``torch.distributed.all_reduce``, or all_gather + sum in
  rank order); a bias is added once, after the sum;
- optionally (``vocab_parallel``) the embedding and the LM head.

:func:`check_shardable` refuses a model this cannot split before anything is spawned;
:func:`backend_for` / :func:`check_world` pick and check the torch.distributed backend.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tracer.errors import TracerError, option
from tracer.execute.family import family_for, role_modules
from tracer.execute.roles import COLUMN_PARALLEL_ROLES, FUSED_ROLES, ROW_PARALLEL_ROLES


#: the most worker processes tracer starts on the CPU
MAX_CPU_RANKS = 64


def backend_for(device: str) -> str:
    """The torch.distributed backend for a device string: ``gloo`` (CPU) or ``nccl`` (CUDA).

    Raises:
        TracerError: torch.distributed, or the backend, is not available in this torch build;
            or the device is neither CPU nor CUDA.
    """
    kind = torch.device(device).type
    if not dist.is_available():
        raise TracerError("this torch build has no torch.distributed; --tp-mode distributed needs it "
                          "(use --tp-mode simulated)")
    if kind == "cpu":
        if not dist.is_gloo_available():
            raise TracerError("this torch build has no gloo backend; --tp-mode distributed on the CPU needs it "
                              "(use --tp-mode simulated)")
        return "gloo"
    if kind == "cuda":
        if not dist.is_nccl_available():
            raise TracerError("this torch build has no NCCL backend; --tp-mode distributed on GPUs needs it "
                              f"(use {option('tp_mode', 'simulated')}, or {option('device', 'cpu')} for gloo)")
        return "nccl"
    raise TracerError(f"--tp-mode distributed runs on cpu (gloo) or cuda (NCCL), not on {device}")


def check_world(k: int, device: str) -> str:
    """Check that K ranks can start for a model on ``device``; return the backend.

    Raises:
        TracerError: K < 1, more ranks than GPUs (CUDA), more than :data:`MAX_CPU_RANKS` (CPU),
            or a missing backend.
    """
    if k < 1:
        raise TracerError(f"--tp must be a positive number of ranks, got {k}")
    backend = backend_for(device)
    if backend == "nccl":
        n_gpu = torch.cuda.device_count()
        if k > n_gpu:
            raise TracerError(f"--tp {k} needs {k} GPUs (one per rank) but {n_gpu} are visible; "
                              f"use {option('tp', n_gpu)} or fewer, or {option('device', 'cpu')} for gloo ranks")
    elif k > MAX_CPU_RANKS:
        raise TracerError(f"--tp {k} would start {k} CPU processes; use at most {MAX_CPU_RANKS}")
    return backend


def _config_int(cfg: Any, *names: str) -> int | None:
    for name in names:
        v = getattr(cfg, name, None)
        if isinstance(v, int):
            return v
    return None


def check_shardable(model: nn.Module, k: int, *, vocab_parallel: bool = False) -> dict[str, int]:
    """Check that tracer's sharding applies to ``model`` at K ranks (before anything is spawned).

    Returns:
        ``{"heads", "kv_heads", "intermediate", "vocab"}`` from the model's config.

    Raises:
        TracerError: a fused projection layout, no q/k/v/o or MLP projections, or K not dividing
            the attention heads, the KV heads, a sharded Linear's dimension or (with
            ``vocab_parallel``) the vocabulary.
    """
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = _config_int(cfg, "num_attention_heads", "n_head")
    kv_heads = _config_int(cfg, "num_key_value_heads") or heads
    vocab = _config_int(cfg, "vocab_size")
    fam = family_for(model)
    fused = sorted({role for _, role, _ in role_modules(model, FUSED_ROLES, fam)})
    have = {role for _, role, _ in role_modules(model, ("q_proj", "k_proj", "v_proj", "o_proj"), fam)}
    if fused or len(have) < 4:
        what = ("fused projections " + "/".join(fam.path_of(r) or r for r in fused) if fused
                else "no separate q/k/v/o projections")
        raise TracerError(f"{type(model).__name__} has {what} ({fam.path}); "
                          "tracer's tensor-parallel sharding covers Llama-style layouts (Llama, Qwen, Mistral, "
                          "SmolLM); use --tp-mode simulated")
    if role_modules(model, ("linear_attention",), fam):
        raise TracerError(f"{type(model).__name__} has linear-attention layers ({fam.path}), which tracer's "
                          "tensor-parallel sharding does not split; use --tp-mode simulated")
    for what, n in (("attention heads", heads), ("KV heads", kv_heads)):
        if n is None or n % k:
            raise TracerError(f"--tp {k} does not divide the {n} {what} of this model; choose a divisor of {n}")
    for name, role, m in _linears(model, COLUMN_PARALLEL_ROLES + ROW_PARALLEL_ROLES):
        dim = m.out_features if role in COLUMN_PARALLEL_ROLES else m.in_features
        if dim % k:
            raise TracerError(f"--tp {k} does not divide dimension {dim} of {name}; choose a divisor of {dim}")
    if vocab_parallel and (vocab is None or vocab % k):
        raise TracerError(f"--tp-vocab-parallel needs --tp {k} to divide the vocabulary ({vocab}); "
                          "drop --tp-vocab-parallel or choose a divisor")
    return {"heads": heads or 0, "kv_heads": kv_heads or 0, "vocab": vocab or 0,
            "intermediate": _config_int(cfg, "intermediate_size") or 0}


def _linears(model: nn.Module, roles: tuple[str, ...]) -> list[tuple[str, str, nn.Linear]]:
    """``(path, role, module)`` of the decoder layers' ``nn.Linear`` modules playing ``roles``."""
    return [(n, r, m) for n, r, m in role_modules(model, roles) if isinstance(m, nn.Linear)]


class Reducer:
    """The sum over ranks of a row-parallel layer's partials, ``(..., N)`` → ``(..., N)`` same dtype.

    ``deterministic=False``: ``torch.distributed.all_reduce`` (the backend picks the algorithm);
    ``True``: all_gather, then ``((p0 + p1) + p2) + ...`` in rank order on every rank.
    """

    def __init__(self, world: int, deterministic: bool) -> None:
        self.world, self.deterministic = world, deterministic

    def __call__(self, part: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return part
        if not self.deterministic:
            out = part.contiguous()
            dist.all_reduce(out)
            return out
        parts = [torch.empty_like(part) for _ in range(self.world)]
        dist.all_gather(parts, part.contiguous())
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        return acc


class Partial(nn.Module):
    """Identity module whose output is a rank's partial product (a hook point for ``--tp-partials``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102 - identity
        return x


def _slice_param(t: torch.Tensor, dim: int, rank: int, k: int) -> nn.Parameter:
    step = t.shape[dim] // k
    return nn.Parameter(t.narrow(dim, rank * step, step).clone(), requires_grad=False)  # own copy, not shared


def shard_model(model: nn.Module, rank: int, k: int, reducer: Reducer, *, vocab_parallel: bool = False) -> list[str]:
    """Shard ``model`` in place for rank ``rank`` of ``k`` (see the module docstring); return the
    row-parallel module paths (each gets a :class:`Partial` child named ``tp_partial``).

    The parameters are replaced by copies of their slices (shared tensors are never written).
    """
    for _, _, m in _linears(model, COLUMN_PARALLEL_ROLES):
        m.weight = _slice_param(m.weight, 0, rank, k)
        if m.bias is not None:
            m.bias = _slice_param(m.bias, 0, rank, k)
        m.out_features //= k
    rows = _linears(model, ROW_PARALLEL_ROLES)
    for _, _, m in rows:
        m.weight = _slice_param(m.weight, 1, rank, k)
        m.in_features //= k
        m.tp_partial = Partial()

        def row_forward(x: torch.Tensor, _m: nn.Linear = m) -> torch.Tensor:
            part = _m.tp_partial(nn.functional.linear(x, _m.weight))  # (..., N) this rank's partial
            out = reducer(part)
            return out if _m.bias is None else out + _m.bias

        m.forward = row_forward
    if vocab_parallel:
        _shard_vocab(model, rank, k)
    return [n for n, _, _ in rows]


def _shard_vocab(model: nn.Module, rank: int, k: int) -> None:
    """Vocab-parallel embedding (masked lookup + all_reduce) and LM head (V/K logits + all_gather)."""
    emb = model.get_input_embeddings()
    if type(emb) is nn.Embedding:  # a subclass (scaled embeddings) keeps its own forward: left replicated
        vocab = emb.num_embeddings
        lo, hi = rank * (vocab // k), (rank + 1) * (vocab // k)
        emb.weight = _slice_param(emb.weight, 0, rank, k)

        def emb_forward(ids: torch.Tensor, _e: nn.Embedding = emb) -> torch.Tensor:
            outside = (ids < lo) | (ids >= hi)
            out = nn.functional.embedding((ids - lo).masked_fill(outside, 0), _e.weight)
            out = out.masked_fill(outside.unsqueeze(-1), 0).contiguous()  # (B, T, hidden)
            dist.all_reduce(out)
            return out

        emb.forward = emb_forward
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear):
        head.weight = _slice_param(head.weight, 0, rank, k)
        if head.bias is not None:
            head.bias = _slice_param(head.bias, 0, rank, k)

        def head_forward(x: torch.Tensor, _h: nn.Linear = head) -> torch.Tensor:
            local = nn.functional.linear(x, _h.weight, _h.bias).contiguous()  # (..., V/K)
            parts = [torch.empty_like(local) for _ in range(k)]
            dist.all_gather(parts, local)
            return torch.cat(parts, dim=-1)

        head.forward = head_forward
