"""The HF executors of ``rollout-vs-train``: a rollout engine's sampling (run A) and a trainer's recompute (run B).

Both are executors of :mod:`tracer.engines.door` (``hf-rollout``, ``hf-train``), chosen from
the plan's :class:`~tracer.plan.rollout.RLSpec` role, with the same signature as the other
executors. Another engine's rollout is an executor of its own (in its folder) for the same plan.

**Rollout** (:func:`execute_rollout`): the K prompts as one left-padded batch ``(K, W)`` with an
attention mask and position ids counted from each row's first real token (as HF ``generate``
does); one prefill forward (GEMM M = K × W), then T - 1 decode steps, each one token per row
from the KV cache (M = K). Token t of every row is chosen from the logits that computed it:
greedy (argmax, first index among ties) or sampled from ``softmax(float32(logits) / τ)`` by a
CPU generator seeded with ``spec.seed``; its logprob ``log_softmax(float32(logits) / τ)[token]``
is recorded in float32, as a rollout engine reports it (``meta["rollout"]``).

**Trainer** (:func:`execute_train`): one forward over the K sequences prompt + response, with no
KV cache, right-padded ``(K, W + T)`` with a 2-D attention mask, or packed into one row
``(1, Σ (L_j + T))`` with position ids restarting at 0 for every sequence and no attention mask:
transformers then builds a block-diagonal causal mask from the position ids for sdpa and eager
(``masking_utils.find_packed_sequence_indices``; flash-attention's varlen path when that is the
attention implementation), so no token attends across sequences. The response tokens'
logprobs are taken the same way (``meta["train"]``).

The capture hooks keep the traced row's positions N-1 .. N+T-2 in both runs; each run's logits
of every row at the response positions stay in memory in ``extras["rl_logits"]`` (``(K, T,
vocab)``, as computed) for the full-vocabulary metrics of :mod:`tracer.diff.rl`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tracer.dtypes import resolve
from tracer.errors import TracerError
from tracer.execute.capture import Capture
from tracer.execute.kernels import KernelRecorder
from tracer.execute.points import CapturePoint
from tracer.execute.records import RunRecord
from tracer.execute.sampling import choose, token_logprobs
from tracer.engines.hf.context import plan_context
from tracer.engines.hf.run import batch_inputs
from tracer.execute.sdpa_inputs import SdpaRecorder
from tracer.load.devices import cast_weights, model_device
from tracer.load.hf_cache import cache_kwarg, output_cache
from tracer.plan.plans import Batch, RunPlan
from tracer.plan.rollout import DECODE_REFUSED, train_dtype_error


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def fp32_lm_head(model: nn.Module, enabled: bool) -> Iterator[None]:
    """The LM head computes in float32 for the block (``F.linear(x.float(), W.float(), b.float())``);
    its hooks still fire (the instance's ``forward`` is replaced, ``__call__`` is not)."""
    if not enabled:
        yield
        return
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise TracerError(f"{type(model).__name__} has no LM head with a weight; --lm-head-fp32 cannot apply")
    w = head.weight.float()
    b = head.bias.float() if getattr(head, "bias", None) is not None else None
    head.forward = lambda x, *a, **k: F.linear(x.float(), w, b)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del head.forward


@contextlib.contextmanager
def run_dtype(model: nn.Module, name: str | None) -> Iterator[None]:
    """Cast the weights to ``name`` for the block and back (:func:`~tracer.load.devices.cast_weights`).

    Raises:
        TracerError: a cast that is not exact both ways (only widening: bf16/fp16 → float32 → float64).
    """
    if name is None:
        yield
        return

    target, home = resolve(name), next(model.parameters()).dtype
    if target == home:
        yield
        return
    why = train_dtype_error(name, str(home))
    if why is not None:
        raise TracerError(why)
    cast_weights(model, target)
    try:
        yield
    finally:
        cast_weights(model, home)


@contextlib.contextmanager
def _recorders(model: nn.Module, points: list[CapturePoint], cap: Capture, kernels: bool,
               sdpa_inputs: bool) -> Iterator[tuple[Any, Any]]:
    with KernelRecorder(model, points, cap) if kernels else contextlib.nullcontext() as rec, \
            SdpaRecorder(model, points, cap) if sdpa_inputs else contextlib.nullcontext() as sdpa:
        yield rec, sdpa


def _check(plan: RunPlan, role: str, decode: int) -> Any:
    spec = plan.rl
    if spec is None or spec.role != role:
        raise TracerError(f"run plan {plan.name} is not the {role} side of an RL step; use the plan's own executor")
    if decode:
        raise TracerError(DECODE_REFUSED)
    return spec


def _record(plan: RunPlan, ids: list[int], window: tuple[int, int], cap: Capture, recorder: Any, sdpa: Any,
            info: dict[str, Any], extras: dict[str, Any]) -> RunRecord:
    captures = cap.records()
    if recorder is not None:
        recorder.attach(captures)
        info["kernels"] = "recorded"
    if sdpa is not None:
        extras["sdpa"] = sdpa.calls
    return RunRecord(name=plan.name, token_ids=list(ids), plan=plan.to_dict(), window=(int(window[0]), int(window[1])),
                     captures=captures, meta=info, extras=extras)


def execute_rollout(loaded: Any, token_ids: list[int], plan: RunPlan, points: list[CapturePoint],
                    window: tuple[int, int], *, keep_on_device: bool = False, decode: int = 0,
                    meta: dict[str, Any] | None = None, say: Callable[[str], None] | None = None,
                    kernels: bool = False, sdpa_inputs: bool = False) -> tuple[RunRecord, None]:
    """Run A of ``rollout-vs-train``: sample T tokens for K prompts from a KV cache (see the module docstring).

    Args:
        loaded: the :class:`~tracer.load.models.LoadedModel`.
        token_ids: the traced prompt, N ints (the other K - 1 prompts are derived from it).
        plan: a plan whose ``rl`` is a ``rollout`` :class:`~tracer.plan.rollout.RLSpec`.
        points, window: capture points and the kept positions (N-1 .. N+T-2, or 0 .. N+T-2).
        keep_on_device, meta, kernels, sdpa_inputs: as :func:`tracer.engines.hf.run.execute`.

    Returns:
        ``(record, None)``: token ids = traced prompt + its response (N + T); ``meta["rollout"]``:
        ``tokens`` (K × T), ``logprobs`` (K × T, float32 values), ``sequences`` (K prompt + response
        id lists), ``lengths``, ``row``, ``tau``; ``extras["rl_logits"]``: ``(K, T, vocab)`` logits.

    Raises:
        TracerError: not a rollout plan, ``decode`` set, or a prompt whose length is not the plan's N.
    """
    spec = _check(plan, "rollout", decode)
    model, n, t, k, r = loaded.model, len(token_ids), spec.new_tokens, spec.rollouts, spec.row
    if spec.lengths[r] != n:
        raise TracerError(f"run plan {plan.name} was planned for a {spec.lengths[r]}-token prompt, the prompt has {n}")
    device = model_device(model)
    padding = "left" if len(set(spec.lengths)) > 1 else "none"
    ids, mask, col = batch_inputs(list(token_ids), Batch(k, r, padding, spec.lengths), device)  # (K, W) each
    gen = torch.Generator().manual_seed(int(spec.seed)) if spec.sample else None
    tokens = torch.zeros((k, t), dtype=torch.long)
    logprobs = torch.zeros((k, t), dtype=torch.float32)
    kept: list[torch.Tensor] = []
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        with Capture(model, points, window, keep_on_device=keep_on_device) as cap, plan_context(model, plan) as fn, \
                fp32_lm_head(model, spec.lm_head_fp32), _recorders(model, points, cap, kernels, sdpa_inputs) as (rec, sdpa):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)  # (K, W): positions from each row's first real token
            with cap.forward_call(0, n, r, col):
                out = fn(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
            cache, last = output_cache(out), pos[:, -1]
            logits = out.logits[:, -1]  # (K, vocab): each row's last prompt token (left padding: last column)
            for i in range(t):
                kept.append(logits.detach().clone())
                tokens[:, i] = choose(logits, spec.sample, spec.tau, gen)
                logprobs[:, i] = token_logprobs(logits, tokens[:, i], spec.tau).cpu()
                if i + 1 == t:
                    break
                mask = torch.cat([mask, torch.ones((k, 1), dtype=mask.dtype, device=device)], dim=1)
                last = last + 1
                with cap.forward_call(n + i, n + i + 1, r, 0):  # one token per row: GEMM M = K
                    out = fn(input_ids=tokens[:, i:i + 1].to(device), attention_mask=mask, position_ids=last[:, None],
                             use_cache=True, **{cache_kwarg(model): cache})
                cache, logits = output_cache(out), out.logits[:, -1]
            if cache is not None:
                cap.add_cache(cache, row=r, col=col)
            _sync(device)
            wall = time.perf_counter() - t0
    prompts = [ids[j, ids.shape[1] - spec.lengths[j]:].tolist() for j in range(k)]
    sequences = [p + tokens[j].tolist() for j, p in enumerate(prompts)]
    info: dict[str, Any] = {"wall_s": wall, "device": str(device), "gemm_m": plan.gemm_m(), **(meta or {}),
                            "rollout": {"tokens": tokens.tolist(), "logprobs": logprobs.tolist(), "row": r,
                                        "lengths": list(spec.lengths), "sequences": sequences, "tau": spec.tau}}
    rec_logits = torch.stack(kept, dim=1)  # (K, T, vocab)
    return _record(plan, sequences[r], window, cap, rec, sdpa, info, {"rl_logits": rec_logits}), None


def train_inputs(sequences: list[list[int]], spec: Any, device: torch.device) -> tuple[dict[str, Any], int, int, list[list[int]]]:
    """The trainer's forward arguments for the K sequences (prompt + response each).

    Returns:
        ``(kwargs, row, col, where)``: ``input_ids`` ``(K, W + T)`` right-padded with token 0 and its
        ``attention_mask``, or ``(1, Σ)`` packed with ``position_ids`` restarting per sequence and no
        mask; the traced sequence's batch row and first column; ``where[j][i]``: the
        ``(row, column)`` flattened as ``row * width + column`` of the logits that give sequence j's
        response token i (its column L_j - 1 + i).
    """
    k, t = len(sequences), spec.new_tokens
    lens = [len(s) for s in sequences]
    if spec.batching == "packed":
        offsets = [sum(lens[:j]) for j in range(k)]
        ids = torch.tensor([[x for s in sequences for x in s]], dtype=torch.long, device=device)  # (1, Σ)
        pos = torch.cat([torch.arange(n_j, device=device) for n_j in lens])[None]  # (1, Σ), restarting at 0
        kwargs: dict[str, Any] = {"input_ids": ids, "position_ids": pos}
        where = [[offsets[j] + lens[j] - t - 1 + i for i in range(t)] for j in range(k)]
        return kwargs, 0, offsets[spec.row], where
    width = max(lens)
    ids = torch.zeros((k, width), dtype=torch.long)
    mask = torch.zeros((k, width), dtype=torch.long)
    for j, s in enumerate(sequences):
        ids[j, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[j, :len(s)] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    where = [[j * width + lens[j] - t - 1 + i for i in range(t)] for j in range(k)]
    return kwargs, spec.row, 0, where


def execute_train(loaded: Any, token_ids: list[int], plan: RunPlan, points: list[CapturePoint],
                  window: tuple[int, int], *, rollout: RunRecord | None = None, keep_on_device: bool = False,
                  decode: int = 0, meta: dict[str, Any] | None = None, say: Callable[[str], None] | None = None,
                  kernels: bool = False, sdpa_inputs: bool = False) -> tuple[RunRecord, None]:
    """Run B of ``rollout-vs-train``: one teacher-forced forward over the rollout's K sequences.

    Args:
        loaded, token_ids, points, window, keep_on_device, meta, kernels, sdpa_inputs: as
            :func:`execute_rollout` (``token_ids``: the traced prompt).
        plan: a plan whose ``rl`` is a ``train`` :class:`~tracer.plan.rollout.RLSpec`.
        rollout: run A's record (its ``meta["rollout"]["sequences"]`` are recomputed).

    Returns:
        ``(record, None)``: token ids = the traced sequence (N + T); ``meta["train"]``: ``logprobs``
        (K × T), ``batching``; ``extras["rl_logits"]``: ``(K, T, vocab)`` logits at the response positions.

    Raises:
        TracerError: not a train plan, no rollout record, ``decode`` set, a dtype that cannot be cast back.
    """
    spec = _check(plan, "train", decode)
    if rollout is None or "rollout" not in rollout.meta:
        raise TracerError(f"run plan {plan.name} recomputes a rollout's sequences; execute the rollout plan first")
    ro = rollout.meta["rollout"]
    sequences = [list(s) for s in ro["sequences"]]
    if len(sequences) != spec.rollouts or sequences[spec.row][:len(token_ids)] != list(token_ids):
        raise TracerError(f"run plan {plan.name}: the rollout holds {len(sequences)} sequences, not the "
                          f"{spec.rollouts} planned around this prompt; run both plans of one scenario")
    model, t, device = loaded.model, spec.new_tokens, model_device(loaded.model)
    kwargs, row, col, where = train_inputs(sequences, spec, device)
    tokens = torch.tensor(ro["tokens"], dtype=torch.long)  # (K, T)
    n_seq = len(sequences[spec.row])
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        with Capture(model, points, window, keep_on_device=keep_on_device) as cap, plan_context(model, plan) as fn, \
                run_dtype(model, spec.dtype), fp32_lm_head(model, spec.lm_head_fp32), \
                _recorders(model, points, cap, kernels, sdpa_inputs) as (rec, sdpa):
            with cap.forward_call(0, n_seq, row, col):
                out = fn(**kwargs, use_cache=False)
            _sync(device)
            wall = time.perf_counter() - t0
            flat = out.logits.reshape(-1, out.logits.shape[-1])  # (rows * width, vocab)
            logits = flat[torch.tensor(where, device=flat.device)]  # (K, T, vocab)
            logprobs = token_logprobs(logits, tokens, spec.tau).cpu()
    info: dict[str, Any] = {"wall_s": wall, "device": str(device), "gemm_m": plan.gemm_m(), **(meta or {}),
                            "train": {"logprobs": logprobs.tolist(), "batching": spec.batching, "tau": spec.tau,
                                      "dtype": spec.dtype, "lm_head_fp32": spec.lm_head_fp32}}
    return _record(plan, sequences[spec.row], window, cap, rec, sdpa, info, {"rl_logits": logits.detach().clone()}), None


__all__ = ["execute_rollout", "execute_train", "train_inputs", "fp32_lm_head", "run_dtype"]
