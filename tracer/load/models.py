"""Resolve a model name to ``(model, tokenizer, ModelInfo)``: a recipe, an HF id, or a directory.

Four sources, tried in this order:

1. a built-in recipe from ``models/*.toml`` (see ``models/README.md``, :mod:`tracer.load.recipes`):
   ``kind = "gguf"`` (pretrained weights dequantized from a GGUF file and cached as a normal
   HF checkpoint, :mod:`tracer.load.gguf`) or ``kind = "random-init"`` (an HF config initialised
   from a seed, :mod:`tracer.load.random_init`);
2. a GGUF file given by path (``*.gguf``: any architecture transformers reads from GGUF, cached
   like a recipe's);
3. a local directory holding ``config.json`` (``save_pretrained`` output);
4. an HF model id already in the local Hugging Face cache (never downloaded: offline).

A folder or GGUF without a tokenizer loads with ``tokenizer=None`` and runs on token ids only.

Every loaded model is in eval mode, has ``requires_grad=False`` everywhere, sits on the
requested device in the requested dtype (:mod:`tracer.load.devices`), and runs the requested
attention implementation. Importing this module has no side effects (no global torch or
transformers state is changed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from tracer import schema
from tracer.errors import TracerError
from tracer.load.devices import (check_attn, dispatch, dtype_kwarg, dtype_name, model_device, parse_device_map,
                                 parse_max_memory, resolve_device, resolve_dtype)
from tracer.load.gguf import cached_checkpoint, check_architecture, file_digest, find_gguf, gguf_file_recipe
from tracer.load.offline import ensure_offline
from tracer.load.quiet import quiet_transformers, status
from tracer.load.random_init import random_init_model
from tracer.load.recipes import Recipe, recipes

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class ModelInfo(schema.Record):
    """What was loaded; goes into the trace header (its ``model``, this record's document; a header
    written by hand may give the name only, so every other field has a default).

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
        n_heads, n_kv_heads, head_dim: attention heads, key/value heads (query groups) and the
            head width, from the config (None where it does not say); an engine dump whose fused
            QKV interleaves query groups (Megatron) is split with them.
    """

    name: str
    source: str | None = None
    family: str | None = None
    dtype: str | None = None
    device: str | None = None
    attn_implementation: str | None = None
    weights_hash: str | None = None
    path: str | None = None
    n_layers: schema.Count | None = None
    hidden_size: schema.Count | None = None
    vocab_size: schema.Count | None = None
    device_map: dict[str, str] | str | None = None
    n_heads: schema.Count | None = None
    n_kv_heads: schema.Count | None = None
    head_dim: schema.Count | None = None


def model_argument(model: dict[str, Any]) -> str:
    """How to name a loaded model again on a command line, from its :meth:`ModelInfo.to_dict` (a trace
    header's ``model``): a recipe's name or an HF id as they are; a GGUF file given by path and a local
    folder by their absolute path (the name of a GGUF by path is its file's stem, which names nothing:
    ``tracer sweep SmolLM2-135M-Instruct.Q4_1`` would not run). Shell-quoted where needed."""
    import shlex

    name, source, path = str(model.get("name") or "MODEL"), model.get("source"), model.get("path")
    if isinstance(path, str) and path:
        by_path = source == "gguf" and path.lower().endswith(".gguf") and Path(path).stem == name
        folder = source == "hf" and "/models--" not in path.replace("\\", "/")  # not a snapshot of the HF cache
        if by_path or folder:
            return shlex.quote(path)
    return shlex.quote(name)


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
    return config.get__text_config() if hasattr(config, "get__text_config") else config


def _info(name: str, source: str, model: PreTrainedModel, dtype: torch.dtype, device: str, attn: str,
          weights_hash: str | None, path: str | None) -> ModelInfo:
    cfg = _text_config(model.config)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (int(cfg.hidden_size) // int(heads) if heads else None)
    return ModelInfo(
        name=name, source=source, family=str(model.config.model_type), dtype=dtype_name(dtype),
        device=device, attn_implementation=attn, weights_hash=weights_hash, path=path,
        n_layers=int(cfg.num_hidden_layers), hidden_size=int(cfg.hidden_size), vocab_size=int(cfg.vocab_size),
        n_heads=None if heads is None else int(heads), n_kv_heads=None if kv is None else int(kv),
        head_dim=None if head_dim is None else int(head_dim),
    )


def _load_gguf(recipe: Recipe, dtype: torch.dtype, device: str, attn: str, gguf: str | None,
               progress: bool, tokenizer: bool = True) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    path = find_gguf(recipe, gguf)
    digest = file_digest(path)
    target, tok = cached_checkpoint(recipe, path, digest, progress, tokenizer=tokenizer)
    with status(progress, f"loading {recipe.name} from {target}"), quiet_transformers(progress=False):
        model = AutoModelForCausalLM.from_pretrained(target, attn_implementation=attn, **dtype_kwarg(dtype))
        model = _finish(model, device, attn)
    check_architecture(recipe, path, getattr(model.config, "model_type", None))  # a cache entry built before the check
    info = _info(recipe.name, "gguf", model, dtype, device, attn, digest, str(path))
    return LoadedModel(model=model, tokenizer=tok, info=info)


def _load_random_init(recipe: Recipe, dtype: torch.dtype, device: str, attn: str, seed: int,
                      progress: bool, tokenizer: bool) -> LoadedModel:
    model, tok = random_init_model(recipe, dtype, attn, seed, progress)
    model = _finish(model, device, attn)
    info = _info(recipe.name, "random-init", model, dtype, device, attn, f"seed={seed}", None)
    return LoadedModel(model=model, tokenizer=tok if tokenizer else None, info=info)


def _has_tokenizer(folder: Path) -> bool:
    """Whether a checkpoint folder holds tokenizer files (``save_pretrained`` output)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
    return any((folder / n).is_file() for n in names)


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
    with status(progress, f"loading {name}"), quiet_transformers(progress):
        try:
            model = AutoModelForCausalLM.from_pretrained(
                where, attn_implementation=attn, **kwargs, **dtype_kwarg(dtype)
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


def tokenizer_only(name: str, gguf: str | None = None) -> PreTrainedTokenizerBase | None:
    """A model's tokenizer without its weights, where that is quick: a random-init recipe's byte
    tokenizer; a GGUF (recipe or file) whose cache entry holds its converted tokenizer; the tokenizer
    files of a local folder or of an HF id in the local cache. The checks that need only the prompt's
    length (``--split-at``, ``--block-size`` against N) run on it before the weights load.

    Returns:
        the tokenizer, or None where it cannot be had without the load (a GGUF not yet dequantized:
        its first load converts it; a model without a tokenizer; one :func:`load_model` will refuse).

    Raises:
        TracerError: what :func:`load_model` would refuse first (a broken recipe, a missing GGUF).
    """
    from transformers import AutoTokenizer

    from tracer.load.gguf import cached_tokenizer_dir

    ensure_offline()
    recipe = recipes().get(name)
    if recipe is None and str(name).lower().endswith(".gguf"):
        if gguf is not None:
            return None  # load_model refuses the pair
        recipe = gguf_file_recipe(name)
        gguf = str(recipe.path)
    if recipe is not None and recipe.kind == "random-init":
        from tracer.load.random_init import byte_tokenizer

        return byte_tokenizer()
    if recipe is not None:
        where = cached_tokenizer_dir(find_gguf(recipe, gguf))
    elif gguf is None:
        local = Path(name).expanduser()
        where = str(local.resolve()) if local.is_dir() and _has_tokenizer(local) else None if local.is_dir() else name
    else:
        return None
    if where is None:
        return None
    try:
        with quiet_transformers(progress=False):
            return AutoTokenizer.from_pretrained(str(where), local_files_only=True)
    except Exception:  # noqa: BLE001 - the load reports a missing or broken tokenizer in its own words
        return None


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
    tokenizer: bool | PreTrainedTokenizerBase = True,
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
            relays the tqdm bars: :func:`tracer.progress.relay_tqdm`).
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
            it once and adds it to the cache. A tokenizer object (:func:`tokenizer_only`) is used
            as the model's, not loaded again.

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
        device_map = parse_device_map(device_map)
        max_memory = parse_max_memory(max_memory)
    elif max_memory is not None:
        raise TracerError("--max-memory applies only with --device-map auto|balanced|sequential; add --device-map auto")
    dev = resolve_device(device) if device_map is None else "cpu"
    attn = check_attn(attn)
    table = recipes(using=name)  # a broken recipe file is this model's error only if it is this recipe
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
    given = None if isinstance(tokenizer, bool) else tokenizer
    want = tokenizer is True
    if recipe is None:
        loaded = _load_hf(name, torch_dtype, dev, attn, trust_remote_code, progress, want)
    elif recipe.kind == "gguf":
        loaded = _load_gguf(recipe, torch_dtype, dev, attn, gguf, progress, want)
    else:
        loaded = _load_random_init(recipe, torch_dtype, dev, attn, seed, progress, want)
    if given is not None:
        loaded.tokenizer = given
    if device_map is not None:
        applied = dispatch(loaded.model, device_map, max_memory)
        info = replace(loaded.info, device=str(model_device(loaded.model)), device_map=applied)
        loaded = LoadedModel(model=loaded.model, tokenizer=loaded.tokenizer, info=info)
    return loaded
