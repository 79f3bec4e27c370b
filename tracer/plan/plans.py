"""The run-plan data types: how one run computes the prompt, and a scenario's pair of them.

A :class:`RunPlan` says how one run computes the prompt: as a sequence of forward passes
(*chunks*) over token positions ``[start, stop)`` that share one KV cache; every other level of
the determinism hierarchy is a field of the plan (``batch``, ``kv_transform``, ``tp``, ``attn``,
``compile``, ``devices``, ``generate``, ``deterministic``, ``engine``, and ``rl``: a side of an
RL step). A :class:`Scenario` pairs plan A with plan B and names the compared window. Plain
frozen data, no torch; the catalogue that builds them is :mod:`tracer.plan.scenarios` (which
re-exports these names).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tracer.errors import TracerError
from tracer.plan.rollout import RLSpec

MITIGATIONS = ("aligned", "deterministic")
PADDINGS = ("none", "left", "right")


@dataclass(frozen=True)
class Batch:
    """The traced prompt as one row of a batch.

    Attributes:
        size: rows in the batch (the traced prompt included).
        row: index of the traced prompt's row.
        padding: ``none`` (all rows have the prompt's length N), ``left`` or ``right`` (rows of
            different lengths padded to the longest, with an attention mask that excludes padding).
        lengths: the length of every row; ``lengths[row]`` is N. The other rows hold the prompt
            rotated by a row-dependent offset (valid tokens, different content), cut to length.
    """

    size: int
    row: int
    padding: str
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.size < 1 or len(self.lengths) != self.size:
            raise TracerError(f"batch of {self.size} rows needs {self.size} lengths, got {len(self.lengths)}; "
                              "use --batch-size 1 or more")
        if not 0 <= self.row < self.size:
            raise TracerError(f"--batch-row {self.row} is outside 0..{self.size - 1}; choose a row of the batch")
        if self.padding not in PADDINGS:
            raise TracerError(f"unknown --padding '{self.padding}'; use one of: {', '.join(PADDINGS)}")
        if self.padding == "none" and len(set(self.lengths)) > 1:
            raise TracerError("rows of different lengths need --padding left or right")

    @property
    def width(self) -> int:
        """Columns of the padded batch (the longest row)."""
        return max(self.lengths)


#: how run B of ``tensor-parallel`` is sharded: in one process (``simulated``, :mod:`tracer.plan.tp`) or
#: over K processes with torch.distributed (``distributed``, :mod:`tracer.execute.tp_dist`)
TP_MODES = ("simulated", "distributed")


@dataclass(frozen=True)
class TPSpec:
    """Tensor parallelism of a run plan.

    Attributes:
        k: shards (simulated) or ranks (distributed). reduce: ``ring`` | ``tree``. dtype:
        ``activation`` | ``float32`` (the dtype the simulated all-reduce adds in; both simulated
        only). mode: ``simulated`` (:mod:`tracer.plan.tp`: row-parallel layers as K partial GEMMs in
        one process) or ``distributed`` (:mod:`tracer.execute.tp_dist`: K processes, real collectives).
        partials: distributed only: also capture every rank's row-parallel partials before the
        all_reduce. vocab_parallel: distributed only: shard the embedding and LM head by vocabulary.
    """

    k: int
    reduce: str = "ring"
    dtype: str = "activation"
    mode: str = "simulated"
    partials: bool = False
    vocab_parallel: bool = False


@dataclass(frozen=True)
class RunPlan:
    """How one run computes the prompt.

    Attributes:
        name: the run's label (``A`` or ``B``).
        chunks: successive forward passes over absolute token positions ``[start, stop)``, sharing
            one KV cache; they must tile ``[0, N)`` in order. A chunk of length ``M`` runs every
            projection as a GEMM with M = ``M`` rows (batch 1).
        description: one line for people (``cache miss: all 250 tokens in one pass``).
        batch: run the prompt as one row of this batch (None = batch of 1).
        kv_transform: a :mod:`tracer.plan.quant` format name; the positions each chunk added to the KV
            cache are quantize-dequantized before the next forward pass reads them.
        tp: simulate tensor parallelism of the row-parallel layers (None = unsharded).
        attn: attention implementation for this run (None = as loaded).
        compile: run a ``torch.compile``-d model.
        devices: the device of each chunk (None = the model's); the model and the KV cache move.
        generate: greedy-decode this many tokens after the prompt (0 = prefill only).
        recompute: with ``generate``, recompute the whole sequence every step instead of using
            the KV cache.
        deterministic: run under torch's deterministic algorithms, TF32 off and
            ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (restored afterwards).
        cuda_graph: record each chunk's forward pass in a CUDA graph and replay it
            (:mod:`tracer.execute.graphs`; the capture copies are recorded into the graph).
        engine: which engine executes the plan (:data:`tracer.execute.engines.ENGINES`: ``hf``,
            the reference, or ``vllm``); :mod:`tracer.execute.engines` picks the executor.
        engine_settings: ``(key, value)`` pairs for the engine (vLLM: ``block_size``, ``chunks``
            ``prefix-cache`` | ``chunked``; :func:`tracer.plan.engines.with_engine` sets them).
        rl: the plan's side of an RL step (:class:`tracer.plan.rollout.RLSpec`: the rollout sampling
            token by token, or the trainer's teacher-forced forward), None otherwise.
    """

    name: str
    chunks: tuple[tuple[int, int], ...]
    description: str = ""
    batch: Batch | None = None
    kv_transform: str | None = None
    tp: TPSpec | None = None
    attn: str | None = None
    compile: bool = False
    devices: tuple[str, ...] | None = None
    generate: int = 0
    recompute: bool = False
    deterministic: bool = False
    cuda_graph: bool = False
    engine: str = "hf"
    rl: RLSpec | None = None
    engine_settings: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        pos = 0
        for start, stop in self.chunks:
            if start != pos or stop <= start:
                raise TracerError(
                    f"run plan {self.name}: chunks {list(self.chunks)} must tile [0, N) in order without gaps"
                )
            pos = stop
        if self.devices is not None and len(self.devices) != len(self.chunks):
            raise TracerError(f"run plan {self.name}: {len(self.devices)} devices for {len(self.chunks)} chunks; "
                              "give one device per chunk")
        if self.batch is not None and self.batch.padding != "none" and len(self.chunks) > 1:
            raise TracerError(f"run plan {self.name}: a padded batch runs as one chunk; use --padding none")
        if self.generate and self.batch is not None:
            raise TracerError(f"run plan {self.name}: generation runs at batch 1; drop the batch")

    @property
    def n_tokens(self) -> int:
        return self.chunks[-1][1] if self.chunks else 0

    def gemm_m(self) -> list[int]:
        """The GEMM M dimension of each forward pass (rows x tokens, padding included)."""
        if self.rl is not None:  # vLLM flattens the requests of a step: no padding
            return self.rl.gemm_m(flattened=self.engine == "vllm")
        if self.batch is not None:
            if self.batch.padding != "none":
                return [self.batch.size * self.batch.width]
            return [self.batch.size * (stop - start) for start, stop in self.chunks]
        ms = [stop - start for start, stop in self.chunks]
        n = self.n_tokens
        ms += [n + t if self.recompute else 1 for t in range(1, self.generate)]
        return ms

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["chunks"] = [list(c) for c in self.chunks]
        d["gemm_m"] = self.gemm_m()
        return d


@dataclass(frozen=True)
class Scenario:
    """Two run plans of one prompt and the positions compared between them.

    Attributes:
        name: catalogue name (``prefix-cache``).
        level: level of the seed's determinism hierarchy (0-7).
        invariant: what a correct engine would keep invariant (``cache hit vs miss``).
        plan_a, plan_b: the two runs.
        window: ``(start, stop)``: the compared absolute positions.
        params: the scenario's parameters (block size, split point, mitigation), recorded in the
            trace header.
    """

    name: str
    level: int
    invariant: str
    plan_a: RunPlan
    plan_b: RunPlan
    window: tuple[int, int]
    params: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "level": self.level,
            "invariant": self.invariant,
            "plan_a": self.plan_a.to_dict(),
            "plan_b": self.plan_b.to_dict(),
            "window": list(self.window),
            "params": dict(self.params),
        }


__all__ = ["MITIGATIONS", "PADDINGS", "TP_MODES", "Batch", "TPSpec", "RunPlan", "Scenario"]


def with_cuda_graphs(scen: Scenario) -> Scenario:
    """``scen`` with both plans' chunks recorded in CUDA graphs and replayed (``--cuda-graphs``):
    the same comparison, under the execution mode serving engines use for decode and short prefills.

    Raises:
        TracerError: the ``cuda-graph`` scenario (it already compares eager with replay).
    """
    from dataclasses import replace

    if scen.name == "cuda-graph":
        raise TracerError("scenario cuda-graph already compares eager execution with CUDA-graph replay; "
                          "drop --cuda-graphs, or choose another scenario to run under CUDA graphs")
    a, b = (replace(p, cuda_graph=True, description=f"{p.description} (CUDA-graph replay)")
            for p in (scen.plan_a, scen.plan_b))
    return replace(scen, plan_a=a, plan_b=b, params={**scen.params, "cuda_graphs": True})

