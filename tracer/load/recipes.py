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
