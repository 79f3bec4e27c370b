"""The run-plan data types: how one run computes the prompt, and a scenario's pair of them.

A :class:`RunPlan` says how one run computes the prompt: as a sequence of forward passes
(*chunks*) over token positions ``[start, stop)`` that share one KV cache; every other level of
the determinism hierarchy is a field of the plan (``batch``, ``kv_transform``, ``tp``, ``attn``,
``compile``, ``devices``, ``generate``, ``deterministic``, ``engine``, and ``rl``: a side of an
RL step). A :class:`Scenario` pairs plan A with plan B and names the compared window. Plain
frozen data, no torch; the catalogue that builds them is :mod:`tracer.plan.scenarios` (which
re-exports these names). Each is a :class:`tracer.schema.Record`: a run's ``plan`` in a trace is
a :class:`RunPlan`'s document, the header's ``scenario`` a :class:`Scenario`'s, and reading them
back checks them with the same rules that built them (``__post_init__``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracer import schema
from tracer.engines.table import REFERENCE, name_of, rows
from tracer.errors import TracerError
from tracer.plan.quant import BlockFormat
from tracer.plan.rollout import RLSpec

MITIGATIONS = ("aligned", "deterministic")
PADDINGS = ("none", "left", "right")


@dataclass(frozen=True)
class Batch(schema.Record):
    """The traced prompt as one row of a batch.

    Attributes:
        size: rows in the batch (the traced prompt included).
        row: index of the traced prompt's row.
        padding: ``none`` (all rows have the prompt's length N), ``left`` or ``right`` (rows of
            different lengths padded to the longest, with an attention mask that excludes padding).
        lengths: the length of every row; ``lengths[row]`` is N. The other rows hold the prompt
            rotated by a row-dependent offset (valid tokens, different content), cut to length.
    """

    size: schema.Count
    row: schema.Count
    padding: str
    lengths: tuple[schema.Count, ...]

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
#: over K processes with torch.distributed (``distributed``, :mod:`tracer.engines.tp.dist`)
TP_MODES = ("simulated", "distributed")


@dataclass(frozen=True)
class TPSpec(schema.Record):
    """Tensor parallelism of a run plan.

    Attributes:
        k: shards (simulated) or ranks (distributed). reduce: ``ring`` | ``tree``. dtype:
        ``activation`` | ``float32`` (the dtype the simulated all-reduce adds in; both simulated
        only). mode: ``simulated`` (:mod:`tracer.plan.tp`: row-parallel layers as K partial GEMMs in
        one process) or ``distributed`` (:mod:`tracer.engines.tp.dist`: K processes, real collectives).
        partials: distributed only: also capture every rank's row-parallel partials before the
        all_reduce. vocab_parallel: distributed only: shard the embedding and LM head by vocabulary.
    """

    k: schema.Count
    reduce: str = "ring"
    dtype: str = "activation"
    mode: str = "simulated"
    partials: bool = False
    vocab_parallel: bool = False


@dataclass(frozen=True)
class RunPlan(schema.Record):
    """How one run computes the prompt.

    Its document (``to_dict``, a run's ``plan`` in a trace) holds the fields and the derived
    ``gemm_m``. A run that no plan made (a capture, an imported engine dump) stores part of one
    (``{"description": ...}``): every field has a default so that such a document reads too.

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
        engine: which engine executes the plan (a name of :mod:`tracer.engines.table`; default the
            reference); :mod:`tracer.engines.door` picks the executor.
        engine_settings: ``(key, value)`` pairs for the engine (e.g. its KV block size and how its
            chunks become requests; the engine sets them when it realises the scenario,
            :func:`tracer.engines.door.realise`).
        rl: the plan's side of an RL step (:class:`tracer.plan.rollout.RLSpec`: the rollout sampling
            token by token, or the trainer's teacher-forced forward), None otherwise.
    """

    name: str = ""
    chunks: tuple[schema.Span, ...] = ()
    description: str = ""
    batch: Batch | None = None
    kv_transform: str | None = None
    tp: TPSpec | None = None
    attn: str | None = None
    compile: bool = False
    devices: tuple[str, ...] | None = None
    generate: schema.Count = 0
    recompute: bool = False
    deterministic: bool = False
    cuda_graph: bool = False
    engine: str = REFERENCE
    rl: RLSpec | None = None
    engine_settings: tuple[tuple[str, Any], ...] = ()

    schema_derived = ("gemm_m",)

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
        if self.rl is not None:  # an engine that flattens a step's requests pads none (its row in the table)
            return self.rl.gemm_m(flattened=getattr(rows().get(name_of(self.engine)), "flattens", False))
        if self.batch is not None:
            if self.batch.padding != "none":
                return [self.batch.size * self.batch.width]
            return [self.batch.size * (stop - start) for start, stop in self.chunks]
        ms = [stop - start for start, stop in self.chunks]
        n = self.n_tokens
        ms += [n + t if self.recompute else 1 for t in range(1, self.generate)]
        return ms

    @classmethod
    def schema_prepare(cls, doc: dict[str, Any]) -> dict[str, Any]:
        """A ``batch`` given as a number or a list (a batch size, as plans written before the
        :class:`Batch` record and by hand say it) reads as no batch record."""
        if isinstance(doc.get("batch"), (int, list)) and not isinstance(doc.get("batch"), bool):
            return {**doc, "batch": None}
        return doc

    def kv_block_size(self) -> int | None:
        """The KV-cache block size this plan's engine is set to (``engine_settings``), None when
        the plan does not set one (the HF engine keeps one contiguous cache)."""
        size = dict(self.engine_settings).get("block_size")
        return int(size) if isinstance(size, int) and not isinstance(size, bool) else None

    def schema_extras(self, doc: dict[str, Any]) -> None:
        doc["gemm_m"] = self.gemm_m()


@dataclass(frozen=True)
class Scenario(schema.Record):
    """Two run plans of one prompt and the positions compared between them.

    A trace header written by hand may name its scenario only (``{"name": "prefix-cache"}``): the
    other fields have defaults (empty plans) so that such a document reads too.

    Attributes:
        name: catalogue name (``prefix-cache``).
        level: level of the seed's determinism hierarchy (0-7).
        invariant: what a correct engine would keep invariant (``cache hit vs miss``).
        plan_a, plan_b: the two runs.
        window: ``(start, stop)``: the compared absolute positions.
        params: the scenario's parameters (block size, split point, mitigation), recorded in the
            trace header; a ``kv-quant`` scenario's ``kv_block_format`` is a
            :class:`~tracer.plan.quant.BlockFormat` document.
    """

    name: str
    level: int = 0
    invariant: str = ""
    plan_a: RunPlan = schema.field(default_factory=lambda: RunPlan("A"))
    plan_b: RunPlan = schema.field(default_factory=lambda: RunPlan("B"))
    window: tuple[schema.Count, schema.Count] = (0, 0)
    params: dict[str, Any] = schema.field(default_factory=dict)

    def block_sizes(self) -> tuple[int | None, int | None]:
        """The KV block size each plan ran with: the engine's setting (its paged KV cache's ``block_size``),
        else the scenario's (``block_sizes`` of the block-size scenario, one per plan; the
        ``block_size`` whose multiple the cached prefix is), else None (no paged KV cache)."""
        pair = self.params.get("block_sizes")
        out = []
        for i, plan in enumerate((self.plan_a, self.plan_b)):
            size = plan.kv_block_size()
            if size is None and isinstance(pair, (list, tuple)) and len(pair) == 2:
                size = pair[i]
            if size is None:
                size = self.params.get("block_size")
            out.append(int(size) if isinstance(size, int) and not isinstance(size, bool) else None)
        return out[0], out[1]

    def schema_check(self) -> str | None:
        fmt = self.params.get("kv_block_format")
        if fmt is not None:
            try:
                BlockFormat.from_dict(fmt)
            except TracerError as e:
                return f"params.kv_block_format: {e}"
        return None


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

