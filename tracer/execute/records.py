"""Plain data passed between the stages: capture → store → compare.

No torch code runs here; these are the records the hooks fill, the store writes and reads,
and the comparison consumes. Tensors are kept in their storage dtype (bit-exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

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
            ``layer``, ...: :data:`tracer.execute.family.ROLES`), from the model's family
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
        engine: a display name (``SGLang dumper``, ``SGLang/vLLM per-pass dump``, ``named tensors``).
        entries: the activations (token bookkeeping removed).
        tokens: step → ``{"input_ids": LongTensor (T,), "positions": LongTensor (T,) or None, "file": str}``,
            plus ``"shape": (b, s)`` when the ids were dumped as a ``[b, s]`` batch (Megatron).
        facts: e.g. ``tokenizer_path``, ``tp_size``, ``steps``, ``framework`` (``sglang``/``megatron``).
        ignored_inputs: names of module inputs (and gradients, parameters) that were read but are
            not activations tracer maps.
        input_digests: ``(module, step, tp_rank)`` → :func:`tracer.store.dump_parallel.digest` of
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
