"""The model's side of the numeric contract: buffer precision, casting, attention per layer kind.

A bit-exact comparison depends on more than the parameters' dtype. A blanket ``model.to(bf16)``
after loading rounds the rotary ``inv_freq`` buffer to bf16, while ``from_pretrained(dtype=bf16)``
keeps it in float32 (on an H200 that alone makes SmolLM2 at N=250 diverge from layer 21);
Gemma's embedding scale is a buffer too; and a model with sliding-window layers runs two kinds
of attention. :func:`numeric_contract` records all of it for the trace header, and
:func:`contract_differences` names what differs between two headers (``tracer compare`` of two
files warns with it).

The KV cache's contract at a boundary it crosses: :mod:`tracer.load.kv_contract`.
"""

from __future__ import annotations

import json
import operator
import re
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tracer import schema

#: buffers that ``from_pretrained`` computes in float32 whatever the parameters' dtype
_FLOAT32_BUFFERS = re.compile(r"(^|\.|_)inv_freq$")
#: how a config marks sliding-window layers, as transformers writes it: ``(field of per-layer kinds,
#: the kinds that slide, field of the window in tokens)``; a family descriptor may say otherwise
SLIDING = ("layer_types", ("sliding_attention",), "sliding_window")


@dataclass(frozen=True)
class BufferFacts(schema.Record):
    """One floating-point buffer: its dtype, device, whether ``state_dict`` saves it, its shape."""

    dtype: str | None = None
    device: str | None = None
    persistent: bool | None = None
    shape: schema.Shape | None = None


@dataclass(frozen=True)
class CastAfterLoad(schema.Record):
    """Whether the model was cast after loading (``detected``; None: unknown), and the evidence."""

    detected: bool | None = None
    evidence: tuple[str, ...] = ()


@dataclass(frozen=True)
class AttentionKind(schema.Record):
    """The attention of one layer kind: what its modules run, its decoder-layer indices, and the
    window in tokens of a sliding kind (None: global attention)."""

    implementation: str | None = None
    layers: tuple[schema.Count, ...] = ()
    sliding_window: schema.Count | None = None


@dataclass(frozen=True)
class NumericContract(schema.Record):
    """The model's side of the numeric contract (the trace header's ``numeric_contract``).

    Attributes:
        parameter_dtypes: dtype name → number of parameter elements.
        buffers: ``module path.buffer`` → :class:`BufferFacts`, every floating-point buffer.
        cast_after_load: :class:`CastAfterLoad`.
        attention: layer kind (``full_attention``, ``sliding_attention``) → :class:`AttentionKind`.
    """

    parameter_dtypes: dict[str, schema.Count] = schema.field(default_factory=dict)
    buffers: dict[str, BufferFacts] = schema.field(default_factory=dict)
    cast_after_load: CastAfterLoad | None = None
    attention: dict[str, AttentionKind] = schema.field(default_factory=dict)


def _dtype(t: torch.dtype) -> str:
    return str(t).removeprefix("torch.")


def float_buffers(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Every floating-point buffer: ``{module path.buffer: {"dtype", "device", "persistent", "shape"}}``.

    ``dtype`` is the canonical name (``float32``), ``device`` the tensor's device string,
    ``persistent`` whether ``state_dict`` saves it, ``shape`` a list of ints. Sorted by name.
    """
    out: dict[str, dict[str, Any]] = {}
    for mod_name, mod in model.named_modules():
        for b_name, buf in mod._buffers.items():
            if buf is None or not torch.is_floating_point(buf):
                continue
            key = f"{mod_name}.{b_name}" if mod_name else b_name
            out[key] = BufferFacts(_dtype(buf.dtype), str(buf.device), b_name not in mod._non_persistent_buffers_set,
                                   tuple(buf.shape)).to_dict()
    return dict(sorted(out.items()))


def parameter_dtypes(model: nn.Module) -> dict[str, int]:
    """``{dtype name: number of parameter elements}`` (one entry for a model in one dtype)."""
    counts: dict[str, int] = {}
    for p in model.parameters():
        counts[_dtype(p.dtype)] = counts.get(_dtype(p.dtype), 0) + p.numel()
    return counts


def cast_after_load(model: nn.Module) -> dict[str, Any]:
    """Whether the model was cast after loading (``model.to(dtype)``), with the evidence.

    Evidence (any one suffices): a rotary ``inv_freq`` buffer that is not float32
    (``from_pretrained(dtype=...)`` and tracer's loaders keep it float32; ``.to(dtype)`` rounds
    it), or ``config.dtype`` naming another floating dtype than the parameters'. A float32
    model cast to float32 leaves no trace and is not detected (nothing was rounded).

    Returns:
        ``{"detected": bool, "evidence": [str, ...]}``.
    """
    evidence = []
    for name, b in float_buffers(model).items():
        if _FLOAT32_BUFFERS.search(name) and b["dtype"] != "float32":
            evidence.append(f"{name} is {b['dtype']} (from_pretrained keeps it float32)")
    params = parameter_dtypes(model)
    config = getattr(model, "config", None)
    declared = getattr(config, "dtype", None) if config is not None else None
    declared = declared if declared is not None else getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    if isinstance(declared, torch.dtype) and len(params) == 1 and _dtype(declared) not in params:
        evidence.append(f"config.dtype is {_dtype(declared)} but the parameters are {next(iter(params))}")
    return {"detected": bool(evidence), "evidence": evidence}


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _decoder_layers(model: nn.Module, n_layers: int) -> list[nn.Module]:
    """The decoder layers: the shallowest ``nn.ModuleList`` of ``n_layers`` modules ([] if none)."""
    lists = [(name.count("."), m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and n_layers and len(m) == n_layers]
    return list(min(lists, key=lambda x: x[0])[1]) if lists else []


def _implementation(layer: nn.Module) -> str | None:
    """The attention implementation a decoder layer's attention runs: the ``_attn_implementation``
    of the config held by its first submodule that holds one (HF attention modules keep theirs)."""
    for mod in layer.modules():
        impl = getattr(getattr(mod, "config", None), "_attn_implementation", None)
        if impl:
            return impl
    return None


def attention_kinds(model: nn.Module, sliding: tuple[str, tuple[str, ...], str] = SLIDING) -> dict[str, dict[str, Any]]:
    """The attention of each layer kind: ``{kind: {"implementation", "layers", "sliding_window"}}``.

    ``kind`` is the config's per-layer kind (``sliding[0]``, ``layer_types``: ``full_attention``,
    ``sliding_attention``; ``full_attention`` for every layer of a model without it), ``layers``
    the decoder-layer indices of that kind, ``sliding_window`` the window in tokens
    (``config.<sliding[2]>``) for the kinds ``sliding[1]``, None for global attention,
    ``implementation`` what the layers' attention modules run (``sdpa``, ``eager``, ...; the
    model's ``_attn_implementation`` where a module does not say). ``sliding`` comes from the
    model's family descriptor (``[sliding]`` in ``hooks/*.toml``).
    """
    config = _text_config(getattr(model, "config", None))
    if config is None:
        return {}
    types_field, sliding_kinds, window_field = sliding
    n_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    types = list(getattr(config, types_field, None) or ["full_attention"] * n_layers)
    default_impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    impl_of = {i: _implementation(layer) or default_impl for i, layer in enumerate(_decoder_layers(model, n_layers))}
    window = getattr(config, window_field, None)
    layers: dict[str, list[int]] = {}
    impls: dict[str, set[Any]] = {}
    for i, kind in enumerate(types):
        layers.setdefault(str(kind), []).append(i)
        impls.setdefault(str(kind), set()).add(impl_of.get(i, default_impl))
    return {kind: AttentionKind(next(iter(impls[kind])) if len(impls[kind]) == 1 else "mixed", tuple(ls),
                                int(window) if kind in sliding_kinds and window else None).to_dict()
            for kind, ls in layers.items()}


def sliding_layers(contract: dict[str, Any]) -> list[int]:
    """Decoder-layer indices with sliding-window attention, from a :func:`numeric_contract` dict."""
    kinds = (contract or {}).get("attention", {}) or {}
    return sorted(i for k in kinds.values() if k.get("sliding_window") for i in k.get("layers", []))


def attention_facts(contract: dict[str, Any]) -> dict[str, Any]:
    """Report facts for a model with sliding-window layers: ``{"sliding_layers": [i, ...],
    "sliding_window": tokens}``; ``{}`` for a model whose layers all attend globally."""
    layers = sliding_layers(contract)
    if not layers:
        return {}
    window = next(k["sliding_window"] for k in contract["attention"].values() if k.get("sliding_window"))
    return {"sliding_layers": layers, "sliding_window": window}


#: model → (fingerprint, contract): every run of a loaded model writes the same contract until the
#: model is cast or moved, so it is computed once per state (it walks every module and parameter)
_CONTRACTS: "weakref.WeakKeyDictionary[nn.Module, tuple[Any, str]]" = weakref.WeakKeyDictionary()


#: model → (its top-level children, its parameters, the (module, name) of each buffer): a cast or a
#: move changes the dtype and device of these same parameter objects and puts new buffer tensors
#: under these names, so the fingerprint reads them without walking the module tree again (a walk
#: costs ~1 ms per 300 parameters)
_TENSORS: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, tuple, tuple]]" = weakref.WeakKeyDictionary()


_DTYPE_DEVICE = operator.attrgetter("dtype", "device")


def _fingerprint(model: nn.Module) -> tuple:
    """What a cast or a move changes: each parameter's and buffer's dtype and device, in order."""
    children = tuple(model._modules.values())
    hit = _TENSORS.get(model)
    if hit is None or hit[0] != children or any(a is not b for a, b in zip(hit[0], children)):
        owners = tuple((m, n) for m in model.modules() for n, b in m._buffers.items() if b is not None)
        hit = (children, tuple(model.parameters()), owners)
        _TENSORS[model] = hit
    buffers = [m._buffers.get(n) for m, n in hit[2]]  # a move or cast puts new buffer tensors there
    return (tuple(map(_DTYPE_DEVICE, hit[1])),  # map: no Python call per parameter (hundreds per run)
            tuple(map(_DTYPE_DEVICE, [b for b in buffers if b is not None])),
            getattr(getattr(model, "config", None), "_attn_implementation", None))


def numeric_contract(model: nn.Module, sliding: tuple[str, tuple[str, ...], str] = SLIDING) -> dict[str, Any]:
    """The model's numeric contract for the trace header, a :class:`NumericContract`'s document;
    computed once per model state (a cast, a move or another attention implementation computes it again).

    Args:
        sliding: how the config marks sliding-window layers (:func:`attention_kinds`).

    Returns:
        ``{"parameter_dtypes": {dtype: elements}, "buffers": float_buffers(model),
        "cast_after_load": cast_after_load(model), "attention": attention_kinds(model)}``
        (a fresh copy: callers may change it).
    """
    key = (_fingerprint(model), sliding)
    hit = _CONTRACTS.get(model)
    if hit is None or hit[0] != key:
        contract = NumericContract(
            parameter_dtypes(model), {k: BufferFacts.from_dict(v) for k, v in float_buffers(model).items()},
            CastAfterLoad.from_dict(cast_after_load(model)),
            {k: AttentionKind.from_dict(v) for k, v in attention_kinds(model, sliding).items()}).to_dict()
        hit = (key, json.dumps(contract))  # plain JSON data: a fresh copy is one json.loads (a deepcopy costs 5x more)
        _CONTRACTS[model] = hit
    return json.loads(hit[1])


def contract_differences(header_a: dict[str, Any], header_b: dict[str, Any]) -> list[str]:
    """What differs in the numeric contract of two trace headers, one phrase per difference.

    Compared: the model's parameter dtypes, every floating-point buffer's dtype and device
    (a buffer on one side only counts too), whether the model was cast after loading, and each
    attention kind's implementation, layers and window. Headers written before the contract was
    recorded (no ``numeric_contract`` key) give one phrase saying it is recorded in one trace only
    (said after ``the numeric contract differs:``, so the phrase does not name the contract again).
    """
    ca, cb = header_a.get("numeric_contract"), header_b.get("numeric_contract")
    if not isinstance(ca, dict) or not isinstance(cb, dict):
        if ca is None and cb is None:
            return []
        return ["recorded in one trace only (buffer dtypes, casting, attention kinds)"]
    out = []
    if ca.get("parameter_dtypes") != cb.get("parameter_dtypes"):
        out.append(f"parameter dtypes {ca.get('parameter_dtypes')} (A) vs {cb.get('parameter_dtypes')} (B)")
    ba, bb = ca.get("buffers", {}) or {}, cb.get("buffers", {}) or {}
    for name in sorted(set(ba) | set(bb)):
        xa, xb = ba.get(name), bb.get(name)
        if xa is None or xb is None:
            out.append(f"buffer {name} exists only in {'B' if xa is None else 'A'}")
            continue
        for key in ("dtype", "device"):
            if xa.get(key) != xb.get(key):
                out.append(f"buffer {name} {key} {xa.get(key)} (A) vs {xb.get(key)} (B)")
    da, db = (ca.get("cast_after_load") or {}).get("detected"), (cb.get("cast_after_load") or {}).get("detected")
    if da != db:
        yes = {True: "cast after loading", False: "not cast", None: "unknown"}
        out.append(f"model {yes[da]} (A) vs {yes[db]} (B)")
    ka, kb = ca.get("attention", {}) or {}, cb.get("attention", {}) or {}
    for kind in sorted(set(ka) | set(kb)):
        if ka.get(kind) != kb.get(kind):
            out.append(f"{kind} attention {_kind(ka.get(kind))} (A) vs {_kind(kb.get(kind))} (B)")
    return out


def _kind(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "absent"
    window = f", window {entry['sliding_window']}" if entry.get("sliding_window") else ""
    return f"{entry.get('implementation')} on {len(entry.get('layers', []))} layers{window}"
