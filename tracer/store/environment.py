"""The environment header of a trace: the numeric contract of the process that made it.

Store-layer module (nothing here touches HDF5): :func:`collect_environment` probes the versions,
flags, devices and instruction sets a bit-exact comparison depends on; :data:`VERSION_KEYS` and
:func:`version_differences` compare two headers (traces made on two machines), naming an
instruction-set difference as a likely cause (the CPU kernels dispatch on it).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
import platform
import shutil
import socket
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np
import torch

from tracer import schema
from tracer.execute.gemm import onednn_verbose
from tracer.store.formats import json_dumps


@dataclass(frozen=True)
class Environment(schema.Record):
    """What a bit-exact comparison depends on in the process that made the trace
    (:func:`tracer.store.environment.collect_environment`): versions, platform, host, CPU and its
    instruction sets, the device and its libraries, the TF32 / reduced-precision / deterministic
    flags, threads and matmul precision. None where not obtainable (every key is written)."""

    tracer_version: str | None = None
    python: str | None = None
    torch: str | None = None
    transformers: str | None = None
    numpy: str | None = None
    h5py: str | None = None
    platform: str | None = None
    hostname: str | None = None
    cpu: str | None = None
    device: str | None = None
    device_name: str | None = None
    device_capability: str | None = None
    device_sm_count: schema.Count | None = None
    cuda: str | None = None
    hip: str | None = None
    cudnn: int | str | None = None
    cublas: str | None = None
    driver: str | None = None
    cpu_capability: str | None = None
    onednn_isa: str | None = None
    cpu_isa_flags: tuple[str, ...] | None = None
    cpu_isa_env: dict[str, str] | None = None
    matmul_allow_tf32: bool | None = None
    matmul_allow_bf16_reduced_precision_reduction: bool | None = None
    matmul_allow_fp16_reduced_precision_reduction: bool | None = None
    cudnn_allow_tf32: bool | None = None
    cudnn_deterministic: bool | None = None
    cudnn_benchmark: bool | None = None
    deterministic_algorithms: bool | None = None
    deterministic_algorithms_warn_only: bool | None = None
    CUBLAS_WORKSPACE_CONFIG: str | None = None
    num_threads: schema.Count | None = None
    float32_matmul_precision: str | None = None
    matmul_fp32_precision: str | None = None
    cudnn_conv_fp32_precision: str | None = None
    cudnn_rnn_fp32_precision: str | None = None


@functools.lru_cache(maxsize=None)  # a process-wide fact: look it up once
def tool_version() -> str:
    """tracer's version: installed metadata, else the checkout's pyproject.toml, else 'unknown'."""
    try:
        return importlib.metadata.version("tracer")
    except importlib.metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        for line in pyproject.read_text().splitlines():
            if line.strip().startswith("version"):
                return line.split("=", 1)[1].strip().strip("\"'")
    except OSError:
        pass
    return "unknown"


@functools.lru_cache(maxsize=None)  # a process-wide fact: look it up once (importlib.metadata is slow)
def _dist_version(name: str) -> str | None:
    """Installed version of a distribution without importing it (None if absent)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)  # a process-wide fact: look it up once
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: the CPU's SIMD features the kernels dispatch on (a subset of /proc/cpuinfo's flags)
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "asimd", "sve", "sve2")
#: environment variables that cap the instruction set ATen and oneDNN dispatch to
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


@functools.lru_cache(maxsize=None)  # a process-wide fact: look it up once
def cpu_isa_flags() -> list[str] | None:
    """The :data:`SIMD_FLAGS` this CPU has (Linux ``/proc/cpuinfo``; arm64's ``Features``), None elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [x for x in SIMD_FLAGS if x in have]
    except OSError:
        pass
    return None


@functools.lru_cache(maxsize=None)  # oneDNN says it once per process
def onednn_isa() -> str | None:
    """The instruction set oneDNN dispatches to on this CPU (``Intel AVX-512 with Intel DL Boost and
    bfloat16 support``), as its verbose mode reports it, or None (no oneDNN, or it was already said).

    oneDNN prints its ISA on stdout (C level) with the first primitive run under verbose mode; one
    reorder of a 64×64 float32 tensor into oneDNN's layout and back (a primitive on every x86 CPU;
    a bf16 matmul runs in oneDNN only where the CPU has AVX-512, so on an AVX2 machine it said
    nothing) is run with file descriptor 1 redirected to a temporary file.
    """
    if not torch.backends.mkldnn.is_available():
        return None
    text = onednn_verbose(lambda: torch.ones(64, 64).to_mkldnn().to_dense()) or ""
    return next((line.split(",isa:", 1)[1].strip() for line in text.splitlines() if ",isa:" in line), None)


@functools.lru_cache(maxsize=None)  # a process-wide fact: look it up once
def _cublas_version() -> str | None:
    """cuBLAS version from the libcublas already loaded by torch (``cublasGetProperty``), or None."""
    try:
        path = None
        with open("/proc/self/maps") as f:
            for line in f:
                if "libcublas.so" in line:
                    path = line.split()[-1]
                    break
        if path is None:
            return None
        lib = ctypes.CDLL(path)
        parts = []
        for prop in (0, 1, 2):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
            value = ctypes.c_int()
            if lib.cublasGetProperty(prop, ctypes.byref(value)) != 0:
                return None
            parts.append(str(value.value))
        return ".".join(parts)
    except Exception:  # noqa: BLE001 - optional fact: any failure means "not obtainable"
        return None


@functools.lru_cache(maxsize=None)  # a process-wide fact: look it up once
def _nvidia_driver(index: int) -> str | None:
    """Driver version from nvidia-smi when it is on PATH and answers within 5 s, else None."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version", "--format=csv,noheader", f"--id={index}"],
            capture_output=True, text=True, timeout=5, check=True,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _flag(read: Callable[[], Any]) -> bool | None:
    """A legacy torch precision flag as a bool: torch >= 2.10 gives the reduced-precision ones as a
    tuple (allow, allow split-K), whose first item is the flag; None when torch refuses to say (a
    process that set cuDNN's conv and RNN TF32 flags apart through the new API, as an engine's
    batch-invariant mode does: the ``*_fp32_precision`` fields then say it)."""
    try:
        value = read()
    except RuntimeError:
        return None
    return bool(value[0]) if isinstance(value, tuple) else bool(value)


def collect_environment(device: str, extra: dict | None = None) -> dict[str, Any]:
    """The numeric contract of this process: what a bit-exact comparison depends on.

    Args:
        device: the device the runs execute on (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...).
        extra: run-level facts merged in last (model name and weights hash, dtype, attention
            implementation, scenario, block size, split points, ...); its keys win.

    Returns:
        a flat JSON-able dict: versions (python, torch, transformers, numpy, h5py, tracer),
        platform, hostname, CPU model, device name and compute capability, CUDA/HIP, cuDNN,
        cuBLAS and driver versions (None where not obtainable), the TF32 / reduced-precision /
        deterministic flags, ``CUBLAS_WORKSPACE_CONFIG``, thread count and float32 matmul
        precision. Nothing is initialised that the runs would not initialise anyway, except
        that a CUDA device is queried when ``device`` names one.

    Raises:
        TracerError: ``extra`` is not JSON-serialisable.
    """
    matmul = torch.backends.cuda.matmul
    env = replace(
        _static_environment(device),
        matmul_allow_tf32=_flag(lambda: matmul.allow_tf32),
        matmul_allow_bf16_reduced_precision_reduction=_flag(lambda: matmul.allow_bf16_reduced_precision_reduction),
        matmul_allow_fp16_reduced_precision_reduction=_flag(lambda: matmul.allow_fp16_reduced_precision_reduction),
        cudnn_allow_tf32=_flag(lambda: torch.backends.cudnn.allow_tf32),
        cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
        cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
        deterministic_algorithms=torch.are_deterministic_algorithms_enabled(),
        deterministic_algorithms_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
        CUBLAS_WORKSPACE_CONFIG=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        num_threads=torch.get_num_threads(),
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        matmul_fp32_precision=getattr(matmul, "fp32_precision", None),  # torch >= 2.9 API
        cudnn_conv_fp32_precision=getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision", None),
        cudnn_rnn_fp32_precision=getattr(getattr(torch.backends.cudnn, "rnn", None), "fp32_precision", None),
    ).to_dict()
    if extra:
        env.update(extra)
    json_dumps(env, "the environment header")
    return env


@functools.lru_cache(maxsize=16)  # process-wide facts: read once per device (platform() reads files)
def _static_environment(device: str) -> Environment:
    """The part of :func:`collect_environment` a process cannot change: versions, platform, host,
    CPU, the device's name, capability and libraries (the flags are read on every call)."""
    cpu = _cpu_model()
    dev = torch.device(device)
    gpu: dict[str, Any] = {"device_name": cpu if dev.type == "cpu" else None}
    if dev.type == "cuda" and torch.cuda.is_available():
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        gpu = {"device_name": props.name, "device_capability": f"{props.major}.{props.minor}",
               "device_sm_count": props.multi_processor_count, "cublas": _cublas_version(), "driver": _nvidia_driver(index)}
    return Environment(
        tracer_version=tool_version(), python=platform.python_version(),
        torch=str(torch.__version__),  # a str subclass (TorchVersion): h5py needs plain str
        transformers=_dist_version("transformers"), numpy=np.__version__, h5py=h5py.__version__,
        platform=platform.platform(), hostname=socket.gethostname(), cpu=cpu, device=device,
        cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None),
        cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        # the instruction sets the CPU kernels dispatch on: ATen's level, oneDNN's ISA, the CPU's flags
        cpu_capability=torch.backends.cpu.get_cpu_capability(), onednn_isa=onednn_isa(),
        cpu_isa_flags=tuple(cpu_isa_flags()) if cpu_isa_flags() is not None else None,
        cpu_isa_env={k: os.environ[k] for k in ISA_ENV if k in os.environ} or None, **gpu)


#: header keys naming a version of something the numbers depend on (compared across two traces)
VERSION_KEYS = ("tracer_version", "python", "torch", "transformers", "numpy", "h5py", "cuda", "hip", "cudnn", "cublas",
                "driver", "device_name", "cpu", "platform")


def version_differences(header_a: dict[str, Any], header_b: dict[str, Any]) -> list[str]:
    """``["torch 2.13.0+cpu (A) vs 2.11.0+cu130 (B)", ...]``: every :data:`VERSION_KEYS` entry
    whose value differs between two trace headers (a key missing on one side counts as differing)."""
    out = []
    for k in VERSION_KEYS:
        a, b = header_a.get(k), header_b.get(k)
        if a != b:
            out.append(f"{k} {a} (A) vs {b} (B)")
    return out


#: header keys naming the instruction sets the kernels dispatch on: the CPU's (ATen's level,
#: oneDNN's ISA, the SIMD flags, caps set in the environment) and a GPU's compute capability
ISA_KEYS = ("cpu_capability", "onednn_isa", "cpu_isa_flags", "cpu_isa_env", "device_capability")


def isa_summary(header: dict[str, Any]) -> str | None:
    """The instruction set the kernels dispatched to, short, for a title line: ``AVX2`` (ATen's
    ``cpu_capability``, with oneDNN's ISA when it names another, and a cap set in the environment:
    ``DEFAULT, oneDNN SSE4.1; capped: ATEN_CPU_CAPABILITY=default, ONEDNN_MAX_CPU_ISA=SSE41``) or, on a
    GPU, ``sm 9.0, driver 580.159.04``; None for a header written before these were recorded."""
    device = str(header.get("device") or "")
    if device.startswith(("cuda", "hip")):
        cap, driver = header.get("device_capability"), header.get("driver")
        parts = [f"sm {cap}" if cap else "", f"driver {driver}" if driver else ""]
        return ", ".join(p for p in parts if p) or None
    cap, onednn = header.get("cpu_capability"), header.get("onednn_isa")
    if not isinstance(cap, str):
        return None
    text = cap
    short = onednn.removeprefix("Intel ").split(" (")[0] if isinstance(onednn, str) else None
    if short and short.replace("-", "").replace(".", "").upper() != cap.replace("-", "").replace(".", "").upper():
        text += f", oneDNN {short}"
    env = header.get("cpu_isa_env")
    if isinstance(env, dict) and env:
        text += "; capped: " + ", ".join(f"{k}={v}" for k, v in sorted(env.items()))
    return text


def isa_differences(header_a: dict[str, Any], header_b: dict[str, Any]) -> list[str]:
    """``["onednn_isa Intel AVX-512 ... (A) vs Intel AVX2 (B)", "cpu_isa_flags: only A has avx512f, ..."]``:
    every :data:`ISA_KEYS` entry that differs between two trace headers (a key missing on one side,
    from a trace written before it was recorded, is not compared). ``[]`` for a CPU's trace and a
    GPU's: their instruction sets are not the cause, the devices are (:func:`device_difference`)."""
    kinds = {_device_kind(h) for h in (header_a, header_b)}
    if len(kinds) == 2 and "" not in kinds and "cpu" in kinds:
        return []
    out = []
    for k in ISA_KEYS:
        if k not in header_a or k not in header_b or header_a[k] == header_b[k]:
            continue
        a, b = header_a[k], header_b[k]
        if isinstance(a, list) and isinstance(b, list):
            only_a, only_b = [x for x in a if x not in b], [x for x in b if x not in a]
            out.append(f"{k}: " + "; ".join(p for p in (f"only A has {', '.join(only_a)}" if only_a else "",
                                                          f"only B has {', '.join(only_b)}" if only_b else "") if p))
        else:
            out.append(f"{k} {a} (A) vs {b} (B)")
    return out


def _device_kind(header: dict[str, Any]) -> str:
    """``cpu``, ``cuda``, ... : the type of a header's ``device`` (``""`` when none is recorded)."""
    return str(header.get("device") or "").split(":")[0]


def _device_text(header: dict[str, Any]) -> str:
    """A device as a likely-cause line names it: ``cpu (AMD EPYC 7B13, AVX2)``, ``NVIDIA H200 (sm 9.0)``."""
    kind = _device_kind(header)
    if kind == "cpu":
        parts = [str(x) for x in (header.get("cpu") or header.get("device_name"), header.get("cpu_capability")) if x]
    else:
        cap = header.get("device_capability")
        return f"{header.get('device_name') or kind}" + (f" (sm {cap})" if cap else "")
    return kind + (f" ({', '.join(parts)})" if parts else "")


def device_difference(header_a: dict[str, Any], header_b: dict[str, Any]) -> str | None:
    """``"cpu (AMD EPYC 7B13, AVX2) (A) vs NVIDIA H200 (sm 9.0) (B)"``: two trace headers' devices
    when they are of different types (a CPU and a GPU) or different GPU models; None for two CPUs
    (their instruction sets: :func:`isa_differences`), one GPU model, or a header without a device."""
    kind_a, kind_b = _device_kind(header_a), _device_kind(header_b)
    if not kind_a or not kind_b or kind_a == kind_b == "cpu":
        return None
    if kind_a == kind_b and header_a.get("device_name") == header_b.get("device_name"):
        return None
    return f"{_device_text(header_a)} (A) vs {_device_text(header_b)} (B)"
