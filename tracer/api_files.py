"""The notebook API's calls on stored files, no model needed: traces, sweep files, engine dumps.

    >>> tracer.compare_trace("run.h5")                       # its stored runs compared (or FILE:RUN, DUMP)
    >>> tracer.trace_info("run.h5"); tracer.read_trace("run.h5"); tracer.read_sweep("sweep.h5")
    >>> tracer.plot_file("run.h5", kind="heatmap"); tracer.report_file("run.h5")
    >>> tracer.import_dump("dump/", "ref.h5:A", "engine.h5")  # an engine dump as a one-run trace

Re-exported by :mod:`tracer.api` (``tracer.trace_info`` ...); the ``tracer`` command's ``compare``,
``import``, ``show``, ``plot`` and ``report`` are built from these functions (:mod:`tracer.cli`).
Importing this module loads neither torch nor transformers.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tracer.diff.refs import resolve_refs, split_ref
from tracer.errors import TracerError
from tracer.plan.checks import check_fail_on
from tracer.plan.rollout import check_rl_thresholds

if TYPE_CHECKING:  # the result types, for the signatures only: importing tracer stays light
    from pathlib import Path

    from tracer.diff.result import Comparison
    from tracer.engines.dumps.namemap import MappedDump
    from tracer.store.sweepfile import SweepResult
    from tracer.store.trace import TraceReader


def compare_trace(path: str, run_a: str | None = None, run_b: str | None = None, *,
                  engine_map: str | None = None, atol: float | None = None, rtol: float | None = None,
                  fail_on: str | None = None, device: str | None = None, reference: str | None = None,
                  temperature: float | None = None, is_cap: float | None = None,
                  mask_threshold: float | None = None) -> Comparison:
    """Compare two stored runs (no model needed): ``path`` alone (its first two runs), ``path run_a
    [run_b]`` (runs of one trace), ``path[:RUN] TRACE2[:RUN]`` (a run of each of two traces, e.g.
    from two machines; a file without :RUN uses the other side's run name, else its first run),
    ``path[:RUN] DUMP``: an HF reference run against an engine dump, or ``DUMP_A DUMP_B`` with
    ``reference``: two engine dumps against each other (a rollout engine's dump against a
    trainer's, both mapped onto the reference run's HF names and token ids; the RL metrics in
    ``.rl`` where both hold logits: :func:`tracer.diff.compare_dumps.compare_dumps`). Two runs of
    a trace give the comparison made when they ran, whatever ``--store`` kept
    (:func:`tracer.diff.stored.compare_stored`: what the file cannot recompute comes from the
    stored run-time comparison, and says so).

    Args:
        path: an HDF5 trace written by 'tracer run' or 'tracer audit', optionally FILE:RUN; or, with
            --reference, the first engine dump (the rollout's).
        run_a: the first run (default: the first in the file), or a second trace FILE2[:RUN], or an
            engine dump (SGLang dumper folder, PassN.pt folder, .safetensors/.npz, or a trace
            written by 'tracer import'); with --reference, the second engine dump (the trainer's).
        run_b: the second run (default: the second).
        engine_map: engine dump map (TOML, schema of hooks/engine-llama.toml) merged over the
            built-in one; for a DUMP argument.
        device: where the metrics are computed: cpu, cuda, cuda:N (default: cuda if available, else cpu).
        reference: REF.h5[:RUN], an HF reference run whose names, shapes and token ids both engine
            dumps are mapped onto (two dumps against each other: DUMP_A DUMP_B --reference REF.h5:RUN).
        temperature: with --reference: τ of the dumps' logprobs, log_softmax(logits / τ), as the rollout
            sampled (default 1).
        is_cap: with --reference: TIS cap C; the share of tokens with ratio > C is reported as clipped (default 2).
        mask_threshold: with --reference: MIS/IcePop threshold b; tokens with ratio outside [1/b, b] count as
            masked (default 2).

    Returns:
        the :class:`~tracer.diff.result.Comparison` (``comparison.check()`` applies ``fail_on``); its
        ``unverified`` names the traces read that carry no checksums.

    Raises:
        TracerError: missing/corrupt trace or dump, unknown run names, an unavailable device, bad
            tolerances or ``fail_on``, RL options without two dumps.
    """
    refs = [str(x) for x in (path, run_a, run_b) if x is not None]
    if reference is not None and len(refs) != 2:  # before anything heavy is imported
        raise TracerError(f"--reference compares two engine dumps: give DUMP_A DUMP_B (got {len(refs)} argument(s))")
    rl = {k: v for k, v in (("temperature", temperature), ("is_cap", is_cap), ("mask_threshold", mask_threshold))
          if v is not None}
    if rl and reference is None:
        raise TracerError(f"--{next(iter(rl)).replace('_', '-')} applies to two engine dumps (DUMP_A DUMP_B --reference "
                          "REF.h5:RUN); a rollout-vs-train trace keeps the values it was run with")
    check_rl_thresholds(**rl)
    check_fail_on(fail_on, atol, rtol)
    from tracer.load.preflight import check_device

    check_device(device)  # before any file is read
    from tracer.diff.compare_dump import compare_dump, dump_side, is_dump
    from tracer.diff.compare_dumps import compare_dumps, dumps_args
    from tracer.diff.stored import compare_stored, mark_unverified

    pair = dumps_args(refs, reference)
    dump = dump_side(refs) if pair is None else None
    if pair is not None:
        comparison = compare_dumps(pair[0], pair[1], split_ref(str(reference)), engine_map=engine_map, atol=atol,
                                   rtol=rtol, device=device,
                                   **{"tau" if k == "temperature" else k: float(v) for k, v in rl.items()})
        comparison = mark_unverified(comparison, [split_ref(str(reference))[0]])
    elif dump is not None:
        comparison = compare_dump(dump[0], dump[1], engine_map=engine_map, atol=atol, rtol=rtol, device=device)
        traces = [dump[0][0]] + ([] if is_dump(dump[1]) else [split_ref(dump[1])[0]])  # an imported dump is a trace
        comparison = mark_unverified(comparison, traces)
    elif engine_map is not None:
        raise TracerError("--map (engine_map) applies to an engine dump; give TRACE[:RUN] DUMP")
    else:  # stored runs: the comparison made when they ran, whatever --store kept
        (pa, ra), (pb, rb) = resolve_refs(refs)
        comparison = mark_unverified(compare_stored((pa, ra), (pb, rb), atol=atol, rtol=rtol, device=device), [pa, pb])
    return replace(comparison, fail_on=fail_on)  # the one place the rule is set


def import_dump(dump: str, reference: str, output: str, *, engine_map: str | None = None,
                overwrite: bool = False, run_name: str = "engine") -> MappedDump:
    """Map an engine dump onto an HF reference run's capture points and write it as a one-run trace
    (compare it with ``tracer compare REF.h5:RUN OUTPUT``; :func:`tracer.diff.compare_dump.import_dump`;
    returns its :class:`~tracer.engines.dumps.namemap.MappedDump`).

    Args:
        dump: an engine dump: SGLang dumper folder, PassN.pt folder (per-rank sub-folders), or
            .safetensors/.npz of named tensors.
        reference: the HF reference run TRACE[:RUN] whose names, shapes and token ids the dump is mapped onto.
        output: the trace to write (one run, HF capture names).
        engine_map: engine dump map (TOML) merged over the built-in one.
        overwrite: replace an existing output file.
        run_name: name of the imported run.

    Raises:
        TracerError: a malformed dump, unknown names, token ids that do not match, an existing output.
    """
    from tracer.diff.compare_dump import import_dump as _imp

    return _imp(str(dump), split_ref(str(reference)), str(output), engine_map=engine_map, overwrite=overwrite,
                run_name=run_name)


def write_sglang_dump(trace: str, run: str, out: str, **kwargs: Any) -> Path:
    """Write a stored HF run as a synthetic SGLang dumper folder (:func:`tracer.engines.dumps.sglang_writer.write_sglang_dump`)."""
    from tracer.engines.dumps.sglang_writer import write_sglang_dump as _w

    return _w(trace, run, out, **kwargs)


def write_megatron_dump(trace: str, run: str, out: str, **kwargs: Any) -> Path:
    """Write a stored HF run as a synthetic Megatron-LM trainer dump, as Miles' dumper writes one
    (:func:`tracer.engines.dumps.megatron_writer.write_megatron_dump`: TP, SP, CP, PP, Transformer Engine spec)."""
    from tracer.engines.dumps.megatron_writer import write_megatron_dump as _w

    return _w(trace, run, out, **kwargs)


def read_trace(path: str) -> TraceReader:
    """Open a stored trace (:class:`tracer.store.trace.TraceReader`; use it as a context manager).

    Raises:
        TracerError: missing, incomplete or corrupt file, unknown format version.
    """
    from tracer.store.trace import TraceReader

    return TraceReader(path)


def read_sweep(path: str) -> SweepResult:
    """Read a sweep file (:func:`tracer.loops.sweep.read_sweep`).

    Raises:
        TracerError: not a sweep file, or corrupt.
    """
    from tracer.loops.sweep import read_sweep as _rs

    return _rs(path)


def plot_file(path: str | os.PathLike, *, kind: str | None = None, output: str | os.PathLike | None = None,
              overwrite: bool = False, layers: str | list[str] | None = None, run_a: str | None = None,
              run_b: str | None = None) -> Path:
    """Draw a figure from a stored trace or sweep file and save it (no model needed; returns its path).

    Args:
        path: a trace (tracer run) or a sweep file (tracer sweep).
        kind: the figure: amplification, heatmap, ulp (traces) or sweep (sweep files); default:
            amplification or sweep.
        output: figure file: .png, .svg or .pdf (default: beside the input, <name>-<kind>.png).
        overwrite: replace an existing output.
        layers: with kind ulp: capture points to show, comma-separated names or indices (default:
            first divergent, middle, last, logits).
        run_a, run_b: the runs to draw, recomputed from their tensors (default: the trace's stored
            comparison of its first two runs).

    Raises:
        TracerError: unknown kind, a kind that does not fit the file, bad output path, unreadable file.
    """
    from tracer.report.outputs import check_plot_options

    check_plot_options(kind, layers, output, overwrite)  # the options first: no torch, matplotlib or file read

    from tracer.report.plot import plot_file as _pf

    return _pf(path, kind=kind, output=output, overwrite=overwrite, layers=layers, run_a=run_a, run_b=run_b)


def report_file(path: str | os.PathLike, *, output: str | os.PathLike | None = None, overwrite: bool = False,
                device: str | None = None) -> Path:
    """Write a single-file HTML report (summary, numeric contract, origin, tables, figures; audit
    matrix or sweep map) from a stored trace or sweep file: no model needed, nothing recomputed.
    Returns the report's path.

    Args:
        path: a trace (tracer run / audit) or a sweep file (tracer sweep).
        output: the .html file (default: beside the input, <name>.html).
        overwrite: replace an existing output.
        device: only for traces without a stored comparison: where to compare (cpu, cuda).

    Raises:
        TracerError: missing or corrupt file, an existing output without ``overwrite``.
    """
    from tracer.report.pages import write_report_file

    return write_report_file(path, output, overwrite=overwrite, device=device)


def trace_info(path: str | os.PathLike) -> dict[str, Any]:
    """A trace's header (the numeric contract), its runs and stored comparisons, as data (``tracer show``).

    Args:
        path: an HDF5 trace written by 'tracer run'.

    Raises:
        TracerError: missing, incomplete or corrupt file; a folder of traces (the message names
            the newest); an engine dump (a folder, ``.safetensors``, ``.npz``: the message names the
            calls that read one).
    """
    from tracer.diff.compare_dump import is_dump
    from tracer.errors import from_cli
    from tracer.store.trace import describe

    p = os.fspath(path)
    held = sorted((e for e in os.scandir(p) if e.name.endswith(".h5") and e.is_file()),
                  key=lambda e: e.stat().st_mtime) if os.path.isdir(p) else []
    if held:  # a folder of traces (traces/, where tracer writes them), not an engine dump
        newest = os.path.join(p, held[-1].name)
        how = f"'tracer show {newest}'" if from_cli() else f"trace_info({newest!r})"
        raise TracerError(f"{p} is a folder holding {len(held)} trace{'s' if len(held) != 1 else ''} (.h5 files); "
                          f"show one, e.g. the newest: {how}")
    if is_dump(p):
        how = (f"compare it with 'tracer compare REF.h5:RUN {p}', or make a trace of it with "
               f"'tracer import {p} -r REF.h5:RUN -o OUT.h5'" if from_cli() else
               f"compare it with tracer.compare_trace('REF.h5:RUN', {p!r}), or make a trace of it with "
               f"tracer.import_dump({p!r}, 'REF.h5:RUN', 'OUT.h5')")
        what = "a folder (an engine dump?)" if os.path.isdir(p) else "an engine dump"
        raise TracerError(f"{p} is {what}; {'tracer show' if from_cli() else 'trace_info'} shows traces "
                          f"(.h5 files written by tracer): {how}")
    return describe(path)


__all__ = ["compare_trace", "import_dump", "write_sglang_dump", "write_megatron_dump", "read_trace", "read_sweep",
           "plot_file", "report_file", "trace_info"]
