"""What a run plan changes about the HF model for its forward passes, undone on exit.

:func:`plan_context` applies a plan's settings (attention implementation, simulated tensor
parallelism, deterministic mode, devices, ``torch.compile``) for one block and restores the model
afterwards; :func:`deterministic_mode` and :func:`attn_implementation` are its parts;
:func:`compiler_warnings` keeps a compiled run's Python warnings for the report.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

import torch
from torch import nn

from tracer.errors import TracerError
from tracer.execute.tp_sim import simulate_tp
from tracer.load.devices import model_device
from tracer.plan.scenarios import RunPlan


@contextlib.contextmanager
def deterministic_mode() -> Iterator[None]:
    """torch deterministic algorithms (warn-only: an op without a deterministic kernel warns instead
    of failing), ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, TF32 off, cuDNN deterministic and not
    benchmarking; everything restored on exit. cuBLAS reads the workspace variable when it
    creates a handle, so it fully applies only to a process that had not used cuBLAS before."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             os.environ.get("CUBLAS_WORKSPACE_CONFIG"), torch.get_float32_matmul_precision(),
             torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    # torch >= 2.9: setting the precisions above also sets these ("none" becomes "ieee"): put them back too,
    # or the next trace header of this process reads another numeric contract
    backends = [b for b in (torch.backends.cuda.matmul, getattr(torch.backends.mkldnn, "matmul", None))
                if b is not None and hasattr(b, "fp32_precision")]
    precisions = [(b, b.fp32_precision) for b in backends]
    try:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True, False
        yield
    finally:
        det, warn, ws, prec, tf32, cdet, bench = saved
        torch.use_deterministic_algorithms(det, warn_only=warn)
        if ws is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ws
        torch.set_float32_matmul_precision(prec)
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = tf32, cdet, bench
        for backend, value in precisions:
            backend.fp32_precision = value


@contextlib.contextmanager
def attn_implementation(model: nn.Module, name: str | None) -> Iterator[None]:
    """Switch the model's attention implementation (``eager``/``sdpa``/``flash_attention_2``) for the block."""
    cfg = getattr(model, "config", None)
    before = getattr(cfg, "_attn_implementation", None)
    if name is None or name == before:
        yield
        return

    def set_(impl: str) -> None:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(impl)
        else:  # pragma: no cover - older transformers
            cfg._attn_implementation = impl

    try:
        set_(name)
    except (ValueError, ImportError) as e:
        raise TracerError(f"attention implementation {name!r} is not available here ({str(e).splitlines()[0]}); "
                          "choose eager or sdpa") from None
    try:
        yield
    finally:
        set_(before)


@contextlib.contextmanager
def plan_context(model: nn.Module, plan: RunPlan) -> Iterator[Callable[..., Any]]:
    """Everything a plan changes about the model, undone on exit: attention implementation,
    simulated TP, deterministic mode, device. Yields the callable to run (``torch.compile``-d
    when ``plan.compile``)."""
    home = model_device(model)
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: model.to(home) if model_device(model) != home else None)
        if plan.deterministic:
            stack.enter_context(deterministic_mode())
        stack.enter_context(attn_implementation(model, plan.attn))
        if plan.tp is not None and plan.tp.mode == "distributed":
            raise TracerError(f"run plan {plan.name} is sharded over processes (--tp-mode distributed); "
                              "execute it with tracer.engines.door.execute_plan, not in one process")
        if plan.tp is not None:
            stack.enter_context(simulate_tp(model, plan.tp.k, plan.tp.reduce, plan.tp.dtype))
        fn = model
        if plan.compile:
            try:
                fn = torch.compile(model)
            except Exception as e:  # noqa: BLE001 - any failure means "unavailable here"
                raise TracerError(f"torch.compile is not available here ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}); skip the compile scenario") from None
        yield fn


@contextlib.contextmanager
def compiler_warnings(on: bool) -> Iterator[list[str]]:
    """With ``on`` (a ``torch.compile`` run), the Python warnings raised inside the block (Dynamo's
    "does not know how to trace" and the like) kept from stderr: yields a list that gets, at the
    end of the block, each distinct warning as ``"Category: first line"``, for the run's
    ``meta["compiler_warnings"]`` (a note of the report, :func:`tracer.diff.facts.run_facts`)."""
    import warnings

    got: list[str] = []
    if not on:
        yield got
        return
    with warnings.catch_warnings(record=True) as caught:  # the filters in force decide what is a warning
        try:
            yield got
        finally:
            lines = (f"{w.category.__name__}: {str(w.message).strip().splitlines()[0] if str(w.message).strip() else ''}"
                     for w in caught)
            got.extend(dict.fromkeys(lines))


__all__ = ["deterministic_mode", "attn_implementation", "plan_context", "compiler_warnings"]
