"""The Python API: one call runs a scenario end to end (the CLI is a thin layer over it).

``tracer.run()`` loads the model, tokenizes the prompt, executes the scenario's two run plans
with capture hooks, writes the HDF5 trace and returns the comparison.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import re
from dataclasses import dataclass, field
from dataclasses import replace as _replace
from pathlib import Path
from typing import Any, Callable

from .errors import TracerError

#: what a run keeps: every tensor in the trace, statistics only (online comparison), or nothing
STORE_MODES = ("tensors", "stats", "none")


@dataclass
class RunResult:
    """What :func:`run` returns.

    Attributes:
        comparison: the :class:`~tracer.compare.Comparison` (the amplification table as data).
        scenario: the :class:`~tracer.scenarios.Scenario` that was run.
        trace: path of the HDF5 trace, or None when nothing was stored.
        token_ids: the prompt's N token ids.
        runs: the two :class:`~tracer.records.RunRecord` objects (captured tensors in memory).
    """

    comparison: Any
    scenario: Any
    trace: str | None
    token_ids: list[int]
    runs: tuple[Any, Any] = field(repr=False, default=(None, None))
    model_info: Any = None
    fail_on: str | None = None

    def check(self) -> tuple[bool, str]:
        """``(failed, reason)`` under the ``fail_on`` rule (see :meth:`Comparison.check`)."""
        return self.comparison.check(self.fail_on)

    def to_dict(self) -> dict[str, Any]:
        """The same document as ``tracer run --format json`` (``check``: the --fail-on outcome)."""
        return self.comparison.to_dict()

    def verdict(self) -> str:
        return self.comparison.verdict()

    def plot(self, kind: str = "amplification", **kwargs: Any):
        """A matplotlib Figure: ``amplification``, ``heatmap`` (per position, from the in-memory
        runs or the trace) or ``ulp`` (``layers=[...]`` picks points); see :mod:`tracer.plot`.

        Raises:
            TracerError: unknown kind, matplotlib missing.
        """
        from .plot import figure_for

        return figure_for(kind, comparison=self.comparison, runs=self.runs, trace=self.trace, **kwargs)

    def to_pandas(self):
        """The comparison as a DataFrame, one row per capture point (see :func:`tracer.frames.comparison_frame`)."""
        from .frames import comparison_frame

        return comparison_frame(self.comparison)

    def _repr_markdown_(self) -> str:  # Jupyter
        from .report import to_markdown

        return to_markdown(self.comparison)

    def __repr__(self) -> str:
        return f"RunResult({self.comparison.verdict()!r}, trace={self.trace!r})"


def read_prompt(prompt: str | None = None, prompt_file: str | None = None,
                token_ids_file: str | None = None) -> tuple[str | None, list[int] | None]:
    """Resolve the prompt options into ``(text, None)`` or ``(None, token_ids)``.

    Raises:
        TracerError: more than one source given, unreadable files, malformed token id JSON.
    """
    given = [x for x in (prompt, prompt_file, token_ids_file) if x is not None]
    if len(given) > 1:
        raise TracerError("give only one of --prompt, --prompt-file and --token-ids-file")
    from .files import read_text_file, read_token_ids

    if prompt_file is not None:  # regular UTF-8 files only: a FIFO or device would block
        return read_text_file(prompt_file, "--prompt-file"), None
    if token_ids_file is not None:
        return None, read_token_ids(token_ids_file)
    if prompt is not None:
        return prompt, None
    from .prompts import DEFAULT_PROMPT

    return DEFAULT_PROMPT, None


def tokenize(tokenizer: Any, text: str | None, token_ids: list[int] | None, *, chat: bool,
             vocab_size: int, length: int | None = None) -> list[int]:
    """Token ids of the prompt: plain text as-is (no special tokens added), or the chat template.

    ``length`` fixes N: the first ``length`` tokens, the prompt repeated as often as needed to
    reach it (so any N can be traced with the built-in prompt).

    Raises:
        TracerError: empty prompt, ids outside the vocabulary, no chat template, length < 2.
    """
    if token_ids is None:
        if chat:
            if getattr(tokenizer, "chat_template", None) is None:
                raise TracerError("this tokenizer has no chat template; drop --chat")
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            token_ids = [int(i) for i in ids]
        else:
            token_ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    elif chat:
        raise TracerError("--chat applies to text prompts, not to --token-ids-file")
    if not token_ids:
        raise TracerError("the prompt is empty; give a --prompt with some text or a non-empty --token-ids-file")
    if length is not None:
        if length < 2:
            raise TracerError(f"--length {length} is too short; a comparison needs at least 2 tokens")
        reps = -(-length // len(token_ids))
        token_ids = (token_ids * reps)[:length]
    bad = [i for i in token_ids if not 0 <= i < vocab_size]
    if bad:
        raise TracerError(f"token id {bad[0]} is outside the model's vocabulary (0..{vocab_size - 1}); "
                          "the ids were made for another tokenizer")
    return token_ids


def default_output(model: str, scenario: str, root: str | Path = "traces") -> Path:
    """``traces/<model>-<scenario>-<UTC timestamp>.h5`` (a free name; never an existing file)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("_") or "model"
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = Path(root) / f"{safe}-{scenario}-{stamp}"
    path, k = base.with_suffix(".h5"), 1
    while path.exists():
        path, k = Path(f"{base}-{k}.h5"), k + 1
    return path


def check_output(output: str | Path | None, overwrite: bool) -> None:
    """Refuse an existing output file (before anything is loaded or run).

    Raises:
        TracerError: the file exists and ``overwrite`` is False, or it is a directory.
    """
    if output is None:
        return
    from .integrity import check_name_length, check_output_path

    p = check_name_length(output, "--output")
    if p.is_dir():
        raise TracerError(f"--output {p} is a directory; give a file path ending in .h5")
    if p.exists() and not overwrite:
        raise TracerError(f"trace {p} exists; pass --overwrite to replace it or choose another --output")
    check_output_path(p, overwrite, "--output")  # devices, FIFOs, long names, read-only folders


def run(model: str = "smollm2-135m", *, prompt: str | None = None, prompt_file: str | None = None,
        token_ids: list[int] | None = None, token_ids_file: str | None = None, chat: bool = False,
        scenario: str = "prefix-cache", block_size: int = 16, split_at: int | None = None,
        mitigation: str | None = None, dtype: str = "bfloat16", device: str | None = None,
        attn: str = "sdpa", gguf: str | None = None, granularity: str = "layers",
        length: int | None = None, output: str | Path | None = None, store: str | bool = "tensors",
        compression: str | None = None,
        overwrite: bool = False, loaded: Any = None, progress: bool = True,
        status: Callable[[str], None] | None = None, decode: int = 0, verdict: bool = False,
        atol: float | None = None, rtol: float | None = None, fail_on: str | None = None,
        positions: str = "window", kv_cache: bool = True, device_map: str | dict[str, Any] | None = None,
        max_memory: str | dict[Any, str] | None = None, **options: Any) -> RunResult:
    """Run a scenario on a model and compare its two runs layer by layer.

    Args:
        model: a built-in recipe (``tracer models``), an HF model id in the local cache, or a
            local directory.
        prompt / prompt_file / token_ids / token_ids_file: the prompt (default: a built-in text
            of a few hundred tokens); text is tokenized as-is unless ``chat``.
        length: use exactly N = ``length`` tokens (the prompt truncated, or repeated to reach N).
        scenario: a catalogue name (:data:`tracer.scenarios.SCENARIOS`: ``repeat``, ``batch``,
            ``prefix-cache``, ``generate-cache``, ``block-size``, ``chunked-prefill``,
            ``tensor-parallel``, ``kv-quant``, ``attention``, ``compile``, ``device``,
            ``disaggregated``), a :class:`~tracer.scenarios.Scenario`, or a function
            ``n_tokens -> Scenario`` (user-defined scenarios).
        options: the scenario's options (see :func:`tracer.scenarios.build`): ``batch_size``,
            ``padding``, ``batch_row``, ``new_tokens``, ``block_sizes``, ``chunk_size``, ``tp``,
            ``reduce``, ``reduce_dtype``, ``kv_format``, ``attn_a``, ``attn_b``, ``devices``.
        block_size: KV block size in tokens; the cached prefix P is the largest multiple below N.
        split_at: explicit P (1..N-1).
        mitigation: ``aligned`` (prefix-cache: run A also splits at P) or ``deterministic``
            (both runs under torch's deterministic mode, TF32 off).
        dtype, device, attn: model dtype (``bfloat16``), device (``cuda`` if available, else
            ``cpu``), attention implementation (``sdpa``/``eager``).
        granularity: ``layers`` or ``sublayers``.
        output: trace path; default ``traces/<model>-<scenario>-<timestamp>.h5``.
        store: ``tensors`` (default): the trace holds every captured tensor, written by a
            background thread while the next plan runs. ``stats``: online comparison — the
            captures stay on the model's device and are compared there, so only statistics reach
            the host; the trace holds the header, both runs' token ids and plans, and the
            comparison (no tensors). ``none``: online comparison, no file. (``True``/``False``
            mean ``tensors``/``none``.)
        compression: HDF5 compression of the stored tensors: None (default), ``lzf``, ``gzip``.
        loaded: a :class:`~tracer.models.LoadedModel` to reuse (notebooks), instead of loading.
        decode: greedy-decode this many tokens from each run's final KV cache and report the
            first generated position where they differ (``comparison.replay``); 0 = off.
        verdict: re-run the scenario at float32 (and float64 on the CPU) on the same model and
            judge rounding noise vs defect (``comparison.noise``, :mod:`tracer.verdict`).
        atol, rtol: tolerances: count elements outside ``atol + rtol * |a|`` per capture point.
        fail_on: ``any`` | ``flip`` | ``tolerance``: the rule :meth:`RunResult.check` (and the
            CLI's exit code 1) judges by; None = report only.
        positions: ``window`` (the positions both runs computed last: P..N-1) or ``all``
            (capture and compare every position 0..N-1: in run B the prefix positions come from
            its cached-prefix pass, so a divergence born there is located op by op; memory N/(N-P)
            times larger).
        kv_cache: capture each layer's KV cache over all N positions (the ``kv_cache`` points
            the origin analysis uses to tell a divergence born in the cached-prefix pass);
            False leaves them out: on long prompts they are most of the bytes captured, stored
            and compared (:func:`tracer.capture.discover_points`).
        device_map, max_memory: spread the model over several GPUs, or GPU and CPU, with
            accelerate (:func:`tracer.models.load_model`); the hooks then capture on whatever
            device each module runs on. Not with ``device``, ``verdict`` or the scenarios whose
            runs move the model between devices.

    Returns:
        a :class:`RunResult`; ``result.to_dict()`` is the JSON document of the CLI.

    Raises:
        TracerError: for every bad input (checked before the model is loaded where possible).
    """
    from . import models as _models
    from .capture import GRANULARITIES, discover_points, host_copies
    from .compare import check_fail_on, compare_records, replay_diff
    from .runner import execute, model_device
    from .scenarios import SCENARIOS, build, check_mitigation
    from .store import TraceWriter, collect_environment

    say = status or (lambda msg: None)
    store = {True: "tensors", False: "none"}.get(store, store)  # type: ignore[arg-type]
    if store not in STORE_MODES:
        raise TracerError(f"unknown --store '{store}'; use one of: {', '.join(STORE_MODES)}")
    # -- validate everything that needs no model --------------------------------------------------
    from .checks import check_compression, check_length, check_scenario_values

    check_length(length)
    compression = check_compression(compression)
    check_scenario_values(options)
    if isinstance(scenario, str) and scenario not in SCENARIOS:
        raise TracerError(f"unknown scenario '{scenario}'; use one of: {', '.join(SCENARIOS)}")
    check_options(options)
    if granularity not in GRANULARITIES:
        raise TracerError(f"unknown granularity '{granularity}'; use one of: {', '.join(GRANULARITIES)}")
    check_mitigation(mitigation)
    check_fail_on(fail_on, atol, rtol)
    if positions not in ("window", "all"):
        raise TracerError(f"unknown --positions '{positions}'; use window (P..N-1) or all (0..N-1)")
    if not isinstance(decode, int) or decode < 0:
        raise TracerError(f"--decode {decode} must be a number of tokens >= 0 (0 = off)")
    dispatched = device_map is not None or (loaded is not None and loaded.info.device_map is not None)
    if dispatched and verdict:
        raise TracerError("--verdict re-loads the model at float32 on one device; it does not combine with --device-map")
    if dispatched and (options.get("devices") is not None or scenario in ("device", "disaggregated")):
        raise TracerError(f"scenario {scenario} moves the model between devices; it does not combine with --device-map")
    if verdict:
        from .verdict import higher_dtypes

        higher_dtypes(_models.dtype_name(_models.resolve_dtype(dtype)) if loaded is None else loaded.info.dtype,
                      _models.resolve_device(device) if loaded is None else loaded.info.device)
    if block_size < 1:
        raise TracerError(f"--block-size must be a positive number of tokens, got {block_size}")
    text, ids = (None, list(token_ids)) if token_ids is not None else read_prompt(prompt, prompt_file, token_ids_file)
    if loaded is None:
        _models.resolve_dtype(dtype)
        if device_map is None:
            _models.resolve_device(device)
        _models.check_attn(attn)
    check_output(output if store != "none" else None, overwrite)
    if length is not None and length < 2:
        raise TracerError(f"--length {length} is too short; a comparison needs at least 2 tokens")
    n_known = length if length is not None else (len(ids) if ids is not None else None)
    if n_known is not None and n_known >= 2 and scenario == "prefix-cache":
        from .scenarios import check_split, default_split

        check_split(n_known, split_at) if split_at is not None else default_split(n_known, block_size)
    sopts = dict(options, block_size=block_size, split_at=split_at, mitigation=mitigation)
    if isinstance(scenario, str):  # every length-independent option error, before loading
        known = n_known is not None and n_known >= 2
        # the prompt length is not known before tokenizing: check everything but the split point
        check_resources(build(scenario, n_known if known else 100_000,
                              **(sopts if known else dict(sopts, split_at=None))))

    # -- load, tokenize, plan ---------------------------------------------------------------------
    if loaded is None:
        say(f"loading {model}")
        loaded = _models.load_model(model, dtype=dtype, device=device, attn=attn, gguf=gguf, progress=progress,
                                    device_map=device_map, max_memory=max_memory)
    info = loaded.info
    ids = tokenize(loaded.tokenizer, text, ids, chat=chat, vocab_size=info.vocab_size, length=length)
    scen = check_resources(make_scenario(scenario, len(ids), sopts))
    points = discover_points(loaded.model, granularity, kv_cache=kv_cache)
    window = (0, len(ids)) if positions == "all" else scen.window

    # -- execute both plans, storing run A while run B executes ------------------------------------
    header = collect_environment(info.device, extra={
        "model": info.to_dict(), "scenario": scen.to_dict(), "granularity": granularity,
        "dtype": info.dtype, "attn_implementation": info.attn_implementation,
        "block_size": block_size, "split_points": [scen.window[0]], "n_tokens": len(ids),
        "store": store, "kv_cache": bool(kv_cache),
    })
    trace_path = None
    writer = None
    if store != "none":
        out = Path(output) if output is not None else default_output(info.name, scen.name)
        writer = TraceWriter(out, header=header, overwrite=overwrite, compression=compression,
                             background=True)
        trace_path = str(out)
    online = store != "tensors"
    # on a GPU the captures stay on the device and are compared there, also when the trace
    # stores tensors: the host gets pinned copies made on a side stream while the next plan runs
    on_gpu = model_device(loaded.model).type == "cuda"
    records, host_records = [], []
    with writer if writer is not None else contextlib.nullcontext():
        for plan in (scen.plan_a, scen.plan_b):
            say(f"run {plan.name}: {plan.description}")
            keep = (online or on_gpu) and not plan.devices
            rec = execute(loaded.model, ids, plan, points, window, keep_on_device=keep,
                          decode=decode, meta={"scenario": scen.name, "level": scen.level})
            if decode:
                rec.meta["decode_text"] = loaded.tokenizer.decode(rec.meta["decode_tokens"])
            records.append(rec)
            host_rec, wait = rec, None
            if not online and keep:
                captures, wait = host_copies(rec.captures)
                host_rec = _replace(rec, captures=captures)
            host_records.append(host_rec)
            if writer is not None:
                writer.add_run(host_rec if not online else _without_tensors(rec), ready=wait)
        rec_a, rec_b = records
        facts = {
            "dtype": info.dtype, "device": info.device, "attn": info.attn_implementation,
            "device_name": header.get("device_name"), "n_tokens": len(ids),
            "plan_a": scen.plan_a.description, "plan_b": scen.plan_b.description,
            "gemm_m_a": scen.plan_a.gemm_m(), "gemm_m_b": scen.plan_b.gemm_m(),
            "chunks_a": [list(c) for c in scen.plan_a.chunks], "chunks_b": [list(c) for c in scen.plan_b.chunks],
            **scenario_facts(scen, rec_a, rec_b),
        }
        comparison = compare_records(rec_a, rec_b, scenario=scen.name, model=info.name,
                                     trace=trace_path, facts=facts, atol=atol, rtol=rtol)
        comparison = _replace(comparison, fail_on=fail_on)
        if decode:
            comparison = _replace(comparison, replay=replay_diff(
                rec_a.meta["decode_tokens"], rec_b.meta["decode_tokens"], rec_a.meta["decode_text"],
                rec_b.meta["decode_text"]))
        if writer is not None and online:
            writer.add_comparison(f"{rec_a.name}-vs-{rec_b.name}", comparison.to_dict())
        if writer is not None:
            say(f"writing {trace_path}")
    if online:  # the device copies have served their purpose
        records = [_without_tensors(r) for r in records]
    else:  # the host copies (landed: the writer waited for them) replace the device tensors
        records = host_records
    if verdict:
        from .verdict import noise_verdict

        say("verdict: re-running at higher precision")
        comparison = _replace(comparison, noise=noise_verdict(loaded.model, ids, scen, comparison, info.dtype, info.device))
    return RunResult(comparison=comparison, scenario=scen, trace=trace_path, token_ids=ids,
                     runs=tuple(records), model_info=info, fail_on=fail_on)


def _without_tensors(rec: Any) -> Any:
    """The run record with its captures dropped (plans, token ids and meta only)."""
    from .records import RunRecord

    return RunRecord(name=rec.name, token_ids=rec.token_ids, plan=rec.plan, window=rec.window,
                     captures={}, meta=rec.meta)


#: scenario options accepted by :func:`run` (``**options``) and :func:`tracer.scenarios.build`
OPTIONS = ("batch_size", "padding", "batch_row", "new_tokens", "block_sizes", "chunk_size", "tp", "reduce",
           "reduce_dtype", "kv_format", "attn_a", "attn_b", "devices")


def check_options(options: dict[str, Any]) -> None:
    """Refuse unknown scenario options and unavailable attention implementations/devices (no model needed).

    Raises:
        TracerError: an unknown option name, attention implementation or device.
    """
    from . import models as _models

    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TracerError(f"unknown scenario option(s) {', '.join(unknown)}; valid: {', '.join(OPTIONS)}")
    for key in ("attn_a", "attn_b"):
        if options.get(key) is not None:
            _models.check_attn(options[key])
    devices = options.get("devices")
    if devices is not None:
        for dev in (devices.split(",") if isinstance(devices, str) else devices):
            _models.resolve_device(dev.strip())


def check_resources(scen: Any) -> Any:
    """Refuse a scenario whose plans need a device or attention implementation this machine lacks.

    Raises:
        TracerError: naming the missing device or implementation.
    """
    from . import models as _models

    for plan in (scen.plan_a, scen.plan_b):
        for dev in plan.devices or ():
            try:
                _models.resolve_device(dev)
            except TracerError as e:
                raise TracerError(f"scenario {scen.name} runs on {dev}, which this machine cannot use ({e}); "
                                  "pass --devices with two devices it has, e.g. cpu,cpu") from None
        if plan.attn is not None:
            _models.check_attn(plan.attn)
    return scen


def make_scenario(scenario: Any, n_tokens: int, options: dict[str, Any]) -> Any:
    """A :class:`~tracer.scenarios.Scenario` from a catalogue name, a Scenario, or ``f(n_tokens)``.

    Raises:
        TracerError: bad options, or a callable that does not return a Scenario.
    """
    from .scenarios import Scenario, build

    if isinstance(scenario, str):
        return build(scenario, n_tokens, **options)
    scen = scenario(n_tokens) if callable(scenario) and not isinstance(scenario, Scenario) else scenario
    if not isinstance(scen, Scenario):
        raise TracerError(f"scenario must be a name, a Scenario or a function n_tokens -> Scenario, got {type(scen).__name__}")
    return scen


def scenario_facts(scen: Any, rec_a: Any, rec_b: Any) -> dict[str, Any]:
    """Scenario-specific facts for the report: generated tokens (``generate-cache``), KV block format."""
    facts: dict[str, Any] = {}
    notes = []
    gen_a, gen_b = rec_a.meta.get("generated"), rec_b.meta.get("generated")
    if gen_a is not None and gen_b is not None:
        first = next((i for i, (x, y) in enumerate(zip(gen_a, gen_b)) if x != y), None)
        facts.update(generated_a=gen_a, generated_b=gen_b, first_token_difference=first)
        notes.append(f"generated tokens: A {gen_a}, B {gen_b}; " + (
            f"identical for all {len(gen_a)} steps" if first is None else
            f"first different at step {first} (position {scen.window[0] + first}); later steps compare different contexts"))
    if "kv_block_format" in scen.params:
        facts["kv_block_format"] = scen.params["kv_block_format"]
        f = scen.params["kv_block_format"]
        notes.append(f"KV format {f['name']}: {f['element']} elements, block {f['block_size'] or '-'}, scale {f['scale']}")
    if notes:
        facts["notes"] = notes
    return facts
