"""Capture points: which modules of an HF decoder model tracer records, found from its family.

A *capture point* is a module of ``model.named_modules()`` (named by its HF path, as nnsight
does) whose output (or input) tracer keeps. :func:`discover_points` finds them from the model's
family descriptor (``hooks/*.toml``, :mod:`tracer.execute.family`): every point carries the
**role** it plays in the block (``q_proj``, ``mlp_norm``, ...), so downstream code (the dataflow
of the origin analysis, tensor-parallel sharding, reports) reads roles, not module names.
:mod:`tracer.execute.capture` attaches the hooks.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from tracer.errors import TracerError
from tracer.execute.kinds import GRANULARITIES  # noqa: F401 - re-exported
from tracer.execute.family import Family, family_for
from tracer.execute.roles import VIRTUAL_ROLES
from tracer.execute.inferred import cache_layout
from tracer.execute.kinds import PointKind



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
            ``"cache"``: the layer's KV cache or recurrent state after the run (no hook; the
            runner reads it from the cache, see :meth:`Capture.add_cache`).
        full: keep every position of the prompt instead of the compared window (for tensors
            the compared positions depend on, such as keys/values).
        layer_index: for ``which == "cache"``: the decoder layer's index in the HF cache.
        role: what the point is in the block (:data:`tracer.execute.roles.ROLES`, a virtual role
            ``attention_core``/``kv_cache``/``mlp_hidden``/``state``, or ``embedding``/``layer``/
            ``final_norm``/``logits``); ``""`` for a module without one (an extra Linear).
    """

    name: str
    module: str
    kind: str
    op: str
    which: str = "output"
    full: bool = False
    layer_index: int = -1
    role: str = ""


def discover_points(model: nn.Module, granularity: str = "layers", *, kv_cache: bool = True) -> list[CapturePoint]:
    """The capture points of ``model`` in execution order.

    ``layers``: the embedding output, every decoder layer's output (the residual stream),
    the final norm and the logits (LM head output). ``sublayers`` adds, inside every decoder
    layer, each norm, the attention block output, the attention core (the input of the output
    projection: the SDPA/eager result before ``o_proj``), the MLP and its activation, the input
    of a gated MLP's down projection (``<layer>.mlp.down_proj.input`` = act(gate) * up, which no
    other point captures), and every Linear, in the order they run.

    Both granularities add one ``kv_cache`` point per attention layer, ``<layer>.<attn>.kv_cache``:
    the layer's keys and values for **all** positions 0..N-1 after the run (``full``), the input the
    attention core consumed besides its queries (in a cache hit the prefix K/V were computed
    by another forward pass). Its tensor is ``(positions, kv_heads * head_dim_k +
    kv_heads * head_dim_v)``: keys then values, heads flattened. The origin analysis needs it
    (:mod:`tracer.diff.dataflow`). A linear-attention layer of a hybrid model (the family's
    ``linear_attention`` role: Qwen3.5's GatedDeltaNet, a Mamba block) gets a ``state`` point
    instead, ``<layer>.<mixer>.state``: the recurrent and conv state its cache holds after the
    run, which a cache hit carries from the prefix pass into the next one
    (:meth:`tracer.execute.capture.Capture.add_cache`). ``kv_cache=False`` leaves these points
    out: on a long prompt they are most of the captured bytes (``2 * N * kv_heads * head_dim``
    values per layer and run, against ``(N - P) * hidden`` for a layer's output), at the price of
    the origin analysis no longer seeing the cache: a divergence born in the cached-prefix pass
    then shows first at the attention core or layer that consumed it.

    A model no descriptor lists or fits gets the layer-level points of its inferred family
    (:func:`tracer.execute.family.infer_family`), its cache points named after the decoder layer
    (``<layer>.kv_cache``, ``<layer>.state``: which layer holds which, from the HF cache its config
    makes); ``sublayers`` needs a descriptor.

    Raises:
        TracerError: unknown granularity, ``sublayers`` for a model without a family descriptor, or
            a model whose structure cannot be discovered.
    """
    if granularity not in GRANULARITIES:
        raise TracerError(f"unknown granularity '{granularity}'; use one of: {', '.join(GRANULARITIES)}")
    fam = family_for(model)
    if fam.inferred and granularity == "sublayers":
        raise TracerError(fam.inferred)
    shape = (fam, len(model._modules), id(next(iter(model._modules.values()), None)))
    try:
        held = _DISCOVERED.get(model)
    except TypeError:  # not weakly referenceable
        held = None
    if held is None or held[0] != shape:
        held = (shape, {})
        try:
            _DISCOVERED[model] = held
        except TypeError:
            pass
    hit = held[1].get((granularity, kv_cache))
    if hit is not None:
        return list(hit)
    points = _discover(model, granularity, kv_cache, fam)
    held[1][(granularity, kv_cache)] = tuple(points)
    return points


#: model → (what its points depend on, {(granularity, kv_cache): the points}): every run asks again,
#: for its own granularity and, for the sublayers estimate (tracer.pipeline), ``sublayers`` too
#: (discovering walks the whole module tree, ~1 ms per 400 modules)
_DISCOVERED: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, dict[tuple[str, bool], tuple[CapturePoint, ...]]]]" = \
    weakref.WeakKeyDictionary()


def _discover(model: nn.Module, granularity: str, kv_cache: bool, fam: Any) -> list[CapturePoint]:
    modules = dict(model.named_modules())  # one walk of the module tree

    def point(path: str, kind: str, **kw: Any) -> CapturePoint:
        return CapturePoint(name=kw.pop("name", path), module=path, kind=kind,
                            op=kw.pop("op", type(modules[path]).__name__), **kw)

    points = [point(fam.embedding, "embedding", role="embedding")]
    n_layers = len(modules[fam.layers])
    layout = cache_layout(model, n_layers) if kv_cache and fam.inferred else None
    for index in range(n_layers):
        layer_path = f"{fam.layers}.{index}"
        if layout is not None:  # no descriptor: the cache points of the layers' HF cache, on the layer
            kv, state = (_cache_point(kind, layer_path, type(modules[layer_path]).__name__, index) if has else None
                         for kind, has in zip((PointKind.KV_CACHE, PointKind.STATE), layout[index]))
        else:
            kv = _kv_point(fam, modules, layer_path, index) if kv_cache else None
            state = _state_point(fam, modules, layer_path, index) if kv_cache else None
        if granularity == "sublayers":
            subs = _sublayer_points(fam, modules[layer_path], layer_path, point)
            at = next((i for i, p in enumerate(subs) if p.kind == PointKind.ATTENTION_CORE), len(subs))
            subs = subs[:at] + ([kv] if kv else []) + subs[at:]
            if state is not None:  # right before the output projection reads the state's result
                at = next((i for i, p in enumerate(subs) if p.role == "linear_out_proj"),
                          next((i for i, p in enumerate(subs) if p.role == "linear_attention"), len(subs)))
                subs = subs[:at] + [state] + subs[at:]
            points.extend(subs)
        else:
            points.extend(p for p in (kv, state) if p is not None)
        points.append(point(layer_path, "layer", role="layer"))
    points.append(point(fam.final_norm, "final_norm", role="final_norm"))
    points.append(point(fam.logits, "logits", role="logits"))
    return points


def _kv_point(fam: Family, modules: dict[str, nn.Module], layer_path: str, index: int) -> CapturePoint | None:
    """The ``kv_cache`` point of one decoder layer (None if the family names no attention module)."""
    attn = fam.path_of("attention")
    if attn is None or f"{layer_path}.{attn}" not in modules:
        return None
    suffix, kind = VIRTUAL_ROLES["kv_cache"]
    return CapturePoint(name=f"{layer_path}.{attn}.{suffix}", module=f"{layer_path}.{attn}", kind=kind,
                        op="KVCache", which="cache", full=True, layer_index=index, role="kv_cache")


def _cache_point(kind: PointKind, layer_path: str, layer_op: str, index: int) -> CapturePoint:
    """A cache point on the decoder layer itself (a family inferred without roles):
    ``<layer>.kv_cache`` or ``<layer>.state``."""
    role = "kv_cache" if kind == PointKind.KV_CACHE else "state"
    suffix = VIRTUAL_ROLES[role][0]
    return CapturePoint(name=f"{layer_path}.{suffix}", module=layer_path, kind=kind,
                        op="KVCache" if kind == PointKind.KV_CACHE else f"{layer_op} state", which="cache",
                        full=True, layer_index=index, role=role)


def _state_point(fam: Family, modules: dict[str, nn.Module], layer_path: str, index: int) -> CapturePoint | None:
    """The ``state`` point of one linear-attention layer (None if the layer has no module playing
    the family's ``linear_attention`` role): the recurrent and conv state the HF cache holds for
    layer ``index`` after the run."""
    mixer = fam.path_of("linear_attention")
    if mixer is None or f"{layer_path}.{mixer}" not in modules:
        return None
    suffix, kind = VIRTUAL_ROLES["state"]
    return CapturePoint(name=f"{layer_path}.{mixer}.{suffix}", module=f"{layer_path}.{mixer}", kind=kind,
                        op=f"{type(modules[f'{layer_path}.{mixer}']).__name__} state", which="cache", full=True,
                        layer_index=index, role="state")


def _sublayer_points(fam: Family, layer: nn.Module, layer_path: str,
                     point: Callable[..., CapturePoint]) -> list[CapturePoint]:
    """The points inside one decoder layer, in definition order (:meth:`Capture.records` returns
    them in the order the hooks fired: Llama defines ``self_attn`` before ``input_layernorm`` but
    runs the norm first): every module with a role or a ``[sublayers]`` kind, every other
    ``nn.Linear``, the attention core right before the output projection, and the input of a
    gated MLP's down projection (act(gate) * up, which no other point captures)."""
    rels = {rel for rel, _ in layer.named_modules() if rel}
    gated = any(fam.path_of(r) in rels for r in ("gate_proj", "gate_up_proj"))
    attn = fam.path_of("attention")
    out: list[CapturePoint] = []
    for rel, module in layer.named_modules():
        if not rel or fam.skips(rel):
            continue
        kind = fam.kind_of(rel) or (PointKind.LINEAR if isinstance(module, nn.Linear) else None)
        if kind is None:
            continue
        role = fam.role_of(rel) or ""
        path = f"{layer_path}.{rel}"
        if role == "o_proj":  # the attention core: the output projection's input, <attention>.core
            owner = attn if attn is not None and attn in rels else rel.rpartition(".")[0]
            suffix, vkind = VIRTUAL_ROLES["attention_core"]
            holder = layer.get_submodule(owner) if owner else layer
            out.append(point(path, vkind, which="input", name=".".join(filter(None, (layer_path, owner, suffix))),
                             op=f"{type(holder).__name__} core", role="attention_core"))
        if role == "down_proj" and gated:
            suffix, vkind = VIRTUAL_ROLES["mlp_hidden"]
            out.append(point(path, vkind, which="input", name=f"{path}.{suffix}", role="mlp_hidden"))
        out.append(point(path, kind, role=role))
    return out


def point_widths(model: nn.Module, points: list[CapturePoint], hidden: int) -> int:
    """Elements per token of ``points`` together (what a trace stores per position and run: each
    point's feature dims, ``shape[1:]``, multiplied out), read from the model's modules and their
    config, without running it. ``hidden``: the model's hidden size.

    Which rule gives which point:

    - a Linear (or GPT-2's ``Conv1D``): its output width, or its input width for an ``input`` point
      (the attention core, a gated MLP's ``down_proj.input``); an Embedding: its ``embedding_dim``;
    - ``act`` (the MLP's activation): the input width of the layer's ``down_proj``, the Linear that
      consumes it (``intermediate_size``; GPT-2's ``4 * n_embd``);
    - ``k_norm``: ``k_proj``'s output width (``kv_heads * head_dim``); ``q_norm``, and any other norm
      inside the attention module (Qwen3.5's role-less ``q_norm``, whose ``q_proj`` also holds the
      output gate): ``num_attention_heads * head_dim`` of the attention module (its ``config`` and
      ``head_dim``);
    - ``kv_cache``: keys then values, ``2 * k_proj``'s output width, else (GPT-2's fused ``c_attn``, an
      inferred family) ``2 * kv_heads * head_dim`` of the attention module;
    - ``state``: 0 (one ``(1, F)`` row per run, the recurrent and conv state: not stored per position);
    - everything else (the attention and MLP blocks, the other norms, the residual stream), and any
      of the above whose modules or config the model lacks: ``hidden``.

    Raises:
        TracerError: as :func:`tracer.execute.family.family_for` (a descriptor names a path the model lacks).
    """
    fam = family_for(model)
    return sum(_point_width(model, p, hidden, fam) for p in points)


def _point_width(model: nn.Module, point: CapturePoint, hidden: int, fam: Family) -> int:
    """One point's elements per token (:func:`point_widths`' rules)."""
    if point.kind == PointKind.STATE:
        return 0
    try:
        mod = model.get_submodule(point.module)
    except AttributeError:
        return hidden
    if point.which == "cache":
        return _kv_width(model, fam, point, mod) or hidden
    io = _io_widths(mod)
    if io is not None:
        return io[0] if point.which == "input" else io[1]
    layer_path, rel = _split_layer(fam, point.module)
    if layer_path is None:
        return hidden
    if point.role == "act":
        down = _io_widths(_role_module(model, fam, layer_path, "down_proj"))
        return down[0] if down is not None else hidden
    attn = fam.path_of("attention")
    if point.kind == PointKind.NORM and attn is not None and rel.startswith(attn + "."):
        if point.role == "k_norm":
            k = _io_widths(_role_module(model, fam, layer_path, "k_proj"))
            return k[1] if k is not None else hidden
        heads, head_dim = _heads(_role_module(model, fam, layer_path, "attention"))
        return heads * head_dim if heads and head_dim else hidden
    return hidden


def _io_widths(mod: nn.Module | None) -> tuple[int, int] | None:
    """(input, output) features of a Linear, GPT-2's Conv1D (weight ``(in, out)``) or an Embedding
    (0 for its input); None for any other module."""
    if isinstance(mod, nn.Linear):
        return mod.in_features, mod.out_features
    if isinstance(mod, nn.Embedding):
        return 0, mod.embedding_dim
    if type(mod).__name__ == "Conv1D" and getattr(mod, "weight", None) is not None and mod.weight.dim() == 2:
        return int(mod.weight.shape[0]), int(mod.weight.shape[1])
    return None


def _split_layer(fam: Family, path: str) -> tuple[str | None, str]:
    """(``<layers>.<i>``, the path inside that layer) of a module path; (None, "") outside the layers."""
    head = fam.layers + "."
    if not path.startswith(head):
        return None, ""
    index, _, rel = path[len(head):].partition(".")
    return (head + index, rel) if index.isdigit() else (None, "")


def _role_module(model: nn.Module, fam: Family, layer_path: str, role: str) -> nn.Module | None:
    """The module playing ``role`` in the decoder layer at ``layer_path`` (None without one)."""
    rel = fam.path_of(role)
    if rel is None:
        return None
    try:
        return model.get_submodule(f"{layer_path}.{rel}")
    except AttributeError:
        return None


def _heads(attn: nn.Module | None, kv: bool = False) -> tuple[int, int]:
    """(query heads, or ``kv``: key/value heads; head_dim) of an HF attention module, from its
    ``config`` and ``head_dim`` attribute; (0, 0) where it lacks them."""
    cfg = getattr(attn, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if kv:
        heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(attn, "head_dim", None) or getattr(cfg, "head_dim", None)
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        return 0, 0
    return heads, head_dim


def _kv_width(model: nn.Module, fam: Family, point: CapturePoint, mod: nn.Module) -> int:
    """A ``kv_cache`` point's width (keys then values): ``2 * k_proj``'s output width, else from the
    attention module's heads; 0 where neither is found. ``mod``: the point's module (the attention, or
    the decoder layer for an inferred family)."""
    layer_path = _split_layer(fam, point.module)[0]
    k = _role_module(model, fam, layer_path, "k_proj") if layer_path is not None else None
    if k is None:  # no role (an inferred family): a key projection under the point's module
        k = next((m for n, m in mod.named_modules() if n.endswith("k_proj") and _io_widths(m)), None)
    io = _io_widths(k)
    if io is not None:
        return 2 * io[1]
    attn = _role_module(model, fam, layer_path, "attention") if layer_path is not None else None
    attn = attn or next((m for m in mod.modules() if hasattr(m, "head_dim") and hasattr(m, "config")), None)
    heads, head_dim = _heads(attn, kv=True)
    return 2 * heads * head_dim


def granularity_width(model: nn.Module, granularity: str, hidden: int, *, kv_cache: bool = True) -> int:
    """:func:`point_widths` of every point of ``granularity`` (:func:`discover_points`): the elements per
    token a trace of that granularity stores per run; computed once per model (every run of a model
    asks for its ``sublayers`` width, :func:`tracer.pipeline.run_scenario`).

    Raises:
        TracerError: as :func:`discover_points`.
    """
    points = discover_points(model, granularity, kv_cache=kv_cache)
    try:
        held = _DISCOVERED.get(model)
    except TypeError:  # not weakly referenceable
        held = None
    key = ("width", granularity, kv_cache, hidden)
    if held is not None and key in held[1]:
        return held[1][key]
    width = point_widths(model, points, hidden)
    if held is not None:
        held[1][key] = width
    return width

