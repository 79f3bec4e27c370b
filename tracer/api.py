"""The notebook API: a few composable calls over the pipeline (the ``tracer`` command is the same calls).

    >>> import tracer
    >>> lm = tracer.load_model("smollm2-135m")                       # LoadedModel (model, tokenizer, info)
    >>> result = tracer.run(lm, scenario="prefix-cache", length=250)  # RunResult: one scenario end to end
    >>> with tracer.capture(lm, points="layers") as cap:              # any forward inside is captured
    ...     lm.model(ids)
    >>> cap["model.layers.3"].tensor                                  # (T, hidden), model dtype
    >>> tracer.compare(cap_a, cap_b)                                  # captures, runs or "file.h5:RUN"
    >>> tracer.render(result, "markdown"); tracer.plot(result, "amplification")
    >>> tracer.audit(lm); tracer.sweep(lm, lengths="17:64")

Every option of :func:`run`, :func:`audit` and :func:`sweep` is declared once in
:data:`tracer.config.OPTIONS`; their signatures are built from it (``inspect.signature`` and tab
completion show every keyword), and the ``tracer`` command's options from these functions
(:mod:`tracer.cli`). The calls on stored files (no model needed: ``compare_trace``, ``trace_info``,
``plot_file``, ``report_file`` ...) live in :mod:`tracer.api_files`, :func:`capture` and
:func:`compare` in :mod:`tracer.api_capture`; both are re-exported here.
Importing this module loads neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import TYPE_CHECKING, Any, Callable

from tracer.api_capture import capture, compare, is_loaded
from tracer.api_files import (compare_trace, import_dump, plot_file, read_sweep, read_trace, report_file, trace_info,
                               write_megatron_dump, write_sglang_dump)
from tracer.config import COMMAND_OPTIONS, OPTIONS, RunConfig
from tracer.engines.table import check_engine, is_reference
from tracer.plan.engines import check_engine_options
from tracer.errors import TracerError, did_you_mean
from tracer.load.recipes import list_models
from tracer.run_result import RunResult as _RunResult
from tracer.validate import validate

if TYPE_CHECKING:  # the result types, for the signatures only (the re-exported ones' too): importing tracer stays light
    from pathlib import Path

    import pandas
    from matplotlib.figure import Figure
    from torch import nn

    from tracer.api_capture import RunRef
    from tracer.diff.result import Comparison
    from tracer.diff.rl import RLComparison
    from tracer.execute.captured import Captured
    from tracer.engines.dumps.namemap import MappedDump
    from tracer.execute.records import RunRecord
    from tracer.load.models import LoadedModel, ModelInfo
    from tracer.loops.audit import Audit, AuditRow
    from tracer.loops.bench import BenchResult
    from tracer.loops.bench_engine import EngineBenchResult
    from tracer.plan.scenarios import Scenario  # RunResult's own annotations (tracer.run_result)
    from tracer.store.sweepfile import SweepResult, SweepRow
    from tracer.store.trace import TraceReader

#: the run options each command takes (:data:`tracer.config.COMMAND_OPTIONS`)
RUN_OPTIONS, AUDIT_OPTIONS, SWEEP_OPTIONS, BENCH_OPTIONS, COMPARE_OPTIONS = (
    COMMAND_OPTIONS[k] for k in ("run", "audit", "sweep", "bench", "compare"))
_MODEL = ("model", "dtype", "device", "attn", "gguf", "device_map", "max_memory")


def _quiet(msg: str) -> None:
    return None


def _config(model: str | LoadedModel, loaded: LoadedModel | None, allowed: tuple[str, ...], check_scenario: bool = True,
            new_output: bool = True, one_length: bool = True, **options: Any) -> tuple[RunConfig, LoadedModel | None]:
    """The validated config and the loaded model to reuse (``model`` may itself be a LoadedModel)."""
    lm = model if is_loaded(model) else loaded
    if lm is not None:
        from tracer.load.devices import loaded_clash

        clash = loaded_clash(lm.info, options)
        if clash:
            raise TracerError(f"{clash} does not match the already loaded model; load it with "
                              "tracer.load_model(..., dtype=..., device=...) instead")
        options = {k: v for k, v in options.items() if k not in _MODEL[1:]}
    name = lm.info.name if lm is not None else model
    cfg = RunConfig.from_options(allowed=allowed, model=name, check_scenario=check_scenario, **options)
    return validate(cfg, lm, new_output=new_output, one_length=one_length), lm


def _asked_store(options: dict[str, Any]) -> dict[str, Any]:
    """A library call writes a file only when asked: ``store`` None means ``auto`` with an
    ``output``, else ``none`` (the CLI always passes ``store``)."""
    if options.get("store") is None:
        return {**options, "store": "auto" if options.get("output") is not None else "none"}
    return options


def _signature(fn: Callable[..., Any], names: tuple[str, ...]) -> Callable[..., Any]:
    """Give ``fn(..., **options)`` a real signature: its own parameters, then every flat option in
    ``names`` as a keyword with its default (tab completion and ``inspect.signature`` see them)."""
    sig = inspect.signature(fn)
    own = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
    defaults = RunConfig()
    extra = []
    for n in names:
        if n in sig.parameters:
            continue
        opt = OPTIONS[n]
        default = (None if opt.group == "scenario_options" or n == "store"
                   else getattr(getattr(defaults, opt.group), opt.field))
        extra.append(inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=default))
    fn.__signature__ = sig.replace(parameters=own + extra)  # type: ignore[attr-defined]
    fn.__doc__ = (fn.__doc__ or "") + "\n    Options (:data:`tracer.config.OPTIONS`):\n" + "".join(
        f"        {n}: {OPTIONS[n].help}\n" for n in names if n in OPTIONS and n not in sig.parameters)
    return fn


def load_model(name: str = "smollm2-135m", *, dtype: str = "bfloat16", device: str | None = None,
               attn: str = "sdpa", gguf: str | None = None, device_map: str | dict[str, Any] | None = None,
               max_memory: str | dict[Any, str] | None = None, progress: bool = False,
               tokenizer: bool = True) -> LoadedModel:
    """Load a model by name (:func:`tracer.load.models.load_model`): a built-in recipe, a GGUF file
    (``*.gguf``), an HF id in the local cache, or a local folder. Returns a
    :class:`~tracer.load.models.LoadedModel`; its ``tokenizer`` is None for a model saved without one
    and with ``tokenizer=False`` (such a model runs on ``token_ids=`` only; a GGUF's tokenizer is
    then not converted).

    Raises:
        TracerError: unknown model, missing or unreadable weights, bad dtype/device/attention/device map.
    """
    from tracer.load.models import load_model as _load

    return _load(name, dtype=dtype, device=device, attn=attn, gguf=gguf, progress=progress,
                 device_map=device_map, max_memory=max_memory, tokenizer=tokenizer)


def run(model: str | LoadedModel = "smollm2-135m", *, loaded: LoadedModel | None = None, progress: bool = True,
        status: Callable[[str], None] | None = None, **options: Any) -> RunResult:
    """Run a scenario on a model and compare its two runs layer by layer.

    Args:
        model: a built-in recipe name, a GGUF file (``*.gguf``), an HF id in the local cache, a
            local folder, or a loaded model (:func:`load_model`) to reuse. A model without a
            tokenizer takes ``token_ids`` / ``token_ids_file`` only.
        loaded: a loaded model to reuse (the older spelling of passing it as ``model``).
        progress: show loading progress bars.
        status: called with one short line per stage.
        options: any of :data:`tracer.config.OPTIONS` (listed below); unknown names, and scenario
            options the chosen scenario does not use, are errors. ``store`` None (the default):
            a trace is written only when ``output`` is given.

    Returns:
        a :class:`RunResult`; ``result.comparison`` is the table as data, ``result.to_dict()`` its
        document, ``result.plot()`` / ``result.to_pandas()`` its figure and DataFrame.

    Raises:
        TracerError: every bad input, checked before the model loads where possible.
    """
    cfg, lm = _config(model, loaded, RUN_OPTIONS, **_asked_store(options))
    from tracer.pipeline import run as _run  # after the checks: the pipeline imports torch

    res = _run(cfg, lm, progress=progress, say=status or _quiet)
    return RunResult(**{f.name: getattr(res, f.name) for f in dataclasses.fields(res)})


class RunResult(_RunResult):
    """What :func:`run` returns: the run's result (:class:`tracer.run_result.RunResult`, data the
    orchestration returns) with its renderings at hand in a notebook: :meth:`plot`, :meth:`to_pandas`
    and Jupyter's markdown (:func:`render`)."""

    def plot(self, kind: str = "amplification", **kwargs: Any) -> Figure:
        """A matplotlib Figure (:func:`plot`): ``amplification``, ``heatmap`` or ``ulp``.

        Raises:
            TracerError: unknown kind, matplotlib missing.
        """
        return plot(self, kind, **kwargs)

    def to_pandas(self) -> pandas.DataFrame:
        """The comparison as a DataFrame, one row per capture point (:func:`to_pandas`)."""
        return to_pandas(self)

    def _repr_markdown_(self) -> str | None:  # Jupyter
        return render(self, "markdown")


def audit(model: str | LoadedModel = "smollm2-135m", *, levels: str | list[int] | None = None,
          mitigations: bool = True, loaded: LoadedModel | None = None, progress: bool | str = True,
          on_check: Callable[[str, int, int], None] | None = None, on_row: Callable[[AuditRow], None] | None = None,
          **options: Any) -> Audit:
    """Run every selected level of the determinism hierarchy on this machine (:mod:`tracer.loops.audit`).

    Args:
        model: a model name or a loaded model.
        levels: levels to run, e.g. 0,1,2 or a list (default: all, 0-7).
        mitigations: re-run diverging levels under each applicable mitigation.
        output: trace file for all runs (default traces/<model>-audit.h5); finished checks are kept
            in OUTPUT.checks/ while it runs, so re-running with the same options resumes an
            interrupted audit.
        kernels: record which kernels each capture point ran in every run (stored in the trace and
            in each stored comparison).
        progress: the plan (each check's cost), one line per finished check and an ETA on stderr:
            True or ``"auto"`` (a bar in a terminal, lines otherwise), ``"lines"``, or False (nothing).
        on_check: called as ``on_check(label, done, total)`` before each check.
        on_row: called with each finished :class:`~tracer.loops.audit.AuditRow`.
        options: model, prompt, capture and store options, and scenario options applied to every
            check that uses them (listed below); ``store=False`` keeps everything in memory.

    Returns:
        an :class:`~tracer.loops.audit.Audit` (the hierarchy table as data).

    Raises:
        TracerError: bad input (checked before the model loads where possible).
    """
    cfg, lm = _config(model, loaded, AUDIT_OPTIONS, check_scenario=False, new_output=False, **_asked_store(options))
    from tracer.loops.audit import audit as _audit  # after the checks: the pipeline imports torch

    return _audit(cfg, levels=levels, mitigations=mitigations, loaded=lm, progress=progress, on_check=on_check,
                  on_row=on_row)


def sweep(model: str | LoadedModel = "smollm2-135m", *, lengths: str | list[int] = "17:512",
          block_sizes: str | list[int] | None = None, keep_tensors: bool = False, loaded: LoadedModel | None = None,
          progress: bool | str = True, on_point: Callable[[SweepRow], None] | None = None,
          **options: Any) -> SweepResult:
    """Run a scenario for every prompt length × KV block size (:mod:`tracer.loops.sweep`).

    Args:
        model: a model name or a loaded model.
        lengths: prompt lengths: start:stop[:step] with stop INCLUSIVE (17:512 = 17..512), comma
            lists (64,128) or both; or a list of ints.
        block_sizes: several KV block sizes as a second axis, e.g. 16,32,64 (same syntax as
            lengths) or a list; excludes block_size (default: the engine's own KV block size, as
            the table of engines gives it).
        keep_tensors: also store every point's captured tensors (large).
        output: the sweep file (default: in traces/, named after the model and scenario); an unfinished one with
            the same parameters is resumed.
        overwrite: start over, replacing an existing output.
        scenario: the scenario run at every point (default prefix-cache).
        on_point: called with each finished :class:`~tracer.loops.sweep.SweepRow`.
        options: listed below; ``store=False`` keeps everything in memory.

    Returns:
        a :class:`~tracer.loops.sweep.SweepResult`.

    Raises:
        TracerError: bad axes, a prompt too short, a file of other parameters, every bad run option.
    """
    block_size = options.pop("block_size", None)
    cfg, lm = _config(model, loaded, SWEEP_OPTIONS, new_output=False, one_length=False, **_asked_store(options))
    from tracer.loops.sweep import block_axis, sweep as _sweep  # after the checks: the pipeline imports torch

    return _sweep(cfg, lengths=lengths, block_sizes=block_axis(block_sizes, block_size), keep_tensors=keep_tensors,
                  loaded=lm, progress=progress, on_point=on_point)


def plot(obj: RunResult | Comparison | SweepResult | str | os.PathLike, kind: str | None = None,
         **kwargs: Any) -> Figure:
    """A matplotlib Figure of a result: a RunResult or Comparison (``amplification``, ``heatmap``,
    ``ulp``), a SweepResult (``sweep``), or a trace/sweep file path (its default figure).

    Raises:
        TracerError: unknown kind for this object, matplotlib missing.
    """
    from tracer.report.plot import figure_of

    return figure_of(obj, kind, **kwargs)


def models() -> list[dict[str, Any]]:
    """The built-in models: ``[{"name", "kind", "description", "default", "installed"}]`` (``tracer
    models``): ``default`` True for the model a command runs when given none; ``installed`` whether
    a real-weights recipe's weights are on this machine (None: random-init, nothing to install),
    with ``install`` the command that installs them."""
    from tracer.config import ModelConfig
    from tracer.load.recipes import install_command, recipes, weights_installed

    known = recipes()
    out = []
    for m in list_models():
        r = known[m["name"]]
        installed = weights_installed(r)
        out.append({**m, "default": m["name"] == ModelConfig.name, "installed": installed,
                    "install": install_command(r) if installed is False else None})
    return out


def options(topic: str | None = None) -> dict[str, dict[str, Any]]:
    """The run options by topic, as ``tracer run --help`` lists them in panels, each with its whole
    help text (``tracer help [TOPIC]``).

    Args:
        topic: one of the topics (run, output, scenario, checks, capture, storage, model, engines,
            rl, tp) or ``scenarios`` (every scenario and what its two runs compute); default: all.

    Returns:
        ``{topic: {"title", "options": [{"name", "flags", "brief", "help"}]}}``; the ``scenarios``
        topic's options are the scenarios (``name``, ``flags`` empty, ``help`` its description).

    Raises:
        TracerError: an unknown topic (the message lists them).
    """
    from tracer.config import scenario_docs
    from tracer.config_help import PANELS

    out: dict[str, dict[str, Any]] = {}
    for key, (title, names) in PANELS.items():
        out[key] = {"title": title, "options": [
            {"name": n, "flags": list(OPTIONS[n].flags), "brief": OPTIONS[n].brief, "help": OPTIONS[n].help}
            for n in names]}
    out["scenarios"] = {"title": "Scenarios (--scenario NAME)", "options": [
        {"name": n, "flags": [], "brief": brief, "help": text} for n, brief, text in scenario_docs()]}
    if topic is None:
        return out
    if topic not in out:
        close = did_you_mean(topic, list(out))
        raise TracerError(f"unknown help topic {topic!r}" + (f" (did you mean {close}?)" if close else "")
                          + f"; topics: {', '.join(out)}")
    return {topic: out[topic]}


def bench(model: str = "smollm2-135m", *, length: int = 1024, dtype: str = "bfloat16", device: str | None = None,
          gguf: str | None = None, granularity: str = "layers", kv_cache: bool = True, block_size: int | None = None,
          scenario: str = "prefix-cache", engine: str | None = None, attention_backend: str | None = None,
          batch_invariant: bool | None = None, reps: int = 5, warmup: int = 1, outdir: str | None = None,
          peers: bool = True,
          progress: Callable[[str], None] | None = None) -> BenchResult | EngineBenchResult:
    """Measure tracer's overhead over the bare forward pass and its I/O against the disk, side by
    side with peers doing the same comparison (:mod:`tracer.loops.bench`).

    Args:
        length: prompt length N in tokens.
        scenario: a scenario whose plans are plain forward calls: prefix-cache (default), repeat,
            block-size or chunked-prefill (the reference engine; another engine benches prefix-cache).
        engine: the reference (default), or another engine of :mod:`tracer.engines.table`: the capture
            overhead inside it as a ratio to its own bare run (prefix-cache, one process, interleaved:
            the engine bench).
        attention_backend: the engine's attention backend by name (an engine option; default: the
            engine's own choice).
        batch_invariant: also measure every mode with the engine's batch-invariant mode on,
            afterwards in the same process (``bare_bi_over_bare``: what the mode costs).
        reps: measured repetitions of each mode.
        warmup: unmeasured repetitions first.
        outdir: folder for the trace and raw I/O files (default: a temp dir).
        peers: also measure the peers in the same loop: HF output_hidden_states, forward hooks +
            .cpu(), nnsight .save() (if installed), each checked to count the same differing
            elements per layer as tracer.
        progress: called with one line per repetition.

    Returns:
        a :class:`~tracer.loops.bench.BenchResult`, or with another engine an
        :class:`~tracer.loops.bench_engine.EngineBenchResult`.

    Raises:
        TracerError: bad options (as :func:`run`); a peer whose per-layer differing counts are not
            tracer's; another engine not installed, or with ``outdir``; an engine option the engine does
            not take.
    """
    if reps < 1 or warmup < 0:
        raise TracerError("--reps must be ≥ 1 and --warmup ≥ 0")
    if not is_reference(engine):
        check_engine(engine)
        if outdir is not None:
            raise TracerError(f"--outdir does not apply to --engine {engine} (the bench writes no file)")
        if scenario != "prefix-cache":
            raise TracerError(f"--engine {engine} benches the prefix-cache scenario; drop --scenario")
        from tracer.loops.bench_engine import bench_engine

        return bench_engine(model, engine=engine, length=length, dtype=dtype, gguf=gguf, granularity=granularity,
                            kv_cache=kv_cache, block_size=block_size, reps=reps, warmup=warmup, device=device,
                            attention_backend=attention_backend, batch_invariant=bool(batch_invariant),
                            progress=progress)
    check_engine_options(engine, "prefix-cache", {"attention_backend": attention_backend,
                                                  "batch_invariant": batch_invariant})
    from tracer.loops.bench import bench as _bench

    return _bench(model, length=length, dtype=dtype, device=device, gguf=gguf, granularity=granularity,
                  kv_cache=kv_cache, block_size=block_size, scenario=scenario,
                  reps=reps, warmup=warmup, outdir=outdir, peers=peers, progress=progress)


def to_pandas(obj: RunResult | Comparison | SweepResult | RLComparison) -> pandas.DataFrame:
    """A pandas DataFrame of a result: one row per capture point (a RunResult or Comparison; a
    ``rollout-vs-train`` run's RL summary in ``frame.attrs["rl"]``), per sweep point (a SweepResult), or
    per response token (the RL metrics ``result.comparison.rl``).

    Raises:
        TracerError: pandas is not installed.
    """
    from tracer.report.frames import comparison_frame, rl_frame, sweep_frame

    if hasattr(obj, "rows") and hasattr(obj, "params"):
        return sweep_frame(obj)
    if hasattr(obj, "dlogp") and hasattr(obj, "steps"):  # an RLComparison
        return rl_frame(obj)
    return comparison_frame(getattr(obj, "comparison", obj))


def render(obj: RunResult | Comparison | Audit, fmt: str = "markdown",
           columns: tuple[str, ...] | None = None) -> str | None:
    """Render a result as text: ``table`` (printed, returns None), ``json``, ``csv`` or ``markdown``
    (:data:`tracer.report.layout.FORMATS`). ``obj`` is a RunResult, a Comparison, an Audit, a
    SweepResult or a benchmark's result (:func:`tracer.report.render.render`).

    Raises:
        TracerError: unknown format or columns, not a result.
    """
    from tracer.report.render import render as _render

    return _render(obj, fmt, columns=columns)


run = _signature(run, tuple(k for k in RUN_OPTIONS if k != "model"))
audit = _signature(audit, tuple(k for k in AUDIT_OPTIONS if k != "model"))
sweep = _signature(sweep, tuple(k for k in SWEEP_OPTIONS if k != "model"))

__all__ = ["load_model", "run", "capture", "compare", "compare_trace", "import_dump", "write_sglang_dump",
           "read_trace", "audit", "sweep", "read_sweep", "plot", "plot_file", "report_file", "trace_info", "models",
           "bench", "render", "to_pandas"]
