"""The model's side of the numeric contract: buffer precision, casting, attention per layer kind.

A bit-exact comparison depends on more than the parameters' dtype. A blanket ``model.to(bf16)``
after loading rounds the rotary ``inv_freq`` buffer to bf16, while ``from_pretrained(dtype=bf16)``
keeps it in float32 (on an H200 that alone makes SmolLM2 at N=250 diverge from layer 21);
Gemma's embedding scale is a buffer too; and a model with sliding-window layers runs two kinds
of attention. :func:`numeric_contract` records all of it for the trace header, and
:func:`contract_differences` names what differs between two headers (``tracer compare`` of two
files warns with it).

A KV cache that crosses a boundary (a KV connector from a prefill instance to a decode instance)
carries the numeric signature of the kernels that wrote it, and its bytes mean something only
under its producer's storage format: the producer's :class:`KVContract` is written beside the
cache (:func:`write_kv_contract`), read back by the consumer (:func:`read_kv_contract`) and held
against the consumer's own (:func:`check_kv_contract`) before any tensor of it is compared. A
difference that changes what the bytes mean (layout, storage dtype, quantization and scale
granularity, shapes, keys before or after RoPE, the cached tokens) is fatal: :func:`require_kv`
refuses it in one line naming both sides ("KV layout: producer NHD, consumer HND"), never a diff
of garbage; every other difference (kernels, accumulators, attention backend, TP and collective,
engine, version, device, ISA, engine settings) is named first in the report. The fields are
specified in ``traces/README.md`` ("The KV cache's numeric contract").
"""

from __future__ import annotations

import hashlib
import json
import operator
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tracer import schema
from tracer.errors import TracerError

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


# ---------------------------------------------------------------- the KV cache's contract

#: the file a producer's KV contract is written to, beside the cache it describes; its format name and version
KV_CONTRACT_FILE, KV_CONTRACT_FORMAT, KV_CONTRACT_VERSION = "tracer-kv-contract.json", "tracer-kv-contract", 1


@dataclass(frozen=True)
class KVContract(schema.Record):
    """What a KV cache's producer wrote, or what its consumer expects (``traces/README.md``: each field).

    Attributes:
        engine, version: who wrote it (its name in the table of engines, its version). device, device_name,
            isa: where (``cpu``, the CPU's model, the attention kernels' ISA; a GPU's ``sm_90``).
        model_dtype: the dtype the model computes in. storage_dtype: one stored element's dtype
            (``bfloat16``, ``float8_e4m3fn``).
        layout: the axes of what crosses: ``NHD`` token-major (tokens, kv_heads, dim), ``HND``
            head-major (kv_heads, tokens, dim). packing: how keys and values share the last axis
            (``keys|values per head``: each head's keys then its values).
        transfer: what crosses, in words (the connector and its files). transfer_unit: ``token`` (each
            row of what crosses is one token: the block size is free) or ``block-row`` (rows of the
            paged block interior: block size and layout must agree).
        block_size: tokens per KV block (0: not paged). cache_layout: the paged cache in memory
            (the engine's own name for it), where known.
        layers, kv_heads, head_dim: the cache's shape per token. keys: ``post-RoPE`` or ``pre-RoPE``.
        quant, scale: ``none``, or a format (``fp8_e4m3``, ``mxfp8``) and its scale granularity
            (``per-tensor fp32``, ``block 32 e8m0``).
        accumulator: op -> accumulator precision where known. kernels: what wrote the cache (``--kernels``).
        attention_backend: the attention kernel family (``CPU_ATTN``, ``FLASH_ATTN``, ``sdpa``).
        tp_degree, collective: tensor parallelism and its all-reduce.
        positions: ``[start, stop)`` of the positions the cache holds (the consumer: those it will look
            for). tokens_sha256: sha256 of those positions' token ids (:func:`tokens_sha256`).
        settings: engine settings (chunked-prefill budget, prefix caching, ...): compared key by key.
    """

    engine: str
    version: str
    device: str
    model_dtype: str
    storage_dtype: str
    layout: str
    transfer_unit: str
    block_size: int
    layers: int
    kv_heads: int
    head_dim: int
    positions: tuple[int, int] = (0, 0)
    tokens_sha256: str = ""
    packing: str = ""
    transfer: str = ""
    cache_layout: str = ""
    keys: str = "post-RoPE"
    quant: str = "none"
    scale: str = "none"
    attention_backend: str = ""
    accumulator: dict[str, str] = schema.field(default_factory=dict)
    kernels: tuple[str, ...] = ()
    tp_degree: int = 1
    collective: str = "none"
    device_name: str = ""
    isa: str = ""
    settings: dict[str, Any] = schema.field(default_factory=dict)

    def schema_check(self) -> str | None:
        if self.transfer_unit not in ("token", "block-row"):
            return f"transfer_unit {self.transfer_unit!r} is neither token nor block-row"
        if min(self.block_size, self.layers, self.kv_heads, self.head_dim) < 0 or self.tp_degree < 1:
            return "block_size, layers, kv_heads and head_dim must be >= 0 and tp_degree >= 1"
        return None


@dataclass(frozen=True)
class KVDifference(schema.Record):
    """One field on which a producer's and a consumer's KV contracts differ: its name in words, both
    values as text, whether the consumer would misread the bytes (``fatal``) and why."""

    field: str
    label: str
    producer: str
    consumer: str
    fatal: bool
    why: str = ""

    def line(self) -> str:
        """``KV storage dtype: producer bfloat16, consumer float32 (why)``."""
        return f"{self.label}: producer {self.producer}, consumer {self.consumer}" + (f" ({self.why})" if self.why else "")


@dataclass(frozen=True)
class KVContractCheck(schema.Record):
    """A producer's KV contract held against a consumer's (:func:`check_kv_contract`): the differences,
    fatal ones first, and the boundary the cache crossed in words (the KV connector and its medium)."""

    producer: KVContract
    consumer: KVContract
    differences: tuple[KVDifference, ...] = ()
    boundary: str = ""

    @property
    def fatal(self) -> tuple[KVDifference, ...]:
        """The differences that would make the consumer misread the bytes."""
        return tuple(d for d in self.differences if d.fatal)

    def lines(self) -> list[str]:
        """One line per difference (fatal ones first, marked); ``[]`` when the contracts agree."""
        return [("refused: " if d.fatal else "") + d.line() for d in self.differences]

    def summary(self) -> str:
        """One line: the contracts agree, or their first difference and how many more."""
        if not self.differences:
            return f"KV contract ({self.boundary}): producer and consumer agree on every field"
        more = len(self.differences) - 1
        return f"KV contract ({self.boundary}): {self.differences[0].line()}" + (f"; {more} more difference(s)" if more else "")

    def schema_extras(self, doc: dict[str, Any]) -> None:
        doc["fatal"], doc["summary"] = bool(self.fatal), self.summary()


#: the boundaries a run's KV cache can have crossed (``meta["kv_transfer"]["role"]``; ``traces/README.md``)
KV_TRANSFER_ROLES = ("miss", "load", "moved", "imported")


@dataclass(frozen=True)
class KvTransfer(schema.Record):
    """A run's ``meta["kv_transfer"]``: which boundary its KV cache crossed (``role``: ``miss``/``load``,
    prefill-decode's runs A and B; ``moved``, the HF cache handed to another device; ``imported``, an
    engine dump's cache), the positions handed over (``transferred``), the connector's ``files``, the
    ``boundary`` in words, the ``--producer`` difference, whether the handed-over positions are
    compared at the ``kv_cache`` points (``kv_compared``, ``kv_not_compared``: why not), the contract
    check (``contract``) and the producer's contract file, or for an import the reference's contract
    (``consumer``) and what is ``unknown``."""

    schema_sparse = True

    role: str
    transferred: schema.Count = 0
    files: schema.Count | None = None
    boundary: str | None = None
    producer: dict[str, Any] | None = None
    kv_compared: bool | None = None
    kv_not_compared: str | None = None
    contract: KVContractCheck | None = None
    contract_file: str | None = None
    consumer: KVContract | None = None
    unknown: str | None = None

    def schema_check(self) -> str | None:
        if self.role not in KV_TRANSFER_ROLES:
            return f"role {self.role!r} is none of {', '.join(KV_TRANSFER_ROLES)}"
        return None


#: (field, label, fatal?, why) in report order; fatal None: fatal only when what crosses is block rows
_KV_FIELDS: tuple[tuple[str, str, bool | None, str], ...] = (
    ("layout", "KV layout", True, "the consumer would read heads as tokens"),
    ("packing", "keys/values packing", True, "keys would be read as values"),
    ("storage_dtype", "KV storage dtype", True, "the bytes would be read as another type"),
    ("quant", "KV quantization", True, "the elements would be decoded with another format"),
    ("scale", "KV scale granularity", True, "the scales would apply to other elements"),
    ("transfer_unit", "transfer unit", True, "token rows against block rows"),
    ("block_size", "KV block size", None, "block rows of another block size hold other tokens"),
    ("kv_heads", "KV heads", True, "another shape"),
    ("head_dim", "head size", True, "another shape"),
    ("layers", "layers", True, "another shape"),
    ("keys", "keys", True, "the rotary embedding applied twice or never"),
    ("positions", "cached positions", True, "the consumer would load other positions than the files hold"),
    ("tokens_sha256", "cached tokens", True, "the cache is of another prompt"),
    ("attention_backend", "attention backend", False, ""),
    ("accumulator", "accumulator precision", False, ""),
    ("kernels", "kernels", False, ""),
    ("cache_layout", "paged cache layout", False, ""),
    ("tp_degree", "TP degree", False, ""),
    ("collective", "collective", False, ""),
    ("model_dtype", "model dtype", False, ""),
    ("engine", "engine", False, ""),
    ("version", "version", False, ""),
    ("device", "device", False, ""),
    ("device_name", "device name", False, ""),
    ("isa", "ISA", False, ""),
    ("transfer", "what crosses", False, ""),
    ("settings", "engine settings", False, ""),
)


def _kv_text(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k} {x}" for k, x in sorted(v.items())) or "none"
    if isinstance(v, (list, tuple)):
        return ".." .join(map(str, v)) if len(v) == 2 and all(isinstance(x, int) for x in v) else ", ".join(map(str, v))
    return str(v)


def check_kv_contract(producer: KVContract, consumer: KVContract, boundary: str = "") -> KVContractCheck:
    """``producer`` held against ``consumer``: every field that differs, fatal ones first (a field either
    side left unknown, ``""`` or empty, is no difference; ``settings`` are compared on the keys both name).
    Pure data: nothing runs."""
    block_rows = "block-row" in (producer.transfer_unit, consumer.transfer_unit)
    out: list[KVDifference] = []
    for name, label, fatal, why in _KV_FIELDS:
        p, c = getattr(producer, name), getattr(consumer, name)
        if name == "settings":
            p, c = ({k: v for k, v in a.items() if k in b} for a, b in ((p, c), (c, p)))
        if p == c or p in ("", (), {}) or c in ("", (), {}):
            continue
        bad = block_rows if fatal is None else fatal
        out.append(KVDifference(name, label, _kv_text(p), _kv_text(c), bool(bad), why if bad else ""))
    out.sort(key=lambda d: not d.fatal)
    return KVContractCheck(producer, consumer, tuple(out), boundary)


def require_kv(result: KVContractCheck) -> KVContractCheck:
    """``result`` when nothing in it is fatal.

    Raises:
        TracerError: one line naming the first fatal difference with both sides (and the others' names).
    """
    bad = result.fatal
    if bad:
        more = f" (and {', '.join(d.label for d in bad[1:])})" if len(bad) > 1 else ""
        raise TracerError(f"KV contract ({result.boundary or 'a boundary'}): {bad[0].line()}{more}; the consumer would "
                          "misread the producer's KV cache, so tracer compares nothing: configure both sides alike")
    return result


def tokens_sha256(token_ids: list[int]) -> str:
    """sha256 (hex) of ``token_ids`` as int64 little-endian bytes: a KV contract's ``tokens_sha256``."""
    return hashlib.sha256(b"".join(int(t).to_bytes(8, "little", signed=True) for t in token_ids)).hexdigest()


def write_kv_contract(contract: KVContract, folder: str | Path) -> Path:
    """Write ``contract`` as ``folder/tracer-kv-contract.json`` (``format``, ``format_version``, then the
    fields); returns the path."""
    path = Path(folder) / KV_CONTRACT_FILE
    doc = {"format": KV_CONTRACT_FORMAT, "format_version": KV_CONTRACT_VERSION, **contract.to_dict()}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def read_kv_contract(path: str | Path) -> KVContract:
    """The contract :func:`write_kv_contract` wrote (``path``: the file or its folder).

    Raises:
        TracerError: no contract there (a cache without one cannot be checked), not JSON, another
            format or a later version, or a field of the wrong type (one line each).
    """
    p = Path(path)
    p = p / KV_CONTRACT_FILE if p.is_dir() else p
    if not p.is_file():
        raise TracerError(f"no KV contract at {p}: its producer wrote none, so the cache cannot be checked; "
                          "produce the cache with tracer")
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise TracerError(f"KV contract {p} is not readable JSON ({e}); produce the cache again") from None
    if not isinstance(doc, dict) or doc.get("format") != KV_CONTRACT_FORMAT:
        raise TracerError(f"{p} is not a tracer KV contract (its format is not {KV_CONTRACT_FORMAT!r})")
    if not isinstance(doc.get("format_version"), int) or doc["format_version"] > KV_CONTRACT_VERSION:
        raise TracerError(f"KV contract {p} has format_version {doc.get('format_version')!r}; this tracer reads "
                          f"1..{KV_CONTRACT_VERSION}: upgrade tracer")
    return schema.decode(KVContract, {k: v for k, v in doc.items() if k not in ("format", "format_version")}, str(p))
