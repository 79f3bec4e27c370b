"""Plain data passed between the stages: capture → store → compare.

No torch code runs here; these are the records the hooks fill, the store writes and reads,
and the comparison consumes. Tensors are kept in their storage dtype (bit-exact).

Besides the run itself (:class:`RunRecord`, :class:`CaptureRecord`), the facts an execution
reports as :mod:`tracer.schema` records, the same types whatever engine ran: one forward call of
a capture point (:class:`Call`, the documents in ``CaptureRecord.calls``), the engine's numeric
contract (:class:`EngineFacts`, a run's ``meta["engine"]`` and the trace header's ``engines``)
and what its scheduler did (:class:`SchedulerFacts`, a run's ``meta["scheduler"]``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from tracer import schema
from tracer.errors import TracerError


@dataclass(frozen=True)
class KernelCount(schema.Record):
    """One kernel or aten op that ran in a forward call, and how many times (``--kernels``)."""

    name: str
    count: schema.Count


@dataclass(frozen=True)
class Kernels(schema.Record):
    """The kernels of one forward call: ``device`` kernels (CUDA names as launched, empty on the
    CPU) and compute-level aten ``ops`` (``traces/README.md``, "kernels of a call")."""

    device: tuple[KernelCount, ...] = ()
    ops: tuple[KernelCount, ...] = ()


#: the shapes a call saw: a list of shapes (None for an input that is not a tensor), or one flat shape
Shapes = tuple[schema.Shape | None, ...] | schema.Shape


@dataclass(frozen=True)
class Call(schema.Record):
    """One forward call of a capture point: the document ``{"positions": [start, stop], "in":
    [shapes], "out": [shapes], "kernels": {...}}`` of ``CaptureRecord.calls`` and of a trace
    index entry's ``calls`` (every key optional; the calls stay plain documents in memory,
    :func:`calls_problem` checks them against this record).

    Attributes:
        positions: the absolute token positions the call computed, ``[start, stop)``.
        inputs, out: the full input and output shapes the module saw (``in`` and ``out``).
        kernels: ``--kernels``: what ran (:class:`Kernels`).
    """

    schema_sparse = True

    positions: schema.Span | None = None
    inputs: Shapes | None = schema.field(key="in", default=None)
    out: Shapes | None = None
    kernels: Kernels | None = None


#: the annotation calls are checked against, built once (the decoder works out each annotation once)
_CALLS = list[Call]
#: calls documents found valid already, by their JSON text (``true`` and ``1``, ``1`` and ``1.0`` differ
#: there as the decoder tells them apart; a tuple and a list that read alike decode alike): the points
#: of a trace repeat a few calls documents (every layer's output saw the same shapes). A refused
#: document is decoded again, so that its message quotes its own values. Emptied past 4096 entries.
_VALID: set[str] = set()


def calls_problem(calls: Any) -> str | None:
    """None when ``calls`` is a list of :class:`Call` documents, else what is wrong (one line)."""
    if not isinstance(calls, list):
        return "calls is not a list"
    try:
        key: str | None = json.dumps(calls, allow_nan=True)
    except (TypeError, ValueError, RecursionError):  # not JSON data, or nested too deep: the decoder says
        key = None
    if key is not None and key in _VALID:
        return None
    try:
        schema.decode_value(calls, _CALLS, "calls")
    except TracerError as e:
        return str(e)
    if key is not None:
        if len(_VALID) > 4096:
            _VALID.clear()
        _VALID.add(key)
    return None


@dataclass(frozen=True)
class Threads(schema.Record):
    """torch's intra-op thread count before and after an engine was built (an engine may set its own)."""

    before_build: int | None = None
    after_build: int | None = None


@dataclass(frozen=True)
class EngineFacts(schema.Record):
    """An engine's numeric contract, the same record whatever the engine (:mod:`tracer.engines.table`): a run's
    ``meta["engine"]`` and, known before the runs, the trace header's ``engines``. Unknown facts
    are None and left out of the document.

    Attributes:
        engine: the engine's name (a row of :mod:`tracer.engines.table`).
        version: its package's version.
        device, dtype: where it ran and the weights' dtype.
        attention_backend: the attention implementation (``sdpa``, a paged engine's ``CPU_ATTN``).
        norm, activation, rotary: what the first decoder layer's norm, activation and rotary
            embedding dispatch to.
        gemm: the GEMM library, or per Linear of the first layer (and ``lm_head``) its GEMM.
        activation_dtype, logits_dtype, kv_cache_dtype: the dtypes of the activations, the LM
            head's output and the KV cache.
        block_size: tokens per KV-cache block; 0: one contiguous cache per sequence (no paging).
        max_num_batched_tokens: the scheduler's token budget per step (chunked prefill splits a
            longer prompt); 0: none (each forward call computes what it is given).
        compilation_mode, cudagraph_mode: compilation level (0: eager) and CUDA graphs (``NONE``).
        weights: the weights folder the engine loaded.
        attention_impl, attention_isa: the attention backend's implementation class and ISA.
        kv_cache_dtype_setting: the KV-cache dtype as configured (``auto``: the model's).
        prefix_caching, chunked_prefill, max_model_len, enforce_eager, in_process: the engine's
            settings as it reports them.
        torch_threads: torch's thread count before and after the engine was built.
        sampler: what the sampler does with the logits.
        device_name: the accelerator's product name (a GPU's), where the engine reports one.
        attention_backend_setting: the attention backend that was asked for (``auto``: the
            engine's own choice; ``attention_backend`` is the one that ran).
        batch_invariant: whether the engine's batch-invariant mode was on.
        model_runner, model_class: the engine's model runner and model classes (module.Class).
        log: the file the engine's own output went to.
        tensor_parallel: the engine's tensor-parallel ranks (1: one process holds the whole model).
    """

    schema_sparse = True

    engine: str
    version: str | None = None
    device: str | None = None
    dtype: str | None = None
    attention_backend: str | None = None
    norm: str | None = None
    activation: str | None = None
    gemm: str | dict[str, str] | None = None
    activation_dtype: str | None = None
    logits_dtype: str | None = None
    kv_cache_dtype: str | None = None
    block_size: schema.Count | None = None
    max_num_batched_tokens: schema.Count | None = None
    compilation_mode: int | None = None
    cudagraph_mode: str | None = None
    weights: str | None = None
    attention_impl: str | None = None
    attention_isa: str | None = None
    kv_cache_dtype_setting: str | None = None
    prefix_caching: bool | None = None
    chunked_prefill: bool | None = None
    max_model_len: schema.Count | None = None
    enforce_eager: bool | None = None
    in_process: bool | None = None
    torch_threads: Threads | None = None
    rotary: str | None = None
    sampler: str | None = None
    device_name: str | None = None
    attention_backend_setting: str | None = None
    batch_invariant: bool | None = None
    model_runner: str | None = None
    model_class: str | None = None
    log: str | None = None
    tensor_parallel: schema.Count | None = None


@dataclass(frozen=True)
class ScheduledRequest(schema.Record):
    """One request an engine's scheduler ran for a run.

    Attributes:
        request_id, internal_id: tracer's id and the engine's own.
        tokens: the request's prompt tokens.
        traced: whether it is (a prefix of) the traced prompt.
        num_cached_tokens: the prompt tokens the engine found in its prefix cache (its own count).
        generated: the token ids it generated.
    """

    schema_sparse = True

    request_id: str | None = None
    internal_id: str | None = None
    tokens: schema.Count | None = None
    traced: bool = False
    num_cached_tokens: schema.Count = 0
    generated: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TracedPositions(schema.Record):
    """The traced prompt's positions one scheduler step computed for one request."""

    request: str
    positions: schema.Span


@dataclass(frozen=True)
class SchedulerStep(schema.Record):
    """One forward pass of the engine: its index, tokens (the forward's rows: every GEMM's M), requests,
    the traced positions in it, and the requests' scheduled tokens (fewer than ``tokens`` when the
    engine pads the step, e.g. to a CUDA graph's batch size).

    Attributes:
        boundaries: how the requests' rows were told apart (``query_start_loc``: the attention
            metadata's; ``positions``: from the positions and KV slots), where the capture read them.
        order: each followed request (its id) → its index among the step's requests.
        notes: what finding the requests could not say exactly, one line each.
    """

    schema_sparse = True

    step: schema.Count | None = None
    tokens: schema.Count | None = None
    requests: schema.Count = 1
    traced: tuple[TracedPositions, ...] = ()
    scheduled: schema.Count | None = None
    boundaries: str | None = None
    order: dict[str, int] | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class SchedulerFacts(schema.Record):
    """What an engine's scheduler did with a run (a run's ``meta["scheduler"]``), and how the
    engine's modules were mapped onto HF capture names.

    Attributes:
        chunks_as: how the plan's chunks were realised (``prefix-cache``: a request per chunk
            boundary; ``chunked``: the token budget splits one request; ``one-step``; ``rollout``).
        requests: every request, in the order added (:class:`ScheduledRequest`).
        steps: the forward passes that computed traced positions (:class:`SchedulerStep`).
        chunks: the traced prompt's positions computed in each step, ``[start, stop)``.
        mapping: HF capture name → the engine module(s) it came from, and how (split, fused).
        notes: one line each on what the mapping could not say exactly.
        runner: the engine's model runner the steps ran in (module.Class), where it has one.
    """

    chunks_as: str | None = None
    requests: tuple[ScheduledRequest, ...] = ()
    steps: tuple[SchedulerStep, ...] = ()
    chunks: tuple[schema.Span, ...] = ()
    mapping: dict[str, str] = schema.field(default_factory=dict)
    notes: tuple[str, ...] = ()
    runner: str | None = None

@dataclass
class CaptureRecord:
    """What one capture point saw during one run.

    Attributes:
        name: the HF module path (``model.layers.3``), as in ``model.named_modules()``.
        kind: ``embedding``, ``layer`` (decoder layer output = residual stream), ``final_norm``,
            ``logits`` (the LM head output), or a sublayer kind (``linear``, ``norm``, ``attention``,
            ``attention_core``, ``mlp``, ``activation``).
        tensor: the module output restricted to the compared window, concatenated over the
            forward calls of the run: shape ``(T, *feature)`` where ``T = window[1] - window[0]``
            (e.g. ``(T, hidden)`` for the residual stream, ``(T, vocab)`` for logits), on the CPU,
            in the dtype the model produced (bf16 stays bf16: nothing is converted).
        calls: one dict per forward call that reached the module, in order:
            ``{"positions": [start, stop], "in": [[shape], ...], "out": [shape]}``:
            the absolute token positions the call computed and the full input/output shapes
            the module saw (for an ``nn.Linear``: in ``[..., K]`` → out ``[..., N]``, GEMM M = prod of leading dims).
        op: the module's class name (``LlamaDecoderLayer``, ``Linear``, ``LlamaRMSNorm``).
        role: what the point is in the decoder block (``q_proj``, ``mlp_norm``, ``attention_core``,
            ``layer``, ...: :data:`tracer.execute.roles.ROLES`), from the model's family
            descriptor; ``""`` when unknown (a module without a role, a trace written before roles
            were stored). The origin analysis reads it (:mod:`tracer.diff.dataflow`).
    """

    name: str
    kind: str
    tensor: torch.Tensor
    calls: list[dict[str, Any]] = field(default_factory=list)
    op: str = ""
    role: str = ""


@dataclass
class RunRecord:
    """One executed run plan: the token ids it processed and every capture point's record.

    Attributes:
        name: the run's label within its trace (``A``, ``B``).
        token_ids: the prompt, ``N`` ints.
        plan: the run plan as plain JSON data (``RunPlan.to_dict()``).
        window: ``(start, stop)``: the absolute token positions kept by the hooks (the compared
            positions, e.g. ``(P, N)`` for prefix-cache).
        captures: capture name → record, in execution order (dict order is meaningful).
        meta: free-form JSON-able facts about the run (wall time, device, dtype, ...).
        extras: in-memory only, never stored: e.g. ``extras["sdpa"]`` = the attention cores'
            SDPA inputs for the float64 replay (:mod:`tracer.execute.sdpa_inputs`).
    """

    name: str
    token_ids: list[int]
    plan: dict[str, Any]
    window: tuple[int, int]
    captures: dict[str, CaptureRecord]
    meta: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict, repr=False)


@dataclass
class DumpEntry:
    """One dumped activation on one rank in one step.

    Attributes:
        name: the engine's name as dumped (``non_intrusive__model.layers.3.mlp.output``).
        module: the engine module path (``model.layers.3.mlp``).
        element: the tuple element (``0``, ``1``) or None for a single tensor.
        step: the step / forward pass the tensor belongs to.
        tp_rank, tp_size: tensor-parallel rank and size of the rank that dumped it.
        pp_rank: pipeline stage.
        dims: the dump's dims string (``"t h(tp)"``) or None.
        tensor: ``(T, *feature)`` rows for the T tokens of the step (any dtype the engine used);
            Megatron: ``(s, b, *feature)`` (the map's ``tokens`` says the layout).
        file: the file it came from (for error messages).
        sp: written under Megatron sequence parallelism (a tensor outside the TP regions holds
            this TP rank's slice of the sequence).
    """

    name: str
    module: str
    element: int | None
    step: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    dims: str | None
    tensor: torch.Tensor
    file: str
    sp: bool = False


@dataclass
class RawDump:
    """A dump as read: activations plus the token ids of each step.

    Attributes:
        path: the folder or file.
        layout: ``sglang-dumper``, ``passes`` or ``tensors``.
        engine: a display name (``SGLang dumper``, a per-pass dump, ``named tensors``).
        entries: the activations (token bookkeeping removed).
        tokens: step → ``{"input_ids": LongTensor (T,), "positions": LongTensor (T,) or None, "file": str}``,
            plus ``"shape": (b, s)`` when the ids were dumped as a ``[b, s]`` batch (Megatron), and
            ``"prompt_ids"`` (the whole prompt from position 0) when the step's rows are a window of it.
        facts: e.g. ``tokenizer_path``, ``tp_size``, ``steps``, ``framework`` (``sglang``/``megatron``).
        ignored_inputs: names of module inputs (and gradients, parameters) that were read but are
            not activations tracer maps.
        input_digests: ``(module, step, tp_rank)`` → :func:`tracer.engines.dumps.parallel.digest` of
            the module's first input (``inputs.0``), to recognise identity modules (Megatron's
            ``IdentityOp`` norms when Transformer Engine fuses the norm into the next linear).
        ledger: the :class:`tracer.files.Ledger` the dump was read within (its files and copies
            against one input budget); the mapping charges its own copies to it. None: unbounded.
    """

    path: str
    layout: str
    engine: str
    entries: list[DumpEntry]
    tokens: dict[int, dict[str, Any]]
    facts: dict[str, Any] = field(default_factory=dict)
    ignored_inputs: list[str] = field(default_factory=list)
    input_digests: dict[tuple[str, int, int], str] = field(default_factory=dict)
    ledger: Any = None


def settle_wall(rec: RunRecord) -> RunRecord:
    """Fill ``rec.meta["wall_s"]`` of a run timed by CUDA events (an engine's run with
    ``keep_on_device`` on a GPU: ``extras["wall_events"]``), waiting for the run's last kernel; a no-op for other runs.
    Returns ``rec``."""
    events = rec.extras.get("wall_events")
    if events is not None:  # idempotent: the writer's thread and the caller may both settle it
        start, end = events
        end.synchronize()
        rec.meta["wall_s"] = start.elapsed_time(end) / 1000.0
    return rec


class RecordsView:
    """The read-only mapping face of a capture (capture name → :class:`CaptureRecord`, in execution
    order) for a class that defines ``records()``; a class with a ``not_captured`` dict (name →
    reason) gets that reason in the ``KeyError`` of a name it holds.

    Raises:
        KeyError: ``view[name]`` of a name not captured (the reason, or the first captured names).
    """

    def records(self) -> dict[str, "CaptureRecord"]:  # pragma: no cover - defined by the class
        raise NotImplementedError

    def __getitem__(self, name: str) -> "CaptureRecord":
        recs = self.records()
        if name not in recs:
            why = (getattr(self, "not_captured", None) or {}).get(name)
            raise KeyError(f"no capture point {name!r}" + (f" ({why})" if why else f"; captured: {', '.join(list(recs)[:6])}, ..."))
        return recs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.records())

    def __len__(self) -> int:
        return len(self.records())

    def keys(self) -> list[str]:
        """The capture names, in execution order."""
        return list(self.records())
