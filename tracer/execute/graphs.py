"""Capturing inside CUDA graphs: a plan's forward passes recorded once and replayed, with the capture
copies recorded into the graph.

Hooks run Python, and a CUDA-graph replay runs no Python: a hook that only fires at replay never
fires (SGLang #38439: "every module inside a captured region silently stops producing frames").
Here the hooks fire while the graph is *recorded*: each capture point's copy of its window
(:class:`tracer.execute.capture.Capture`, which copies instead of keeping a reference while a
stream captures) becomes a node of the graph, writing into a buffer that lives as long as the
capture does. Every replay then refreshes those buffers at the cost of a few copy kernels and no
host work.

:func:`graph_forward` runs a plan that way (``RunPlan.cuda_graph``): one eager warm-up of every
chunk on a side stream (hooks idle), then each chunk recorded into a CUDA graph of its own (one
memory pool, so a later chunk's graph reads the KV cache an earlier one wrote), then every graph
replayed in order. Anything that cannot be recorded (a host synchronisation in a hook or in the
model) is a one-line :class:`~tracer.errors.TracerError`, never an empty capture.

:func:`graph_chunks` is the bookkeeping of :func:`tracer.capture` around a recording: which of a
point's kept chunks belong to the graph (the recording's buffer), not to the eager forwards before it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from tracer.engines.table import is_reference
from tracer.errors import TracerError


def recording(t: torch.Tensor) -> bool:
    """Whether ``t`` is being made inside a CUDA-graph recording (its kernels are recorded, not run:
    its values exist only after a replay)."""
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def graph_chunks(name: str, chunks: list[torch.Tensor], recorded: list[bool], calls: list[dict[str, Any]],
                 calls_recorded: list[bool]) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """The kept chunks and calls of one capture point of a block that recorded CUDA graphs: when some
    were recorded into a graph, only those (the buffers every replay refreshes; the eager forwards
    before, such as PyTorch's warm-ups on a side stream, are not the graph's), else all of them.

    Raises:
        TracerError: the point was recorded in more than one forward: its value would be a copy of
            several buffers made before any replay (values no forward computed).
    """
    if not any(recorded):
        return chunks, calls
    kept = [c for c, r in zip(chunks, recorded) if r]
    if len(kept) > 1:
        raise TracerError(f"capture point {name} was recorded in {len(kept)} forwards inside CUDA graphs in one "
                          "capture block; its value must be the one buffer a replay refreshes: record one forward per "
                          "'with tracer.capture(..., cuda_graphs=True)' block")
    return kept, [c for c, r in zip(calls, calls_recorded) if r]


def check_graph_device(device: Any, what: str = "--cuda-graphs", fix: str = "drop --cuda-graphs or run on --device cuda") -> None:
    """Refuse CUDA-graph capture off a CUDA device (``what`` asked for it; ``fix`` says what to do).

    Raises:
        TracerError: ``device`` is not a CUDA device, or CUDA is unavailable.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise TracerError(f"{what} records the forward passes in CUDA graphs, which need a CUDA GPU; the model runs "
                          f"on {dev.type}: {fix}")


def check_graph_plan(plan: Any, *, kernels: bool = False, sdpa_inputs: bool = False) -> None:
    """Refuse a plan whose execution cannot be recorded in CUDA graphs.

    A graph replays fixed kernels on fixed buffers: a plan that changes the model or the KV cache
    between chunks on the host (a KV format applied between chunks, a device move, a padded batch
    built per chunk, torch.compile, simulated TP, generation, an RL step), or a recorder that
    synchronises with the host (``--kernels``, ``--op-replay``), cannot be replayed faithfully.

    Raises:
        TracerError: naming the first such feature.
    """
    why = None
    if plan.batch is not None:
        why = "a batch"
    elif plan.kv_transform is not None:
        why = f"a KV-cache format ({plan.kv_transform}) applied between chunks"
    elif plan.devices is not None:
        why = "chunks on several devices"
    elif plan.compile:
        why = "torch.compile"
    elif plan.tp is not None:
        why = "tensor parallelism"
    elif plan.generate or plan.rl is not None:
        why = "token-by-token generation"
    elif not is_reference(plan.engine):
        why = f"the {plan.engine} engine (which manages its own CUDA graphs)"
    elif kernels:
        why = "--kernels (torch.profiler cannot run inside a graph capture)"
    elif sdpa_inputs:
        why = "--op-replay (its recorder copies to the host)"
    if why is not None:
        raise TracerError(f"run plan {plan.name} cannot be recorded in CUDA graphs: it uses {why}; "
                          "drop --cuda-graphs or choose a scenario of plain forward passes (repeat, prefix-cache, "
                          "chunked-prefill, block-size, cuda-graph)")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def graph_forward(model: nn.Module, ids: torch.Tensor, plan: Any, capture: Any,
                  fn: Callable[..., Any], chunk_kwargs: Callable[[int, int, Any], dict[str, Any]]) -> Any:
    """Run the plan's chunks as CUDA-graph replays (see the module docstring); returns the last
    chunk's output (its tensors are the graph's static outputs, holding the replay's values).

    Args:
        model: the HF causal LM, on a CUDA device.
        ids: ``(1, N)`` int64 token ids on that device (the graphs read them in place).
        plan: a :class:`~tracer.plan.plans.RunPlan` that :func:`check_graph_plan` accepts.
        capture: the :class:`~tracer.execute.capture.Capture` (or None: bare replays).
        fn: the callable to run (the model).
        chunk_kwargs: ``(start, stop, cache) -> kwargs`` of one chunk's call.

    Raises:
        TracerError: a hook or an op of the model cannot be recorded in a CUDA graph.
    """
    from tracer.load.hf_cache import output_cache

    check_graph_plan(plan)
    side = torch.cuda.Stream(ids.device)
    side.wait_stream(torch.cuda.current_stream(ids.device))
    try:
        with torch.cuda.stream(side):  # warm-up: lazy initialisations happen outside the graph; hooks idle
            cache = None
            for start, stop in plan.chunks:
                cache = output_cache(fn(**chunk_kwargs(start, stop, cache)))
            del cache
        torch.cuda.current_stream(ids.device).wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        graphs, cache, out = [], None, None
        for start, stop in plan.chunks:
            graph = torch.cuda.CUDAGraph()
            kwargs = chunk_kwargs(start, stop, cache)
            # thread_local: the trace writer's thread may wait on events of the previous run meanwhile
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                with capture.forward_call(start, stop) if capture is not None else contextlib.nullcontext():
                    out = fn(**kwargs)
            graphs.append(graph)
            cache = output_cache(out)
    except TracerError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the recording is reported as one line
        raise TracerError(f"run plan {plan.name} cannot be recorded in a CUDA graph ({type(e).__name__}: "
                          f"{_first_line(e)}); something in the forward pass or a capture hook synchronises "
                          "with the host: drop --cuda-graphs") from None
    for graph in graphs:
        graph.replay()
    torch.cuda.current_stream(ids.device).synchronize()  # the graphs are freed on return: let their replays end
    return out
