"""The trace's facts as records: the header, a run's meta, and how older versions are read.

Store-layer module. The JSON a trace holds besides its tensors is the document of a
:mod:`tracer.schema` record, written from the record and checked by decoding it (one declaration
per fact; a value of the wrong type or range is one :class:`~tracer.errors.TracerError` line
naming it, before any code uses it):

==========================  =====================================================================
JSON                        record
==========================  =====================================================================
``/header`` ``json``        :class:`TraceHeader` (the :class:`Environment` flattened into it)
a run's ``plan``            :class:`tracer.plan.plans.RunPlan`
a run's ``meta``            :class:`RunMeta` (engine facts :class:`~tracer.execute.records.EngineFacts`,
                            scheduler facts :class:`~tracer.execute.records.SchedulerFacts`, ...)
an index entry's ``calls``  :class:`tracer.execute.records.Call`
``/comparisons/<name>``     :class:`tracer.diff.result.Comparison` (its facts
                            :class:`tracer.diff.result.ComparisonFacts`)
==========================  =====================================================================

Format version 3 writes these documents. Versions 1 and 2 wrote the same documents with three
differences, which :func:`upgrade_v2` (registered for both, :mod:`tracer.store.formats`) turns
into version 3's before they are checked or used: the header's ``block_size`` was the scenario's
default (16) whatever the engine used (a paged engine may run at 32), a run's scheduler facts
were under the key of its engine's name (``meta[meta["engine"]["engine"]]``), and the HF engine's
KV block size and token budget were sentences where version 3 has ``0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracer import schema
from tracer.execute.family import FamilyFacts
from tracer.execute.records import EngineFacts, SchedulerFacts
from tracer.load.contract import NumericContract
from tracer.load.kv_contract import KvTransfer
from tracer.load.models import ModelInfo
from tracer.plan.plans import Scenario
from tracer.store.budget import StoreAuto
from tracer.store.environment import Environment


@dataclass(frozen=True)
class EngineDumpRef(schema.Record):
    """An imported engine dump's header entry: the engine, the dump's path, the reference run."""

    engine: str
    path: str
    reference: str | None = None


@dataclass(frozen=True)
class TraceHeader(schema.Document):
    """The trace header (``/header`` ``json``): the environment, then the run-level facts merged
    in by the command that wrote the trace. A fact that is not known is left out (a header
    written by hand may hold any subset); it reads like its document (``header["model"]``).

    Attributes:
        environment: :class:`Environment`, its keys at the top level of the document.
        model: the loaded model (:class:`~tracer.load.models.ModelInfo`), or its name.
        numeric_contract: the model's side of the contract (:class:`~tracer.load.contract.NumericContract`).
        family: the family descriptor used (:class:`~tracer.execute.family.FamilyFacts`).
        granularity, dtype, attn_implementation: as captured; n_tokens: N.
        store: the ``--store`` mode; kv_cache: whether KV-cache points were captured.
        sublayers_width: elements per position and run of the model's ``--granularity sublayers``
            points, with ``kv_cache`` as here (:func:`tracer.pipeline.sublayers_width`: what the
            suggestion's size of a sublayers trace is counted from); None where no descriptor names
            them, and in traces written before it was recorded.
        scenario: the scenario run (:class:`~tracer.plan.plans.Scenario`; an audit's names its
            levels in ``params``), or its name.
        block_size: the KV-cache block size both runs used (their engines' setting, else the
            scenario's); None when the runs keep a contiguous KV cache or use different sizes.
        block_sizes: each run's (A, B), None for a run with a contiguous KV cache.
        split_points: the compared window's first position.
        options: the run's options (:meth:`tracer.config.RunConfig.to_dict`).
        tensor_parallel: a distributed TP run's world, backend, collectives and rendezvous.
        engines: run name → its engine's facts, known before it ran (a run on an engine other than HF).
        engine_dump: an imported engine dump (:class:`EngineDumpRef`).
        audit, audit_options, audit_rows, audit_fingerprint: an audit's checks (name → scenario
            document), options, finished rows and fingerprint.
        sweep: a sweep's parameters.
    """

    environment: Environment = schema.field(flatten=True, default_factory=Environment)
    model: ModelInfo | str | None = None
    numeric_contract: NumericContract | None = None
    family: FamilyFacts | None = None
    granularity: str | None = None
    dtype: str | None = None
    attn_implementation: str | None = None
    n_tokens: schema.Count | None = None
    store: str | None = None
    kv_cache: bool | None = None
    sublayers_width: schema.Count | None = None
    scenario: Scenario | str | None = None
    block_size: schema.Count | None = None
    block_sizes: tuple[schema.Count | None, schema.Count | None] | None = None
    split_points: tuple[schema.Count, ...] | None = None
    options: dict[str, Any] | None = None
    tensor_parallel: dict[str, Any] | None = None
    engines: dict[str, EngineFacts] | None = None
    engine_dump: EngineDumpRef | None = None
    audit: dict[str, Scenario] | None = None
    audit_options: dict[str, Any] | None = None
    audit_rows: tuple[dict[str, Any], ...] | None = None
    audit_fingerprint: str | None = None
    sweep: dict[str, Any] | None = None


@dataclass(frozen=True)
class LogitsAt(schema.Record):
    """Where an engine computed a run's logits (an engine that samples: each request's last scheduled
    token) and their dtype."""

    positions: tuple[schema.Count, ...] = ()
    dtype: str | None = None


@dataclass(frozen=True)
class EngineDumpMeta(schema.Record):
    """An imported run's ``meta["engine_dump"]``: the engine, the dump's path, how each HF capture
    point was mapped from the dump's names, notes, and what the dump's reader found (``facts``:
    TP size, steps, framework, ...)."""

    engine: str
    path: str
    mapping: dict[str, str]
    notes: tuple[str, ...]
    facts: dict[str, Any] = schema.field(default_factory=dict)


@dataclass(frozen=True)
class RunMeta(schema.Record):
    """The facts of one run (a run's ``meta``) that tracer reads back; a run may carry more (the
    spec calls ``meta`` free-form), which are kept as written and not checked.

    Attributes:
        scenario, level: the scenario the run belongs to (an audit's runs: each check's).
        wall_s: seconds the run took; device: where it ran; gemm_m: GEMM M of each forward pass.
        store_auto: ``--store auto``'s choice (:class:`~tracer.store.budget.StoreAuto`).
        decode_tokens, decode_text: ``--decode``'s greedy continuation; generated: a generation
            run's tokens.
        engine: the engine's facts (:class:`~tracer.execute.records.EngineFacts`).
        scheduler: what its scheduler did (:class:`~tracer.execute.records.SchedulerFacts`).
        cached_tokens: the traced prompt's tokens the engine found cached.
        not_captured: HF capture name → why the engine has no such point.
        logits: logits name → where the engine computed them (:class:`LogitsAt`).
        engine_dump: an imported run's dump (:class:`EngineDumpMeta`).
        rollout, train: an RL step's sides (tokens, logprobs, ...).
        kernels: ``"recorded"`` when ``--kernels`` recorded the kernels of every call.
        kv_transfer: the boundary its KV cache crossed (:class:`KvTransfer`).
    """

    schema_sparse = True

    scenario: str | None = None
    level: int | float | None = None
    wall_s: float | None = None
    device: str | None = None
    gemm_m: tuple[int, ...] | None = None
    store_auto: StoreAuto | None = None
    decode_tokens: tuple[int, ...] | None = None
    decode_text: str | None = None
    generated: tuple[int, ...] | None = None
    engine: EngineFacts | None = None
    scheduler: SchedulerFacts | None = None
    cached_tokens: schema.Count | None = None
    not_captured: dict[str, str] | None = None
    logits: dict[str, LogitsAt] | None = None
    engine_dump: EngineDumpMeta | None = None
    rollout: dict[str, Any] | None = None
    train: dict[str, Any] | None = None
    kernels: str | None = None
    kv_transfer: KvTransfer | None = None


def block_sizes(scen: Scenario, engines: dict[str, Any] | None = None) -> tuple[int | None, int | None]:
    """The KV block size each plan of ``scen`` ran with: its engine's facts (``engines``, run name →
    :class:`~tracer.execute.records.EngineFacts` document; what the engine reported it used; ``0``,
    a contiguous cache, is None here), else the plan's and scenario's setting
    (:meth:`~tracer.plan.plans.Scenario.block_sizes`)."""
    planned = scen.block_sizes()
    out = []
    for plan, size in zip((scen.plan_a, scen.plan_b), planned):
        facts = (engines or {}).get(plan.name)
        used = facts.get("block_size") if isinstance(facts, dict) else None
        if isinstance(used, int) and not isinstance(used, bool):
            size = used or None
        out.append(size)
    return out[0], out[1]


def block_facts(scen: Scenario, engines: dict[str, Any] | None = None) -> dict[str, Any]:
    """The header's ``block_size`` (the one both runs used, else None) and ``block_sizes`` of ``scen``."""
    a, b = block_sizes(scen, engines)
    return {"block_size": a if a == b else None, "block_sizes": [a, b]}


# ------------------------------------------------------------------ versions 1 and 2


#: the sentences the HF engine's facts held in versions 1 and 2 where version 3 has 0
_HF_NONE = {"block_size": "none (a contiguous KV cache)",
            "max_num_batched_tokens": "none (each forward call computes what it is given)"}


def _engine_v2(facts: Any) -> Any:
    if not isinstance(facts, dict):
        return facts
    return {**facts, **{k: 0 for k, text in _HF_NONE.items() if facts.get(k) == text}}


def upgrade_v2(kind: str, doc: Any) -> Any:
    """A version-1 or -2 document (``kind``: ``header``, ``plan``, ``meta``, ``comparison``) as
    version 3 writes it: the header's block size from the engines' facts and the scenario (not the
    default 16 that was written), engine facts with 0 for the HF engine's "none" sentences, the
    scheduler facts under ``scheduler`` (not under the engine's name). A document that is not an object, or already
    as version 3 writes it, is returned as it is (the checks that follow name what is wrong)."""
    if not isinstance(doc, dict):
        return doc
    if kind == "header":
        out = dict(doc)
        if isinstance(out.get("engines"), dict):
            out["engines"] = {k: _engine_v2(v) for k, v in out["engines"].items()}
        scen = out.get("scenario")
        if isinstance(scen, dict) and isinstance(scen.get("plan_a"), dict):
            try:
                out.update(block_facts(Scenario.from_dict(scen), out.get("engines")))
            except Exception:  # noqa: BLE001 - a malformed scenario: its own check names it
                pass
        return out
    if kind == "meta":
        out = dict(doc)
        old = out["engine"].get("engine") if isinstance(out.get("engine"), dict) else None
        if isinstance(old, str) and isinstance(out.get(old), dict) and "scheduler" not in out:
            out["scheduler"] = out.pop(old)  # versions 1-2: under the engine's own name
        if "engine" in out:
            out["engine"] = _engine_v2(out["engine"])
        return out
    if kind == "comparison":
        facts = doc.get("facts")
        if isinstance(facts, dict) and any(k in facts for k in ("engine_a", "engine_b")):
            facts = {**facts, **{k: _engine_v2(facts[k]) for k in ("engine_a", "engine_b") if k in facts}}
            return {**doc, "facts": facts}
    return doc


def current(kind: str, doc: Any) -> Any:
    """A version-3 document as it is (the reader of the current version)."""
    return doc


__all__ = ["EngineDumpRef", "TraceHeader", "LogitsAt", "EngineDumpMeta", "RunMeta", "block_sizes",
           "block_facts", "upgrade_v2", "current"]
