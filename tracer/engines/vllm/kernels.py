"""``--kernels`` inside vLLM: which kernels each vLLM module ran for the traced rows, per step.

The HF path's recorder (:class:`tracer.execute.kernels.KernelRecorder`: a ``torch.profiler``
session, one ``record_function`` range per firing of a hooked module, the capture's own copies
left out) on vLLM's modules: the modules :class:`~tracer.engines.vllm.capture.VllmCapture` hooks,
ranges opened only in steps that compute traced positions (the capture's ``_call``). Every HF
point gets the kernels of the vLLM module it was mapped from (a fused ``qkv_proj``'s GEMM for each
of q, k and v), call by call (one call per step). On a GPU the device kernels are named (cuBLASLt's
``nvjet`` tiles and split-K, vLLM's Triton attention); on the CPU the ops (vLLM's ``_C::onednn_mm``).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

from tracer.execute.kernels import KernelRecorder
from tracer.execute.kinds import PointKind


class VllmKernelRecorder(KernelRecorder):
    """:class:`~tracer.execute.kernels.KernelRecorder` on vLLM modules.

    Args:
        model: vLLM's ``nn.Module``.
        modules: the vLLM module paths to record (the capture's hooked modules).
        capture: the entered :class:`~tracer.engines.vllm.capture.VllmCapture` (its ``_call``
            says whether the current step computes traced positions, and which).

    Enter it after the capture. vLLM's custom ops (``_C::onednn_mm``, ``vllm::unified_attention``)
    count as ops like aten's compute ops (on the CPU they are the GEMM and attention kernels).
    """

    custom_ops = re.compile(r"^(_C|_C_cache_ops|_C_custom_ar|_moe_C|_rocm_C|_vllm_fa\d_C|vllm|sgl_kernel)::")

    def __init__(self, model: Any, modules: list[str], capture: Any) -> None:
        super().__init__(model, [], capture)
        self.modules = list(modules)
        self._firings = {m: [] for m in self.modules}

    def attach_vllm(self, records: dict[str, Any], capture: Any) -> None:
        """Add ``kernels`` to every call of every record (in place; copies the call dicts): a
        point's k-th call gets the firing of its source module with the same positions."""
        for name, rec in records.items():
            if rec.kind == PointKind.KV_CACHE:
                continue
            rec.calls = self.calls_with_kernels(rec.calls, capture.sources.get(name, ("",))[0])


@contextlib.contextmanager
def recorder(engine: Any, capture: Any, kernels: bool) -> Iterator[VllmKernelRecorder | None]:
    """A :class:`VllmKernelRecorder` on ``engine``'s model for the block (None when ``kernels`` is off)."""
    if not kernels:
        yield None
        return
    with VllmKernelRecorder(engine.model, capture.hooked(), capture) as rec:
        yield rec


__all__ = ["VllmKernelRecorder", "recorder"]
