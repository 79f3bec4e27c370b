"""The ``tracer`` command: a thin layer over :mod:`tracer.api`, :mod:`tracer.diff.compare`, :mod:`tracer.store.trace`.

Arguments are validated before any model is loaded. Bad input prints one line to stderr and
exits with code 2 (no traceback); nothing on disk is touched.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from typing import Annotated, Optional

import typer
from rich.console import Console

from tracer.errors import EXIT_DIVERGED, EXIT_ERROR, EXIT_INTERNAL, TracerError
from tracer.report.progress import DELAY_S, StatusProgress, phase
from tracer.report.textsafe import printable

app = typer.Typer(
    name="tracer",
    help="Layer-by-layer numeric divergence tracer for transformer inference.\n\n"
    "Runs one prompt two ways that a correct engine treats as equivalent (e.g. cache miss vs "
    "cache hit), captures every layer bit-exact into an HDF5 trace, and prints where and how "
    "much the runs diverge.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

err = Console(stderr=True)

# -- options, each declared once and reused by every command that takes it -------------------------
ModelArg = Annotated[str, typer.Argument(help="Built-in model (see 'tracer models'), a GGUF file (path/to/model.gguf), HF model id in the local cache, or local directory.")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="Model dtype: bfloat16, float16, float32, float64.")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cpu, cuda, cuda:N (default: cuda if available, else cpu).")]
AttnOpt = Annotated[str, typer.Option("--attn", help="Attention implementation: sdpa or eager.")]
GgufOpt = Annotated[Optional[str], typer.Option("--gguf", help="GGUF file for a GGUF recipe (smollm2-135m, gemma3-270m; default: the recipe's package copy, or $TRACER_SMOLLM2_GGUF / $TRACER_GEMMA3_GGUF).")]
FormatOpt = Annotated[str, typer.Option("--format", "-f", help="Output: table, json, csv, markdown.")]
AtolOpt = Annotated[Optional[float], typer.Option("--atol", help="Absolute tolerance: count elements with |a-b| > atol + rtol*|a| per capture point.")]
RtolOpt = Annotated[Optional[float], typer.Option("--rtol", help="Relative tolerance (see --atol).")]
FailOnOpt = Annotated[Optional[str], typer.Option("--fail-on", help="Exit 1 when the comparison fails: any (a bitwise difference), flip (an argmax flip), tolerance (outside --atol/--rtol). Default: report only.")]
WideOpt = Annotated[bool, typer.Option("--wide", help="Table: every metric column (ULP line distance, cosine, SQNR, 1‰/5‰ shares, NaN/Inf, ...).")]
AllRowsOpt = Annotated[bool, typer.Option("--all-rows", help="Table: every capture point (default: the headline and the rows that matter, sized to the terminal).")]
ReportOpt = Annotated[Optional[str], typer.Option("--report", help="Also write a single-file HTML report (summary, tables, figures; no network needed to view it) to this .html file.")]
ColumnsOpt = Annotated[Optional[str], typer.Option("--columns", help="Table: comma-separated columns, e.g. diff,max_abs,ulp,hist,sqnr (see tracer.report.tables.COLUMNS).")]
PromptOpt = Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text (default: a built-in prompt of a few hundred tokens).")]
PromptFileOpt = Annotated[Optional[str], typer.Option("--prompt-file", help="Read the prompt text from a file.")]
TokenIdsOpt = Annotated[Optional[str], typer.Option("--token-ids-file", help="JSON array of token ids (as bug reports give them); the only prompt a model without a tokenizer takes, and a GGUF's tokenizer is then not converted.")]
LengthOpt = Annotated[Optional[int], typer.Option("--length", "-n", help="Use exactly N tokens: the prompt truncated, or repeated to reach N.")]
ChatOpt = Annotated[bool, typer.Option("--chat", help="Apply the tokenizer's chat template to the prompt.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing --output file.")]
GranularityOpt = Annotated[str, typer.Option("--granularity", help="layers (residual stream) or sublayers (norms, attention, MLP, every Linear).")]
KvCacheOpt = Annotated[bool, typer.Option("--kv-cache/--no-kv-cache", help="Capture each layer's KV cache over all N positions (origin analysis of cached-prefix divergence); --no-kv-cache for long prompts, where it is most of the bytes.")]
ScenarioOpt = Annotated[str, typer.Option("--scenario", "-s", help="Scenario: repeat, batch, prefix-cache (cache miss vs hit; --split-at N-1 is a decode step), generate-cache, block-size, chunked-prefill, tensor-parallel, kv-quant, attention, compile, device, disaggregated, rollout-vs-train (RL: a rollout sampling from a KV cache vs the trainer's teacher-forced recompute).")]
BlockSizeOpt = Annotated[Optional[int], typer.Option("--block-size", "-b", help="KV cache block size in tokens; the cached prefix is the largest multiple below N (default 16).")]
SplitAtOpt = Annotated[Optional[int], typer.Option("--split-at", help="Cached prefix length P (1..N-1), overriding --block-size.")]
MitigationOpt = Annotated[Optional[str], typer.Option("--mitigation", help="aligned (prefix-cache: the cache-miss run also splits at P, vLLM #34046) or deterministic (torch deterministic algorithms, TF32 off).")]
DeviceMapOpt = Annotated[Optional[str], typer.Option("--device-map", help="Spread the model over GPUs (or GPU+CPU) with accelerate: auto, balanced, sequential, or a JSON object {\"model.layers.0\": \"cuda:0\", ...}; excludes --device.")]
MaxMemoryOpt = Annotated[Optional[str], typer.Option("--max-memory", help="With --device-map auto: per-device budget, e.g. 0=20GiB,1=20GiB,cpu=64GiB.")]
OutputOpt = Annotated[Optional[str], typer.Option("--output", "-o", help="Trace file (default traces/<model>-<scenario>-<timestamp>.h5).")]
NoStoreOpt = Annotated[bool, typer.Option("--no-store", help="Compare in memory; write no file (same as --store none).")]
PositionsOpt = Annotated[str, typer.Option("--positions", help="window: compare the positions both runs computed last (P..N-1); all: every position 0..N-1 (locates a divergence born in the cached-prefix pass).")]
# scenario options: each scenario uses the ones that apply to it (others are refused)
BatchSizeOpt = Annotated[Optional[int], typer.Option("--batch-size", help="batch: rows in the batch, the prompt included (default 4).")]
PaddingOpt = Annotated[Optional[str], typer.Option("--padding", help="batch: none (rows of equal length), left or right (different lengths, attention mask).")]
BatchRowOpt = Annotated[Optional[int], typer.Option("--batch-row", help="batch: row of the traced prompt (default batch-size // 2).")]
NewTokensOpt = Annotated[Optional[int], typer.Option("--new-tokens", help="generate-cache: greedy tokens to generate (default 8).")]
BlockSizesOpt = Annotated[Optional[str], typer.Option("--block-sizes", help="block-size: two KV block sizes b1,b2 (default 16,64).")]
ChunkSizeOpt = Annotated[Optional[int], typer.Option("--chunk-size", help="chunked-prefill: tokens per chunk C (default 32; 1 = token by token).")]
TpOpt = Annotated[Optional[int], typer.Option("--tp", help="tensor-parallel: shards k of the row-parallel layers (default 2).")]
ReduceOpt = Annotated[Optional[str], typer.Option("--reduce", help="tensor-parallel: all-reduce order ring or tree (default ring).")]
TpModeOpt = Annotated[Optional[str], typer.Option("--tp-mode", help="tensor-parallel: simulated (one process, default) or distributed (run B on --tp processes with torch.distributed: gloo on the CPU, NCCL on GPUs).")]
TpPartialsOpt = Annotated[Optional[bool], typer.Option("--tp-partials", help="tensor-parallel, distributed: also store every rank's o_proj/down_proj partial product before the all_reduce (run B.partials).")]
TpVocabOpt = Annotated[Optional[bool], typer.Option("--tp-vocab-parallel", help="tensor-parallel, distributed: shard the embedding and the LM head by vocabulary too.")]
ReduceDtypeOpt = Annotated[Optional[str], typer.Option("--reduce-dtype", help="tensor-parallel: add partials in the activation dtype or float32.")]
KvFormatOpt = Annotated[Optional[str], typer.Option("--kv-format", help="kv-quant: fp8-e4m3, mxfp8 or nvfp4 (default fp8-e4m3).")]
AttnAOpt = Annotated[Optional[str], typer.Option("--attn-a", help="attention: run A's implementation (default eager).")]
AttnBOpt = Annotated[Optional[str], typer.Option("--attn-b", help="attention: run B's implementation (default sdpa; flash_attention_2 where installed).")]
DevicesOpt = Annotated[Optional[str], typer.Option("--devices", help="device/disaggregated: X,Y (default cpu,cuda).")]
# rollout-vs-train (RL): help text from tracer.config's one declaration
def _rl_opt(name: str, *flags: str):
    from tracer.config import _HELP

    return typer.Option(*flags, help=_HELP[name][0].upper() + _HELP[name][1:] + ".")


RolloutsOpt = Annotated[Optional[int], _rl_opt("rollouts", "--rollouts")]
SampleOpt = Annotated[Optional[bool], _rl_opt("sample", "--sample")]
TemperatureOpt = Annotated[Optional[float], _rl_opt("temperature", "--temperature")]
SeedOpt = Annotated[Optional[int], _rl_opt("seed", "--seed")]
TrainBatchingOpt = Annotated[Optional[str], _rl_opt("train_batching", "--train-batching")]
TrainAttnOpt = Annotated[Optional[str], _rl_opt("train_attn", "--train-attn")]
LmHeadFp32Opt = Annotated[Optional[bool], _rl_opt("lm_head_fp32", "--lm-head-fp32")]
TrainDtypeOpt = Annotated[Optional[str], _rl_opt("train_dtype", "--train-dtype")]
IsCapOpt = Annotated[Optional[float], _rl_opt("is_cap", "--is-cap")]
MaskThresholdOpt = Annotated[Optional[float], _rl_opt("mask_threshold", "--mask-threshold")]
MitigationsOpt = Annotated[Optional[bool], _rl_opt("mitigations", "--mitigations")]

#: parameters of the commands that are not run options (output format, table layout, CLI-only flags)
_NOT_OPTIONS = ("fmt", "wide", "columns", "all_rows", "report", "no_store", "levels", "no_mitigations", "lengths",
                "block_sizes_axis",
                "keep_tensors", "plot")


def run_options(given: dict) -> dict:
    """The run options among a command's parameters (``locals()``), parsed; None = the default."""
    opts = {k: v for k, v in given.items() if k not in _NOT_OPTIONS and v is not None}
    if isinstance(opts.get("block_sizes"), str):
        try:
            opts["block_sizes"] = tuple(int(x) for x in opts["block_sizes"].split(","))
        except ValueError:
            raise TracerError(f"--block-sizes {given['block_sizes']!r} must be two integers such as 16,64") from None
    if given.get("no_store"):
        if opts.get("store", "none") != "none":
            raise TracerError(f"--no-store and --store {opts['store']} contradict each other; give one of them")
        opts["store"] = "none"
    opts.setdefault("store", "auto")  # the command writes its file unless --no-store
    return opts


def _fail(message: str) -> None:
    from rich.text import Text

    # the message may quote file names or file contents: no markup, control characters escaped
    err.print(Text.assemble(("error:", "bold red"), " ", printable(message)), highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_ERROR)


def _emit(comparison, fmt: str, columns: tuple[str, ...] | None = None, all_rows: bool = False) -> None:
    from tracer.report.console import stdout_console
    from tracer.report.tables import DEFAULT_COLUMNS, render

    # styled in a terminal; piped: $COLUMNS or 120 wide, every asked-for column kept
    console = stdout_console(explicit_columns=columns is not None and columns != DEFAULT_COLUMNS)
    text = render(comparison, fmt, console, columns or DEFAULT_COLUMNS, all_rows)
    if text is not None:
        text = printable(text, newlines=True)  # csv/markdown quote names from the trace
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def _check_report(report: str | None, overwrite: bool, output: str | None = None) -> None:
    if report is not None:
        from tracer.report.html import check_report_path

        if output is not None and os.path.abspath(report) == os.path.abspath(output):
            raise TracerError(f"--report {report} is the trace's --output too; give the report another name "
                              "(e.g. .html beside the .h5)")
        check_report_path(report, overwrite)


def _trace_header(trace: str | None) -> dict | None:
    """The header of a written trace (the report's numeric contract), None without one."""
    if not trace:
        return None
    from tracer.store.trace import TraceReader

    with TraceReader(trace) as r:
        return r.header


def _exit_on(comparison, fail_on: str | None) -> None:
    """Exit 1 (EXIT_DIVERGED) when the comparison fails the --fail-on rule, saying why on stderr."""
    failed, reason = comparison.check(fail_on)  # the same rule the JSON's "check" reports
    if failed:
        err.print(f"fail-on {fail_on}: {printable(reason)}", highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(EXIT_DIVERGED)


@app.command("run")
def run_cmd(
    model: ModelArg = "smollm2-135m",
    prompt: PromptOpt = None, prompt_file: PromptFileOpt = None, token_ids_file: TokenIdsOpt = None,
    length: LengthOpt = None, chat: ChatOpt = False,
    scenario: ScenarioOpt = "prefix-cache", block_size: BlockSizeOpt = None, split_at: SplitAtOpt = None,
    mitigation: MitigationOpt = None,
    dtype: DtypeOpt = "bfloat16", device: DeviceOpt = None, attn: AttnOpt = "sdpa", gguf: GgufOpt = None,
    granularity: GranularityOpt = "layers", kv_cache: KvCacheOpt = True,
    device_map: DeviceMapOpt = None, max_memory: MaxMemoryOpt = None,
    output: OutputOpt = None, overwrite: OverwriteOpt = False,
    store: Annotated[Optional[str], typer.Option("--store", help="auto (default): compare every point on the device, keep full tensors of the logits and the points around the origin within --max-trace-size, statistics of all; tensors: every captured tensor; stats: the comparison only; none: no file.")] = None,
    max_trace_size: Annotated[Optional[str], typer.Option("--max-trace-size", help="With --store auto: bytes of full tensors the trace may hold, e.g. 300MB, 2GiB (default 256MiB).")] = None,
    no_store: NoStoreOpt = False,
    compression: Annotated[Optional[str], typer.Option("--compression", help="HDF5 compression of stored tensors: none, lzf, gzip.")] = None,
    fmt: FormatOpt = "table",
    decode: Annotated[int, typer.Option("--decode", help="Greedy-decode T tokens from each run's KV cache and report the first generated position that differs (0 = off).")] = 0,
    verdict: Annotated[bool, typer.Option("--verdict", help="Re-run at float32 (and float64 on CPU) and judge: rounding noise, defect suspected, or inconclusive.")] = False,
    atol: AtolOpt = None, rtol: RtolOpt = None, fail_on: FailOnOpt = None, wide: WideOpt = False, columns: ColumnsOpt = None,
    all_rows: AllRowsOpt = False, report: ReportOpt = None,
    positions: PositionsOpt = "window",
    kernels: Annotated[bool, typer.Option("--kernels", help="Record which kernels each capture point ran in each run (torch.profiler): kernels column, origin class, JSON kernels_a/kernels_b.")] = False,
    cuda_graphs: Annotated[bool, typer.Option("--cuda-graphs", help="Record both runs' forward passes in CUDA graphs and replay them, the capture copies recorded into the graphs (CUDA GPU only; scenario cuda-graph compares eager with replay).")] = False,
    op_replay: Annotated[bool, typer.Option("--op-replay", help="Replay each origin op in float64 on the CPU from the captured inputs: each run's error in ULPs against the exact result (with --granularity sublayers).")] = False,
    batch_size: BatchSizeOpt = None, padding: PaddingOpt = None, batch_row: BatchRowOpt = None,
    new_tokens: NewTokensOpt = None, block_sizes: BlockSizesOpt = None, chunk_size: ChunkSizeOpt = None,
    tp: TpOpt = None, reduce: ReduceOpt = None, reduce_dtype: ReduceDtypeOpt = None, kv_format: KvFormatOpt = None,
    attn_a: AttnAOpt = None, attn_b: AttnBOpt = None, devices: DevicesOpt = None,
    tp_mode: TpModeOpt = None, tp_partials: TpPartialsOpt = None, tp_vocab_parallel: TpVocabOpt = None,
    rollouts: RolloutsOpt = None, sample: SampleOpt = None, temperature: TemperatureOpt = None, seed: SeedOpt = None,
    train_batching: TrainBatchingOpt = None, train_attn: TrainAttnOpt = None, lm_head_fp32: LmHeadFp32Opt = None,
    train_dtype: TrainDtypeOpt = None, is_cap: IsCapOpt = None, mask_threshold: MaskThresholdOpt = None,
    mitigations: MitigationsOpt = None,
) -> None:
    """Run a scenario on a model and print the layer-by-layer amplification table."""
    given = dict(locals())  # the parameters, before any other local exists
    from tracer.api import run
    from tracer.report.tables import check_columns, check_format

    try:
        check_format(fmt)
        cols = check_columns(columns, wide)
        _check_report(report, overwrite, output)
        opts = run_options(given)
        # a spinner in a terminal; piped, a line for every phase still running after DELAY_S seconds
        with StatusProgress("run", mode="auto", delay_s=DELAY_S) as status:
            result = run(progress=err.is_terminal, status=status, **opts)
            if report is not None and result.comparison is not None:
                from tracer.report.html import comparison_html, write_report

                status(f"writing the HTML report {report}")
                write_report(comparison_html(result.comparison, _trace_header(result.trace)), report, overwrite=overwrite)
    except TracerError as e:
        _fail(str(e))
        return
    if result.comparison is None:  # a rank > 0 under torchrun: rank 0 reports
        return
    _emit(result.comparison, fmt, cols, all_rows)
    if report is not None:
        err.print(f"report: {report}", highlight=False)
    if mitigation is not None and fmt == "table":
        ok = result.comparison.identical
        Console().print(
            f"mitigation {mitigation}: {'restores' if ok else 'does NOT restore'} bitwise equality "
            f"({'every' if ok else 'not every'} compared tensor is bit-identical)",
            style="green" if ok else "red",
        )
    _exit_on(result.comparison, fail_on)


@app.command("audit")
def audit_cmd(
    model: ModelArg = "smollm2-135m",
    levels: Annotated[Optional[str], typer.Option("--levels", "-l", help="Levels to run, e.g. 0,1,2 (default: all, 0-7).")] = None,
    prompt: PromptOpt = None, prompt_file: PromptFileOpt = None, token_ids_file: TokenIdsOpt = None,
    length: LengthOpt = None, chat: ChatOpt = False,
    dtype: DtypeOpt = "bfloat16", device: DeviceOpt = None, attn: AttnOpt = "sdpa", gguf: GgufOpt = None,
    granularity: GranularityOpt = "layers", kv_cache: KvCacheOpt = True,
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="Trace file for all runs (default traces/<model>-audit.h5); finished checks are kept in OUTPUT.checks/ while it runs, so re-running with the same options resumes an interrupted audit.")] = None,
    overwrite: OverwriteOpt = False, no_store: NoStoreOpt = False,
    no_mitigations: Annotated[bool, typer.Option("--no-mitigations", help="Do not re-run diverging levels under the mitigations.")] = False,
    fmt: FormatOpt = "table",
    report: ReportOpt = None,
    kernels: Annotated[bool, typer.Option("--kernels", help="Record which kernels each capture point ran in every run (stored in the trace and in each stored comparison).")] = False,
    batch_size: BatchSizeOpt = None, batch_row: BatchRowOpt = None, new_tokens: NewTokensOpt = None,
    block_sizes: BlockSizesOpt = None, chunk_size: ChunkSizeOpt = None, tp: TpOpt = None,
) -> None:
    """Run every level of the determinism hierarchy this machine can run and print the hierarchy table."""
    given = dict(locals())  # the parameters, before any other local exists
    from tracer.api import audit
    from tracer.plan.hierarchy import parse_levels
    from tracer.report.hierarchy import render_audit
    from tracer.report.tables import check_format

    try:
        check_format(fmt)
        from tracer.plan.checks import check_length

        check_length(length)
        parse_levels(levels)
        _check_report(report, overwrite, output)
        opts = run_options(given)
        # the plan with each check's cost, then each result as it comes, on stderr
        result = audit(levels=levels, mitigations=not no_mitigations,
                       progress=True if err.is_terminal else "lines", **opts)
        if report is not None:
            from tracer.report.hierarchy import audit_html
            from tracer.report.html import write_report

            write_report(audit_html(result), report, overwrite=overwrite)
    except TracerError as e:
        _fail(str(e))
        return
    from tracer.report.console import stdout_console

    text = render_audit(result, fmt, stdout_console())
    if text is not None:
        sys.stdout.write(text)


@app.command("compare")
def compare_cmd(
    trace: Annotated[str, typer.Argument(help="An HDF5 trace written by 'tracer run' or 'tracer audit', optionally FILE:RUN.")],
    run_a: Annotated[Optional[str], typer.Argument(help="First run (default: the first in the file), or a second trace FILE2[:RUN].")] = None,
    run_b: Annotated[Optional[str], typer.Argument(help="Second run (default: the second).")] = None,
    fmt: FormatOpt = "table",
    atol: AtolOpt = None,
    rtol: RtolOpt = None,
    fail_on: FailOnOpt = None,
    wide: WideOpt = False,
    columns: ColumnsOpt = None,
    all_rows: AllRowsOpt = False,
    device: Annotated[Optional[str], typer.Option("--device", help="Where the metrics are computed: cpu, cuda, cuda:N (default: cuda if available, else cpu).")] = None,
    engine_map: Annotated[Optional[str], typer.Option("--map", help="Engine dump map (TOML, schema of hooks/engine-llama.toml) merged over the built-in one; for a DUMP argument.")] = None,
) -> None:
    """Compare two stored runs (no model needed): TRACE [RUN_A [RUN_B]], or TRACE[:RUN] TRACE2[:RUN]
    for traces made on two machines (a file without :RUN uses the other side's run name, else its first run),
    or TRACE[:RUN] DUMP: an HF reference run against an engine dump (SGLang dumper folder, PassN.pt
    folder, .safetensors/.npz, or a trace written by 'tracer import')."""
    from tracer.diff.compare_dump import compare_dump, dump_side
    from tracer.diff.compare import compare_runs
    from tracer.diff.refs import resolve_refs
    from tracer.diff.result import check_fail_on
    from tracer.report.tables import check_columns, check_format

    try:
        check_format(fmt)
        cols = check_columns(columns, wide)
        check_fail_on(fail_on, atol, rtol)
        refs = [x for x in (trace, run_a, run_b) if x is not None]
        dump = dump_side(refs)
        with phase("compare", f"comparing {' '.join(refs)}"):
            if dump is not None:
                comparison = compare_dump(dump[0], dump[1], engine_map=engine_map, atol=atol, rtol=rtol, device=device)
            elif engine_map is not None:
                raise TracerError("--map applies to an engine dump; give TRACE[:RUN] DUMP")
            else:
                from tracer.diff.stored import auto_comparison

                (pa, ra), (pb, rb) = resolve_refs(refs)
                # a --store auto trace without some tensors: its run-time comparison of all points (no tolerances asked)
                stored = auto_comparison(pa, ra, rb) if pa == pb and atol is None and rtol is None else None
                comparison = stored or compare_runs((pa, ra), (pb, rb), atol=atol, rtol=rtol, device=device)
        comparison = replace(comparison, fail_on=fail_on)
    except TracerError as e:
        _fail(str(e))
        return
    _emit(comparison, fmt, cols, all_rows)
    _exit_on(comparison, fail_on)


@app.command("import")
def import_cmd(
    dump: Annotated[str, typer.Argument(help="An engine dump: SGLang dumper folder, PassN.pt folder (per-rank sub-folders), or .safetensors/.npz of named tensors.")],
    output: Annotated[str, typer.Option("--output", "-o", help="The trace to write (one run, HF capture names).")],
    reference: Annotated[str, typer.Option("--reference", "-r", help="The HF reference run TRACE[:RUN] whose names, shapes and token ids the dump is mapped onto.")],
    engine_map: Annotated[Optional[str], typer.Option("--map", help="Engine dump map (TOML) merged over the built-in one.")] = None,
    run_name: Annotated[str, typer.Option("--run", help="Name of the imported run.")] = "engine",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing output file.")] = False,
) -> None:
    """Map an engine dump onto an HF reference run's capture points and write it as a trace
    (compare it with 'tracer compare REF.h5:RUN OUTPUT')."""
    from tracer.diff.refs import split_ref
    from tracer.diff.compare_dump import import_dump

    try:
        with phase("import", f"mapping {dump} onto {reference}"):
            mapped = import_dump(dump, split_ref(reference), output, engine_map=engine_map, overwrite=overwrite,
                                 run_name=run_name)
    except TracerError as e:
        _fail(str(e))
        return
    lo, hi = mapped.positions
    print(f"imported {mapped.engine} {mapped.path}: {len(mapped.tensors)} capture points, positions {lo}..{hi - 1} "
          f"-> {output} (run {run_name})")
    for line in mapped.notes:
        print(f"  {line}")


@app.command("show")
def show_cmd(
    trace: Annotated[str, typer.Argument(help="An HDF5 trace written by 'tracer run'.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the header and runs as JSON.")] = False,
) -> None:
    """Print a trace's header (the numeric contract) and its runs."""
    from rich.table import Table

    from tracer.store.trace import TraceReader

    try:
        with phase("show", f"reading {trace}"), TraceReader(trace) as r:
            header = r.header
            runs = []
            for name in r.runs:
                rec = r.run(name, load_tensors=False)
                runs.append({"name": name, "n_tokens": len(rec.token_ids), "window": list(rec.window),
                             "plan": rec.plan, "captures": len(r.capture_names(name)), "meta": rec.meta})
            stored = r.comparisons()
            checksummed = r.checksummed
    except TracerError as e:
        _fail(str(e))
        return
    if as_json:
        print(json.dumps({"header": header, "runs": runs, "comparisons": stored}, indent=2, default=str))
        return
    from rich.text import Text

    def cell(v) -> Text:  # header strings come from the file: shown as data, never as markup
        return Text(printable(v if isinstance(v, str) else json.dumps(v, default=str)))

    out = Console()
    t = Table(title=cell(f"trace {trace}"), show_header=False, title_justify="left")
    t.add_column("key", style="bold")
    t.add_column("value")
    for k, v in header.items():
        t.add_row(cell(k), cell(v))
    if not checksummed:
        t.add_row("checksums", "none: written before tracer stored checksums; integrity not verified")
    out.print(t)
    rt = Table(title="runs", title_justify="left")
    for col in ("run", "tokens", "compared positions", "plan", "GEMM M", "capture points"):
        rt.add_column(col)
    for r in runs:
        rt.add_row(cell(r["name"]), str(r["n_tokens"]), f"{r['window'][0]}..{r['window'][1] - 1}",
                   cell(r["plan"].get("description", "")), cell(str(r["plan"].get("gemm_m", ""))), str(r["captures"]))
    out.print(rt)
    for name, comp in stored.items():
        out.print(Text(printable(f"stored comparison {name}: {comp.get('verdict', '?')}")))


@app.command("sweep")
def sweep_cmd(
    model: ModelArg = "smollm2-135m",
    lengths: Annotated[str, typer.Option("--lengths", "-l", help="Prompt lengths: start:stop[:step] with stop INCLUSIVE (17:512 = 17..512), comma lists (64,128) or both.")] = "17:512",
    block_size: BlockSizeOpt = None,
    block_sizes_axis: Annotated[Optional[str], typer.Option("--block-sizes", help="Several KV block sizes as a second axis, e.g. 16,32,64 (same syntax as --lengths).")] = None,
    scenario: Annotated[str, typer.Option("--scenario", "-s", help="Scenario run at every point (default prefix-cache).")] = "prefix-cache",
    mitigation: MitigationOpt = None,
    prompt: PromptOpt = None, prompt_file: PromptFileOpt = None, token_ids_file: TokenIdsOpt = None,
    dtype: DtypeOpt = "bfloat16", device: DeviceOpt = None, attn: AttnOpt = "sdpa", gguf: GgufOpt = None,
    granularity: GranularityOpt = "layers", kv_cache: KvCacheOpt = True,
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="Sweep file (default traces/sweep-<model>-<scenario>.h5); an unfinished one with the same parameters is resumed.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Start over, replacing an existing --output.")] = False,
    keep_tensors: Annotated[bool, typer.Option("--keep-tensors", help="Also store every point's captured tensors (large).")] = False,
    plot: Annotated[Optional[str], typer.Option("--plot", help="Also write the divergence map to this .png/.svg/.pdf.")] = None,
    report: ReportOpt = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="Output: table, json, csv.")] = "table",
    batch_size: BatchSizeOpt = None, padding: PaddingOpt = None, batch_row: BatchRowOpt = None,
    new_tokens: NewTokensOpt = None, chunk_size: ChunkSizeOpt = None,
    tp: TpOpt = None, reduce: ReduceOpt = None, reduce_dtype: ReduceDtypeOpt = None, kv_format: KvFormatOpt = None,
    attn_a: AttnAOpt = None, attn_b: AttnBOpt = None,
) -> None:
    """Run a scenario for every prompt length (x block size): which lengths diverge, from which layer, how much."""
    given = dict(locals())  # the parameters, before any other local exists
    from tracer.api import sweep
    from tracer.loops.sweep import parse_int_list
    from tracer.report.sweep_lines import sweep_summary_lines

    try:
        if fmt not in ("table", "json", "csv"):
            raise TracerError(f"unknown format '{fmt}'; use one of: table, json, csv")
        if block_size is not None and block_sizes_axis is not None:
            raise TracerError("give --block-size or --block-sizes, not both")
        bs = parse_int_list(block_sizes_axis, "--block-sizes") if block_sizes_axis is not None else [16 if block_size is None else block_size]
        if plot is not None:
            from tracer.report.plot import check_figure_path

            check_figure_path(plot, overwrite)
        _check_report(report, overwrite, output)
        opts = run_options(given)
        opts.pop("block_size", None)  # the block-size axis, not a run option
        result = sweep(lengths=lengths, block_sizes=bs, keep_tensors=keep_tensors,
                       progress=True if err.is_terminal else "lines", **opts)
        if plot is not None:
            from tracer.report.plot import save_figure, sweep_figure

            save_figure(sweep_figure(result), plot, overwrite=overwrite)
        if report is not None:
            from tracer.report.html import write_report
            from tracer.report.pages import sweep_html

            write_report(sweep_html(result), report, overwrite=overwrite)
    except TracerError as e:
        _fail(str(e))
        return
    if fmt == "table":
        for line in sweep_summary_lines(result):
            print(line)
        if result.path:
            print(f"sweep file: {result.path}")
        if plot is not None:
            print(f"divergence map: {plot}")
    else:
        df_rows = result.summary_rows()
        if fmt == "json":
            print(json.dumps(result.summary(), indent=1, default=str))
        else:
            import csv

            w = csv.DictWriter(sys.stdout, fieldnames=list(df_rows[0]) if df_rows else ["length"], lineterminator="\n")
            w.writeheader()
            w.writerows(df_rows)


@app.command("plot")
def plot_cmd(
    trace: Annotated[str, typer.Argument(help="A trace (tracer run) or a sweep file (tracer sweep).")],
    kind: Annotated[Optional[str], typer.Option("--kind", "-k", help="amplification, heatmap, ulp (traces) or sweep (sweep files); default: amplification or sweep.")] = None,
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="Figure file: .png, .svg or .pdf (default: beside the input, <name>-<kind>.png).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --output.")] = False,
    layers: Annotated[Optional[str], typer.Option("--layers", help="ulp: capture points to show, comma-separated names or indices (default: first divergent, middle, last, logits).")] = None,
) -> None:
    """Draw a figure from a stored trace or sweep file (no model needed)."""
    from tracer.api import plot_file

    try:
        with phase("plot", f"drawing {kind or 'the figure'} from {trace}"):
            path = plot_file(trace, kind=kind, output=output, overwrite=overwrite,
                             layers=layers.split(",") if layers else None)
    except TracerError as e:
        _fail(str(e))
        return
    print(path)


@app.command("report")
def report_cmd(
    trace: Annotated[str, typer.Argument(help="A trace (tracer run / audit) or a sweep file (tracer sweep).")],
    output: Annotated[Optional[str], typer.Option("--output", "-o", help="The .html file (default: beside the input, <name>.html).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --output.")] = False,
    device: Annotated[Optional[str], typer.Option("--device", help="Only for traces without a stored comparison: where to compare (cpu, cuda).")] = None,
) -> None:
    """Write a single-file HTML report (summary, numeric contract, origin, tables, figures; audit matrix or
    sweep map) from a stored trace or sweep file: no model needed, nothing recomputed."""
    from tracer.report.pages import write_report_file

    try:
        with phase("report", f"writing the HTML report of {trace}"):
            path = write_report_file(trace, output, overwrite=overwrite, device=device)
    except TracerError as e:
        _fail(str(e))
        return
    print(path)


@app.command("models")
def models_cmd() -> None:
    """List the built-in model names."""
    from rich.table import Table

    from tracer.load.recipes import list_models

    t = Table(title="built-in models (any HF model id in the local cache or a local directory also works)",
              title_justify="left")
    t.add_column("name", style="bold")
    t.add_column("kind")
    t.add_column("description")
    for m in list_models():
        t.add_row(m["name"], m["kind"], m.get("description", ""))
    Console().print(t)


@app.command("bench")
def bench_cmd(
    model: ModelArg = "smollm2-135m",
    length: Annotated[int, typer.Option("--length", "-n", help="Prompt length N in tokens.")] = 1024,
    dtype: DtypeOpt = "bfloat16",
    device: DeviceOpt = None,
    gguf: GgufOpt = None,
    granularity: Annotated[str, typer.Option("--granularity", help="layers or sublayers.")] = "layers",
    kv_cache: KvCacheOpt = True,
    block_size: Annotated[int, typer.Option("--block-size", "-b", help="KV cache block size in tokens; the cached prefix is the largest multiple below N.")] = 16,
    reps: Annotated[int, typer.Option("--reps", help="Measured repetitions of each mode.")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Unmeasured repetitions first.")] = 1,
    outdir: Annotated[Optional[str], typer.Option("--outdir", help="Folder for the trace and raw I/O files (default: a temp dir).")] = None,
    peers: Annotated[bool, typer.Option("--peers/--no-peers", help="Also measure the peers in the same loop: HF output_hidden_states, forward hooks + .cpu(), nnsight .save() (if installed), each checked to count the same differing elements per layer as tracer.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Measure tracer's overhead over the bare forward pass and its I/O against the disk, side by
    side with peers doing the same comparison: HF output_hidden_states, naive forward hooks +
    .cpu(), and nnsight .save() when installed (the 'peers' extra). The bench refuses
    to report when a peer's per-layer differing counts are not tracer's."""
    from tracer.loops.bench import bench, table, to_json

    if reps < 1 or warmup < 0:
        _fail("--reps must be ≥ 1 and --warmup ≥ 0")
    try:
        with StatusProgress("bench", mode="auto") as status:
            result = bench(model, length=length, dtype=dtype, device=device, gguf=gguf,
                           granularity=granularity, kv_cache=kv_cache, block_size=block_size, reps=reps,
                           warmup=warmup, outdir=outdir, peers=peers, progress=status)
    except TracerError as e:
        _fail(str(e))
        return
    if as_json:
        print(to_json(result))
    else:
        Console().print(table(result))


def main() -> None:
    """Entry point of the ``tracer`` console script.

    Exit codes: 0 identical / within tolerance / report only, 1 diverged (failed ``--fail-on``),
    2 bad input or corrupt file, 3 internal error (one line; the traceback with
    ``TRACER_DEBUG=1``), 130 interrupted.
    """
    from tracer.load.offline import ensure_offline

    ensure_offline()  # before anything imports huggingface_hub (no network unless TRACER_ALLOW_NETWORK=1)
    try:
        app()
    except TracerError as e:  # pragma: no cover - commands catch their own
        err.print(f"error: {printable(e)}", highlight=False, markup=False)
        sys.exit(EXIT_ERROR)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - a bug: one line and code 3, never the code of "diverged"
        if os.environ.get("TRACER_DEBUG") == "1":
            raise SystemExit(_debug_exit()) from None
        first = (str(e).splitlines() or [""])[0][:200]
        err.print(f"internal error: {type(e).__name__}: {printable(first)} (a tracer bug; set TRACER_DEBUG=1 for "
                  "the traceback and report it)", highlight=False, markup=False, soft_wrap=True)
        sys.exit(EXIT_INTERNAL)


def _debug_exit() -> int:
    import traceback

    traceback.print_exc()
    return EXIT_INTERNAL
