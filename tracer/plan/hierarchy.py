"""The determinism hierarchy as checks: each level's scenarios with the options that make each variant.

Levels 0-7 as in "The Illusion of Determinism in Disaggregated Inference": repeating the call,
batch size, cache hit vs miss, KV block size / chunking, parallelism degree, quantization scheme,
engine choice, hardware. :func:`checks` is the catalogue ``tracer audit`` runs; :data:`SEED_STATUS`
is the source's own status of each level, printed beside the measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tracer import schema
from tracer.engines.table import ENGINES, REFERENCE, row, selectable
from tracer.errors import TracerError

#: where ``--mitigation aligned`` comes from: the scheduling fix the seed cites for level 2
ALIGNED_SOURCE = "vLLM #34046"
#: the seed's status of each level ("The Illusion of Determinism", hierarchy table)
SEED_STATUS = {
    0: "largely solved (fixed kernel, fixed shape, no atomics)",
    1: "attempted; 11 of 28 items unresolved (SGLang #10278)",
    2: f"addressed via scheduling constraints ({ALIGNED_SOURCE}, open)",
    3: "inherently follows from level 2",
    4: "partially solved (deterministic all-reduce; edge cases remain)",
    5: "unsolved",
    6: "unattempted",
    7: "currently inexpressible",
}
STATUSES = ("passed", "failed", "skipped")


@dataclass(frozen=True)
class Check(schema.Record):
    """One row of the audit: a scenario with the options that make this variant.

    Attributes:
        key: run-name prefix in the trace (``L1-batch-padded``).
        level, scenario, label: hierarchy level, catalogue name, one line for the table.
        options: scenario options fixed by this check (they win over the user's).
        needs: ``"cuda"``, ``"flash"``, an engine of :mod:`tracer.engines.table` (``tp``: K processes
            of a torch.distributed group, always on the CPU with gloo, one GPU per rank with NCCL;
            another engine: its package) or None.
        mitigations: mitigations that apply when the check diverges.
    """

    key: str
    level: int
    scenario: str
    label: str
    options: dict[str, Any] = field(default_factory=dict)
    needs: str | None = None
    mitigations: tuple[str, ...] = ("deterministic",)


#: the engine of the real-TP check (chosen by ``--tp-mode distributed``) and the other engine of ``engine``
_TP = next(r.name for r in ENGINES if r.chosen_by == "--tp-mode distributed")
_OTHER = selectable()[1]


def checks(n_tokens: int | None = None) -> list[Check]:
    """The audit's checks in level order (``n_tokens`` fixes the decode-step split at N-1)."""
    decode = {"split_at": n_tokens - 1} if n_tokens else {}
    return [
        Check("L0-repeat", 0, "repeat", "the same call twice"),
        Check("L1-batch", 1, "batch", "alone vs one row of an equal-length batch", {"padding": "none"}),
        Check("L1-batch-padded", 1, "batch", "alone vs one row of a left-padded batch", {"padding": "left"}),
        Check("L2-prefix-cache", 2, "prefix-cache", "cache miss vs hit (last block boundary)", {},
              mitigations=("aligned", "deterministic")),
        Check("L2-decode-step", 2, "prefix-cache", "cache miss vs hit at N-1 (a decode step)", decode,
              mitigations=("aligned", "deterministic")),
        Check("L2-generate-cache", 2, "generate-cache", "greedy generation with vs without KV cache"),
        Check("L3-block-size", 3, "block-size", "cache hit at block size 16 vs 64"),
        Check("L3-chunked-prefill", 3, "chunked-prefill", "full prefill vs chunks"),
        Check("L4-tp-sim-ring", 4, "tensor-parallel", "unsharded vs simulated TP-2, ring all-reduce",
              {"reduce": "ring"}),
        # at k = 2 every order and dtype gives the same sum (one rounding of p0 + p1); k = 4 differs
        Check("L4-tp-sim-tree-fp32", 4, "tensor-parallel", "unsharded vs simulated TP-4, tree all-reduce in fp32",
              {"tp": 4, "reduce": "tree", "reduce_dtype": "float32"}),
        Check("L4-tp-real", 4, "tensor-parallel", "unsharded vs real TP-2 over torch.distributed",
              {"tp": 2, "tp_mode": "distributed"}, needs=_TP),
        Check("L5-kv-fp8", 5, "kv-quant", "KV cache model dtype vs FP8 E4M3", {"kv_format": "fp8-e4m3"}),
        Check("L5-kv-mxfp8", 5, "kv-quant", "KV cache model dtype vs MXFP8 (32, E8M0)", {"kv_format": "mxfp8"}),
        Check("L5-kv-nvfp4", 5, "kv-quant", "KV cache model dtype vs NVFP4 (16, E4M3)", {"kv_format": "nvfp4"}),
        Check("L6-attention", 6, "attention", "attention eager vs sdpa"),
        Check("L6-attention-flash", 6, "attention", "attention sdpa vs flash_attention_2",
              {"attn_a": "sdpa", "attn_b": "flash_attention_2"}, needs="flash"),
        Check("L6-compile", 6, "compile", "eager vs torch.compile"),
        Check("L6-engine", 6, "engine", f"HF {row(REFERENCE).product} vs {row(_OTHER).product} (same weights and "
              "token ids)", needs=_OTHER, mitigations=()),
        Check("L6-cuda-graph", 6, "cuda-graph", "eager vs CUDA-graph replay", needs="cuda"),
        Check("L7-device", 7, "device", "CPU vs GPU", {"devices": "cpu,cuda"}, needs="cuda"),
        Check("L7-disaggregated", 7, "disaggregated", "prefix on CPU, moved to GPU, vs all on GPU",
              {"devices": "cpu,cuda"}, needs="cuda"),
    ]


def parse_levels(levels: str | None) -> list[int]:
    """``"0,1,2"`` → ``[0, 1, 2]``; None → all levels 0-7.

    Raises:
        TracerError: not a comma-separated list of integers 0-7, or a level named twice (``0,0``
            ran one level where two were asked for).
    """
    if levels is None:
        return list(range(8))
    if not levels.replace(",", "").strip():  # "" is a mistake, not "all levels"
        raise TracerError("--levels is empty; give e.g. --levels 0,1,2, or leave it out for all levels")
    try:
        given = [int(x) for x in levels.split(",") if x.strip()]
    except ValueError:
        raise TracerError(f"--levels {levels!r} must be comma-separated levels 0-7, e.g. 0,1,2") from None
    twice = sorted({x for x in given if given.count(x) > 1})
    if twice:
        once = ",".join(str(x) for x in sorted(set(given)))
        raise TracerError(f"--levels {levels!r} names level {', '.join(map(str, twice))} more than once (each level "
                          f"runs once); give --levels {once}")
    out = sorted(given)
    bad = [x for x in out if not 0 <= x <= 7]
    if bad or not out:
        raise TracerError(f"--levels {levels!r}: levels are 0-7; e.g. --levels 0,1,2")
    return out


#: the invariant of each level
INVARIANTS = {0: "repeating the call", 1: "batch size", 2: "cache hit vs miss", 3: "KV block size / chunking",
               4: "parallelism degree", 5: "quantization scheme", 6: "engine choice", 7: "hardware"}


def invariant(c: Check) -> str:
    """The invariant a check's level tests (``cache hit vs miss``)."""
    return INVARIANTS[c.level]
