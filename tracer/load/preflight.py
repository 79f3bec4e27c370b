"""What can be checked about a model, its device and attention before torch or transformers load.

A typo costs a second, not the import of torch (several seconds) and a model load: the model
name is resolved against the built-in recipes, the file system and the local Hugging Face cache
(with "did you mean" for a near-miss of a recipe, and no download hint for it); a device string
is parsed, and a CUDA device refused on a torch build without CUDA (read from the installed
package's version, ``2.13.0+cpu``) or with no GPU visible; the attention implementation is one
this machine has. What needs torch (a CUDA device index, MPS) is left to
:func:`tracer.load.devices.resolve_device`.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Any

from tracer.errors import TracerError, did_you_mean, option

#: attention implementations always accepted; "flash_attention_2" too when flash_attn is importable
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
_DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")


def _hf_cached(name: str) -> bool:
    """``name`` is an HF model id with a ``config.json`` in the local Hugging Face cache."""
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name):
        return False
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # noqa: BLE001 - an id huggingface_hub refuses is not in the cache
        return False


def check_model(name: str, gguf: str | None = None) -> None:
    """Refuse a model name that names nothing this machine has: not a built-in recipe, not a GGUF
    file, not a directory with ``config.json``, not an HF id in the local cache.

    Raises:
        TracerError: with "did you mean" for a near-miss of a recipe name (and then no download
            hint), or the ways to get the model; a ``--gguf`` that is not a file.
    """
    from tracer.files import check_gguf_file
    from tracer.load.recipes import recipes

    table = recipes(using=name)  # a broken recipe file is this model's error only if it is this recipe
    if gguf is not None and not str(gguf).strip():
        raise TracerError("--gguf is empty; give the GGUF file's path, or leave it out for the package's copy")
    if gguf is not None:
        if not Path(gguf).expanduser().is_file():
            raise TracerError(f"--gguf names {gguf!r}, which is not a file; give the GGUF file's path")
        check_gguf_file(Path(gguf).expanduser(), "--gguf")
    if name in table:
        return
    path = Path(name).expanduser()
    if name.lower().endswith(".gguf"):
        if not path.exists():
            raise TracerError(f"GGUF file {name!r} does not exist; check the path")
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TracerError(f"directory {name!r} has no config.json; pass a directory written by save_pretrained")
        return
    if _hf_cached(name):
        return
    if path.is_file() and path.suffix.lower() in (".h5", ".hdf5"):  # a trace given where a model goes
        raise TracerError(f"{name!r} is a file, not a model: to read a trace use 'tracer compare {name}' or "
                          f"'tracer show {name}'; to run, give a model ('tracer models' lists them)")
    guess = did_you_mean(name, list(table))
    if guess is not None:
        raise TracerError(f"model {name!r} is not a built-in recipe; did you mean {guess}? (see 'tracer models')")
    raise TracerError(f"model {name!r} is not a built-in recipe (see 'tracer models') and is not in the local "
                      f"Hugging Face cache or a local directory; download it where the hub is reachable "
                      f"(hf download {name}) or pass a directory")


def no_cuda_reason() -> str | None:
    """Why CUDA cannot be available, known without importing torch (None: torch must be asked)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        local = version("torch").partition("+")[2]
    except PackageNotFoundError:
        return None
    if local == "cpu":
        return "this torch build has no CUDA (torch " + version("torch") + ")"
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return "CUDA_VISIBLE_DEVICES hides every GPU"
    return None


def check_device(name: str | None) -> None:
    """Refuse a malformed device string, and a CUDA device where CUDA cannot be available.

    Raises:
        TracerError: unknown device name; CUDA requested on a machine without it.
    """
    if name is None:
        return
    dev = name.strip().lower()
    if not _DEVICE.match(dev):
        guess = "cuda" if dev.startswith(("gpu", "nvidia")) else did_you_mean(dev, ["cpu", "cuda", "mps"])
        raise TracerError(f"unknown device {name!r}; valid: cpu, cuda, cuda:N, mps"
                          + (f" (did you mean {guess}?)" if guess else ""))
    if dev.startswith("cuda"):
        why = no_cuda_reason()
        if why is not None:
            raise TracerError(f"CUDA was requested but {why}; use {option('device', 'cpu')}")


def attn_choices() -> tuple[str, ...]:
    """The attention implementations this machine runs: sdpa, eager, and flash_attention_2 where installed."""
    if importlib.util.find_spec("flash_attn") is not None:
        return (*ATTN_IMPLEMENTATIONS, "flash_attention_2")
    return ATTN_IMPLEMENTATIONS


def check_attn(name: str) -> str:
    """Validate an attention implementation name; returns it.

    ``sdpa`` and ``eager`` always; ``flash_attention_2`` only when ``flash_attn`` is importable.

    Raises:
        TracerError: unknown or unavailable implementation, listing the valid ones.
    """
    choices = attn_choices()
    if name not in choices:
        hint = "" if name != "flash_attention_2" else " (flash_attention_2 needs 'pip install flash-attn')"
        raise TracerError(f"unknown attention implementation {name!r}{hint}; valid: {', '.join(choices)}")
    return name


#: the device maps accelerate computes itself (``--device-map auto``)
AUTO_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def device_map_form(device_map: object) -> str | dict[Any, Any]:
    """A ``--device-map`` value in its form: one of :data:`AUTO_MAPS` (stripped), or a non-empty
    JSON object (a dict given as it is, a string parsed); its devices are resolved at load
    (:func:`tracer.load.devices.parse_device_map`).

    Raises:
        TracerError: neither a known name nor a non-empty JSON object.
    """
    import json

    if isinstance(device_map, str) and device_map.strip() in AUTO_MAPS:
        return device_map.strip()
    if isinstance(device_map, str):
        try:
            device_map = json.loads(device_map)
        except ValueError:
            raise TracerError(f"--device-map {device_map!r} is neither {', '.join(AUTO_MAPS)} nor a JSON object "
                              '{"module.path": "cuda:0" | "cpu" | "disk"}') from None
    if not isinstance(device_map, dict) or not device_map:
        raise TracerError('--device-map must be auto, balanced, sequential or a JSON object {"module.path": "cuda:0"}')
    return device_map


def check_device_map(device_map: object, max_memory: object, device: str | None) -> None:
    """Refuse a ``--device-map``/``--max-memory`` that cannot be right whatever the machine: both
    ``--device`` and a map, a budget without an automatic map, a map that is neither a known name nor
    a JSON object, a budget entry that is not DEVICE=SIZE (devices and sizes are checked at load).

    Raises:
        TracerError: one line naming the fix.
    """
    if device_map is None:
        if max_memory is not None:
            raise TracerError("--max-memory applies only with --device-map auto|balanced|sequential; add --device-map auto")
        return
    if device is not None:
        raise TracerError("give either --device or --device-map, not both (the map names the devices)")
    device_map_form(device_map)
    for part in filter(None, (p.strip() for p in max_memory.split(","))) if isinstance(max_memory, str) else ():
        key, sep, value = part.partition("=")
        key = key.strip().removeprefix("cuda:")
        if not sep or not value.strip() or not (key.isdigit() or key in ("cpu", "disk")):
            raise TracerError(f"--max-memory entry {part!r} is not DEVICE=SIZE; write e.g. 0=20GiB,cpu=64GiB")
        if not re.fullmatch(r"\d+(\.\d+)?\s*([KMGT]i?B|B)?", value.strip(), flags=re.IGNORECASE):
            raise TracerError(f"--max-memory size {value.strip()!r} is not a size like 600MiB or 20GiB")
