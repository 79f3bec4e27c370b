"""Which library runs torch's GEMMs on a device (cuBLAS, oneDNN, MKL, ATen's own CPU GEMM), as
engine facts name it, and what oneDNN's verbose mode says while some work runs (its ISA line:
:mod:`tracer.store.environment`). Leaf module: torch only."""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import torch


def onednn_verbose(work: Any) -> str | None:
    """What oneDNN's verbose mode prints (on stdout, at the C level) while ``work()`` runs: file
    descriptor 1 is redirected to a temporary file meanwhile. None when it cannot be read."""
    import tempfile

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with tempfile.TemporaryFile() as tmp:
            os.dup2(tmp.fileno(), 1)
            try:
                with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                    work()
            finally:
                os.dup2(saved, 1)
            tmp.seek(0)
            return tmp.read().decode("utf-8", "replace")
    except (OSError, RuntimeError):
        return None
    finally:
        os.close(saved)


@functools.lru_cache(maxsize=None)  # a process-wide fact: look it up once per device and dtype
def torch_gemm(device: str, dtype: str) -> str:
    """The library that runs torch's GEMMs (``F.linear``: ``aten::mm``/``addmm``) for ``dtype`` on ``device``,
    determined where it can be: on CUDA/ROCm torch's preferred BLAS (``torch F.linear on cuBLAS``); on the
    CPU, oneDNN when its verbose mode shows a primitive running a small ``F.linear`` (``torch F.linear on
    oneDNN gemm_api (avx512_core_bf16)``), else the BLAS torch was built with for float32/float64
    (``torch F.linear on MKL sgemm``, from ``torch.__config__.show()``), else ATen's own CPU GEMM
    (bf16/fp16 where oneDNN does not take them: ``torch F.linear on ATen's CPU GEMM (AVX2)``).

    Args:
        device: ``cpu``, ``cuda``, ``cuda:1``, ... dtype: ``bfloat16``, ``float32``, ...
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        try:
            lib = torch.backends.cuda.preferred_blas_library().name
        except (AttributeError, RuntimeError):  # an older torch
            lib = "Cublas"
        name = {"Cublas": "hipBLAS" if torch.version.hip else "cuBLAS",
                "Cublaslt": "hipBLASLt" if torch.version.hip else "cuBLASLt", "Ck": "CK"}.get(lib, lib)
        return f"torch F.linear on {name}"
    if dev.type != "cpu":
        return f"torch F.linear on the {dev.type} backend's GEMM"
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        return "torch F.linear"
    text = ""
    if torch.backends.mkldnn.is_available():
        x, w = torch.ones(32, 256, dtype=dt), torch.ones(256, 256, dtype=dt)
        text = onednn_verbose(lambda: torch.nn.functional.linear(x, w)) or ""
    ran = [line.split(",") for line in text.splitlines() if ",exec,cpu," in line]
    if ran:  # onednn_verbose,<ts>,primitive,exec,cpu,<kind>,<implementation>,...
        f = ran[0]
        i = f.index("cpu")
        kind, impl = (f[i + 1], f[i + 2]) if len(f) > i + 2 else (f[-1], "")
        return f"torch F.linear on oneDNN {kind}" + (f" ({impl})" if impl else "")
    if dt in (torch.float32, torch.float64):
        config = torch.__config__.show()
        blas = next((b for k, b in (("BLAS_INFO=mkl", "MKL"), ("BLAS_INFO=open", "OpenBLAS"),
                                    ("BLAS_INFO=accelerate", "Accelerate"), ("BLAS_INFO=", "BLAS")) if k in config), None)
        if blas is not None:
            return f"torch F.linear on {blas} {'s' if dt == torch.float32 else 'd'}gemm"
    return f"torch F.linear on ATen's CPU GEMM ({torch.backends.cpu.get_cpu_capability()})"


__all__ = ["onednn_verbose", "torch_gemm"]
