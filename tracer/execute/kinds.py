"""What a capture point is: the kinds :func:`tracer.execute.points.discover_points` creates.

A ``str`` enum, so every kind is also its plain string: stored traces, JSON documents and code
that still compares strings read the same values (``PointKind.LAYER == "layer"``).
"""

from __future__ import annotations

import enum

from tracer.errors import TracerError

#: what ``tracer.capture`` and ``--granularity`` capture: the residual stream, or every sublayer too
GRANULARITIES = ("layers", "sublayers")


class PointKind(enum.StrEnum):
    """The kind of a capture point (``CaptureRecord.kind``, ``PointResult.kind``)."""

    EMBEDDING = "embedding"  # the embedding output
    LAYER = "layer"  # a decoder layer's output: the residual stream
    FINAL_NORM = "final_norm"
    LOGITS = "logits"  # the LM head's output
    LINEAR = "linear"  # an nn.Linear (or GPT-2's Conv1D) inside a layer
    NORM = "norm"
    ATTENTION = "attention"  # the attention block's output
    ATTENTION_CORE = "attention_core"  # the input of the attention's output projection
    MLP = "mlp"
    MLP_HIDDEN = "mlp_hidden"  # the input of a gated MLP's down projection
    ACTIVATION = "activation"
    KV_CACHE = "kv_cache"  # a layer's keys and values for all positions
    STATE = "state"  # a linear-attention (recurrent) layer's cached state after the run: recurrent + conv state
    MODULE = "module"  # any other module (tracer.capture(points=[...]))


#: the kinds of a layer's cache points (read from the HF cache after the run, no hook): the KV cache
#: of an attention layer, the recurrent/conv state of a linear-attention (GatedDeltaNet, Mamba) layer
CACHE_KINDS = frozenset({PointKind.KV_CACHE, PointKind.STATE})
#: the kinds of ``--granularity layers`` (the residual stream, the layers' caches, the logits); a point
#: of any other kind is inside a decoder layer (``--granularity sublayers``)
LAYER_KINDS = frozenset({PointKind.EMBEDDING, PointKind.LAYER, PointKind.FINAL_NORM, PointKind.LOGITS,
                         *CACHE_KINDS})


def point_kind(kind: str, name: str) -> PointKind:
    """``kind`` as a :class:`PointKind`.

    Raises:
        TracerError: a kind tracer does not know (a hook map's ``sublayers`` naming another kind, or
            a trace written by another version).
    """
    try:
        return PointKind(kind)
    except ValueError:
        raise TracerError(f"capture point {name} has kind {kind!r}, which this tracer does not know; "
                          f"kinds: {', '.join(PointKind)}") from None
