"""The roles of a decoder block as data: what each module of a layer plays, tracer's virtual points.

A **role** (:data:`ROLES`) is what a module does in a transformer block, whatever the family calls
it (the attention and its norm, the q/k/v/o projections or a fused qkv, the MLP and its norm,
gate/up/down or a fused gate_up, the activation, post-norms, a hybrid's linear-attention mixer); a
family descriptor (:mod:`tracer.execute.family`) says which module path plays it. Over roles, not
module names, tracer knows the capture kind of each point, the points it adds itself
(:data:`VIRTUAL_ROLES`), what each role consumes (:data:`DATAFLOW`, for :mod:`tracer.diff.dataflow`)
and how tensor parallelism shards it (the ``*_ROLES`` tuples).
"""

from __future__ import annotations

from tracer.execute.kinds import PointKind

#: role inside a decoder layer → the capture kind of its point
ROLES: dict[str, PointKind] = {
    "attention": PointKind.ATTENTION,                    # the attention block (its output: after o_proj)
    "attn_norm": PointKind.NORM,                         # the norm that feeds the attention (pre-norm)
    "q_proj": PointKind.LINEAR, "k_proj": PointKind.LINEAR, "v_proj": PointKind.LINEAR,
    "qkv_proj": PointKind.LINEAR,                        # fused q/k/v (Phi-3 qkv_proj, GPT-2 c_attn)
    "q_norm": PointKind.NORM, "k_norm": PointKind.NORM,  # per-head norms of the queries / keys (Qwen3, Gemma 3)
    "o_proj": PointKind.LINEAR,                          # the attention output projection (consumes the core)
    "attn_post_norm": PointKind.NORM,  # the attention output's norm before the residual add (Gemma 2/3, OLMo 2)
    "mlp_norm": PointKind.NORM,                          # the norm that feeds the MLP: residual + attention, normed
    "mlp": PointKind.MLP,                                # the MLP block
    "gate_proj": PointKind.LINEAR, "up_proj": PointKind.LINEAR,
    "gate_up_proj": PointKind.LINEAR,                    # fused gate/up (Phi-3)
    "act": PointKind.ACTIVATION,                         # the activation function module
    "down_proj": PointKind.LINEAR,                       # the MLP output projection
    "mlp_post_norm": PointKind.NORM,  # the MLP output's norm before the residual add (Gemma 2/3, OLMo 2)
    # hybrid models: a linear-attention / state-space token mixer in place of (or beside) the attention
    "linear_attention": PointKind.ATTENTION,  # the mixer block (Qwen3.5's GatedDeltaNet, a Mamba block); its output
    "linear_out_proj": PointKind.LINEAR,      # its output projection (reads the recurrent state's result)
}
#: roles of the points tracer adds itself (no module of their own): name suffix and kind
VIRTUAL_ROLES: dict[str, tuple[str, PointKind]] = {
    "attention_core": ("core", PointKind.ATTENTION_CORE),  # <attention>.core: the input of o_proj
    "kv_cache": ("kv_cache", PointKind.KV_CACHE),          # <attention>.kv_cache: the layer's keys and values
    "mlp_hidden": ("input", PointKind.MLP_HIDDEN),         # <down_proj>.input: act(gate) * up of a gated MLP
    "state": ("state", PointKind.STATE),                   # <linear_attention>.state: its recurrent + conv state
}

#: what each role consumes: a list of groups; each group is a list of alternatives in order of
#: preference, the first whose roles are all captured wins (``a+b``: both; ``X``: the layer's
#: input, i.e. the previous layer's output or the embedding). Used by :mod:`tracer.diff.dataflow`.
DATAFLOW: dict[str, list[list[str]]] = {
    "attn_norm": [["X"]],
    "q_proj": [["attn_norm", "X"]], "k_proj": [["attn_norm", "X"]], "v_proj": [["attn_norm", "X"]],
    "qkv_proj": [["attn_norm", "X"]],
    "q_norm": [["q_proj", "qkv_proj"]], "k_norm": [["k_proj", "qkv_proj"]],
    "kv_cache": [["k_norm", "k_proj", "qkv_proj", "X"], ["v_proj", "qkv_proj", "X"]],
    "attention_core": [["q_norm", "q_proj", "qkv_proj"], ["kv_cache", "k_norm+v_proj", "k_proj+v_proj", "qkv_proj"]],
    "o_proj": [["attention_core", "q_norm", "q_proj", "qkv_proj", "X"]],
    "attention": [["o_proj", "attention_core", "X"]],
    "attn_post_norm": [["attention", "X"]],
    "mlp_norm": [["X"], ["attn_post_norm", "attention"], ["linear_attention"]],
    "gate_proj": [["mlp_norm", "X+attn_post_norm", "X+attention", "X"]],
    "up_proj": [["mlp_norm", "X+attn_post_norm", "X+attention", "X"]],
    "gate_up_proj": [["mlp_norm", "X+attn_post_norm", "X+attention", "X"]],
    "act": [["gate_proj", "gate_up_proj", "up_proj", "mlp_norm", "X+attn_post_norm", "X+attention", "X"]],
    "mlp_hidden": [["act", "gate_proj", "mlp_norm", "X+attn_post_norm", "X+attention", "X"],
                   ["up_proj", "gate_up_proj"]],
    "down_proj": [["mlp_hidden", "act", "mlp_norm", "X+attn_post_norm", "X+attention", "X"]],
    "mlp": [["down_proj", "mlp_norm", "X+attn_post_norm", "X+attention", "X"]],
    "mlp_post_norm": [["mlp", "mlp_norm", "X+attn_post_norm", "X+attention", "X"]],
    "linear_attention": [["linear_out_proj", "state", "X"]],
    "layer": [["X"], ["attn_post_norm", "attention", "kv_cache"], ["linear_attention", "state"],
              ["mlp_post_norm", "mlp"]],
}
# ``state`` has no rule on purpose: the recurrent state reads the mixer's in-projections (and its
# convolution), which carry no role, so it consumes everything that ran before it in its layer (the
# conservative fallback of :mod:`tracer.diff.dataflow`) and, before the compared window, the
# previous layer's cache point, as a ``kv_cache`` does.

#: Megatron-style tensor parallelism by role: output rows sharded / input columns sharded + all_reduce
COLUMN_PARALLEL_ROLES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL_ROLES = ("o_proj", "down_proj")
#: fused projections (tracer's TP sharding does not split them by whole heads)
FUSED_ROLES = ("qkv_proj", "gate_up_proj")
#: roles whose tensors a TP rank holds a feature slice of (concatenated over the ranks in rank order)
SHARDED_ROLES = (*COLUMN_PARALLEL_ROLES, "attention_core", "mlp_hidden", "act", "kv_cache", "q_norm", "k_norm")
#: sharded roles whose tensors are ``(T, heads, head_dim)``: a rank holds whole heads (concatenated along heads)
HEAD_SHARDED_ROLES = ("q_norm", "k_norm")


__all__ = ["ROLES", "VIRTUAL_ROLES", "DATAFLOW", "COLUMN_PARALLEL_ROLES", "ROW_PARALLEL_ROLES", "FUSED_ROLES",
           "SHARDED_ROLES", "HEAD_SHARDED_ROLES"]
