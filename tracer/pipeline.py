"""The one orchestration: a scenario on a loaded model → both runs captured, compared, stored.

Every command goes through these functions (``run``, ``audit``, ``sweep``, the ``--verdict``
precision ladder and ``bench``)::

    prepare(cfg)               the tokenizer's checks, load the model, tokenize the prompt, plan the
                               scenario                                                → Prepared
    open_writer(cfg, ...)      the HDF5 trace writer (background thread), or None
    run_scenario(...)          execute run A and run B with the capture hooks, compare them,
                               hand both runs (and the comparison) to the writer       → Outcome
    precision_ladder(...)      the noise-or-defect re-runs at float32/float64, each a run_scenario
    run(cfg)                   all of the above for one scenario                       → RunResult

The GPU fast path lives here once: on a CUDA device the captures stay on the device and both runs
are compared there; for a stored trace run A's captures are copied to pinned host memory on a
side stream while run B executes, and a background thread writes them.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from dataclasses import replace as _replace
from pathlib import Path
from typing import Any, Callable

import torch

from tracer import schema
from tracer.config import CaptureConfig, RunConfig
from tracer.diff.accuracy import replay_origins
from tracer.diff.compare import compare_records
from tracer.diff.engine import engine_note, engine_skips, sampled_logits
from tracer.diff.facts import run_facts
from tracer.diff.logits import with_token_texts
from tracer.diff.replay import replay_diff
from tracer.diff.result import Comparison
from tracer.diff.rl import comparable, is_rl, mitigation_table, rl_comparison
from tracer.diff.verdict import Level, NoiseVerdict, epsilon, higher_dtypes, judge, measure
from tracer.errors import TracerError
from tracer.execute.family import family_for
from tracer.execute.kinds import PointKind
from tracer.execute.points import CapturePoint, discover_points, granularity_width
from tracer.execute.records import RunRecord, settle_wall
from tracer.load.contract import numeric_contract
from tracer.load.devices import cast_weights, model_device
from tracer.load.models import LoadedModel, load_model
from tracer.load.prompts import prompt_file_note
from tracer.plan.build import check_resources, make_scenario
from tracer.prompt_checks import check_prompt_length, check_prompt_positions, needs_tokenizer, prompt_ids
from tracer.plan.plans import Scenario, with_cuda_graphs
from tracer.plan.rollout import mitigation_variants
from tracer.run_result import RunResult
from tracer.store.handoff import hand_over, store_auto
from tracer.store.header import TraceHeader, block_facts
from tracer.store.trace import TraceWriter, collect_environment, default_output
from tracer.store.writer_process import prestart as prestart_writer

Say = Callable[[str], None]


def _quiet(msg: str) -> None:
    return None


@dataclass(frozen=True)
class Prepared:
    """A loaded model, the prompt's token ids and the planned scenario: what a run needs.

    Attributes:
        loaded: the :class:`~tracer.load.models.LoadedModel`.
        token_ids: the prompt, N ints.
        scenario: the :class:`~tracer.plan.scenarios.Scenario` planned for N tokens.
    """

    loaded: LoadedModel
    token_ids: list[int]
    scenario: Scenario


def load(cfg: RunConfig, *, progress: bool | Say = False, tokenizer: Any = None) -> LoadedModel:
    """Load ``cfg.model`` (:func:`tracer.load.models.load_model`), with its tokenizer only when
    :func:`needs_tokenizer` says the run uses it (``tokenizer``: one already loaded, :func:`check_prompt_length`).

    ``progress``: the loader's status messages and progress bars (True), none (False), or a callable
    that gets the messages (:func:`tracer.load.models.load_model`).

    Raises:
        TracerError: unknown model, missing weights, bad device or device map.
    """
    m = cfg.model
    want = needs_tokenizer(cfg)
    return load_model(m.name, dtype=m.dtype, device=m.device, attn=m.attn, gguf=m.gguf, progress=progress,
                      device_map=m.device_map, max_memory=m.max_memory,
                      tokenizer=tokenizer if want and tokenizer is not None else want)


def prepare(cfg: RunConfig, loaded: LoadedModel | None = None, *, progress: bool = False, say: Say = _quiet) -> Prepared:
    """Load (unless ``loaded`` is given), tokenize, and plan the scenario for the prompt's N (once:
    :func:`tracer.plan.build.make_scenario`; the positions it needs are checked with it).

    Raises:
        TracerError: every bad input the model, the prompt or the scenario reveals.
    """
    from tracer.engines.door import check, realise

    if loaded is None:
        tok = check_prompt_length(cfg)  # the tokenizer's checks first: a bad --split-at costs no model load
        say(f"loading {cfg.model.name}")
        # a status callback also gets the loader's own messages (cache builds, tokenizer conversion)
        loaded = load(cfg, progress=say if say is not _quiet else progress, tokenizer=tok)
    ids = prompt_ids(cfg, loaded, check=False)
    scen = check_resources(realise(make_scenario(cfg.scenario.name, len(ids), cfg.scenario.params()), cfg.scenario.engine))
    check_prompt_positions(cfg, loaded, len(ids), scen)
    if cfg.capture.cuda_graphs:  # both plans recorded in CUDA graphs and replayed
        scen = with_cuda_graphs(scen)
    check(scen, loaded.info.device, verdict=cfg.checks.verdict, dispatched=loaded.info.device_map is not None,
          model=loaded.model)
    return Prepared(loaded, ids, scen)


def trace_header(loaded: LoadedModel, scen: Scenario, n_tokens: int, capture: CaptureConfig, store: str,
                 extra: dict[str, Any] | None = None) -> TraceHeader:
    """The trace header (:class:`~tracer.store.header.TraceHeader`): the environment
    (:func:`tracer.store.trace.collect_environment`) plus the model, its family descriptor
    (``hooks/*.toml``: file, module paths, roles), its numeric contract
    (:func:`tracer.load.contract.numeric_contract`: buffer dtypes and devices, casting after load,
    attention per layer kind), granularity, dtype, attention, N, store mode, whether KV-cache
    points were captured and, for one scenario (``scen`` not None), the scenario, the KV block
    size its plans ran with (:func:`tracer.store.header.block_facts`: each engine's facts in
    ``extra["engines"]``, else the plans' and the scenario's settings) and its split points;
    ``extra`` (header facts by their keys) is merged in last.

    Raises:
        TracerError: no descriptor fits the model and ``capture`` asks for sublayers (before any
            trace is opened); a fact of the wrong type, or a key of ``extra`` the header does not declare.
    """
    info = loaded.info
    family = family_for(loaded.model)
    if family.inferred and capture.granularity == "sublayers":
        raise TracerError(family.inferred)
    facts: dict[str, Any] = {
        "model": info.to_dict(), "numeric_contract": numeric_contract(loaded.model, family.sliding.spec),
        "family": family.to_dict(),
        "granularity": capture.granularity, "dtype": info.dtype,
        "attn_implementation": info.attn_implementation, "n_tokens": n_tokens, "store": store,
        "kv_cache": bool(capture.kv_cache),
        # what the suggestion's size of a sublayers trace counts from; nothing stored, no suggestion of it
        "sublayers_width": sublayers_width(loaded.model, info.hidden_size, bool(capture.kv_cache))
        if store != "none" else None}
    if scen is not None:
        facts.update(scenario=scen.to_dict(), **block_facts(scen, (extra or {}).get("engines")),
                     split_points=[scen.window[0]])
    doc = collect_environment(info.device, extra={**facts, **(extra or {})})
    try:  # every run of a loaded model has the same header until a fact changes: built once
        key = json.dumps(doc)
    except (TypeError, ValueError):  # a fact that is not JSON data: the record refuses it below
        key = None
    if key is None or _HEADER[0] != key:
        _HEADER[:] = [key, schema.build(TraceHeader, doc)]
    return _HEADER[1]


#: [the last header's document as JSON text, its TraceHeader]: a run's header is the previous one's
#: whenever its document is (a frozen record, read only; building it costs ~1 ms)
_HEADER: list[Any] = [None, None]


def open_writer(path: str | Path, header: TraceHeader | dict[str, Any], *, overwrite: bool = False,
                compression: str | None = None) -> Any:
    """A background :class:`~tracer.store.trace.TraceWriter` on ``path`` (use it as a context manager):
    on a thread, or in the writer process with ``TRACER_WRITER=process``
    (:mod:`tracer.store.writer_process`)."""
    return TraceWriter(Path(path), header=header, overwrite=overwrite, compression=compression, background=True)


@dataclass
class Outcome:
    """What :func:`run_scenario` returns.

    Attributes:
        comparison: the :class:`~tracer.diff.result.Comparison` of run A vs run B.
        records: both :class:`~tracer.execute.records.RunRecord` (host tensors; no tensors when
            the run compared online).
        partials: ``--tp-mode distributed --tp-partials``: every rank's row-parallel partials before
            the all-reduce, as a run of its own (else None).
    """

    comparison: Comparison
    records: tuple[RunRecord, RunRecord]
    partials: RunRecord | None = None


def run_scenario(loaded: LoadedModel, token_ids: list[int], scen: Scenario, capture: CaptureConfig = CaptureConfig(), *,
                 writer: TraceWriter | None = None, online: bool = True, names: tuple[str, str] | None = None,
                 header: TraceHeader | dict[str, Any] | None = None, comparison_key: str | None = None,
                 decode: int = 0, atol: float | None = None, rtol: float | None = None, op_replay: bool = False,
                 trace: str | None = None, points: list[Any] | None = None, budget: int | None = None,
                 say: Say = _quiet) -> Outcome:
    """Execute both plans of ``scen`` with the capture hooks, compare them and store them.

    Args:
        loaded: a :class:`~tracer.load.models.LoadedModel`.
        token_ids: the prompt, N ints.
        scen: the planned :class:`~tracer.plan.scenarios.Scenario`.
        capture: granularity, positions (``window``: the scenario's compared window; ``all``:
            every position 0..N-1) and KV-cache points.
        writer: a :class:`~tracer.store.trace.TraceWriter` receiving both runs (None: nothing stored).
        online: compare without keeping tensors for the trace (the writer then gets the runs'
            token ids, plans and meta only, and the comparison under ``comparison_key``).
        names: run names in the trace (default: the plans' names ``A``, ``B``).
        header: the trace header, for the report's facts (default: the model, its numeric contract
            and the scenario).
        comparison_key: also store the comparison in the trace under this name.
        decode: greedy-decode this many tokens from each run's final KV cache (``comparison.replay``).
        atol, rtol: tolerances counted per capture point.
        op_replay: replay every origin op in float64 on the CPU from the captured inputs
            (``comparison.op_replay``, :func:`tracer.diff.accuracy.replay_origins`).
        trace: the trace path the comparison names.
        points: capture points (default :func:`tracer.execute.points.discover_points`).
        budget: ``--store auto``: compare every point first (as ``online``), then give the writer
            full tensors only of the points :func:`tracer.store.budget.choose` keeps within this
            many bytes (both runs); the choice goes into each stored run's meta (``store_auto``)
            and the comparison's notes.

    Returns:
        an :class:`Outcome`.

    Raises:
        TracerError: a plan the model or machine cannot execute; runs that are not alignable.
    """
    from tracer.engines.door import execute_plan, facts, uses_engines

    model, info = loaded.model, loaded.info
    if points is None:
        points = capture_points(loaded, capture)
    window = (0, max(len(token_ids), scen.window[1])) if capture.positions == "all" else scen.window
    rl, on_engines = is_rl(scen), uses_engines(scen)
    # on a GPU the captures stay on the device and are compared there, also when the trace stores
    # tensors: the host gets pinned copies made on a side stream while the next plan runs
    on_gpu = model_device(model).type == "cuda"
    records, host_records, partials, early = [], [], None, None
    for plan, name in zip((scen.plan_a, scen.plan_b), names or (scen.plan_a.name, scen.plan_b.name)):
        say(f"run {name}: {plan.description}" + (f", then greedy-decoding {decode} tokens" if decode else ""))
        keep = (online or on_gpu or budget is not None) and not plan.devices
        extra = {"rollout": records[0]} if rl and plan is scen.plan_b else {}  # the trainer recomputes run A's tokens
        rec, part = execute_plan(loaded, token_ids, plan, points, window, keep_on_device=keep, decode=decode,
                                 meta={"scenario": scen.name, "level": scen.level}, say=say,
                                 kernels=capture.kernels, sdpa_inputs=op_replay, **extra)
        rec.name = name
        if on_engines and "engine" not in rec.meta:  # the reference side of an engine comparison: its contract too
            rec.meta["engine"] = facts(loaded, plan)
        if part is not None:  # --tp-partials: every rank's row-parallel partials, a run of their own
            partials = _replace(part, name=f"{name}.partials")
        if keep and plan.tp is not None and plan.tp.mode == "distributed":  # compared beside run A
            dev = model_device(model)
            rec.captures = {n: _replace(c, tensor=c.tensor.to(dev)) for n, c in rec.captures.items()}
        if decode:
            rec.meta["decode_text"] = loaded.tokenizer.decode(rec.meta["decode_tokens"]) if loaded.tokenizer else None
        records.append(rec)
        host_rec, handed = hand_over(rec, writer, online=online, keep=keep, budget=budget,
                                     first=plan is scen.plan_a and partials is None)
        host_records.append(host_rec)
        early = early or handed
    if writer is not None and partials is not None and not online:
        writer.add_run(partials)
    rec_a, rec_b = records
    header = header if header is not None else schema.build(TraceHeader, {  # (a Document's truth encodes it)
        "model": info.to_dict(), "scenario": scen.to_dict(),
        "numeric_contract": numeric_contract(model, family_for(model).sliding.spec),
        "sublayers_width": sublayers_width(model, info.hidden_size, True)})  # no kv_cache here: read as True
    say(f"comparing {rec_a.name} with {rec_b.name} ({len(rec_a.captures)} capture points)")
    cmp_a, cmp_b, notes = comparable(rec_a, rec_b) if rl else (rec_a, rec_b, ())  # an fp32 LM head: widened
    facts = run_facts(header, rec_a, rec_b)
    if notes:
        facts["notes"] = list(facts.get("notes", [])) + list(notes)
    comparison = compare_records(cmp_a, cmp_b, scenario=scen.name, model=info.name, trace=trace,
                                 facts=facts, atol=atol, rtol=rtol)
    if on_engines:  # an engine may compute logits only where it samples: compared at the positions both runs have
        comparison = engine_note(engine_skips(sampled_logits(comparison, cmp_a, cmp_b), cmp_a, cmp_b), cmp_a, cmp_b)
    del cmp_a, cmp_b
    tok = getattr(loaded, "tokenizer", None)
    if comparison.logits is not None and comparison.logits.argmax_flips and tok is not None:  # the tokens' text
        comparison = _replace(comparison, logits=with_token_texts(comparison.logits, lambda t: tok.decode([t])))
    for rec in records:  # the comparison waited for both runs: their CUDA-event times are ready
        settle_wall(rec)
    if rl:  # what RL stacks log, from both runs' logprobs and logits
        comparison = _replace(comparison, rl=rl_comparison(rec_a, rec_b, scen.params, comparison))
    if decode:
        comparison = _replace(comparison, replay=replay_diff(
            rec_a.meta["decode_tokens"], rec_b.meta["decode_tokens"], rec_a.meta["decode_text"],
            rec_b.meta["decode_text"]))
    if op_replay:
        say("replaying the origin ops in float64")
        comparison = _replace(comparison, op_replay=replay_origins(model, comparison, rec_a, rec_b))
    if budget is not None:  # --store auto: the comparison decides which tensors the trace keeps
        comparison, host_records = store_auto(records, comparison, budget, writer, say, early)
        if writer is not None and partials is not None:
            writer.add_run(partials)  # asked for with --tp-partials: written whole, outside the budget
    if writer is not None and comparison_key is not None:
        writer.add_comparison(comparison_key, comparison.to_dict(), safe=True)  # json_safe's text
    # online: the device copies have served their purpose; else the host copies (landed: the
    # writer waited for them) replace the device tensors
    kept = tuple(without_tensors(r) for r in records) if online and budget is None else tuple(host_records)
    return Outcome(comparison, kept, partials)


def sublayers_width(model: Any, hidden: int | None, kv_cache: bool) -> int | None:
    """Elements per position and run of the model's own ``--granularity sublayers`` points
    (:func:`tracer.execute.points.granularity_width`), for the trace header's ``sublayers_width``:
    what :func:`tracer.diff.facts.sublayers_bytes` counts a sublayers trace's size from, in the run and
    in a comparison read back from its trace alike; None where no descriptor names the points or
    there is no HF module to walk."""
    try:
        return granularity_width(model, "sublayers", hidden, kv_cache=kv_cache)
    except (TracerError, AttributeError, TypeError):  # no descriptor, or no HF module to walk
        return None


def capture_points(loaded: LoadedModel, capture: CaptureConfig) -> list[CapturePoint]:
    """The capture points of ``capture`` on the loaded model (:func:`tracer.execute.points.discover_points`)."""
    return discover_points(loaded.model, capture.granularity, kv_cache=capture.kv_cache)


def without_tensors(rec: RunRecord) -> RunRecord:
    """The run record with its captures dropped (plans, token ids and meta only)."""
    return _replace(rec, captures={})


def run(cfg: RunConfig, loaded: LoadedModel | None = None, *, progress: bool = False, say: Say = _quiet,
        default_trace: bool = True) -> RunResult:
    """Run one scenario end to end: prepare, execute both plans, compare, store, decode, verdict.

    Args:
        cfg: a validated :class:`~tracer.config.RunConfig` (:func:`tracer.validate.validate`).
        loaded: a loaded model to reuse instead of loading ``cfg.model``.
        progress: show the model loading's progress bars.
        say: status callback (one short line per stage).
        default_trace: with ``store`` tensors/stats and no ``output``, write
            ``traces/<model>-<scenario>-<timestamp>.h5`` (the CLI); False writes nothing then.

    Raises:
        TracerError: every bad input found while loading, tokenizing, planning or running.
    """
    from tracer.engines.door import engines_header, execute_plan, follower_plans, header as engine_header

    st, ch = cfg.store, cfg.checks
    if st.mode != "none" and (st.output or default_trace):
        prestart_writer()  # TRACER_WRITER=process: its interpreter starts while the model loads
    prep = prepare(cfg, loaded, progress=progress, say=say)
    info, scen, ids = prep.loaded.info, prep.scenario, prep.token_ids
    if follower_plans(scen):
        # a follower rank (under torchrun: rank > 0) only takes part in its plan; rank 0 compares and writes
        window = (0, len(ids)) if cfg.capture.positions == "all" else scen.window
        for plan in follower_plans(scen):
            execute_plan(prep.loaded, ids, plan, capture_points(prep.loaded, cfg.capture), window,
                         decode=ch.decode, meta={"scenario": scen.name, "level": scen.level})
        return RunResult(comparison=None, scenario=scen, trace=None, token_ids=ids, model_info=info)
    out = st.output
    if out is None and st.mode != "none" and default_trace:
        out = default_output(info.name, scen.name)
    header = trace_header(prep.loaded, scen, len(ids), cfg.capture, st.mode,
                          extra={"options": cfg.to_dict(), **engine_header(scen, info.device),
                                 **engines_header(prep.loaded, scen)})
    writer = open_writer(out, header, overwrite=st.overwrite, compression=st.compression) if out else None
    online = st.mode != "tensors"
    budget = st.budget() if st.mode == "auto" and writer is not None else None
    with writer if writer is not None else contextlib.nullcontext():
        outcome = run_scenario(prep.loaded, ids, scen, cfg.capture, writer=writer, online=online, header=header,
                               comparison_key="A-vs-B", decode=ch.decode, atol=ch.atol, op_replay=ch.op_replay,
                               rtol=ch.rtol, trace=str(out) if out else None, budget=budget, say=say)
        if writer is not None:
            say(f"writing {out}")
    comparison = _replace(outcome.comparison, fail_on=ch.fail_on)  # the one place the rule is held
    note = prompt_file_note(cfg.prompt.prompt)
    if note is not None:  # --prompt prompt.txt traces the name: said under the table and in the JSON
        comparison = _replace(comparison, facts={**comparison.facts, "notes": [*comparison.facts.get("notes", []), note]})
    if comparison.rl is not None and scen.params.get("mitigations"):  # which knob closes the gap
        table = mitigation_table(mitigation_variants(scen), comparison, lambda s: run_scenario(
            prep.loaded, ids, s, CaptureConfig("layers", kv_cache=False)).comparison, say)
        comparison = _replace(comparison, rl=_replace(comparison.rl, mitigations=table))
    if ch.verdict:
        say("verdict: re-running at higher precision")
        comparison = _replace(comparison, noise=precision_ladder(prep.loaded, ids, scen, comparison, say=say))
    return RunResult(comparison=comparison, scenario=scen, trace=str(out) if out else None, token_ids=ids,
                     runs=outcome.records, model_info=info, partials=outcome.partials)


def precision_ladder(loaded: LoadedModel, token_ids: list[int], scen: Scenario, base: Comparison,
                     dtypes: tuple[str, ...] | None = None, say: Say = _quiet) -> Any:
    """Noise or defect: re-run ``scen`` with the model cast to each higher dtype and judge how the
    divergence of ``base`` scales with machine epsilon (rule: :mod:`tracer.diff.verdict`).

    The model is cast in place and cast back afterwards, whatever happens (an up-cast and back is
    exact, so its weights are bit-identical afterwards); non-persistent buffers such as rotary
    ``inv_freq`` keep their dtype, as ``from_pretrained(dtype=...)`` leaves them
    (:func:`~tracer.load.devices.cast_weights`), so the numeric contract is the same after the
    ladder as before. Each re-run is a :func:`run_scenario`
    at ``layers`` granularity, compared online.

    Returns:
        a :class:`~tracer.diff.verdict.NoiseVerdict`.

    Raises:
        TracerError: no higher precision on this device.
    """
    info, model = loaded.info, loaded.model
    dtypes = dtypes or higher_dtypes(info.dtype, info.device)
    layers = [p for p in base.points if p.kind == PointKind.LAYER]
    worst = max(layers, key=lambda p: p.diff.max_abs_diff).name if layers else None
    lb, yb = measure(base, worst)
    levels = []
    try:
        for i, name in enumerate(dtypes, 1):
            say(f"verdict: re-run {i}/{len(dtypes)} at {name}")
            cast_weights(model, getattr(torch, name))
            c = run_scenario(loaded, token_ids, scen, CaptureConfig("layers"),
                             say=lambda m, i=i, name=name: say(f"verdict: re-run {i}/{len(dtypes)} at {name}: {m}")).comparison
            lg, ly = measure(c, worst)
            levels.append(Level(name, epsilon(name), lg, ly, c.identical))
    finally:
        cast_weights(model, getattr(torch, info.dtype))
    verdict, reason, judged = judge(Level(info.dtype, epsilon(info.dtype), lb, yb, base.identical), levels)
    return NoiseVerdict(verdict, reason, worst, judged)


__all__ = ["Prepared", "Outcome", "load", "prepare",
           "trace_header", "open_writer",
           "run_scenario", "without_tensors", "run", "precision_ladder", "TracerError"]
