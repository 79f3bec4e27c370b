"""Capture points: which modules of an HF decoder model tracer records, found from the model.

A *capture point* is a module of ``model.named_modules()`` (named by its HF path, as nnsight
does) whose output (or input) tracer keeps. :func:`discover_points` finds them for standard
HF decoder models (Llama, Qwen2/3, Mistral, Gemma, Phi-3, GPT-2, ...), optionally steered by a
TOML hook map in ``hooks/``; :mod:`tracer.execute.capture` attaches the hooks.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from torch import nn

from tracer.errors import TracerError
from tracer.load.recipe_check import check_hook_map
from tracer.load.recipes import data_dir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10
    import tomli as tomllib


GRANULARITIES = ("layers", "sublayers")

_FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "final_norm")

_LAYER_LIST_NAMES = ("layers", "h", "blocks", "block", "decoder_layers")


@dataclass(frozen=True)
class CapturePoint:
    """One place tracer records.

    Attributes:
        name: the capture name; the HF module path for outputs (``model.layers.3``), or a
            documented virtual name (e.g. ``model.layers.3.self_attn.core`` for the input of
            ``o_proj``) when ``which == "input"``.
        module: the HF module path the hook sits on.
        kind: ``embedding`` | ``layer`` | ``final_norm`` | ``logits`` | a sublayer kind.
        op: the module's class name.
        which: ``"output"`` (the module's output), ``"input"`` (its first tensor input), or
            ``"cache"``: the layer's KV cache after the run (no hook; the runner reads it from
            the cache, see :meth:`Capture.add_cache`).
        full: keep every position of the prompt instead of the compared window (for tensors
            the compared positions depend on, such as keys/values).
        layer_index: for ``which == "cache"``: the decoder layer's index in the KV cache.
    """

    name: str
    module: str
    kind: str
    op: str
    which: str = "output"
    full: bool = False
    layer_index: int = -1


@lru_cache(maxsize=None)
def _hook_maps() -> tuple[dict[str, Any], ...]:
    maps = []
    for path in sorted(data_dir("hooks").glob("*.toml")):
        if path.name.startswith("engine-"):  # engine-dump name maps (tracer.execute.enginemap), not hook maps
            continue
        try:
            with open(path, "rb") as f:
                data = check_hook_map(tomllib.load(f), path)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise TracerError(f"hook map {path} cannot be read: {exc}; fix or delete the file") from None
        data["_path"] = str(path)
        maps.append(data)
    return tuple(maps)


def hook_map_for(model_type: str) -> dict[str, Any] | None:
    """The hook map (from ``hooks/*.toml``) whose ``families`` lists ``model_type``, or None."""
    for m in _hook_maps():
        if model_type in m.get("families", ()):
            return m
    return None


def _find_layer_list(model: nn.Module, modules: dict[str, nn.Module], n_layers: int | None) -> tuple[str, nn.ModuleList]:
    candidates = [
        (name, m)
        for name, m in modules.items()
        if isinstance(m, nn.ModuleList) and len(m) > 0 and (n_layers is None or len(m) == n_layers)
    ]
    named = [c for c in candidates if c[0].rsplit(".", 1)[-1] in _LAYER_LIST_NAMES]
    pick = named or candidates
    if not pick:
        raise TracerError(
            f"could not find the decoder layers of {type(model).__name__}; "
            "add a hook map for this family in hooks/ (see hooks/README.md)"
        )
    return min(pick, key=lambda c: c[0].count("."))


def _layer_paths(model: nn.Module, modules: dict[str, nn.Module]) -> dict[str, Any]:
    """Module paths of the embedding, decoder layers, final norm and LM head (``modules``: the
    model's ``named_modules()``, walked once by the caller)."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", "")
    hmap = hook_map_for(model_type) or {}
    names = {id(m): name for name, m in modules.items()}

    def must_exist(path: str, what: str) -> str:
        if path not in modules:
            raise TracerError(
                f"hook map {hmap.get('_path', '?')} names {what} '{path}', which "
                f"{type(model).__name__} does not have; fix the map"
            )
        return path

    def path_of(getter: str, error: str) -> str:
        """The module path of ``model.<getter>()`` (the embedding or the LM head)."""
        module = getattr(model, getter)() if hasattr(model, getter) else None
        if module is None or id(module) not in names:
            raise TracerError(f"{type(model).__name__} {error}")
        return names[id(module)]

    if "embedding" in hmap:
        embedding = must_exist(hmap["embedding"], "embedding")
    else:
        embedding = path_of("get_input_embeddings", "has no input embedding module; add a hook map in hooks/")

    n_layers = next((getattr(cfg, k) for k in ("num_hidden_layers", "n_layer", "num_layers")
                     if getattr(cfg, k, None) is not None), None)
    if "layers" in hmap:
        layers_path = must_exist(hmap["layers"], "layers")
        layer_list = modules[layers_path]
    else:
        layers_path, layer_list = _find_layer_list(model, modules, n_layers)
    layers = [f"{layers_path}.{i}" for i in range(len(layer_list))]

    if "final_norm" in hmap:
        final_norm = must_exist(hmap["final_norm"], "final_norm")
    else:
        parent = layers_path.rsplit(".", 1)[0] if "." in layers_path else ""
        final_norm = None
        for cand in _FINAL_NORM_NAMES:
            path = f"{parent}.{cand}" if parent else cand
            if path in modules:
                final_norm = path
                break
        if final_norm is None:
            raise TracerError(
                f"could not find the final norm of {type(model).__name__} next to {layers_path}; "
                "name it in a hook map in hooks/"
            )

    if "logits" in hmap:
        logits = must_exist(hmap["logits"], "logits")
    else:
        logits = path_of("get_output_embeddings", "has no LM head (get_output_embeddings() is None); "
                                                  "tracer needs a causal LM (…ForCausalLM)")
    return {"embedding": embedding, "layers": layers, "final_norm": final_norm, "logits": logits,
            "map": hmap}


def _sublayer_kind(module: nn.Module, rel: str, hmap: dict[str, Any]) -> str | None:
    """Kind of a module inside a decoder layer, or None if it is not a capture point."""
    explicit = hmap.get("sublayers", {})
    if rel in explicit:
        return explicit[rel]
    cls = type(module).__name__
    last = rel.rsplit(".", 1)[-1]
    if isinstance(module, nn.Linear) or cls in ("Conv1D",):
        return "linear"
    if "norm" in cls.lower() or "norm" in last.lower():
        return "norm"
    if last in ("self_attn", "attn", "attention", "self_attention"):
        return "attention"
    if last in ("mlp", "feed_forward", "ffn"):
        return "mlp"
    if last in ("act_fn", "act", "activation_fn"):
        return "activation"
    return None


def discover_points(model: nn.Module, granularity: str = "layers", *, kv_cache: bool = True) -> list[CapturePoint]:
    """The capture points of ``model`` in execution order.

    ``layers``: the embedding output, every decoder layer's output (the residual stream),
    the final norm and the logits (LM head output). ``sublayers`` adds, inside every decoder
    layer, each norm, the attention block output, the attention core (the input of the output
    projection: the SDPA/eager result before ``o_proj``), the MLP and its activation, the input
    of a gated MLP's down projection (``<layer>.mlp.down_proj.input`` = act(gate) * up, which no
    other point captures), and every Linear, in the order they run.

    Both granularities add one ``kv_cache`` point per layer, ``<layer>.<attn>.kv_cache``: the
    layer's keys and values for **all** positions 0..N-1 after the run (``full``), the input the
    attention core consumed besides its queries (in a cache hit the prefix K/V were computed
    by another forward pass). Its tensor is ``(positions, kv_heads * head_dim_k +
    kv_heads * head_dim_v)``: keys then values, heads flattened. The origin analysis needs it
    (:mod:`tracer.diff.dataflow`). ``kv_cache=False`` leaves these points out: on a long prompt
    they are most of the captured bytes (``2 * N * kv_heads * head_dim`` values per layer and
    run, against ``(N - P) * hidden`` for a layer's output), at the price of the origin
    analysis no longer seeing the cache: a divergence born in the cached-prefix pass then shows
    first at the attention core or layer that consumed it.

    Raises:
        TracerError: unknown granularity, or a model whose structure cannot be discovered.
    """
    if granularity not in GRANULARITIES:
        raise TracerError(f"unknown granularity '{granularity}'; use one of: {', '.join(GRANULARITIES)}")
    modules = dict(model.named_modules())  # one walk of the module tree (it costs ~1 ms per 400 modules)
    paths = _layer_paths(model, modules)

    def point(path: str, kind: str, **kw: Any) -> CapturePoint:
        return CapturePoint(name=kw.pop("name", path), module=path, kind=kind,
                            op=kw.pop("op", type(modules[path]).__name__), **kw)

    points = [point(paths["embedding"], "embedding")]
    for index, layer_path in enumerate(paths["layers"]):
        kv = _kv_point(modules[layer_path], layer_path, index) if kv_cache else None
        if granularity == "sublayers":
            subs = _sublayer_points(modules[layer_path], layer_path, paths["map"], point)
            at = next((i for i, p in enumerate(subs) if p.kind == "attention_core"), len(subs))
            points.extend(subs[:at] + ([kv] if kv else []) + subs[at:])
        elif kv is not None:
            points.append(kv)
        points.append(point(layer_path, "layer"))
    points.append(point(paths["final_norm"], "final_norm"))
    points.append(point(paths["logits"], "logits"))
    return points

_ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention")


def _kv_point(layer: nn.Module, layer_path: str, index: int) -> CapturePoint | None:
    """The ``kv_cache`` point of one decoder layer (None if it has no attention submodule)."""
    attn = next((n for n, _ in layer.named_children() if n in _ATTN_NAMES), None)
    if attn is None:
        return None
    return CapturePoint(name=f"{layer_path}.{attn}.kv_cache", module=f"{layer_path}.{attn}", kind="kv_cache",
                        op="KVCache", which="cache", full=True, layer_index=index)


def _sublayer_points(layer: nn.Module, layer_path: str, hmap: dict[str, Any], point) -> list[CapturePoint]:
    order = _execution_order(layer, layer_path, hmap)
    rels = {rel for rel, _ in order}
    out: list[CapturePoint] = []
    for rel, kind in order:
        path = f"{layer_path}.{rel}"
        parent, _, last = rel.rpartition(".")
        if kind == "linear" and last in ("o_proj", "out_proj", "c_proj", "dense") and (
            rel.split(".")[0] in _ATTN_NAMES
        ):
            out.append(point(path, "attention_core", which="input", name=f"{layer_path}.{parent}.core",
                             op=f"{type(layer.get_submodule(parent)).__name__} core"))
        if kind == "linear" and last == "down_proj" and (
            f"{parent}.gate_proj" in rels or f"{parent}.gate_up_proj" in rels
        ):  # a gated MLP: down_proj consumes act(gate) * up, which no other point captures
            out.append(point(path, "mlp_hidden", which="input", name=f"{path}.input"))
        out.append(point(path, kind))
    return out


def _execution_order(layer: nn.Module, layer_path: str, hmap: dict[str, Any]) -> list[tuple[str, str]]:
    """Sublayer modules of one decoder layer, in definition order.

    Definition order is not always execution order (Llama defines ``self_attn`` before
    ``input_layernorm`` but runs the norm first); :meth:`Capture.records` therefore returns
    records in the order the hooks actually fired.
    """
    found = []
    for rel, m in layer.named_modules():
        if rel:
            kind = _sublayer_kind(m, rel, hmap)
            if kind is not None:
                found.append((rel, kind))
    return found
