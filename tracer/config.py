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
signatures use; its words (each option's help, brief and ``--help`` panel) are
:mod:`tracer.config_help`.
"""

from __future__ import annotations

import inspect
import types
import typing
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Callable

from tracer.config_help import BRIEF, HELP, PANELS, SCENARIO_NOTES
from tracer.errors import TracerError, did_you_mean
from tracer.plan.checks import applicable_options, check_applicable, scenario_option_names
from tracer.plan.scenarios import SCENARIOS

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
            close = did_you_mean(unknown[0], valid)
            raise TracerError(f"unknown option(s) {', '.join(unknown)}" + (f" (did you mean {close}?)" if close else "")
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
            out[key] = Option(group, f.name, HELP[key], cli_type(hints[f.name]), _flags(key), _brief(key), _panel(key))
    types = {p.name: p.annotation for fn in SCENARIOS.values()
             for p in inspect.signature(fn, eval_str=True).parameters.values()}
    for key in scenario_option_names():
        out[key] = Option("scenario_options", key, HELP[key], cli_type(types[key]), _flags(key), _brief(key), _panel(key))
    return out


def _brief(key: str) -> str:
    return BRIEF.get(key, HELP[key])


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
        out.append((name, SCENARIO_NOTES.get(name, ""), _for_users(doc, applicable_options(name), re)))
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
