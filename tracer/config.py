"""One run configuration: every option of run, audit, sweep and bench, grouped, frozen, validated once.

Options arrive flat (the CLI's ``--tp 2``, ``tracer.run(tp=2)``) and are sorted into six frozen
groups that follow the pipeline (load → plan → execute/capture → store → compare)::

    RunConfig.from_options(model="smollm2-135m", scenario="tensor-parallel", tp=2)
      .model     ModelConfig     what to load and where: name, dtype, device, attn, gguf, device map
      .prompt    PromptConfig    the prompt: text, file, token ids, chat template, length N
      .scenario  ScenarioConfig  which pair of run plans: name, block size, split, mitigation, options
      .capture   CaptureConfig   what the hooks keep: granularity, positions, KV-cache points
      .store     StoreConfig     where the trace goes: tensors / stats / none, output, compression
      .checks    ChecksConfig    what is judged: tolerances, --fail-on, decode replay, noise verdict

:meth:`RunConfig.from_options` refuses unknown names (listing the valid ones) and options that do
not apply to the chosen scenario (``--tp 2`` with ``--scenario repeat`` is an error, not ignored);
:func:`tracer.validate.validate` checks every value that can be checked before a model loads.
:data:`OPTIONS` (flat name → group, field, help) is the one declaration the CLI and the API
signatures use.
"""

from __future__ import annotations

import inspect
import types
import typing
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable

from tracer.dtypes import ALIASES, FLOATS
from tracer.engines.table import ENGINES, REFERENCE, default, help_line, selectable, takers
from tracer.errors import TracerError
from tracer.plan.hierarchy import ALIGNED_SOURCE
from tracer.plan.checks import applicable_options, check_applicable, scenario_option_names
from tracer.plan.scenarios import SCENARIOS

#: a few words after a scenario's name in ``--scenario``'s help (the list itself is :data:`SCENARIOS`)
_SCENARIO_NOTES = {
    "prefix-cache": "cache miss vs hit; --split-at N-1 is a decode step",
    "cuda-graph": "eager vs CUDA-graph replay, GPU only",
    "engine": f"{' vs '.join(selectable()[:2])}, --engines",
    "prefill-decode": "a producer's KV cache handed to a consumer that decodes, inside "
                      + ", ".join(r.name for r in ENGINES if r.scenarios and "prefill-decode" in r.scenarios),
    "rollout-vs-train": "RL: a rollout sampling from a KV cache vs the trainer's teacher-forced recompute",
}

if TYPE_CHECKING:
    from tracer.plan.scenarios import Scenario

#: what a run keeps: full tensors of the points around the origin within a byte budget (auto), every
#: tensor in the trace, statistics only (online comparison), or nothing
STORE_MODES = ("auto", "tensors", "stats", "none")
POSITIONS = ("window", "all")
COMPRESSIONS = (None, "lzf", "gzip")


@dataclass(frozen=True)
class ModelConfig:
    """What to load: a built-in recipe, a GGUF file, an HF id in the local cache, a folder; dtype, device, attention."""

    name: str = "smollm2-135m"
    dtype: str = "bfloat16"
    device: str | None = None
    attn: str = "sdpa"
    gguf: str | None = None
    device_map: str | dict[str, Any] | None = None
    max_memory: str | dict[Any, str] | None = None


@dataclass(frozen=True)
class PromptConfig:
    """The prompt: one of text, a text file, token ids, a token-id file (default: the built-in text)."""

    prompt: str | None = None
    prompt_file: str | None = None
    token_ids: tuple[int, ...] | None = None
    token_ids_file: str | None = None
    chat: bool = False
    length: int | None = None


@dataclass(frozen=True)
class ScenarioConfig:
    """Which pair of run plans: a catalogue name (or a Scenario / ``f(n_tokens)``) and its options.

    ``block_size``, ``split_at`` and every entry of ``options`` are None-or-absent when unset: the
    scenario's own default applies (its engine's: :func:`tracer.engines.table.default`). ``engine``:
    who executes both plans (None: the reference; :mod:`tracer.engines.table`); ``attention_backend``
    and ``batch_invariant``: engine options, set in the plans of the engines that take them
    (:data:`tracer.engines.table.ENGINE_OPTIONS`).
    """

    name: str | Scenario | Callable[[int], Scenario] = "prefix-cache"
    block_size: int | None = None
    split_at: int | None = None
    mitigation: str | None = None
    options: tuple[tuple[str, Any], ...] = ()
    engine: str | None = None
    attention_backend: str | None = None
    batch_invariant: bool | None = None

    def params(self) -> dict[str, Any]:
        """Keyword arguments of :func:`tracer.plan.build.build` (unset ones left out)."""
        out = {k: v for k, v in self.options if v is not None}
        for k in ("block_size", "split_at", "mitigation", "engine", "attention_backend", "batch_invariant"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out


@dataclass(frozen=True)
class CaptureConfig:
    """What the hooks keep: ``layers``/``sublayers``, the compared ``window`` or ``all`` positions, KV caches,
    (``kernels``) which kernels each capture point ran (``torch.profiler``, :mod:`tracer.execute.kernels`),
    and (``cuda_graphs``) whether both runs' forward passes are recorded in CUDA graphs and replayed,
    the capture copies recorded with them (:mod:`tracer.execute.graphs`)."""

    granularity: str = "layers"
    positions: str = "window"
    kv_cache: bool = True
    kernels: bool = False
    cuda_graphs: bool = False


@dataclass(frozen=True)
class StoreConfig:
    """Where the trace goes: ``auto`` (every point compared on the device, full tensors of the
    points around the origin and the logits within ``max_trace_size`` bytes, :mod:`tracer.store.budget`),
    ``tensors`` (every captured tensor), ``stats`` (the comparison only) or ``none``."""

    mode: str = "auto"
    output: str | None = None
    overwrite: bool = False
    compression: str | None = None
    max_trace_size: int | str | None = None

    def budget(self) -> int:
        """``--store auto``'s byte budget (:data:`tracer.store.budget.DEFAULT_MAX_TRACE_SIZE` when unset).

        Raises:
            TracerError: not a size.
        """
        from tracer.store.budget import DEFAULT_MAX_TRACE_SIZE, parse_size

        return DEFAULT_MAX_TRACE_SIZE if self.max_trace_size is None else parse_size(self.max_trace_size)


@dataclass(frozen=True)
class ChecksConfig:
    """What is judged: tolerances, the ``--fail-on`` rule, the decode replay, the noise verdict, and
    (``op_replay``) each origin op replayed in float64 against both runs (:mod:`tracer.diff.accuracy`)."""

    atol: float | None = None
    rtol: float | None = None
    fail_on: str | None = None
    decode: int = 0
    verdict: bool = False
    op_replay: bool = False


@dataclass(frozen=True)
class RunConfig:
    """The whole configuration of one scenario run (see the module docstring)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    scenario: ScenarioConfig = field(default_factory=ScenarioConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    checks: ChecksConfig = field(default_factory=ChecksConfig)

    @classmethod
    def from_options(cls, *, allowed: tuple[str, ...] | None = None, check_scenario: bool = True,
                     **options: Any) -> "RunConfig":
        """Sort flat options into the groups.

        Args:
            allowed: the flat names a command takes (default: all of :data:`OPTIONS`).
            check_scenario: refuse scenario options the chosen scenario does not use (the audit,
                which runs many scenarios, checks them against its checks instead).
            options: flat options; None means "not given" (the default applies).

        Raises:
            TracerError: an unknown option, one the command does not take, or a scenario option
                that the chosen scenario does not use (each listing the valid ones).
        """
        valid = tuple(OPTIONS) if allowed is None else allowed
        unknown = sorted(k for k in options if k not in valid)
        if unknown:
            import difflib

            close = difflib.get_close_matches(unknown[0], valid, n=1)
            raise TracerError(f"unknown option(s) {', '.join(unknown)}" + (f" (did you mean {close[0]}?)" if close else "")
                              + f"; valid: {', '.join(valid)}")
        groups: dict[str, dict[str, Any]] = {g: {} for g in _GROUPS}
        scen_opts: dict[str, Any] = {}
        for key, value in options.items():
            if value is None:
                continue
            group, name = OPTIONS[key].group, OPTIONS[key].field
            if group == "scenario_options":
                scen_opts[key] = value
            else:
                groups[group][name] = _normalise(key, value)
        groups["scenario"]["options"] = tuple(sorted(scen_opts.items()))
        cfg = cls(**{g: _GROUPS[g](**kw) for g, kw in groups.items()})
        if check_scenario:
            check_applicable(cfg.scenario)
        return cfg

    def flat(self) -> dict[str, Any]:
        """The options as flat keyword arguments (the inverse of :meth:`from_options`)."""
        out: dict[str, Any] = {}
        for key, opt in OPTIONS.items():
            if opt.group == "scenario_options":
                out[key] = dict(self.scenario.options).get(key)
            else:
                out[key] = getattr(getattr(self, opt.group), opt.field)
        return out

    def with_options(self, **options: Any) -> "RunConfig":
        """A copy with some flat options changed (validated like :meth:`from_options`)."""
        return RunConfig.from_options(**{**{k: v for k, v in self.flat().items() if v is not None}, **options})

    def to_dict(self) -> dict[str, Any]:
        """The options that were set, as JSON data (the trace header's ``options``); a Scenario object or
        builder given as ``scenario`` is named by its type, token ids are left out (the runs hold them)."""
        out: dict[str, Any] = {}
        for k, v in self.flat().items():
            if v is None or k == "token_ids":
                continue
            out[k] = v if isinstance(v, (str, int, float, bool, list, tuple, dict)) else type(v).__name__
        return out


def _normalise(key: str, value: Any) -> Any:
    if key == "store":
        return {True: "tensors", False: "none"}.get(value, value)
    if key == "token_ids":
        import numbers

        if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
            raise TracerError(f"token_ids must be a list of ints, got {type(value).__name__}")
        ids = tuple(value)
        bad = [v for v in ids if isinstance(v, bool) or not isinstance(v, numbers.Integral)][:1]
        if bad:
            raise TracerError(f"token_ids must be a list of ints; {bad[0]!r} ({type(bad[0]).__name__}) is not one")
        return tuple(int(v) for v in ids)
    if key == "compression" and value == "none":
        return None
    return value


_GROUPS: dict[str, Callable[..., Any]] = {"model": ModelConfig, "prompt": PromptConfig, "scenario": ScenarioConfig,
                                          "capture": CaptureConfig, "store": StoreConfig, "checks": ChecksConfig}


@dataclass(frozen=True)
class Option:
    """One flat option: the group and field it fills (one of :class:`RunConfig`'s six, or
    ``scenario_options``), its help (the whole text: the API's docstrings and ``tracer help TOPIC``),
    its one-line ``brief`` and the ``panel`` it is listed in (``tracer run --help``: :data:`PANELS`),
    and its command-line facets, derived from the field's annotation: the value's type there
    (``str``, ``int``, ``float``, ``bool``, ``tuple``: integers as ``16,64``) and its flags."""

    group: str
    field: str
    help: str
    type: type = str
    flags: tuple[str, ...] = ()
    brief: str = ""
    panel: str = ""


_HELP = {
    "model": "built-in model (see 'tracer models'), a GGUF file (path/to/model.gguf), HF model id in the local cache, "
             "or local directory",
    "dtype": f"model dtype: {', '.join(FLOATS)} (also {', '.join(ALIASES)})",
    "device": "where the model runs: cpu, cuda, cuda:N (default: cuda if available, else cpu)",
    "attn": "attention implementation: sdpa or eager",
    "gguf": "GGUF file for a GGUF recipe (smollm2-135m, gemma3-270m; default: the recipe's package copy, or "
            "$TRACER_SMOLLM2_GGUF / $TRACER_GEMMA3_GGUF)",
    "device_map": "spread the model over GPUs (or GPU+CPU) with accelerate: auto, balanced, sequential, or a JSON "
                  "object {\"model.layers.0\": \"cuda:0\", ...}; excludes --device",
    "max_memory": "with --device-map auto: per-device budget, e.g. 0=20GiB,cpu=64GiB",
    "prompt": "prompt text (default: a built-in prompt of a few hundred tokens)",
    "prompt_file": "read the prompt text from a file",
    "token_ids": "the prompt as token ids: a list of ints (on the command line 1,2,3)",
    "token_ids_file": "JSON array of token ids (as bug reports give them); the only prompt a model without a "
                      "tokenizer takes, and a GGUF's tokenizer is then not converted",
    "chat": "apply the tokenizer's chat template to the prompt",
    "length": "use exactly N tokens: the prompt truncated, or repeated to reach N",
    "scenario": "scenario: " + ", ".join(name + (f" ({_SCENARIO_NOTES[name]})" if name in _SCENARIO_NOTES else "")
                                         for name in SCENARIOS)
                + "; from Python also a Scenario or f(n_tokens) -> Scenario",
    "block_size": "KV cache block size in tokens; the cached prefix is the largest multiple below N (default "
                  + ", ".join(f"{r.defaults['block_size']}" + ("" if r.name == REFERENCE else f" with --engine {r.name}")
                              for r in ENGINES if "block_size" in r.defaults) + ")",
    "split_at": "cached prefix length P (1..N-1), overriding block_size",
    "mitigation": f"aligned (prefix-cache: the cache-miss run also splits at P, {ALIGNED_SOURCE}) or deterministic "
                  "(torch deterministic algorithms, TF32 off)",
    "engine": help_line(),
    "engines": f"engine: run A's and run B's engine, e.g. {','.join(selectable()[:2])} (default); NAME:BACKEND names "
               f"an engine's attention backend ({', '.join(takers('attention_backend'))}), e.g. "
               f"{next(iter(takers('attention_backend')), 'NAME')}:TRITON_ATTN, so that two backends can be compared",
    "attention_backend": f"{'/'.join(takers('attention_backend'))}: the engine's attention backend by name, e.g. "
                         "TRITON_ATTN, FLEX_ATTENTION, FLASH_ATTN, FLASHINFER, CPU_ATTN (default: the engine's own "
                         "choice); recorded in the numeric contract",
    "batch_invariant": f"{'/'.join(takers('batch_invariant'))}: the engine's batch-invariant mode (set before the "
                       "engine starts; CUDA, ROCm, XPU); once on, on for the whole process",
    "granularity": "layers (residual stream) or sublayers (norms, attention, MLP, every Linear)",
    "positions": "window: compare the positions both runs computed last (P..N-1); all: every position 0..N-1 "
                 "(locates a divergence born in the cached-prefix pass)",
    "kv_cache": "capture each layer's KV cache over all N positions (origin analysis of cached-prefix divergence); "
                "--no-kv-cache for long prompts, where it is most of the bytes",
    "kernels": "record which kernels each capture point ran in each run (torch.profiler): kernels column, origin "
               "class, JSON kernels_a/kernels_b",
    "cuda_graphs": "run both plans as CUDA-graph replays, the capture copies recorded into the graphs (CUDA GPU only)",
    "op_replay": "replay each origin op in float64 on the CPU from the captured inputs: each run's error in ULPs "
                 "against the exact result (with --granularity sublayers)",
    "store": "auto (full tensors around the origin and the logits within --max-trace-size; statistics of all), "
             "tensors (every captured tensor), stats (comparison only) or none (no file)",
    "max_trace_size": "with --store auto: bytes of full tensors the trace may hold, e.g. 300MB, 2GiB (default 256MiB; "
                      "tracer audit: per check, default 1MiB)",
    "output": "trace file (default: a new file in traces/ named after the model, scenario and time)",
    "overwrite": "replace an existing output file",
    "compression": "HDF5 compression of stored tensors: none, lzf, gzip",
    "atol": "absolute tolerance: count elements with |a-b| > atol + rtol*|a| per capture point",
    "rtol": "relative tolerance (see atol)",
    "fail_on": "when the comparison fails (exit 1; from Python: result.check()): any (a bitwise difference), "
               "flip (an argmax flip), tolerance (outside --atol/--rtol); default: report only",
    "decode": "greedy-decode T tokens from each run's KV cache; report the first that differs (0 = off)",
    "verdict": "re-run at float32 (and float64 on CPU): rounding noise, defect suspected or inconclusive",
    "batch_size": "batch: rows in the batch, the prompt included (default 4)",
    "padding": "batch: none, left or right",
    "batch_row": "batch, rollout-vs-train: row of the traced prompt (default batch_size // 2, rollouts // 2)",
    "new_tokens": "generate-cache, prefill-decode: greedy tokens to generate (default 8); rollout-vs-train: response "
                  "tokens (default 16)",
    "producer": "prefill-decode: the one setting in which the producer differs from the consumer, KEY=VALUE: "
                "block_size, max_num_batched_tokens (its chunked-prefill budget), dtype, kv_cache_dtype, "
                "attention_backend (default: none, the control; a value equal to the consumer's is refused: that "
                "is the control)",
    "block_sizes": f"block-size: two KV block sizes b1,b2 (default {','.join(map(str, default(None, 'block_sizes')))})",
    "chunk_size": "chunked-prefill: tokens per chunk (default 32)",
    "tp": "tensor-parallel: shards k of the row-parallel layers, or an engine's TP ranks (default 2)",
    "reduce": "tensor-parallel: all-reduce order ring or tree (default ring)",
    "reduce_dtype": "tensor-parallel: add partials in the activation dtype or float32",
    "kv_format": "kv-quant: fp8-e4m3, mxfp8 or nvfp4 (default fp8-e4m3)",
    "attn_a": "attention: run A's implementation (default eager)",
    "attn_b": "attention: run B's implementation (default sdpa; flash_attention_2 where installed)",
    "devices": "device/disaggregated: X,Y (default cpu,cuda)",
    "tp_mode": "tensor-parallel: simulated (one process, default) or distributed (run B on --tp processes with "
               "torch.distributed: gloo on the CPU, NCCL on GPUs)",
    "tp_partials": "tensor-parallel, distributed: also store every rank's row-parallel partials",
    "tp_vocab_parallel": "tensor-parallel, distributed: shard the embedding and LM head by vocabulary",
    "rollouts": "rollout-vs-train: K sequences per RL step, the traced prompt among them (default 4)",
    "sample": "rollout-vs-train: sample the response (seeded) instead of greedy decoding",
    "temperature": "rollout-vs-train, with --sample: sampling temperature; logprobs are log_softmax(logits / T) (default 1)",
    "seed": "rollout-vs-train, with --sample: seed of the sampling generator (default 0)",
    "train_batching": "rollout-vs-train: the trainer's layout, padded (right-padded rows) or packed (one row, "
                      "position ids restarting per sequence) (default padded)",
    "train_attn": "rollout-vs-train: the trainer's attention implementation: eager, sdpa, flash_attention_2 "
                  "(default: as loaded)",
    "lm_head_fp32": "rollout-vs-train: the trainer computes its LM head in float32",
    "train_dtype": "rollout-vs-train: the trainer's dtype, float32 or float64 (default: the model's)",
    "is_cap": "rollout-vs-train: TIS cap C; the share of tokens with ratio > C is reported as clipped (default 2)",
    "mask_threshold": "rollout-vs-train: MIS/IcePop threshold b; tokens with ratio outside [1/b, b] count as "
                      "masked (default 2)",
    "mitigations": "rollout-vs-train: re-run with each knob changed (same attention, fp32 LM head, no padding, "
                   "batch of one, deterministic) and report the |dlogp| each leaves",
}


#: the panels of ``tracer run --help``, in print order, each with the options it lists (every option is in
#: one; the long help of a panel's options: ``tracer help TOPIC``, TOPIC its key here)
PANELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "run": ("What to run", ("model", "scenario", "prompt", "prompt_file", "length", "dtype", "device", "granularity",
                            "positions")),
    "output": ("Output", ("output", "overwrite")),  # and the command line's own: --format, --report, ... (tracer.cli.RENDER)
    "scenario": ("Scenario options", ("block_size", "split_at", "mitigation", "batch_size", "padding", "batch_row",
                                      "new_tokens", "block_sizes", "chunk_size", "kv_format", "attn_a", "attn_b",
                                      "devices", "producer")),
    "checks": ("Checks", ("decode", "verdict", "op_replay", "fail_on", "atol", "rtol")),
    "capture": ("Capture", ("kv_cache", "kernels", "cuda_graphs")),
    "storage": ("Storage", ("store", "max_trace_size", "compression")),
    "model": ("Model loading", ("attn", "gguf", "device_map", "max_memory", "chat", "token_ids", "token_ids_file")),
    "engines": ("Engines", ("engine", "engines", "attention_backend", "batch_invariant")),
    "rl": ("RL: rollout-vs-train", ("rollouts", "sample", "temperature", "seed", "train_batching", "train_attn",
                                    "lm_head_fp32", "train_dtype", "is_cap", "mask_threshold", "mitigations")),
    "tp": ("Tensor parallel", ("tp", "reduce", "reduce_dtype", "tp_mode", "tp_partials", "tp_vocab_parallel")),
}

#: one line of ``--help`` for options whose whole help (:data:`_HELP`) is longer than one
_BRIEF = {
    "model": "recipe (tracer models), .gguf file, HF id or folder",
    "dtype": ", ".join(f"{name} ({', '.join(a for a, n in ALIASES.items() if n == name)})" if name in ALIASES.values()
                      else name for name in FLOATS),
    "device": "cpu, cuda, cuda:N (default: cuda if there)",
    "gguf": "GGUF file for a GGUF recipe",
    "device_map": "auto, balanced, sequential or JSON (accelerate)",
    "max_memory": "per-device budget, e.g. 0=20GiB,cpu=64GiB",
    "prompt": "prompt text (default: a built-in prompt)",
    "token_ids": "the prompt as token ids, e.g. 1,2,3",
    "token_ids_file": "JSON array of token ids",
    "length": "use exactly N tokens (truncate or repeat)",
    "scenario": "which two runs: prefix-cache (default), batch, ... (tracer help scenarios)",
    "block_size": "KV cache block size (default 16)",
    "split_at": "cached prefix length P, overriding --block-size",
    "mitigation": "aligned or deterministic",
    "engine": f"who runs both: {' or '.join(selectable())} (default {REFERENCE}; tracer help engines)",
    "engines": f"engine: run A's and B's, e.g. {','.join(selectable()[:2])}; NAME:BACKEND",
    "attention_backend": f"{'/'.join(takers('attention_backend'))}: attention backend, e.g. TRITON_ATTN",
    "batch_invariant": f"{'/'.join(takers('batch_invariant'))}: batch-invariant mode (GPUs)",
    "granularity": "layers (default) or sublayers (every op)",
    "positions": "window (default: P..N-1) or all",
    "kv_cache": "capture each layer's KV cache (default on)",
    "kernels": "record the kernels each point ran",
    "cuda_graphs": "run both plans as CUDA-graph replays",
    "op_replay": "replay each origin op in float64 (ULPs)",
    "store": "auto (default), tensors, stats or none",
    "max_trace_size": "--store auto's budget, e.g. 300MB (default 256MiB)",
    "output": "trace file (default: a new file in traces/)",
    "compression": "none (default), lzf or gzip",
    "atol": "absolute tolerance (with --fail-on tolerance)",
    "rtol": "relative tolerance (see --atol)",
    "fail_on": "exit 1 on: any, flip or tolerance",
    "decode": "greedy-decode T tokens from each run",
    "verdict": "re-run at float32/64: rounding noise or defect?",
    "batch_size": "batch: rows in the batch (default 4)",
    "padding": "batch: none, left or right",
    "batch_row": "batch, RL: the traced prompt's row",
    "new_tokens": "generate-cache, prefill-decode (8), rollout-vs-train (16): tokens",
    "producer": "prefill-decode: the producer's one difference, KEY=VALUE (keys: tracer help scenario)",
    "block_sizes": "block-size: two KV block sizes (default 16,64)",
    "chunk_size": "chunked-prefill: tokens per chunk (default 32)",
    "tp": "shards of the row-parallel layers; an engine's TP ranks (default 2)",
    "reduce": "all-reduce order: ring (default) or tree",
    "reduce_dtype": "add partials in the activation dtype or float32",
    "kv_format": "kv-quant: fp8-e4m3 (default), mxfp8, nvfp4",
    "attn_a": "attention: run A's implementation (default eager)",
    "attn_b": "attention: run B's implementation (default sdpa)",
    "devices": "device/disaggregated: X,Y (default cpu,cuda)",
    "tp_mode": "simulated (default) or distributed",
    "tp_partials": "distributed: store every rank's partials",
    "tp_vocab_parallel": "distributed: shard embedding and LM head",
    "rollouts": "K sequences per RL step (default 4)",
    "sample": "sample the response instead of greedy",
    "temperature": "with --sample: temperature (default 1)",
    "seed": "with --sample: seed (default 0)",
    "train_batching": "trainer layout: padded (default) or packed",
    "train_attn": "trainer attention: eager, sdpa, flash_attention_2",
    "lm_head_fp32": "trainer LM head in float32",
    "train_dtype": "trainer dtype: float32 or float64",
    "is_cap": "TIS cap C (default 2)",
    "mask_threshold": "MIS/IcePop threshold b (default 2)",
    "mitigations": "re-run with each knob changed; |Δlogp| each leaves",
}


#: short flags of the run options (``-n 64``)
_SHORT = {"prompt": "-p", "length": "-n", "scenario": "-s", "block_size": "-b", "output": "-o"}
#: options whose command-line flag pairs with an off switch (they default to on)
_SWITCHES = {"kv_cache": "--kv-cache/--no-kv-cache"}


def cli_type(annotation: Any) -> type:
    """The command-line type of a field annotated ``annotation``: bool, int, float, ``tuple`` (of
    ints: ``16,64`` on the command line), else text."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    args = [a for a in typing.get_args(annotation) if a is not type(None)] if union else [annotation]
    if len(args) == 1 and typing.get_origin(args[0]) is tuple and set(typing.get_args(args[0])) <= {int, ...}:
        return tuple
    return args[0] if len(args) == 1 and args[0] in (bool, int, float) else str


def _flags(key: str) -> tuple[str, ...]:
    if key in _SWITCHES:
        return (_SWITCHES[key],)
    return ("--" + key.replace("_", "-"), *((_SHORT[key],) if key in _SHORT else ()))


def _declare() -> dict[str, Option]:
    renames = {("model", "name"): "model", ("scenario", "name"): "scenario", ("store", "mode"): "store"}
    out: dict[str, Option] = {}
    for group, cls in _GROUPS.items():
        hints = typing.get_type_hints(cls, localns={"Scenario": object})  # a Python-only type: not a CLI type
        for f in fields(cls):
            if f.name == "options":
                continue
            key = renames.get((group, f.name), f.name)
            out[key] = Option(group, f.name, _HELP[key], cli_type(hints[f.name]), _flags(key), _brief(key), _panel(key))
    types = {p.name: p.annotation for fn in SCENARIOS.values()
             for p in inspect.signature(fn, eval_str=True).parameters.values()}
    for key in scenario_option_names():
        out[key] = Option("scenario_options", key, _HELP[key], cli_type(types[key]), _flags(key), _brief(key), _panel(key))
    return out


def _brief(key: str) -> str:
    return _BRIEF.get(key, _HELP[key])


def _panel(key: str) -> str:
    """The title of the panel that lists option ``key`` (:data:`PANELS`); a new option must be given one."""
    title = next((t for t, keys in PANELS.values() if key in keys), None)
    if title is None:
        raise AssertionError(f"option {key!r} is in no panel of tracer.config.PANELS")
    return title


OPTIONS: dict[str, Option] = _declare()

def scenario_docs() -> list[tuple[str, str, str]]:
    """Every scenario of :data:`SCENARIOS` as ``(name, note, description)``: the few words of
    ``--scenario``'s help and the first paragraph of its docstring (``tracer help scenarios``)."""
    import re

    out = []
    for name, fn in SCENARIOS.items():
        doc = " ".join((inspect.getdoc(fn) or "").split("\n\n")[0].split())
        out.append((name, _SCENARIO_NOTES.get(name, ""), _for_users(doc, applicable_options(name), re)))
    return out


def _for_users(doc: str, params: tuple[str, ...], re: types.ModuleType) -> str:
    """A builder's docstring as a user reads it: RST roles and double backticks gone (``:mod:`x```
    becomes ``x``), each of the builder's parameters with an underscore named by its ``--flag``
    (``batch_row``: ``--batch-row``), and the builder's flags listed."""
    doc = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc).replace("``", "")
    flags = {p: OPTIONS[p].flags[0].split("/")[0] for p in params if p in OPTIONS}
    for p, flag in flags.items():  # a name with an underscore: one word (engines) is also English
        if "_" in p:
            doc = re.sub(rf"(?<![\w.-]){p}(?![\w-])", flag, doc)
    return doc + (f" Options: {', '.join(flags.values())}." if flags else "")


_MODEL = ("model", "dtype", "device", "attn", "gguf", "device_map", "max_memory")
_PROMPT = ("prompt", "prompt_file", "token_ids", "token_ids_file", "chat", "length")
#: the run options each command takes: the API's keywords and the ``tracer`` command's flags are both
#: built from these (tests/test_cli_api.py checks they agree). The audit's checks fix padding, reduce
#: order and dtype, KV formats and devices themselves; a sweep's axes are the prompt length and the
#: KV block size (its own ``block_sizes``, not the block-size scenario's pair), and its rows hold no RL
#: metrics (so no ``mitigations``, ``is_cap``, ``mask_threshold``: they would change nothing).
_SWEEP_LEAVES = ("block_sizes", "mitigations", "is_cap", "mask_threshold")
COMMAND_OPTIONS: dict[str, tuple[str, ...]] = {
    "run": tuple(OPTIONS),
    "audit": (*_MODEL, *_PROMPT, "engine", "granularity", "kv_cache", "kernels", "store", "max_trace_size", "output",
              "overwrite", "batch_size", "batch_row", "new_tokens", "block_sizes", "chunk_size", "tp", "attn_a", "attn_b"),
    "sweep": (*_MODEL[:5], *_PROMPT[:5], "scenario", "block_size", "mitigation", "engine", "granularity", "kv_cache", "store",
              "output", "overwrite", *(k for k, o in OPTIONS.items() if o.group == "scenario_options" and k not in _SWEEP_LEAVES)),
    "bench": ("model", "length", "dtype", "device", "gguf", "granularity", "kv_cache", "block_size", "engine",
              "attention_backend", "batch_invariant"),
    "compare": ("atol", "rtol", "fail_on", "temperature", "is_cap", "mask_threshold"),
}


__all__ = ["COMMAND_OPTIONS", "PANELS", "scenario_docs", "RunConfig", "ModelConfig", "PromptConfig", "ScenarioConfig", "CaptureConfig", "StoreConfig",
           "ChecksConfig", "OPTIONS", "Option", "check_applicable", "applicable_options", "replace"]
