"""Dtype, device and attention-implementation resolution, and device maps (accelerate dispatch).

The option checks here are cheap and run before any model loads (the CLI and
:func:`tracer.validate.validate` call them); :func:`dispatch` spreads a CPU-loaded model over devices.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import weakref
from typing import Any

import torch

from tracer import dtypes
from tracer.errors import TracerError, option
from tracer.load.preflight import AUTO_MAPS, ATTN_IMPLEMENTATIONS, attn_choices, check_attn, device_map_form  # noqa: F401 - re-exported


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/... (or a ``torch.dtype`` of :data:`tracer.dtypes.DTYPES`) → ``torch.dtype``.

    Raises:
        TracerError: unknown name, listing the valid ones.
    """
    return dtypes.resolve(name)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the canonical names of :data:`tracer.dtypes.DTYPES`)."""
    return dtypes.name_of(dtype)


def resolve_device(name: str | None) -> str:
    """Validate a device string: ``cpu``, ``cuda``, ``cuda:N``, ``mps``; None → cuda if available else cpu.

    Returns the device string unchanged (``"cuda"`` stays ``"cuda"``).

    Raises:
        TracerError: malformed name, CUDA/MPS requested but unavailable, or ``cuda:N`` out of range.
    """
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    dev = name.strip().lower()
    if dev == "cpu":
        return dev
    if dev == "cuda" or dev.startswith("cuda:"):
        index = dev.partition(":")[2]
        if dev != "cuda" and not index.isdigit():
            raise TracerError(f"unknown device {name!r}; valid: cpu, cuda, cuda:N, mps")
        if not torch.cuda.is_available():
            raise TracerError(f"CUDA was requested but torch.cuda.is_available() is False; use {option('device', 'cpu')}")
        if index and int(index) >= torch.cuda.device_count():
            raise TracerError(
                f"device {name!r} does not exist: {torch.cuda.device_count()} CUDA device(s) visible; "
                f"use cuda:0..cuda:{torch.cuda.device_count() - 1}"
            )
        return dev
    if dev == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise TracerError(f"MPS was requested but torch.backends.mps.is_available() is False; use {option('device', 'cpu')}")
        return dev
    raise TracerError(f"unknown device {name!r}; valid: cpu, cuda, cuda:N, mps")


def dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``dtype=`` for transformers ≥ 4.56, ``torch_dtype=`` before."""
    import transformers
    from packaging.version import Version

    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {key: dtype}


def cast_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters and persistent buffers to ``dtype`` in place, leaving non-persistent
    buffers alone (their dtype and values are kept).

    This matches ``from_pretrained(dtype=...)``, which keeps e.g. ``rotary_emb.inv_freq`` in
    float32; a plain ``model.to(dtype)`` would round it (recorded as ``cast_after_load`` in the
    header's numeric contract, :mod:`tracer.load.contract`).
    """
    keep = [
        (mod, bname, buf)
        for mod in model.modules()
        for bname, buf in mod._buffers.items()
        if buf is not None and bname in mod._non_persistent_buffers_set
    ]
    model.to(dtype)
    for mod, bname, buf in keep:
        mod._buffers[bname] = buf


def model_device(model: Any) -> torch.device:
    """The device of the model's input embedding (where ``input_ids`` must go): its weight's
    device, or, for a module accelerate offloaded (weight on ``meta``), its execution device."""
    emb = model.get_input_embeddings()
    if emb.weight.device.type == "meta":
        hook = getattr(emb, "_hf_hook", None)
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    return emb.weight.device



def parse_device_map(device_map: str | dict[str, Any]) -> str | dict[str, str]:
    """``auto``-style names as they are; a dict or JSON object → ``{module: device}`` (validated).

    Raises:
        TracerError: not a known name, bad JSON, or an unknown device in the map.
    """
    device_map = device_map_form(device_map)
    if isinstance(device_map, str):
        return device_map
    out = {}
    for module, where in device_map.items():
        where = str(where) if not isinstance(where, int) else f"cuda:{where}"
        if where != "disk":
            where = resolve_device(where)
        out[str(module)] = where
    return out


def parse_max_memory(max_memory: str | dict[Any, str] | None) -> dict[Any, str] | None:
    """``"0=20GiB,cpu=64GiB"`` → ``{0: "20GiB", "cpu": "64GiB"}`` (dicts pass through).

    Raises:
        TracerError: a malformed entry.
    """
    if max_memory is None or isinstance(max_memory, dict):
        return max_memory
    out: dict[Any, str] = {}
    for part in filter(None, (p.strip() for p in max_memory.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().removeprefix("cuda:")
        if not sep or not value.strip() or not (key.isdigit() or key in ("cpu", "disk")):
            raise TracerError(f"--max-memory entry {part!r} is not DEVICE=SIZE; write e.g. 0=20GiB,cpu=64GiB")
        if not re.fullmatch(r"\d+(\.\d+)?\s*([KMGT]i?B|B)?", value.strip(), flags=re.IGNORECASE):
            raise TracerError(f"--max-memory size {value.strip()!r} is not a size like 600MiB or 20GiB")
        if key.isdigit() and int(key) >= torch.cuda.device_count():
            raise TracerError(f"--max-memory names GPU {key}, but {torch.cuda.device_count()} CUDA device(s) are "
                              "visible; budget cpu= (and disk=) only, or run on a machine with that GPU")
        out[int(key) if key.isdigit() else key] = value.strip()
    return out


def dispatch(model: Any, device_map: str | dict[str, str], max_memory: dict[Any, str] | None) -> dict[str, str]:
    """Dispatch a CPU-loaded model over devices with accelerate (see :func:`tracer.load.models.load_model`);
    returns the map applied, ``{module path: device}``.

    Raises:
        TracerError: accelerate is missing, or the map does not cover the model.
    """
    try:
        from accelerate import dispatch_model, infer_auto_device_map
    except ImportError:
        raise TracerError("--device-map needs accelerate: pip install accelerate") from None
    if isinstance(device_map, str):
        kwargs: dict[str, Any] = {"no_split_module_classes": list(getattr(model, "_no_split_modules", None) or [])}
        if max_memory is not None:
            kwargs["max_memory"] = max_memory
        elif device_map != "sequential":
            from accelerate.utils import get_balanced_memory

            kwargs["max_memory"] = get_balanced_memory(model, low_zero=device_map == "balanced_low_0", **kwargs)
        device_map = {k: (f"cuda:{v}" if isinstance(v, int) else str(v))
                      for k, v in infer_auto_device_map(model, **kwargs).items()}
    gpus = [d for d in device_map.values() if d.startswith("cuda")]
    if set(device_map.values()) == {"disk"}:
        raise TracerError("--device-map puts the whole model on disk; keep at least the embedding on a GPU or the CPU")
    offload_dir = None
    if "disk" in device_map.values():
        offload_dir = tempfile.mkdtemp(prefix="tracer-offload-")
        weakref.finalize(model, shutil.rmtree, offload_dir, True)  # the offloaded weights go with the model
    try:
        dispatch_model(model, device_map=device_map, main_device=gpus[0] if gpus else "cpu",
                       offload_dir=offload_dir)
    except (ValueError, KeyError, RuntimeError, OSError, AssertionError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TracerError(f"--device-map could not be applied ({msg[:160]}); the map must place every "
                          "module of the model, e.g. --device-map auto") from None
    return dict(device_map)


def loaded_clash(info: Any, options: dict[str, Any]) -> str | None:
    """The first model option that contradicts a loaded model (``dtype="float32"`` on a bf16 model), or None."""
    for key in ("gguf", "device_map", "max_memory"):
        if options.get(key) is not None:
            return f"{key}={options[key]!r}"
    if options.get("dtype") is not None and dtype_name(resolve_dtype(options["dtype"])) != info.dtype:
        return f"dtype={options['dtype']!r} (the model is {info.dtype})"
    if options.get("device") is not None and not same_device(resolve_device(options["device"]), info.device):
        return f"device={options['device']!r} (the model is on {info.device})"
    if options.get("attn") is not None and options["attn"] != info.attn_implementation:
        return f"attn={options['attn']!r} (the model uses {info.attn_implementation})"
    return None


def same_device(a: str, b: str) -> bool:
    """``a`` and ``b`` name one device (``cuda`` = ``cuda:0``)."""
    da, db = torch.device(a), torch.device(b)
    return da.type == db.type and (da.index or 0) == (db.index or 0)
