"""The dataflow map: which capture points each capture point consumes.

The origin analysis (:func:`tracer.diff.origins.classify_origins`) calls a differing capture point an
**origin** when everything it consumed was bit-identical in both runs. This module says what
"everything it consumed" is, from the capture names alone (so a stored trace can be analysed
without the model). It is derived from the HF module structure of the decoder families tracer
knows by name (Llama, Mistral, Qwen2/3, Gemma, Gemma2/3, Phi-3, GPT-2, and others with the same
module names):

=====================================  ==================================================
capture point (relative to a layer)    consumes
=====================================  ==================================================
``input_layernorm`` / ``ln_1``         X (the layer input: previous layer output, or the
                                       embedding for layer 0), compared positions
``<attn>.q_proj|k_proj|v_proj``        the attention norm
``<attn>.qkv_proj`` / ``<attn>.c_attn``  the attention norm
``<attn>.q_norm`` / ``k_norm``         ``q_proj`` / ``k_proj`` (Qwen3, Gemma3)
``<attn>.kv_cache``                    compared positions: the K/V producers (``k_norm`` or
                                       ``k_proj``, ``v_proj``; X at layers granularity);
                                       positions before the window: the previous layer's
                                       ``kv_cache`` (see below)
``<attn>.core`` (o_proj input)         the queries (``q_norm``/``q_proj``, compared positions)
                                       and ``<attn>.kv_cache`` (keys and values of **all**
                                       positions 0..N-1: in a cache hit the prefix K/V come
                                       from another forward pass)
``<attn>.o_proj`` / ``c_proj``         ``<attn>.core``
``<attn>`` (attention block output)    ``o_proj``
``post_attention_layernorm``/``ln_2``  X and ``<attn>`` (the residual add happens inside the
                                       layer; Gemma2/3: ``<attn>`` only, it is a post-norm)
``pre_feedforward_layernorm``          X and ``post_attention_layernorm`` (Gemma2/3)
``mlp.gate_proj|up_proj|gate_up_proj`` the MLP norm (``post_attention_layernorm``, ``ln_2`` or
``mlp.c_fc``                           ``pre_feedforward_layernorm``)
``mlp.act_fn|act|activation_fn``       ``gate_proj`` / ``gate_up_proj`` / ``c_fc``
``mlp.down_proj.input``                ``act_fn`` and ``up_proj`` (or ``gate_up_proj``): the
                                       product act(gate) * up, captured as its own point
``mlp.down_proj``                      ``mlp.down_proj.input``
``mlp.c_proj`` (GPT-2)                 ``mlp.act``
``mlp``                                ``down_proj`` / ``c_proj``
``post_feedforward_layernorm``         ``mlp`` (Gemma2/3)
the layer output                       X, ``<attn>`` and ``mlp`` (Gemma2/3: X and the two
                                       post-norms); at layers granularity: X and the layer's
                                       ``kv_cache``
=====================================  ==================================================

Outside the layers: the embedding consumes the token ids (identical by construction, so a
differing embedding is an origin); the final norm consumes the last layer; the logits consume the
final norm.

**KV cache positions before the compared window** were computed by forward passes that tracer
does not trace position by position (in a cache hit: the earlier request's prefill). Their only
recorded upstream is the previous layer's cache at those positions, which stands in for the
hidden states of that pass: a layer whose prefix K/V differ while the previous layer's agreed is
an origin *in the prefix pass* (the divergence was born there, between the two caches).

A capture point this table does not name (an unknown family's extra module) conservatively
consumes X and every capture point that ran before it in the same layer, so it can only be an
origin if the whole layer was identical up to it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tracer import schema
from tracer.execute.kinds import PointKind

ATTN_NAMES = ("self_attn", "attn", "attention", "self_attention")
MLP_NAMES = ("mlp", "feed_forward", "ffn")
ATTN_NORMS = ("input_layernorm", "ln_1", "attention_norm", "input_norm")
MLP_NORMS = ("pre_feedforward_layernorm", "post_attention_layernorm", "ln_2", "ffn_norm",
             "post_attention_norm")


@dataclass(frozen=True)
class Consumes(schema.Record):
    """What one capture point consumes.

    Attributes:
        points: capture names whose outputs it consumes at the compared positions (or at all
            positions, for a ``kv_cache`` dependency).
        prefix: capture names standing in for its inputs at positions *before* the compared
            window (only ``kv_cache`` points have these: the previous layer's cache).
        rule: ``structure`` (from the family's module names) or ``fallback`` (unknown module:
            everything before it in the layer).
    """

    points: tuple[str, ...]
    prefix: tuple[str, ...] = ()
    rule: str = "structure"


def _first(present: set[str], *cands: str) -> str | None:
    return next((c for c in cands if c in present), None)


def _layer_rules(rels: list[str]) -> dict[str, tuple[tuple[str, ...], str]]:
    """rel → (deps as rels, with "X" for the layer input and "PREV_KV" for the previous cache)."""
    present = set(rels)
    attn = next((a for a in ATTN_NAMES if a in present or any(r.startswith(a + ".") for r in rels)), None)
    mlp = next((m for m in MLP_NAMES if m in present or any(r.startswith(m + ".") for r in rels)), None)
    rules: dict[str, tuple[str, ...]] = {}
    a = (lambda s: f"{attn}.{s}") if attn else (lambda s: s)
    m = (lambda s: f"{mlp}.{s}") if mlp else (lambda s: s)
    attn_norm = _first(present, *ATTN_NORMS)
    gemma2 = "pre_feedforward_layernorm" in present
    mlp_norm = "pre_feedforward_layernorm" if gemma2 else _first(present, *MLP_NORMS[1:])
    x = ("X",)
    if attn_norm:
        rules[attn_norm] = x
    attn_in = (attn_norm,) if attn_norm else x
    for proj in ("q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn", "query_key_value", "Wqkv"):
        rules[a(proj)] = attn_in
    fused = _first(present, a("qkv_proj"), a("c_attn"), a("query_key_value"), a("Wqkv"))
    if a("q_proj") in present:
        rules[a("q_norm")] = (a("q_proj"),)
    if a("k_proj") in present:
        rules[a("k_norm")] = (a("k_proj"),)
    q = _first(present, a("q_norm"), a("q_proj")) or fused
    k = _first(present, a("k_norm"), a("k_proj")) or fused
    v = _first(present, a("v_proj")) or fused
    kv = a("kv_cache") if a("kv_cache") in present else None
    kv_window = tuple(dict.fromkeys(d for d in (k, v) if d)) or x
    if kv:
        rules[kv] = kv_window
    core = a("core")
    rules[core] = tuple(d for d in (q,) if d) + ((kv,) if kv else tuple(d for d in (k, v) if d and d != q))
    out_proj = _first(present, a("o_proj"), a("c_proj"), a("dense"), a("out_proj"))
    if out_proj:
        rules[out_proj] = (core,) if core in present else ((q,) if q else x)
    if attn:
        rules[attn] = (out_proj,) if out_proj else ((core,) if core in present else x)
    attn_out = (attn,) if attn and attn in present else ()
    if gemma2:
        rules["post_attention_layernorm"] = attn_out or x
        rules["pre_feedforward_layernorm"] = x + (("post_attention_layernorm",) if "post_attention_layernorm" in present else attn_out)
    elif mlp_norm:
        rules[mlp_norm] = x + attn_out
    mlp_in = (mlp_norm,) if mlp_norm else x + attn_out
    for proj in ("gate_proj", "up_proj", "gate_up_proj", "c_fc", "fc1", "w1", "w3"):
        rules[m(proj)] = mlp_in
    gate = _first(present, m("gate_proj"), m("gate_up_proj"), m("c_fc"), m("fc1"))
    up = _first(present, m("up_proj"), m("gate_up_proj"))
    act = _first(present, m("act_fn"), m("act"), m("activation_fn"))
    if act:
        rules[act] = (gate,) if gate else mlp_in
    hidden = m("down_proj.input")
    rules[hidden] = tuple(dict.fromkeys(d for d in (act, up) if d)) or mlp_in
    for proj in ("down_proj", "c_proj", "fc2", "w2"):
        if hidden in present and proj == "down_proj":
            rules[m(proj)] = (hidden,)
        else:
            rules[m(proj)] = tuple(dict.fromkeys(d for d in (act, up if proj == "down_proj" else None) if d)) or mlp_in
    mlp_proj = _first(present, m("down_proj"), m("c_proj"), m("fc2"), m("w2"))
    if mlp:
        rules[mlp] = (mlp_proj,) if mlp_proj else mlp_in
    mlp_out = (mlp,) if mlp and mlp in present else ()
    if gemma2:
        rules["post_feedforward_layernorm"] = mlp_out or mlp_in
        rules[""] = x + tuple(n for n in ("post_attention_layernorm", "post_feedforward_layernorm") if n in present)
    else:
        rules[""] = x + attn_out + mlp_out
    if set(rels) <= {"", kv} and kv:  # layers granularity: the layer output and its K/V cache only
        rules[kv] = x
        rules[""] = x + (kv,)
    return {rel: (tuple(d for d in deps if d == "X" or d in present), "structure") for rel, deps in rules.items()}


def dataflow(points: list[tuple[str, str]]) -> dict[str, Consumes]:
    """The dataflow map of capture points given in execution order.

    Args:
        points: ``(name, kind)`` pairs in execution order, as a run records them (kinds as in
            :class:`tracer.execute.records.CaptureRecord`; ``logits`` included or not).

    Returns:
        name → :class:`Consumes` for every point. Dependencies name only points of ``points``.
        (Memoised per point list: every run of one model and granularity shares it.)
    """
    return dict(_dataflow(tuple((str(n), str(k)) for n, k in points)))


@functools.lru_cache(maxsize=16)
def _dataflow(points: tuple[tuple[str, str], ...]) -> dict[str, Consumes]:
    names = [n for n, _ in points]
    kinds = dict(points)
    layers = [n for n, k in points if k == PointKind.LAYER]
    embedding = next((n for n, k in points if k == PointKind.EMBEDDING), None)
    layer_of: dict[str, str] = {}
    for n in names:
        owner = max((lay for lay in layers if n == lay or n.startswith(lay + ".")), key=len, default=None)
        if owner is not None:
            layer_of[n] = owner
    out: dict[str, Consumes] = {}
    prev_x = embedding
    prev_kv: str | None = None
    for li, lay in enumerate(layers):
        members = [n for n in names if layer_of.get(n) == lay]
        rels = [("" if n == lay else n[len(lay) + 1:]) for n in members]
        rules = _layer_rules(rels)
        seen: list[str] = []
        layer_kv = None
        for n, rel in zip(members, rels):
            if rel in rules:
                deps, rule = rules[rel]
            else:  # unknown module: everything that ran before it in this layer
                deps, rule = ("X",) + tuple(seen), "fallback"
            resolved = tuple(dict.fromkeys(
                (prev_x if d == "X" else f"{lay}.{d}" if d else lay) for d in deps if not (d == "X" and prev_x is None)))
            prefix: tuple[str, ...] = ()
            if kinds.get(n) == PointKind.KV_CACHE:
                prefix = (prev_kv,) if prev_kv else ()
                layer_kv = n
            out[n] = Consumes(points=tuple(r for r in resolved if r != n), prefix=prefix, rule=rule)
            seen.append(rel)
        prev_x = lay
        prev_kv = layer_kv or prev_kv
    for n, k in points:
        if n in out:
            continue
        if k == PointKind.EMBEDDING:
            out[n] = Consumes(points=())
        elif k == PointKind.FINAL_NORM:
            out[n] = Consumes(points=(layers[-1],) if layers else ())
        elif k == PointKind.LOGITS:
            norm = next((m for m, kk in points if kk == PointKind.FINAL_NORM), None)
            out[n] = Consumes(points=(norm,) if norm else ((layers[-1],) if layers else ()))
        else:  # outside any layer and of unknown kind: everything before it
            idx = names.index(n)
            out[n] = Consumes(points=tuple(names[:idx]), rule="fallback")
    return out
