"""The dataflow map: which capture points each capture point consumes.

The origin analysis (:func:`tracer.diff.origins.classify_origins`) calls a differing capture point an
**origin** when everything it consumed was bit-identical in both runs. This module says what
"everything it consumed" is, from each point's **role** in the decoder block (recorded with the
capture from the model's family descriptor, ``hooks/*.toml``, and stored in the trace), so a
stored trace is analysed without the model and a new family with other module names needs no
code here. The rules are :data:`tracer.execute.roles.DATAFLOW`, over roles; in the names of the
Llama and GPT-2 families they read:

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
                                       ``kv_cache`` (or ``state``)
``<mixer>.state`` (a hybrid model's    everything that ran before it in its layer (the mixer's
linear-attention layer: its recurrent  in-projections carry no role) and, for the positions
and conv state after the run)          before the window, the previous layer's cache point
``<mixer>.out_proj``                   everything before it in its layer (the state included)
``<mixer>`` (the mixer block)          its ``out_proj`` (at layers granularity: the ``state``)
=====================================  ==================================================

Outside the layers: the embedding consumes the token ids (identical by construction, so a
differing embedding is an origin); the final norm consumes the last layer; the logits consume the
final norm.

**KV cache positions before the compared window** were computed by forward passes that tracer
does not trace position by position (in a cache hit: the earlier request's prefill). Their only
recorded upstream is the previous layer's cache at those positions, which stands in for the
hidden states of that pass: a layer whose prefix K/V differ while the previous layer's agreed is
an origin *in the prefix pass* (the divergence was born there, between the two caches). A
linear-attention layer's ``state`` mixes every position into one tensor, so it has no rows to
split: it is an origin only when its inputs at the compared positions and the previous layer's
cache point (standing in for the prefix pass) all agreed.

A capture point without a role (a module the descriptor does not name) conservatively consumes
X and every capture point that ran before it in the same layer, so it can only be an origin if
the whole layer was identical up to it. Points given without roles (a trace written before roles
were stored) get the roles of the descriptor that knows the most of their layer's names
(:func:`tracer.execute.family.infer_roles`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from tracer import schema
from tracer.execute.family import infer_roles
from tracer.execute.roles import DATAFLOW, VIRTUAL_ROLES
from tracer.execute.kinds import CACHE_KINDS, PointKind

#: capture kinds that name their role (points tracer adds itself)
_KIND_ROLES = {kind: role for role, (_suffix, kind) in VIRTUAL_ROLES.items()}


@dataclass(frozen=True)
class Consumes(schema.Record):
    """What one capture point consumes.

    Attributes:
        points: capture names whose outputs it consumes at the compared positions (or at all
            positions, for a ``kv_cache`` dependency).
        prefix: capture names standing in for its inputs at positions *before* the compared
            window (only cache points have these: the previous layer's ``kv_cache`` and ``state``).
        rule: ``structure`` (from the point's role) or ``fallback`` (no role: everything before
            it in the layer).
    """

    points: tuple[str, ...]
    prefix: tuple[str, ...] = ()
    rule: str = "structure"


def _resolve(groups: list[list[str]], present: dict[str, str]) -> tuple[str, ...]:
    """The dependencies of one rule: per group, the first alternative whose roles are all present
    (``X`` always is), as layer-relative names ("X" for the layer input)."""
    out: list[str] = []
    for group in groups:
        for alt in group:
            parts = alt.split("+")
            if all(r == "X" or r in present for r in parts):
                out.extend("X" if r == "X" else present[r] for r in parts)
                break
    return tuple(dict.fromkeys(out))


def _layer_rules(members: list[tuple[str, str, str]]) -> dict[str, tuple[str, ...]]:
    """rel → its dependencies as rels ("X" = the layer input), for the members with a known role
    (``members``: ``(rel, kind, role)``, rel ``""`` = the layer output)."""
    rels = [rel for rel, _, _ in members]
    # roles recorded with the capture are the truth; a layer without any (a trace written before
    # roles were stored, or names given alone) gets the roles of the descriptor that fits best
    guessed = infer_roles([r for r in rels if r]) if not any(role for rel, _, role in members if rel) else {}
    roles: dict[str, str] = {}
    for rel, kind, role in members:
        role = role or ("layer" if rel == "" else guessed.get(rel) or _KIND_ROLES.get(kind, ""))
        if role:
            roles[rel] = role
    present: dict[str, str] = {}
    for rel, role in roles.items():
        present.setdefault(role, rel)
    return {rel: _resolve(DATAFLOW[role], present) for rel, role in roles.items() if role in DATAFLOW}


def dataflow(points: Sequence[tuple[str, ...]]) -> dict[str, Consumes]:
    """The dataflow map of capture points given in execution order.

    Args:
        points: ``(name, kind)`` or ``(name, kind, role)`` tuples in execution order, as a run
            records them (kinds and roles as in :class:`tracer.execute.records.CaptureRecord`;
            ``logits`` included or not).

    Returns:
        name → :class:`Consumes` for every point. Dependencies name only points of ``points``.
        (Memoised per point list: every run of one model and granularity shares it.)
    """
    return dict(_dataflow(tuple((str(p[0]), str(p[1]), str(p[2]) if len(p) > 2 and p[2] else "") for p in points)))


@functools.lru_cache(maxsize=16)
def _dataflow(points: tuple[tuple[str, str, str], ...]) -> dict[str, Consumes]:
    names = [n for n, _, _ in points]
    kinds = {n: k for n, k, _ in points}
    layers = [n for n, k, _ in points if k == PointKind.LAYER]
    embedding = next((n for n, k, _ in points if k == PointKind.EMBEDDING), None)
    layer_of: dict[str, str] = {}
    for n in names:
        owner = max((lay for lay in layers if n == lay or n.startswith(lay + ".")), key=len, default=None)
        if owner is not None:
            layer_of[n] = owner
    out: dict[str, Consumes] = {}
    prev_x = embedding
    prev_kv: tuple[str, ...] = ()  # the cache points of the last layer that had any
    for lay in layers:
        members = [(n, k, r) for n, k, r in points if layer_of.get(n) == lay]
        rels = [("" if n == lay else n[len(lay) + 1:]) for n, _, _ in members]
        rules = _layer_rules([(rel, k, r) for rel, (_, k, r) in zip(rels, members)])
        seen: list[str] = []
        layer_kv: list[str] = []
        for (n, _, _), rel in zip(members, rels):
            if rel in rules:
                deps, rule = rules[rel], "structure"
            else:  # no role: everything that ran before it in this layer
                deps, rule = ("X",) + tuple(seen), "fallback"
            resolved = tuple(dict.fromkeys(
                (prev_x if d == "X" else f"{lay}.{d}" if d else lay) for d in deps if not (d == "X" and prev_x is None)))
            prefix: tuple[str, ...] = ()
            if kinds.get(n) in CACHE_KINDS:
                prefix = prev_kv
                layer_kv.append(n)
            out[n] = Consumes(points=tuple(r for r in resolved if r != n), prefix=prefix, rule=rule)
            seen.append(rel)
        prev_x = lay
        prev_kv = tuple(layer_kv) or prev_kv
    for n, k, _ in points:
        if n in out:
            continue
        if k == PointKind.EMBEDDING:
            out[n] = Consumes(points=())
        elif k == PointKind.FINAL_NORM:
            out[n] = Consumes(points=(layers[-1],) if layers else ())
        elif k == PointKind.LOGITS:
            norm = next((m for m, kk, _ in points if kk == PointKind.FINAL_NORM), None)
            out[n] = Consumes(points=(norm,) if norm else ((layers[-1],) if layers else ()))
        else:  # outside any layer and of unknown kind: everything before it
            idx = names.index(n)
            out[n] = Consumes(points=tuple(names[:idx]), rule="fallback")
    return out
