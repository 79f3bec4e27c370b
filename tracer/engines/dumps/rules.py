"""Engine maps as files: the ``hooks/engine-*.toml`` of a model family read, each rule checked, and
an override merged over them.

Used by :mod:`tracer.engines.dumps.namemap` (which applies the rules to a dump) and the vLLM executor.
A map's ``[layer]`` and ``[model]`` tables give, per engine module name, the rules that say which HF
capture point(s) it becomes; the schema is documented in ``hooks/engine-llama.toml``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tracer.errors import TracerError

_RULE_KEYS = {"hf", "element", "sum", "split", "shard", "rows", "tokens", "identity"}
#: values of a rule's ``tokens``: the leading dims of the engine's tensor (``t``: one token dim,
#: SGLang/vLLM; ``sb``: Megatron's ``[s, b, ...]``; ``bs``: ``[b, s, ...]``)
_TOKEN_LAYOUTS = ("t", "sb", "bs")


def _check_rules(rules: Any, key: str, where: str) -> list[dict[str, Any]]:
    rules = rules if isinstance(rules, list) else [rules]
    for r in rules:
        if not isinstance(r, dict) or "hf" not in r or set(r) - _RULE_KEYS:
            raise TracerError(f"{where}: rule for {key!r} must be a table with 'hf' and only {sorted(_RULE_KEYS)}")
        if r.get("split") not in (None, "qkv", "qkv_groups", "halves") or r.get("shard") not in (None, "columns", "replicated"):
            raise TracerError(f"{where}: rule for {key!r} has an unknown split/shard; use split qkv|qkv_groups|halves, "
                              "shard columns|replicated")
        if r.get("tokens", "t") not in _TOKEN_LAYOUTS or r.get("identity") not in (None, "skip"):
            raise TracerError(f"{where}: rule for {key!r} has an unknown tokens/identity; use tokens t|sb|bs, identity skip")
    return rules


def load_engine_map(family: str, override: str | Path | None = None, engine: str | None = None) -> dict[str, Any]:
    """The engine map for ``family`` (``hooks/engine-*.toml`` on the family-descriptor search path,
    :func:`tracer.execute.family.engine_map_files`), with ``override`` (a TOML file of the same
    schema) merged over it key by key.

    A map whose ``[engine]`` table has no ``engine`` key is generic: it describes the module tree
    that SGLang and vLLM share for these families (what a dump of either holds). A map with
    ``engine = "vllm"`` adds that engine's own rules for these families (``[layer]``/``[model]``
    keys win over the generic ones) and its ``[capture]`` table (what the in-process capture hooks:
    :mod:`tracer.engines.vllm.capture`); it is read only when ``engine`` names it.

    Returns:
        ``{"layer": {rel: [rule...]}, "model": {rel: [rule...]}, "ignore": [patterns],
        "capture": {...}, "settings": {...}, "sources": [paths], "override": the override's path or None}``;
        ``settings`` holds the
        ``[engine]`` table's other keys, later maps winning: ``tokens`` (the default of the rules'
        ``tokens``) and ``kv_heads`` (the model's query groups, for ``split = "qkv_groups"``).

    Raises:
        TracerError: no map for the family and no override; an unreadable or malformed map.
    """
    from tracer.execute.family import engine_map_files

    merged: dict[str, Any] = {"layer": {}, "model": {}, "ignore": [], "capture": {}, "settings": {}, "sources": [],
                              "override": None if override is None else str(override)}
    layers = [(p, _read_toml(p)) for p in engine_map_files(family, engine)]
    if override is not None:
        layers.append((Path(override), _read_toml(Path(override))))
    if not layers:
        raise TracerError(f"no engine map for model family {family!r} (hooks/engine-*.toml); "
                          "write one in that schema and pass it with --map FILE")
    for path, data in layers:
        for section in ("layer", "model"):
            for key, rules in data.get(section, {}).items():
                merged[section][key] = _check_rules(rules, key, str(path))
        head = data.get("engine", {}) if isinstance(data.get("engine"), dict) else {}
        merged["ignore"] += list(head.get("ignore", data.get("ignore", [])))
        merged["settings"].update({k: v for k, v in head.items() if k not in ("families", "ignore", "engine")})
        if merged["settings"].get("tokens", "t") not in _TOKEN_LAYOUTS:
            raise TracerError(f"{path}: [engine] tokens must be one of {', '.join(_TOKEN_LAYOUTS)}")
        merged["capture"].update(data.get("capture", {}))
        merged["sources"].append(str(path))
    return merged


def _read_toml(path: Path) -> dict[str, Any]:
    """An engine map through the input gate (a regular UTF-8 file of bounded size, valid TOML).

    Raises:
        TracerError: a FIFO, device, procfs file, a file too large, not UTF-8 or not TOML (one line).
    """
    from tracer.files import read_toml

    data = read_toml(path, "engine map")
    for section in ("layer", "model", "engine", "capture"):
        if not isinstance(data.get(section, {}), dict):
            raise TracerError(f"engine map {path}: [{section}] must be a table")
    if not isinstance(data.get("engine", {}).get("ignore", data.get("ignore", [])), list):
        raise TracerError(f"engine map {path}: ignore must be a list of name patterns")
    return data
