"""Checking a run configuration before a model loads: :func:`validate` and the checks it runs.

A :class:`tracer.config.RunConfig` holds what the user asked for; :func:`validate` refuses every bad
value that can be caught before torch or transformers is imported (model name, files, choices,
devices: :mod:`tracer.load.preflight`; bounds and combinations that would run forever, crash later
or be silently ignored), then what needs torch (a CUDA index, ``--verdict``, distributed TP, CUDA
graphs). Each refusal is one :class:`tracer.errors.TracerError` line naming the option and the fix.
"""

from __future__ import annotations

import os
from typing import Any

from tracer.config import COMPRESSIONS, POSITIONS, STORE_MODES, PromptConfig, RunConfig
from tracer.engines.table import name_of, row
from tracer.errors import TracerError, did_you_mean


def validate(cfg: RunConfig, loaded: Any = None, *, new_output: bool = True, one_length: bool = True) -> RunConfig:
    """Check every value that can be checked before a model loads; return ``cfg`` unchanged.

    A typo is caught before torch or transformers is imported (model name, files, choices, devices:
    :mod:`tracer.load.preflight`); only what needs torch (a CUDA index, ``--verdict``, distributed
    TP) comes after. ``loaded``: a model to reuse, whose facts replace the model checks.
    ``new_output=False`` accepts an existing output (a sweep resumes it); ``one_length=False``: the
    prompt is not the scenario's N (a sweep runs its prefixes). Prompt files are read here too.

    Raises:
        TracerError: the first bad value, one line naming the option and the fix.
    """
    from tracer.dtypes import canonical
    from tracer.execute.kinds import GRANULARITIES
    from tracer.load import preflight
    from tracer.load.prompts import check_prompt, read_prompt
    from tracer.plan.checks import (check_block_size, check_capture_options, check_compression, check_fail_on,
                                    check_length, check_scenario_values)
    from tracer.engines.door import realise
    from tracer.engines.table import REFERENCE, check_engine, is_reference
    from tracer.plan.engines import check_engine_options
    from tracer.plan.build import check_resources, preview
    from tracer.plan.checks import own_params
    from tracer.plan.rollout import check_rl_run
    from tracer.plan.scenarios import check_mitigation
    from tracer.store.integrity import check_output

    m, s, c, st, ch, pr = cfg.model, cfg.scenario, cfg.capture, cfg.store, cfg.checks, cfg.prompt
    check_length(pr.length)
    check_compression(st.compression)
    check_scenario_values(dict(s.options))
    if s.block_size is not None:
        check_block_size(s.block_size)
    if st.mode not in STORE_MODES:
        guess = did_you_mean(str(st.mode), STORE_MODES)
        raise TracerError(f"unknown --store '{st.mode}'; use one of: {', '.join(STORE_MODES)}"
                          + (f" (did you mean {guess}?)" if guess else ""))
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
        guess = did_you_mean(str(c.granularity), GRANULARITIES)
        raise TracerError(f"unknown granularity '{c.granularity}'; use one of: {', '.join(GRANULARITIES)}"
                          + (f" (did you mean {guess}?)" if guess else ""))
    if c.positions not in POSITIONS:
        guess = did_you_mean(str(c.positions), POSITIONS)
        raise TracerError(f"unknown --positions '{c.positions}'; use window (P..N-1) or all (0..N-1)"
                          + (f" (did you mean {guess}?)" if guess else ""))
    check_mitigation(s.mitigation)
    check_engine(s.engine, installed=False)
    check_engine_options(s.engine, s.name, s.params())
    if ch.verdict and (not is_reference(s.engine) or s.name == "engine"):
        raise TracerError("--verdict re-runs the HF model at float32 and float64; another engine loads its own weights "
                          f"and is not re-run: drop --verdict, or use --engine {REFERENCE}")
    check_fail_on(ch.fail_on, ch.atol, ch.rtol)
    _check_bounds(cfg)
    if not isinstance(ch.decode, int) or isinstance(ch.decode, bool) or ch.decode < 0:
        raise TracerError(f"--decode {ch.decode} must be a number of tokens >= 0 (0 = off)")
    # one source; files readable, ids valid; not empty
    text, ids = read_prompt(pr.prompt, pr.prompt_file, pr.token_ids_file, pr.token_ids)
    check_prompt(text, ids, chat=pr.chat)
    dispatched = m.device_map is not None or (loaded is not None and loaded.info.device_map is not None)
    _check_dispatch(cfg, dispatched)
    if loaded is None:
        canonical(m.dtype)
        preflight.check_device_map(m.device_map, m.max_memory, m.device)
        if m.device_map is None:
            preflight.check_device(m.device)
        preflight.check_attn(m.attn)
        if isinstance(m.name, str):
            preflight.check_model(m.name, m.gguf)
    if st.mode != "none" and new_output:
        check_output(st.output, st.overwrite)
    if st.output is not None:  # never write over a file this run reads
        from tracer.store.integrity import check_not_an_input

        check_not_an_input(st.output, {"--prompt-file": pr.prompt_file, "--token-ids-file": pr.token_ids_file,
                                       "--gguf": m.gguf, "model file": m.name if isinstance(m.name, str)
                                       and os.path.isfile(m.name) else None})
    planned = None
    if isinstance(s.name, str):  # every length-independent scenario error, before loading
        own = own_params(s.name, s.params())  # an audit's options are its checks'
        planned = check_resources(realise(preview(s.name, _known_length(pr, ids) if one_length else None, own),
                                          s.engine))
        check_rl_run(planned, m.dtype if loaded is None else str(loaded.info.dtype), ch.decode)
        check_capture_options(planned, kernels=c.kernels, op_replay=ch.op_replay, decode=ch.decode)
        for plan in (planned.plan_a, planned.plan_b):  # every engine a plan runs on is installed here
            check_engine(plan.engine, "--engines" if s.name == "engine" else "--engine")
        if not (is_reference(planned.plan_a.engine) and is_reference(planned.plan_b.engine)):  # a start's bound
            from tracer.watchdog import start_bound

            start_bound()
        _check_engine_blocks(planned, m.device)
    # what needs torch: a CUDA device's index, the verdict's precisions, distributed TP
    _check_with_torch(cfg, loaded, planned, dispatched)
    if planned is not None and (c.cuda_graphs or s.name == "cuda-graph"):
        _check_graphs(cfg, planned, loaded, dispatched)
    return cfg


def _check_with_torch(cfg: RunConfig, loaded: Any, planned: Any, dispatched: bool) -> None:
    m, ch = cfg.model, cfg.checks
    distributed = planned is not None and any(p.tp is not None and p.tp.mode == "distributed"
                                              for p in (planned.plan_a, planned.plan_b))
    if distributed and ch.verdict:
        raise TracerError("--verdict re-runs the scenario in this process; it does not combine with "
                          "--tp-mode distributed (use --tp-mode simulated)")
    if loaded is None and m.device_map is None and m.device not in (None, "cpu"):
        from tracer.load.devices import resolve_device

        resolve_device(m.device)
    if ch.verdict:
        from tracer.diff.verdict import higher_dtypes
        from tracer.dtypes import canonical
        from tracer.load.devices import resolve_device

        higher_dtypes(canonical(m.dtype) if loaded is None else loaded.info.dtype,
                      resolve_device(m.device) if loaded is None else loaded.info.device)
    if distributed:
        from tracer.engines.door import check

        check(planned, m.device if loaded is None else loaded.info.device, verdict=ch.verdict, dispatched=dispatched)


def _check_bounds(cfg: RunConfig) -> None:
    """Bounds and combinations that ran forever, crashed later or were silently ignored (issue 24):
    ``--decode`` within the longest prompt, text options not empty and valid UTF-8, ``--split-at``
    with ``--block-size`` (the block size would be ignored), ``--op-replay`` with prefill-decode (refused
    first, :func:`tracer.plan.checks.check_capture_options`) or without sublayers (no op to replay), a ``--device-map`` JSON nested deeper than a map. The model's positions are
    checked once it is loaded (:func:`tracer.plan.checks.check_positions`).

    Raises:
        TracerError: one line naming the option and the fix.
    """
    from tracer.files import MAX_TOKENS, _depth_ok
    from tracer.plan.checks import check_capture_options, check_int

    s, ch, pr = cfg.scenario, cfg.checks, cfg.prompt
    check_int(ch.decode, "--decode", 0, MAX_TOKENS)
    texts = {"--prompt": pr.prompt, "--model": cfg.model.name if isinstance(cfg.model.name, str) else None,
             **{"--" + k.replace("_", "-"): v for k, v in s.options if isinstance(v, str)}}
    for option, text in texts.items():
        if text is None:
            continue
        if option != "--prompt" and not text.strip():
            raise TracerError(f"{option} is empty; give a value (see --help) or leave it out for the default")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TracerError(f"{option} holds bytes that are not UTF-8 (at character {e.start}); give UTF-8 text"
                              + (" or a --prompt-file" if option == "--prompt" else "")) from None
    if s.split_at is not None and s.block_size is not None and s.name == "prefix-cache":
        raise TracerError(f"--split-at {s.split_at} sets the cached prefix itself; --block-size {s.block_size} would "
                          "only choose it (the last block boundary), so it would be ignored: give one of them")
    # prefill-decode refuses --op-replay whatever the granularity: said before the hint to add sublayers
    check_capture_options(s, kernels=cfg.capture.kernels, op_replay=ch.op_replay, decode=ch.decode)
    if ch.op_replay and cfg.capture.granularity != "sublayers":
        raise TracerError("--op-replay replays the origin ops (Linear, norm, attention core) from their captured "
                          "inputs, which only --granularity sublayers captures; add --granularity sublayers")
    dm = cfg.model.device_map
    if isinstance(dm, str) and not _depth_ok(dm, 2):
        raise TracerError('--device-map nests deeper than a map {"module.path": "cuda:0"}; give a flat JSON object')


def _engine_device(engine: str | None, device: str | None) -> str:
    """The device type an engine runs a plan on, known without importing it: where one of its
    package's CPU-only builds is installed (its row's ``cpu_builds``), the CPU; else ``device``."""
    from importlib.metadata import PackageNotFoundError, version

    from tracer.load.preflight import no_cuda_reason

    if device is not None and device.strip().lower() == "cpu":
        return "cpu"
    for dist in row(engine).cpu_builds:
        try:
            version(dist)
            return "cpu"
        except PackageNotFoundError:
            pass
    return "cpu" if no_cuda_reason() is not None and device in (None, "") else (device or "cuda").split(":")[0]


def _check_engine_blocks(planned: Any, device: str | None) -> None:
    """Every plan's KV block size is one its engine accepts on its device (the rule is the engine's
    row: ``block_multiple`` in :mod:`tracer.engines.table`): an engine that refuses a block size only
    once it has started (minutes) is refused here in one line before anything loads.

    Raises:
        TracerError: naming the block size, the rule and the sizes that work.
    """
    option = "--block-sizes" if planned.name == "block-size" else "--block-size"
    for plan in (planned.plan_a, planned.plan_b):
        size = dict(plan.engine_settings).get("block_size")
        rules = row(plan.engine).block_multiple
        kind = _engine_device(plan.engine, device) if rules else ""
        step = rules.get(kind)
        if isinstance(size, int) and step and size % step:
            raise TracerError(f"{option}: {name_of(plan.engine)} on the {kind.upper()} needs a KV block size that is a "
                              f"multiple of {step}, not {size}; use {step} or {2 * step}")


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


def _known_length(p: PromptConfig, ids: list[int] | None = None) -> int | None:
    """N when it is known before tokenizing (``length``, or the token ids given inline or read from
    ``--token-ids-file``: ``ids``)."""
    if p.length is not None:
        if p.length < 2:
            raise TracerError(f"--length {p.length} is too short; a comparison needs at least 2 tokens")
        return p.length
    return len(ids) if ids is not None else len(p.token_ids) if p.token_ids is not None else None
