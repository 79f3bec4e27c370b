"""Executing a run plan on the model with capture hooks attached.

One run = the plan's chunks as successive forward passes sharing one KV cache (HF's
``DynamicCache``), under ``torch.inference_mode``. Positions come from the cache length, as in
HF ``generate``: chunk ``[s, e)`` is computed at positions ``s..e-1``.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from tracer.engines.hf.context import compiler_warnings, plan_context
from tracer.errors import TracerError
from tracer.execute.capture import Capture
from tracer.execute.kernels import KernelRecorder
from tracer.execute.points import CapturePoint
from tracer.execute.records import RunRecord
from tracer.execute.sdpa_inputs import SdpaRecorder
from tracer.load.devices import model_device
from tracer.load.hf_cache import cache_kwarg, output_cache
from tracer.plan.quant import quantize_dequantize
from tracer.plan.scenarios import Batch, RunPlan, Scenario

if TYPE_CHECKING:
    from tracer.load.models import LoadedModel


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kv_layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TracerError(f"{type(cache).__name__} has no .layers; this transformers version's KV cache is not supported "
                          "by kv_transform/devices (transformers >= 4.56 needed)")
    return [layer for layer in layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]


def cached_length(cache: Any) -> int:
    """The positions an HF cache holds keys and values for (``get_seq_length``); 0 for a cache whose
    layers all hold a recurrent state instead (a pure state-space model: Mamba, Mamba-2), whose
    ``get_seq_length`` raises."""
    try:
        return int(cache.get_seq_length())
    except ValueError:
        return 0


def transform_kv(cache: Any, fmt: str, start: int, stop: int) -> None:
    """Quantize-dequantize (:mod:`tracer.plan.quant` format ``fmt``) the cached keys and values of
    sequence columns ``[start, stop)``, in place. Cache layers hold ``(batch, kv_heads, seq, head_dim)``."""
    for layer in _kv_layers(cache):
        layer.keys[:, :, start:stop] = quantize_dequantize(layer.keys[:, :, start:stop], fmt)
        layer.values[:, :, start:stop] = quantize_dequantize(layer.values[:, :, start:stop], fmt)


def move_kv(cache: Any, device: torch.device) -> None:
    """Move every cached key/value tensor, and a hybrid model's linear-attention states
    (``conv_states``/``recurrent_states``), to ``device`` (a disaggregated KV transfer; bits unchanged)."""
    for layer in _kv_layers(cache):
        layer.keys, layer.values = layer.keys.to(device), layer.values.to(device)
        if hasattr(layer, "device"):
            layer.device = device
    for layer in cache.layers:
        for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
            for k, t in (states or {}).items():
                if t is not None:
                    states[k] = t.to(device)
                    layer.device = device


#: the boundary a disaggregated run's cache crosses, in words (its KV contract check's)
HF_BOUNDARY = "HF cache moved to another device"


def _producer(model: nn.Module, cache: Any, ids: torch.Tensor, crossing: bool) -> Any:
    """The producer's KV contract of ``cache`` about to be handed to a chunk with a device of its own
    (``crossing``; the same device too: ``--devices cpu,cpu`` checks the contract all the same), else None."""
    from tracer.load.kv_contract import tokens_sha256
    from tracer.load.hf_cache import cache_contract

    if cache is None or not crossing:
        return None
    stop = cached_length(cache)
    return cache_contract(model, cache, model_device(model), (0, stop), tokens_sha256(ids[0, :stop].tolist()))


def _checked(producer: Any, model: nn.Module, dev: torch.device, ids: torch.Tensor, start: int) -> Any:
    """The producer's contract held against the consumer's (``model`` on ``dev``, looking for positions
    ``0..start - 1``).

    Raises:
        TracerError: a fatal difference (:func:`tracer.load.kv_contract.require_kv`, one line naming both sides).
    """
    from tracer.load.kv_contract import check_kv_contract, require_kv, tokens_sha256
    from tracer.load.hf_cache import cache_contract

    consumer = cache_contract(model, None, dev, (0, start), tokens_sha256(ids[0, :start].tolist()))
    return require_kv(check_kv_contract(producer, consumer, f"{HF_BOUNDARY}: {producer.device} to {consumer.device}"))


def batch_inputs(token_ids: list[int], spec: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The padded batch: ``ids (B, W)`` int64, ``mask (B, W)`` int64 (1 = real token) and the column
    of the traced prompt's first token. Row ``spec.row`` is the prompt; row j holds the prompt
    rotated by ``(37 j + 11) mod N`` tokens, repeated to its length. Padding uses token 0."""
    n, w = len(token_ids), spec.width
    ids = torch.zeros((spec.size, w), dtype=torch.long)
    mask = torch.zeros((spec.size, w), dtype=torch.long)
    for j, length in enumerate(spec.lengths):
        if j == spec.row:
            row = list(token_ids)
        else:
            rot = (37 * j + 11) % n
            base = token_ids[rot:] + token_ids[:rot]
            row = (base * (-(-length // n)))[:length]
        lo = w - length if spec.padding == "left" else 0
        ids[j, lo:lo + length] = torch.tensor(row, dtype=torch.long)
        mask[j, lo:lo + length] = 1
    col = w - n if spec.padding == "left" else 0
    return ids.to(device), mask.to(device), col


def _call(fn: Callable[..., Any], compiled: bool, **kwargs: Any) -> Any:
    if not compiled:
        return fn(**kwargs)
    try:
        return fn(**kwargs)
    except TracerError:
        raise
    except Exception as e:  # noqa: BLE001 - compiler failures surface at the first call
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise TracerError(f"torch.compile failed on this platform ({type(e).__name__}: {msg}); "
                          "skip the compile scenario") from None


def forward_chunks(model: nn.Module, ids: torch.Tensor, plan: RunPlan,
                   capture: Capture | None = None, fn: Callable[..., Any] | None = None, *,
                   extra: dict[str, Any] | None = None,
                   on_output: Callable[[int, int, Any], None] | None = None,
                   compiled: bool | None = None, kv_moves: list[Any] | None = None) -> Any:
    """Run the plan's chunks on ``ids`` (shape ``(1, N)``, int64) and return the last model output.

    Each chunk ``[s, e)`` is one ``model(input_ids=ids[:, s:e], cache=cache)`` call (all rows of
    ``plan.batch`` at once, with its attention mask and position ids when padded; the argument is
    ``past_key_values=`` where the installed transformers' ``forward`` has no ``cache``, see
    :mod:`tracer.load.hf_cache`). Between chunks the new KV entries go through
    ``plan.kv_transform``; a chunk on another device (``plan.devices``) moves the model and the
    KV cache there first. The output's cache (:func:`~tracer.load.hf_cache.output_cache`) is the
    final cache.

    ``extra``: more keyword arguments for every call (e.g. ``output_hidden_states=True``);
    ``on_output(s, e, output)`` is called after each chunk's call; ``compiled``: whether ``fn``
    is a ``torch.compile``-d model (its failures are then reported as such; default: ``fn`` is
    not ``model``); ``kv_moves``: a list that gets, for each move of the cache to another device,
    its :class:`~tracer.load.kv_contract.KVContractCheck` (the producer's contract against the
    consumer's, checked before the consumer computes: a fatal difference raises, one line).
    """
    fn = model if fn is None else fn
    compiled = fn is not model if compiled is None else compiled
    n = ids.shape[1]
    if plan.cuda_graph:  # every chunk recorded in a CUDA graph (the hooks' copies too), then replayed
        from tracer.execute.graphs import check_graph_device, graph_forward

        check_graph_device(model_device(model), f"run plan {plan.name} (CUDA-graph replay)")
        dev = model_device(model)
        ids = ids.to(dev)

        def chunk_kwargs(start: int, stop: int, cache: Any) -> dict[str, Any]:
            kw: dict[str, Any] = {"input_ids": ids[:, start:stop], "use_cache": not plan.recompute, **(extra or {})}
            if cache is not None:
                kw[cache_kwarg(model)] = cache
            return kw

        out = graph_forward(model, ids, plan, capture, fn, chunk_kwargs)
        if on_output is not None:
            on_output(plan.chunks[-1][0], plan.chunks[-1][1], out)
        return out
    cache, out = None, None
    for i, (start, stop) in enumerate(plan.chunks):
        if plan.devices is not None and plan.devices[i] is not None:
            dev = torch.device(plan.devices[i])
            moved = _producer(model, cache, ids, kv_moves is not None)
            if model_device(model) != dev:
                model.to(dev)
            if cache is not None:
                move_kv(cache, dev)
            if moved is not None:
                kv_moves.append(_checked(moved, model, dev, ids, start))
        dev = model_device(model)
        kwargs: dict[str, Any] = {"use_cache": not plan.recompute, **(extra or {})}
        row, col = 0, 0
        if plan.batch is not None:
            bids, mask, col = batch_inputs(ids[0].tolist(), plan.batch, dev)  # (B, W)
            row = plan.batch.row
            if plan.batch.padding == "none":
                kwargs["input_ids"] = bids[:, start:stop]
            else:
                kwargs.update(input_ids=bids, attention_mask=mask,
                              position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        else:
            kwargs["input_ids"] = ids[:, start:stop].to(dev)
        if cache is not None:
            kwargs[cache_kwarg(model)] = cache
        before = cached_length(cache) if cache is not None and plan.kv_transform is not None else 0
        if capture is not None:
            with capture.forward_call(start, stop, row, col):
                out = _call(fn, compiled, **kwargs)
        else:
            out = _call(fn, compiled, **kwargs)
        if on_output is not None:
            on_output(start, stop, out)
        cache = output_cache(out)
        if plan.kv_transform is not None and cache is not None:
            transform_kv(cache, plan.kv_transform, before, cached_length(cache))
    assert n == plan.n_tokens or plan.batch is not None, "ids must hold the plan's N tokens"
    return out


def greedy(model: nn.Module, ids: torch.Tensor, out: Any, steps: int, *, recompute: bool = False,
           capture: Capture | None = None) -> list[int]:
    """Greedy-decode ``steps`` tokens continuing a prefilled run; return them.

    Args:
        model: the HF causal LM.
        ids: ``(1, N)`` int64 prompt ids.
        out: the prefill's model output; its KV cache (:func:`~tracer.load.hf_cache.output_cache`)
            is extended in place.
        steps: tokens to generate (0 gives ``[]``). The first is the argmax (first index among
            ties) of the prefill's last logits; step t ≥ 1 computes position N-1+t with the KV cache
            (one token, GEMM M = 1) or, with ``recompute``, the whole sequence of N+t tokens
            without a cache.
        capture: hooks that record each step (only the step's own position is kept), or None.
    """
    n = ids.shape[1]
    dev = model_device(model)
    gen: list[int] = []
    cache = output_cache(out)
    logits = out.logits[0, -1]
    for t in range(steps):
        gen.append(int(torch.argmax(logits)))
        if t + 1 == steps:
            break
        pos = n + t
        if recompute:
            seq = torch.cat([ids.to(dev), torch.tensor([gen], dtype=torch.long, device=dev)], dim=1)  # (1, N+t+1)
            kwargs: dict[str, Any] = {"input_ids": seq, "use_cache": False}
            col = pos
        else:
            kwargs = {"input_ids": torch.tensor([[gen[-1]]], dtype=torch.long, device=dev),
                      cache_kwarg(model): cache, "use_cache": True}
            col = 0
        ctx = capture.forward_call(pos, pos + 1, 0, col) if capture is not None else contextlib.nullcontext()
        with ctx:
            step = model(**kwargs)
        cache, logits = output_cache(step), step.logits[0, -1]
    return gen


def execute(model: nn.Module, token_ids: list[int], plan: RunPlan, points: list[CapturePoint],
            window: tuple[int, int], *, meta: dict[str, Any] | None = None,
            keep_on_device: bool = False, decode: int = 0, kernels: bool = False,
            sdpa_inputs: bool = False) -> RunRecord:
    """Execute one run plan with capture hooks and return what they saw.

    Args:
        model: an HF causal LM (eval mode).
        token_ids: the prompt, N ints; the plan's chunks must tile ``[0, N)``.
        plan: the run plan.
        points: capture points (:func:`tracer.execute.points.discover_points`).
        window: the compared positions ``(start, stop)`` kept by the hooks.
        keep_on_device: leave the captures on the model's device (online comparison) instead
            of copying them to the host.
        decode: greedy-decode this many tokens from the run's final KV cache after the capture
            (``meta["decode_tokens"]``); the hooks are removed by then, and the ``kv_cache``
            points are read before decoding extends the cache.
        kernels: record which kernels each capture point's module ran (``calls[k]["kernels"]``,
            :mod:`tracer.execute.kernels`); the run executes under ``torch.profiler``.
        sdpa_inputs: keep the attention cores' SDPA inputs (queries of the compared window, mask
            rows, scale) in ``extras["sdpa"]`` for the float64 replay (:mod:`tracer.execute.sdpa_inputs`).

    Returns:
        a :class:`RunRecord` whose captures hold ``(stop - start, *feature)`` tensors on the CPU
        in the model's dtype (``kv_cache`` points: all positions), with wall time and GEMM M
        per chunk in ``meta``. With ``keep_on_device`` on a GPU the wall time is measured with
        CUDA events and ``meta["wall_s"]`` is None until :func:`tracer.execute.records.settle_wall`.

    Raises:
        TracerError: the plan does not cover the prompt, or ``decode < 0``.
    """
    if decode < 0:
        raise TracerError(f"--decode {decode} is negative; give a number of tokens to generate (0 = off)")
    n = len(token_ids)
    if plan.n_tokens != n:
        raise TracerError(f"run plan {plan.name} covers {plan.n_tokens} tokens but the prompt has {n}")
    device = model_device(model)
    if plan.cuda_graph:
        from tracer.execute.graphs import check_graph_device, check_graph_plan

        check_graph_device(device, f"run plan {plan.name} (CUDA-graph replay)")
        check_graph_plan(plan, kernels=kernels, sdpa_inputs=sdpa_inputs)
        keep_on_device = True  # the capture copies are nodes of the graph: they land on the GPU
    ids = torch.tensor([token_ids], dtype=torch.long)  # (1, N)
    # a GPU gets them from pinned memory without blocking: a copy from pageable memory would wait
    # for every kernel queued before it (run A's, when run B starts)
    ids = ids.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else ids.to(device)
    # on a GPU with the captures kept there, the run's time comes from CUDA events, so the host
    # never waits for the GPU between the runs (the next run's launches overlap this one's tail)
    events = keep_on_device and device.type == "cuda" and not plan.devices and not kernels
    if events:
        start_event = torch.cuda.Event(enable_timing=True)
        start_event.record()
    else:
        _sync(device)
    t0 = time.perf_counter()
    generated = None
    tokens = None
    with torch.inference_mode(), compiler_warnings(plan.compile) as warned:
        # eager plans: the hooks as forward wrappers (no torch.compile traces them; PyTorch's fast call path);
        # not while kernels are recorded per module (the capture's copies would count as the module's kernels).
        # The plan's changes first: simulated TP sets the row-parallel Linears' forward on the instance, which
        # would replace a wrapper installed before it (those points captured empty); after it, the wrapper wraps it
        with plan_context(model, plan) as fn, \
                Capture(model, points, window, keep_on_device=keep_on_device, wrap_forward=not (plan.compile or kernels)) as cap:
            with KernelRecorder(model, points, cap) if kernels else contextlib.nullcontext() as recorder, \
                    SdpaRecorder(model, points, cap) if sdpa_inputs else contextlib.nullcontext() as sdpa:
                moves: list[Any] = []
                out = forward_chunks(model, ids, plan, cap, fn, kv_moves=moves)
                if output_cache(out) is not None:
                    b = plan.batch
                    cap.add_cache(output_cache(out), row=b.row if b is not None else 0,
                                  col=b.width - n if b is not None and b.padding == "left" else 0)
                if plan.generate:
                    generated = greedy(model, ids, out, plan.generate, recompute=plan.recompute, capture=cap)
            if events:
                end_event = torch.cuda.Event(enable_timing=True)
                end_event.record()
                wall = None  # settle_wall() reads the events
            else:
                _sync(model_device(model))
                wall = time.perf_counter() - t0
            if decode:  # replay: greedy continuation of the final KV cache, not captured
                tokens = greedy(model, ids, out, decode)
    info = {"wall_s": wall, "device": ",".join(plan.devices) if plan.devices else str(device),
            "gemm_m": plan.gemm_m()}
    if moves:  # the KV contracts of a cache moved to another device, beside the run (prefill-decode's key)
        from tracer.load.kv_contract import KvTransfer

        info["kv_transfer"] = KvTransfer(role="moved", transferred=moves[-1].producer.positions[1],
                                         boundary=moves[-1].boundary, contract=moves[-1]).to_dict()
    if warned:
        info["compiler_warnings"] = warned
    if generated is not None:
        info["generated"] = generated
    if tokens is not None:
        info["decode_tokens"] = tokens
    info.update(meta or {})
    captures = cap.records()
    if recorder is not None:
        recorder.attach(captures)
        info["kernels"] = "recorded"
    extras: dict[str, Any] = {"sdpa": sdpa.calls} if sdpa is not None else {}
    if events:
        extras["wall_events"] = (start_event, end_event)
    return RunRecord(name=plan.name, token_ids=list(token_ids), plan=plan.to_dict(),
                     window=(int(window[0]), int(window[1])), captures=captures, meta=info, extras=extras)


def run_bare(loaded: LoadedModel, token_ids: list[int], scen: Scenario, *, extra: dict[str, Any] | None = None,
             on_output: Callable[[int, int, int, Any], None] | None = None,
             wrap: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None) -> None:
    """Both plans of ``scen`` with no hooks and no comparison: the floor ``tracer bench`` measures
    tracer against (mode a).

    The bench's peers (:mod:`tracer.loops.peers`) run the same plans, calling the model the same
    way (the same chunks, the same KV cache), through these arguments:

    Args:
        extra: more keyword arguments for every model call (``output_hidden_states=True``).
        on_output: ``on_output(plan_index, start, stop, output)`` after each chunk (plan A is 0).
        wrap: ``wrap(fn)`` returns the callable to call instead of the plan's model (nnsight).
    """
    ids = torch.tensor([token_ids], device=model_device(loaded.model))  # (1, N)
    with torch.inference_mode():
        for i, plan in enumerate((scen.plan_a, scen.plan_b)):
            with plan_context(loaded.model, plan) as fn:
                each = None if on_output is None else (lambda s, e, out, i=i: on_output(i, s, e, out))
                forward_chunks(loaded.model, ids, plan, None, fn if wrap is None else wrap(fn), extra=extra,
                               on_output=each, compiled=fn is not loaded.model)


def execute_loaded(loaded: LoadedModel, token_ids: list[int], plan: RunPlan, points: list[CapturePoint],
                   window: tuple[int, int], *, say: Callable[[str], None] | None = None,
                   **options: Any) -> tuple[RunRecord, None]:
    """The ``hf`` executor of :mod:`tracer.engines.door`: :func:`execute` on ``loaded.model``
    (``options`` as there); no partials."""
    return execute(loaded.model, token_ids, plan, points, window, **options), None
