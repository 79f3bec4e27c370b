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
completion show every keyword). Importing this module loads neither torch nor transformers.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from tracer.config import OPTIONS, RunConfig, validate
from tracer.errors import TracerError

#: the flat options of each command (audit and sweep take no per-run scenario choice of their own)
_MODEL = ("model", "dtype", "device", "attn", "gguf", "device_map", "max_memory")
_PROMPT = ("prompt", "prompt_file", "token_ids", "token_ids_file", "chat", "length")
RUN_OPTIONS = tuple(OPTIONS)
#: the audit's checks fix padding, reduce order and dtype, KV formats and devices themselves
AUDIT_OPTIONS = (*_MODEL, *_PROMPT, "granularity", "kv_cache", "kernels", "store", "output", "overwrite",
                 "batch_size", "batch_row", "new_tokens", "block_sizes", "chunk_size", "tp", "attn_a", "attn_b")
SWEEP_OPTIONS = (*(k for k in _MODEL if k not in ("device_map", "max_memory")), *(k for k in _PROMPT if k != "length"),
                 "scenario", "mitigation", "granularity", "kv_cache", "store", "output", "overwrite",
                 *(k for k, o in OPTIONS.items() if o.group == "scenario_options"))


def _quiet(msg: str) -> None:
    return None


def _is_loaded(obj: Any) -> bool:
    return hasattr(obj, "model") and hasattr(obj, "info") and hasattr(obj, "tokenizer")


def _config(model: Any, loaded: Any, allowed: tuple[str, ...], check_scenario: bool = True,
            new_output: bool = True, one_length: bool = True, **options: Any) -> tuple[RunConfig, Any]:
    """The validated config and the loaded model to reuse (``model`` may itself be a LoadedModel)."""
    lm = model if _is_loaded(model) else loaded
    if lm is not None:
        clash = _loaded_clash(lm.info, options)
        if clash:
            raise TracerError(f"{clash} does not match the already loaded model; load it with "
                              "tracer.load_model(..., dtype=..., device=...) instead")
        options = {k: v for k, v in options.items() if k not in _MODEL[1:]}
    name = lm.info.name if lm is not None else model
    cfg = RunConfig.from_options(allowed=allowed, model=name, check_scenario=check_scenario, **options)
    return validate(cfg, lm, new_output=new_output, one_length=one_length), lm


def _loaded_clash(info: Any, options: dict[str, Any]) -> str | None:
    """The first model option that contradicts a loaded model (``dtype="float32"`` on a bf16 model), or None."""
    from tracer.load.devices import dtype_name, resolve_device, resolve_dtype

    for key in ("gguf", "device_map", "max_memory"):
        if options.get(key) is not None:
            return f"{key}={options[key]!r}"
    if options.get("dtype") is not None and dtype_name(resolve_dtype(options["dtype"])) != info.dtype:
        return f"dtype={options['dtype']!r} (the model is {info.dtype})"
    if options.get("device") is not None and not _same_device(resolve_device(options["device"]), info.device):
        return f"device={options['device']!r} (the model is on {info.device})"
    if options.get("attn") is not None and options["attn"] != info.attn_implementation:
        return f"attn={options['attn']!r} (the model uses {info.attn_implementation})"
    return None


def _same_device(a: str, b: str) -> bool:
    import torch

    da, db = torch.device(a), torch.device(b)
    return da.type == db.type and (da.index or 0) == (db.index or 0)


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
               attn: str = "sdpa", gguf: str | None = None, device_map: Any = None, max_memory: Any = None,
               progress: bool = False, tokenizer: bool = True) -> Any:
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


def run(model: Any = "smollm2-135m", *, loaded: Any = None, progress: bool = True,
        status: Callable[[str], None] | None = None, **options: Any) -> Any:
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
        a :class:`~tracer.pipeline.RunResult`; ``result.comparison`` is the table as data and
        ``result.to_dict()`` the JSON document of ``tracer run --format json``.

    Raises:
        TracerError: every bad input, checked before the model loads where possible.
    """
    from tracer.pipeline import run as _run

    cfg, lm = _config(model, loaded, RUN_OPTIONS, **_asked_store(options))
    return _run(cfg, lm, progress=progress, say=status or _quiet)


def capture(model: Any, points: str | list[str] = "layers", *, keep_on_device: bool = False,
            cuda_graphs: bool = False) -> Any:
    """A context manager that captures every forward pass of ``model`` run inside it.

    ``model`` is an HF causal LM or a loaded model; ``points`` is ``"layers"`` (embedding, every
    decoder layer's output, final norm, logits), ``"sublayers"`` or a list of module paths
    (``["model.layers.3", "model.layers.3.mlp"]``). Each forward is a call of its own: positions
    continue from the KV cache it is given, else start at 0; every position of batch row 0 is kept,
    in call order. After (or during) the block, ``cap["model.layers.3"]`` is a
    :class:`~tracer.execute.records.CaptureRecord` whose ``.tensor`` is ``(T, *feature)`` in the
    model's dtype (on the CPU unless ``keep_on_device``)::

        with tracer.capture(lm) as cap:
            lm.model(ids)

    ``cuda_graphs=True``: the model runs as CUDA-graph replays recorded inside the block; the
    capture copies are recorded into the graph, so every replay refreshes the captures (on the
    GPU, the latest replay's values)::

        with tracer.capture(lm, cuda_graphs=True) as cap:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = lm.model(static_ids)
        g.replay()  # cap["model.layers.3"].tensor now holds this replay's output

    Raises:
        TracerError: unknown granularity or module path; ``cuda_graphs`` off a CUDA GPU, or with no
            capture point fired in the block.
    """
    from tracer.execute.capture import Captured

    return Captured(model.model if _is_loaded(model) else model, points, keep_on_device=keep_on_device,
                    cuda_graphs=cuda_graphs)


def compare(a: Any, b: Any, *, atol: float | None = None, rtol: float | None = None,
            device: str | None = None) -> Any:
    """Compare two captures, two runs, or two stored runs, layer by layer.

    Args:
        a, b: each a :func:`capture` result, a :class:`~tracer.execute.records.RunRecord`, or a
            reference ``"file.h5:RUN"`` / ``("file.h5", "RUN")`` (files from different machines
            included; ``"file.h5"`` alone: its first run for ``a``, its second for ``b``); ``b``
            may be an engine dump (SGLang dumper folder, ``PassN.pt`` folder, ``.safetensors``/
            ``.npz``) compared against the HF reference run ``a``.
        atol, rtol: tolerances counted per capture point.
        device: where the metrics of stored runs are computed (default: cuda if available).

    Returns:
        the :class:`~tracer.diff.result.Comparison` the CLI renders.

    Raises:
        TracerError: runs of different prompts or windows, unknown files or runs.
    """
    from tracer.diff.compare_dump import compare_dump, dump_side
    from tracer.diff.compare import compare_records, compare_runs

    if _is_ref(a) and _is_ref(b):
        dump = dump_side([str(a), str(b)]) if isinstance(a, str) and isinstance(b, str) else None
        if dump is not None:  # an HF reference run against an engine dump
            return compare_dump(dump[0], dump[1], atol=atol, rtol=rtol, device=device)
        return compare_runs(_ref(a, 0), _ref(b, 1), atol=atol, rtol=rtol, device=device)
    rec_a, rec_b = _record(a, "A", 0), _record(b, "B", 1)
    return compare_records(rec_a, rec_b, scenario="capture", model="model", atol=atol, rtol=rtol)


def _is_ref(x: Any) -> bool:
    return isinstance(x, (str, tuple)) or hasattr(x, "__fspath__")


def _ref(x: Any, side: int) -> tuple[str, str | None]:
    from tracer.diff.refs import split_ref

    if isinstance(x, tuple):
        return str(x[0]), x[1]
    path, run = split_ref(str(x))
    if run is None:
        from tracer.store.trace import TraceReader

        with TraceReader(path) as r:
            if len(r.runs) <= side:
                raise TracerError(f"{path} holds {len(r.runs)} run(s); name the run as {path}:RUN")
            run = r.runs[side]
    return path, run


def _record(x: Any, name: str, side: int) -> Any:
    """A RunRecord of a capture, a run record, or a stored run (read whole)."""
    from tracer.execute.capture import Captured
    from tracer.execute.records import RunRecord

    if isinstance(x, Captured):
        return x.run_record(name)
    if isinstance(x, RunRecord):
        return x
    if _is_ref(x):
        from tracer.store.trace import TraceReader

        path, run = _ref(x, side)
        with TraceReader(path) as r:
            return r.run(run)
    raise TracerError(f"cannot compare a {type(x).__name__}; give a tracer.capture(...), a RunRecord or 'file.h5:RUN'")


def compare_trace(path: str, run_a: str | None = None, run_b: str | None = None, *,
                  engine_map: str | None = None, atol: float | None = None, rtol: float | None = None,
                  device: str | None = None) -> Any:
    """Compare two runs of a stored trace (default: its first two), or an HF reference run with an
    engine dump: ``compare_trace("REF.h5:A", DUMP)`` where DUMP is an SGLang dumper folder, a
    ``PassN.pt`` folder, a ``.safetensors``/``.npz`` file or a trace written by :func:`import_dump`
    (``engine_map``: a TOML map merged over the built-in one; :func:`tracer.diff.compare_dump.compare_dump`).

    Raises:
        TracerError: missing/corrupt trace or dump, unknown run names, an unavailable device.
    """
    from tracer.diff.compare_dump import compare_dump, dump_side
    from tracer.diff.compare import compare_trace as _ct

    dump = dump_side([str(path), str(run_a)]) if run_a is not None and run_b is None else None
    if dump is not None:
        return compare_dump(dump[0], dump[1], engine_map=engine_map, atol=atol, rtol=rtol, device=device)
    if engine_map is not None:
        raise TracerError("engine_map applies to an engine dump: compare_trace('REF.h5:RUN', DUMP, engine_map=...)")
    if atol is None and rtol is None:  # a --store auto trace without some tensors: its run-time comparison
        from tracer.diff.stored import auto_comparison

        stored = auto_comparison(path, run_a, run_b)
        if stored is not None:
            return stored
    return _ct(path, run_a, run_b, atol=atol, rtol=rtol, device=device)


def import_dump(dump: str, reference: str, output: str, *, engine_map: str | None = None,
                overwrite: bool = False, run_name: str = "engine") -> Any:
    """Map an engine dump onto reference run ``TRACE[:RUN]`` and write it as a one-run trace
    (:func:`tracer.diff.compare_dump.import_dump`; returns its :class:`~tracer.execute.enginemap.MappedDump`).

    Raises:
        TracerError: a malformed dump, unknown names, token ids that do not match, an existing output.
    """
    from tracer.diff.compare_dump import import_dump as _imp
    from tracer.diff.refs import split_ref

    return _imp(str(dump), split_ref(str(reference)), str(output), engine_map=engine_map, overwrite=overwrite,
                run_name=run_name)


def write_sglang_dump(trace: str, run: str, out: str, **kwargs: Any) -> Any:
    """Write a stored HF run as a synthetic SGLang dumper folder (:func:`tracer.store.sglang_dump.write_sglang_dump`)."""
    from tracer.store.sglang_dump import write_sglang_dump as _w

    return _w(trace, run, out, **kwargs)


def read_trace(path: str) -> Any:
    """Open a stored trace (:class:`tracer.store.trace.TraceReader`; use it as a context manager).

    Raises:
        TracerError: missing, incomplete or corrupt file, unknown format version.
    """
    from tracer.store.trace import TraceReader

    return TraceReader(path)


def audit(model: Any = "smollm2-135m", *, levels: str | list[int] | None = None, mitigations: bool = True,
          loaded: Any = None, progress: bool | str = True, on_check: Callable[[str, int, int], None] | None = None,
          on_row: Callable[[Any], None] | None = None, **options: Any) -> Any:
    """Run every selected level of the determinism hierarchy on this machine (:mod:`tracer.loops.audit`).

    Args:
        model: a model name or a loaded model.
        levels: ``"0,1,2"`` or a list of levels (default: all).
        mitigations: re-run diverging checks under each applicable mitigation.
        progress: the plan (each check's cost), one line per finished check and an ETA on stderr:
            True or ``"auto"`` (a bar in a terminal, lines otherwise), ``"lines"``, or False (nothing).
        on_check: called as ``on_check(label, done, total)`` before each check.
        on_row: called with each finished :class:`~tracer.loops.audit.AuditRow`.
        options: model, prompt, capture and store options, and scenario options applied to every
            check that uses them (listed below); ``store=False`` keeps everything in memory; with
            an ``output``, every finished check is kept and an interrupted audit with the same
            output resumes (:mod:`tracer.loops.audit_store`).

    Returns:
        an :class:`~tracer.loops.audit.Audit` (the hierarchy table as data).

    Raises:
        TracerError: bad input (checked before the model loads where possible).
    """
    from tracer.loops.audit import audit as _audit

    cfg, lm = _config(model, loaded, AUDIT_OPTIONS, check_scenario=False, new_output=False, **_asked_store(options))
    return _audit(cfg, levels=levels, mitigations=mitigations, loaded=lm, progress=progress, on_check=on_check,
                  on_row=on_row)


def sweep(model: Any = "smollm2-135m", *, lengths: str | list[int] = "17:512", block_sizes: str | list[int] = (16,),
          keep_tensors: bool = False, loaded: Any = None, progress: bool | str = True,
          on_point: Callable[[Any], None] | None = None, **options: Any) -> Any:
    """Run a scenario for every prompt length × KV block size (:mod:`tracer.loops.sweep`).

    Args:
        model: a model name or a loaded model.
        lengths: ``"17:512"`` (start:stop[:step], stop inclusive), ``"64,128"`` or a list of ints.
        block_sizes: KV block sizes, same syntax, or a list.
        keep_tensors: also store both runs' captured tensors of every point (large).
        on_point: called with each finished :class:`~tracer.loops.sweep.SweepRow`.
        options: listed below; ``store=False`` keeps everything in memory, ``output`` is the sweep
            file (an unfinished one with the same parameters is resumed).

    Returns:
        a :class:`~tracer.loops.sweep.SweepResult`.

    Raises:
        TracerError: bad axes, a prompt too short, a file of other parameters, every bad run option.
    """
    from tracer.loops.sweep import sweep as _sweep

    cfg, lm = _config(model, loaded, SWEEP_OPTIONS, new_output=False, one_length=False, **_asked_store(options))
    return _sweep(cfg, lengths=lengths, block_sizes=block_sizes, keep_tensors=keep_tensors, loaded=lm,
                  progress=progress, on_point=on_point)


def read_sweep(path: str) -> Any:
    """Read a sweep file (:func:`tracer.loops.sweep.read_sweep`).

    Raises:
        TracerError: not a sweep file, or corrupt.
    """
    from tracer.loops.sweep import read_sweep as _rs

    return _rs(path)


def plot(obj: Any, kind: str | None = None, **kwargs: Any) -> Any:
    """A matplotlib Figure of a result: a RunResult or Comparison (``amplification``, ``heatmap``,
    ``ulp``), a SweepResult (``sweep``), or a trace/sweep file path (its default figure).

    Raises:
        TracerError: unknown kind for this object, matplotlib missing.
    """
    from tracer.report.plot import figure_for

    if isinstance(obj, (str, bytes)) or hasattr(obj, "__fspath__"):
        from tracer.store.sweepfile import is_sweep_file, read_sweep as _rs

        if is_sweep_file(obj):
            return figure_for(kind or "sweep", sweep=_rs(str(obj)), **kwargs)
        return figure_for(kind or "amplification", trace=str(obj), **kwargs)
    if hasattr(obj, "rows") and hasattr(obj, "params"):  # a SweepResult
        return figure_for(kind or "sweep", sweep=obj, **kwargs)
    if hasattr(obj, "comparison"):  # a RunResult
        return obj.plot(kind or "amplification", **kwargs)
    return figure_for(kind or "amplification", comparison=obj, trace=obj.trace, run_names=(obj.run_a, obj.run_b),
                      **kwargs)


def plot_file(path: Any, *, kind: str | None = None, output: Any = None,
              overwrite: bool = False, layers: list[str] | None = None, run_a: str | None = None,
              run_b: str | None = None) -> Any:
    """``tracer plot``: draw ``kind`` from a trace or sweep file and save it.

    Default kind: ``sweep`` for a sweep file, ``amplification`` for a trace. Default output:
    ``<input stem>-<kind>.png`` beside the input.

    Raises:
        TracerError: unknown kind, a kind that does not fit the file, bad output path, unreadable file.
    """
    from tracer.diff.compare import compare_trace
    from tracer.diff.stored import stored_comparison
    from tracer.report.plot import (KINDS, check_figure_path, figure_for, heatmap_figure, position_diffs_trace,
                                    save_figure, sweep_figure)
    from tracer.store.sweepfile import is_sweep_file, read_sweep

    from pathlib import Path

    from tracer.files import check_input_file

    src = Path(path)
    if not src.exists():
        raise TracerError(f"file {src} not found; pass a trace or sweep file")
    check_input_file(src, "input file")  # a FIFO or device would block the read
    if kind is not None and kind not in KINDS:
        raise TracerError(f"unknown plot kind '{kind}'; use one of: {', '.join(KINDS)}")
    is_sweep = is_sweep_file(src)
    kind = kind or ("sweep" if is_sweep else "amplification")
    if is_sweep != (kind == "sweep"):
        raise TracerError(f"--kind {kind} needs a {'sweep file' if kind == 'sweep' else 'trace'}, "
                          f"but {src} is a {'sweep file' if is_sweep else 'trace'}; "
                          f"use --kind {'sweep' if is_sweep else 'amplification, heatmap or ulp'}")
    out = check_figure_path(output if output is not None else src.with_name(f"{src.stem}-{kind}.png"), overwrite)
    if is_sweep:
        return save_figure(sweep_figure(read_sweep(src)), out, overwrite=overwrite)
    stored = stored_comparison(src) if run_a is None and run_b is None else None
    if stored is not None and (kind != "heatmap" or stored.per_position):  # drawn from the stored numbers
        fig = figure_for(kind, comparison=stored, layers=layers)
    elif kind == "heatmap":  # a trace written before comparisons were stored with it: from its tensors
        fig = heatmap_figure(position_diffs_trace(src, run_a, run_b))
    else:
        fig = figure_for(kind, comparison=compare_trace(str(src), run_a, run_b), layers=layers)
    return save_figure(fig, out, overwrite=overwrite)


def to_pandas(obj: Any) -> Any:
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


def render(obj: Any, fmt: str = "markdown", columns: tuple[str, ...] | None = None) -> str | None:
    """Render a result as text: ``table`` (printed, returns None), ``json``, ``csv`` or ``markdown``.
    ``obj`` is a RunResult, a Comparison or an Audit.

    Raises:
        TracerError: unknown format or columns.
    """
    from rich.console import Console

    from tracer.report.hierarchy import render_audit
    from tracer.report.tables import DEFAULT_COLUMNS, render as _render

    if hasattr(obj, "rows") and hasattr(obj, "counts"):  # an Audit
        return render_audit(obj, fmt, Console())
    comparison = getattr(obj, "comparison", obj)
    return _render(comparison, fmt, Console(), columns or DEFAULT_COLUMNS)


run = _signature(run, tuple(k for k in RUN_OPTIONS if k != "model"))
audit = _signature(audit, tuple(k for k in AUDIT_OPTIONS if k != "model"))
sweep = _signature(sweep, tuple(k for k in SWEEP_OPTIONS if k != "model"))

__all__ = ["load_model", "run", "capture", "compare", "compare_trace", "import_dump", "write_sglang_dump",
           "read_trace", "audit", "sweep", "read_sweep", "plot", "plot_file", "render", "to_pandas"]
