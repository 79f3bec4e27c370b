"""A decoder model's layout inferred from its modules and config, for a model no family descriptor
describes (:mod:`tracer.execute.family`): what ``--granularity layers`` needs and no more.

:func:`model_paths` finds the embedding, the decoder-layer list, the final norm and the LM head;
:func:`cache_layout` says which layer's HF cache holds keys and values and which a linear-attention
(recurrent) state. Neither reads module names a descriptor would give: only HF's own accessors
(``get_input_embeddings``, ``get_output_embeddings``), the config (``num_hidden_layers``, the
``DynamicCache`` transformers builds from it) and the module tree's shape.
"""

from __future__ import annotations

from typing import Any, Mapping

#: class-name fragment of a normalisation module (LayerNorm, RMSNorm, GroupNorm and the HF variants)
_NORM = "norm"


def _is_norm(module: Any) -> bool:
    return _NORM in type(module).__name__.lower()


def _path_of(module: Any, modules: Mapping[str, Any]) -> str | None:
    return next((path for path, m in modules.items() if m is module and path), None) if module is not None else None


def layer_list(model: Any, modules: Mapping[str, Any]) -> str | None:
    """The path of the decoder layers: the ``nn.ModuleList`` (not inside another list's element)
    whose length is the (text) config's ``num_hidden_layers``, preferring lists of one block class,
    then the longest, then the shallowest; None when the model has no list."""
    from torch import nn

    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n_layers = getattr(text, "num_hidden_layers", None)
    lists = {p: m for p, m in modules.items() if isinstance(m, nn.ModuleList) and len(m) and p}
    nested = {p for p in lists for q in lists if p != q and p.startswith(q + ".")}

    def score(path: str) -> tuple:
        blocks = lists[path]
        return (len(blocks) == n_layers, len({type(b) for b in blocks}) == 1, len(blocks), -path.count("."))

    return max((p for p in lists if p not in nested), key=score, default=None)


def model_paths(model: Any, modules: Mapping[str, Any]) -> tuple[str, str, str, str] | None:
    """``(embedding, layers, final_norm, logits)`` module paths of an HF causal LM: the input
    embedding (``get_input_embeddings()``), the decoder layers (:func:`layer_list`), the final norm
    (the first norm module registered after the layers in the layers' parent, else its last norm
    module: ``model.norm``, ``transformer.ln_f``, ``model.norm_f``) and the LM head
    (``get_output_embeddings()``). None when any of the four is not found.

    Args:
        model: the HF model.
        modules: ``dict(model.named_modules())``.
    """
    try:
        embedding = _path_of(model.get_input_embeddings(), modules)
        logits = _path_of(model.get_output_embeddings(), modules)
    except (AttributeError, NotImplementedError):
        return None
    layers = layer_list(model, modules)
    if embedding is None or logits is None or layers is None:
        return None
    parent_path, _, name = layers.rpartition(".")
    parent = modules.get(parent_path) if parent_path else model
    children = list(parent.named_children())
    at = next(i for i, (child, _) in enumerate(children) if child == name)
    norms = [n for n, child in children[at + 1:] if _is_norm(child)] or \
            [n for n, child in reversed(children) if _is_norm(child)]
    if not norms:
        return None
    return embedding, layers, ".".join(filter(None, (parent_path, norms[0]))), logits


def cache_layout(model: Any, n_layers: int) -> list[tuple[bool, bool]] | None:
    """Per decoder layer, whether the HF cache transformers builds from the model's config
    (``DynamicCache(config=...)``, what the model's forward creates) holds keys/values and whether
    it holds a linear-attention state: ``(has_kv, has_state)``; a layer whose cache is a
    ``DummyLayer`` (an MLP-only layer, a layer reusing another's KV) has neither. None when this
    transformers cannot say (no ``config`` argument, no linear-attention cache layers, another
    layer count): then the caller captures no cache points."""
    try:
        from transformers import DynamicCache
        from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

        layers = DynamicCache(config=model.config).layers
    except Exception:  # noqa: BLE001 - an older transformers or a config it cannot map: no cache points
        return None
    if len(layers) != n_layers:
        return None
    return [(isinstance(c, CacheLayerMixin), isinstance(c, LinearAttentionCacheLayerMixin)) for c in layers]


__all__ = ["layer_list", "model_paths", "cache_layout"]
