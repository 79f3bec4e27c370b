"""The KV cache's numeric contract, at a boundary it crosses.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracer import schema
from tracer.errors import TracerError


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
