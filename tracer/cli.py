"""The ``tracer`` command: every command parses, makes one :mod:`tracer.api` call, renders.

No option is written here. Each command is built from its API function
(:func:`tracer.cli_parser.api_command`): the run options come from :data:`tracer.config.OPTIONS`
(help, type, flags), the function's own parameters from its signature (default, type) and its
docstring's ``Args:`` (help); the command line adds only how the result is printed or saved
(:data:`tracer.cli_parser.RENDER`: ``--format``, ``--report``, ...). So ``tracer run --help`` and
``help(tracer.run)`` list one set of options, worded once. Rendering lives in
:mod:`tracer.report.terminal` and :mod:`tracer.report.show`; how the process ends after a signal
or a crash in :mod:`tracer.cli_exit`.

Bad input prints one line to stderr and exits with code 2 (no traceback), checked before any
model loads; nothing on disk is touched.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import typer

from tracer import api
from tracer.cli_exit import debug_exit, dump_on_crash, exit_interrupted, quiet_exit_on_signals, restore_signals
from tracer.cli_parser import IN_PROCESS, OUTPUT_PANEL, RENDER, api_command, app, render_options
from tracer.errors import EXIT_ERROR, EXIT_INTERNAL, TracerError, exit_broken_pipe

#: what other code imports from here: the parser's app and tables (:mod:`tracer.cli_parser`)
__all__ = ["IN_PROCESS", "OUTPUT_PANEL", "RENDER", "app", "close_options", "command", "main", "render_options",
           "versions"]


def versions() -> str:
    """``tracer 0.1.0 · torch 2.13.0+cpu · transformers 5.24.0 · Python 3.12.3``: what ``tracer --version``
    prints (the installed distributions' versions, read without importing them; ``not installed``
    for one that is not)."""
    import platform
    from importlib import metadata

    from tracer import __version__

    def of(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (f"tracer {__version__} · torch {of('torch')} · transformers {of('transformers')} · "
            f"Python {platform.python_version()}")


def _store(store: str | None, no_store: bool) -> str:
    """``--store`` and its alias ``--no-store``; the command writes its file unless told not to."""
    if no_store and store not in (None, "none"):
        raise TracerError(f"--no-store and --store {store} contradict each other; give one of them")
    return "none" if no_store else (store or "auto")


def _progress() -> bool | str:
    """A bar in a terminal, log lines otherwise (stderr)."""
    from tracer.report.terminal import err

    return True if err.is_terminal else "lines"


@api_command("run", api.run, ("fmt", "wide", "columns", "all_rows", "report", "no_store"))
def run_cmd(opts: dict[str, Any], fmt: str, wide: bool, columns: str | None, all_rows: bool, report: str | None,
            no_store: bool) -> int:
    """Run a scenario on a model and print the layer-by-layer amplification table."""
    from tracer.progress import DELAY_S, StatusProgress
    from tracer.report.terminal import check_outputs, check_table, err, print_run, write_after, write_run_report

    from tracer.load.prompts import prompt_file_note

    cols = check_table(fmt, columns, wide, all_rows=all_rows)
    check_outputs(report=report, output=opts["output"], overwrite=opts["overwrite"])
    opts["store"] = _store(opts["store"], no_store)
    if (note := prompt_file_note(opts.get("prompt"))) is not None:  # before the run too, not only under the table
        from tracer.report.console import print_fitted

        print_fitted(err, note, len("note: "), label="note:")
    # a spinner in a terminal; piped, a line for every phase still running after DELAY_S seconds
    with StatusProgress("run", mode="auto", delay_s=DELAY_S) as status:
        result = api.run(progress=err.is_terminal, status=status, **opts)
    code = print_run(result, fmt, cols, all_rows, opts["mitigation"])
    if report is not None and result.comparison is not None:  # after the result: a failing write still shows it
        code = write_after(lambda: write_run_report(result, report, opts["overwrite"]), f"report: {report}") or code
    return code


@api_command("audit", api.audit, ("fmt", "report", "no_store"))
def audit_cmd(opts: dict[str, Any], fmt: str, report: str | None, no_store: bool) -> int:
    """Run every level of the determinism hierarchy this machine can run and print the hierarchy table."""
    from tracer.report.terminal import check_outputs, check_table, print_audit

    check_table(fmt, audit=True)
    check_outputs(report=report, output=opts["output"], overwrite=opts["overwrite"])
    opts["store"] = _store(opts["store"], no_store)
    # the plan with each check's cost, then each result as it comes, on stderr
    return print_audit(api.audit(progress=_progress(), **opts), fmt, report, opts["overwrite"])


@api_command("compare", api.compare_trace, ("fmt", "wide", "columns", "all_rows", "report", "overwrite_report"),
          inputs=("path", "reference"))
def compare_cmd(opts: dict[str, Any], fmt: str, wide: bool, columns: str | None, all_rows: bool,
                report: str | None, overwrite_report: bool) -> int:
    """Compare two stored runs (no model needed): TRACE [RUN_A [RUN_B]], or TRACE[:RUN] TRACE2[:RUN]
    for traces made on two machines (a file without :RUN uses the other side's run name, else its first run),
    or TRACE[:RUN] DUMP: an HF reference run against an engine dump (SGLang dumper folder, PassN.pt
    folder, .safetensors/.npz, or a trace written by 'tracer import'), or DUMP_A DUMP_B --reference
    TRACE[:RUN]: two engine dumps (SGLang, Megatron-LM as Miles writes it) against each other."""
    from tracer.progress import phase
    from tracer.report.terminal import check_outputs, check_table, fail_on_exit, print_comparison, write_after

    cols = check_table(fmt, columns, wide, all_rows=all_rows)
    check_outputs(report=report, output=None, overwrite=overwrite_report)  # before any work: nothing is clobbered
    refs = " ".join(str(opts[k]) for k in ("path", "run_a", "run_b") if opts[k] is not None)
    with phase("compare", f"comparing {refs}"):
        comparison = api.compare_trace(**opts)
    print_comparison(comparison, fmt, cols, all_rows, "compare")
    code = fail_on_exit(comparison)
    if report is not None:  # as tracer run: written after the table, and said where
        from tracer.report.html import comparison_html, write_report

        code = write_after(lambda: write_report(comparison_html(comparison), report, overwrite=overwrite_report),
                           f"report: {report}") or code
    return code


@api_command("import", api.import_dump, inputs=("dump", "reference"))
def import_cmd(opts: dict[str, Any]) -> None:
    """Map an engine dump onto an HF reference run's capture points and write it as a trace
    (compare it with 'tracer compare REF.h5:RUN OUTPUT')."""
    from tracer.progress import phase
    from tracer.report.terminal import print_import

    with phase("import", f"mapping {opts['dump']} onto {opts['reference']}"):
        mapped = api.import_dump(**opts)
    print_import(mapped, opts["output"], opts["run_name"])


@api_command("show", api.trace_info, ("show_fmt", "as_json"), inputs=("path",))
def show_cmd(opts: dict[str, Any], show_fmt: str, as_json: bool) -> None:
    """Print a trace's header (the numeric contract) and its runs. It shows traces (.h5) only: an
    engine dump is compared with 'tracer compare REF.h5:RUN DUMP' or made a trace by 'tracer import'."""
    from tracer.progress import phase
    from tracer.report.show import check_show_format, print_trace_info

    fmt = check_show_format(show_fmt, as_json)  # --json does not hide an unknown --format
    with phase("show", f"reading {opts['path']}"):
        info = api.trace_info(**opts)
    print_trace_info(info, opts["path"], fmt)


@api_command("sweep", api.sweep, ("fmt", "plot", "report", "no_store"))
def sweep_cmd(opts: dict[str, Any], fmt: str, plot: str | None, report: str | None, no_store: bool) -> int:
    """Run a scenario for every prompt length (x block size): which lengths diverge, from which layer, how much."""
    from tracer.report.terminal import check_outputs, check_sweep_format, print_sweep

    check_sweep_format(fmt)
    check_outputs(report=report, plot=plot, output=opts["output"], overwrite=opts["overwrite"])
    opts["store"] = _store(opts["store"], no_store)
    return print_sweep(api.sweep(progress=_progress(), **opts), fmt, plot, report, opts["overwrite"])


@api_command("plot", api.plot_file, inputs=("path",))
def plot_cmd(opts: dict[str, Any]) -> None:
    """Draw a figure from a stored trace or sweep file (no model needed)."""
    from tracer.progress import phase
    from tracer.report.terminal import print_path

    with phase("plot", f"drawing {opts['kind'] or 'the figure'} from {opts['path']}"):
        path = api.plot_file(**opts)
    print_path(path, f"the {opts['kind'] + ' ' if opts['kind'] else ''}figure of {opts['path']}")


@api_command("report", api.report_file, inputs=("path",))
def report_cmd(opts: dict[str, Any]) -> None:
    """Write a single-file HTML report (summary, numeric contract, origin, tables, figures; audit matrix or
    sweep map) from a stored trace or sweep file: no model needed, nothing recomputed."""
    from tracer.progress import phase
    from tracer.report.terminal import print_path

    with phase("report", f"writing the HTML report of {opts['path']}"):
        path = api.report_file(**opts)
    print_path(path, f"the HTML report of {opts['path']}")


@api_command("models", api.models)
def models_cmd(opts: dict[str, Any]) -> None:
    """List the built-in model names."""
    from tracer.report.terminal import print_models

    print_models(api.models())


@api_command("help", api.options)
def help_cmd(opts: dict[str, Any]) -> None:
    """Explain one topic's options in full (tracer help scenarios, tracer help rl, ...) or list the topics:
    'tracer run --help' gives each option one line."""
    from tracer.report.terminal import print_options_help

    doc = api.options(**opts)
    if "output" in doc:  # the run options --output/--overwrite, then every command's own output options
        known = {tuple(o["flags"]) for o in doc["output"]["options"]}
        doc["output"]["options"] += [o for o in render_options() if tuple(o["flags"]) not in known]
    print_options_help(doc, opts["topic"])


@api_command("bench", api.bench, ("fmt", "as_json"))
def bench_cmd(opts: dict[str, Any], fmt: str, as_json: bool) -> None:
    """Measure tracer's overhead over the bare forward pass and its I/O against the disk, side by
    side with peers doing the same comparison: HF output_hidden_states, naive forward hooks +
    .cpu(), and nnsight .save() when installed (the 'peers' extra). The bench refuses
    to report when a peer's per-layer differing counts are not tracer's. On a CPU the
    defaults (N = 1024, 5 repetitions of every mode) take many minutes: start with
    --length 128 --reps 3."""
    from tracer.progress import StatusProgress
    from tracer.report.terminal import check_bench_format, print_bench

    fmt = check_bench_format(fmt, as_json)  # before the bench runs
    with StatusProgress("bench", mode="auto") as status:
        result = api.bench(progress=status, **opts)
    print_bench(result, fmt)


def close_options(given: str, options: list[str], cutoff: float = 0.6) -> list[str]:
    """The options of ``options`` that ``given`` (an unknown ``--flag``) is plausibly a misspelling of,
    closest first (at most 3): compared without the dashes (``--frobnicate`` is not close to
    ``--format``: click's own guess compares the dashes too), or ``given`` the start of one."""
    import difflib

    def bare(flag: str) -> str:
        return flag.lstrip("-").split("=")[0]

    word = bare(given)
    longs = sorted({o for o in options if o.startswith("--")})
    scored = [(difflib.SequenceMatcher(None, word, bare(o)).ratio(), o) for o in longs]
    scored = [(1.0 if word and bare(o).startswith(word) and len(word) >= 3 else r, o) for r, o in scored]
    good = sorted((t for t in scored if t[0] >= cutoff), key=lambda t: (-t[0], t[1]))
    return [o for r, o in good if r >= good[0][0] - 0.1][:3] if good else []


def command() -> None:
    """Entry point of the ``tracer`` console script and of ``python -m tracer``: :func:`main` as the
    whole process (``standalone``)."""
    main(standalone=True)


def _file_id(fd: int) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of what descriptor ``fd`` points at; None where it is closed."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _reader_gone(stdout_before: tuple[Any, tuple[int, int] | None]) -> bool:
    """Whether an exit 1 came from click or rich meeting a closed stdout (``tracer --help | head -1``,
    a print of ``--format json``): click put its ``PacifyFlushWrapper`` in ``sys.stdout``, or rich
    pointed descriptor 1 at ``os.devnull``, neither so when the command began (``stdout_before``:
    ``sys.stdout`` and :func:`_file_id` of descriptor 1 then)."""
    if sys.stdout is not stdout_before[0] and type(sys.stdout).__name__ == "PacifyFlushWrapper":
        return True
    try:
        st = os.stat(os.devnull)
    except OSError:
        return False
    null = (st.st_dev, st.st_ino)
    return _file_id(1) == null != stdout_before[1]


def main(standalone: bool = False) -> None:
    """Run one ``tracer`` command from ``sys.argv``; exits with its code (``SystemExit``).

    ``standalone``: this process is the command (:func:`command`): a watchdog backs up its signal
    handling (:mod:`tracer.watchdog`), and a terminated or interrupted command ends the process at
    once (``os._exit`` after the exit hooks) instead of raising ``SystemExit``. Without it (a
    program calling ``main()`` for several commands in one process) the process is left as it was.

    Exit codes: 0 identical / within tolerance / report only, 1 diverged (failed ``--fail-on``),
    2 bad input or corrupt file, 3 internal error (one line; the traceback with
    ``TRACER_DEBUG=1``), 130 interrupted, 143 terminated (SIGTERM; 129 SIGHUP), after the same clean-up;
    137 (killed) when a signal found the command inside native code that did not return within
    :data:`tracer.watchdog.GRACE_S` seconds (:mod:`tracer.watchdog`, partial files removed).
    """
    from tracer.load.offline import ensure_offline
    from tracer.report.terminal import err, print_error, print_internal_error

    ensure_offline()  # before anything imports huggingface_hub (no network unless TRACER_ALLOW_NETWORK=1)
    from tracer.errors import raise_on_termination, terminated_by

    from tracer import watchdog

    restore_signals()  # main() called again in one process: the last command's exit-time handlers go
    # SIGTERM/SIGHUP clean up like Ctrl-C: partials, scratch folders, ranks; each handler tells the watchdog
    raise_on_termination(on_signal=watchdog.ack if standalone else None)
    if standalone:
        watchdog.start()  # the backstop: a command stuck in native code (holding the GIL) still ends on a signal
        dump_on_crash()
    stdout_before = (sys.stdout, _file_id(1))
    try:  # typer >= 0.24 carries its own copy of click
        from typer._click import exceptions as click_errors
    except ImportError:  # pragma: no cover - older typer: click itself
        from click import exceptions as click_errors

    if sys.argv[1:] == ["--version"]:  # no command: what a bug report needs first
        print(versions())
        sys.exit(0)
    from tracer.errors import cli_wording

    try:
        with cli_wording():  # messages name options as flags (--device cpu), not as the API's keywords
            code = app(standalone_mode=False)  # click's usage errors come here: one line, not a usage box
    except click_errors.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "tracer"
        message = e.format_message()
        positional = [p.name.upper() for p in (e.ctx.command.params if e.ctx is not None else ())
                      if p.param_type_name == "argument" and p.name]
        if isinstance(e, click_errors.NoSuchOption) and e.option_name.lstrip("-").upper() in positional:
            # a positional argument given as an option: say so instead of guessing options
            message = (f"No such option: {e.option_name}; {e.option_name.lstrip('-').upper()} is positional: "
                       f"{where} {' '.join(positional)} ...")
        elif isinstance(e, click_errors.NoSuchOption) and e.ctx is not None:
            close = close_options(e.option_name, [o for p in e.ctx.command.params for o in (*p.opts, *p.secondary_opts)])
            message = f"No such option: {e.option_name}" + (f" (did you mean {' or '.join(close)}?)" if close else "")
        print_error(f"{message} (see '{where} --help')")
        sys.exit(EXIT_ERROR)
    except typer.Abort:  # click turns KeyboardInterrupt (and so Terminated) into Abort
        exit_interrupted(standalone)
    except click_errors.ClickException as e:  # pragma: no cover - other click errors: one line too
        print_error(e.format_message())
        sys.exit(e.exit_code or EXIT_ERROR)
    except TracerError as e:  # pragma: no cover - commands catch their own
        print_error(str(e))
        sys.exit(EXIT_ERROR)
    except (KeyboardInterrupt, SystemExit) as e:
        if isinstance(e, SystemExit) and terminated_by() is None:
            if e.code == 1 and _reader_gone(stdout_before):  # click's or rich's exit 1 says "diverged"
                exit_broken_pipe()
            raise
        exit_interrupted(standalone)
    except BrokenPipeError:  # stdout's reader went away where click did not catch it itself (above: its exit 1)
        exit_broken_pipe()
    except Exception as e:  # noqa: BLE001 - a bug: one line and code 3, never the code of "diverged"
        from tracer.errors import interrupted_in

        if interrupted_in(e):  # an interrupt that library code turned into another error
            exit_interrupted(standalone)
        if os.environ.get("TRACER_DEBUG") == "1":
            raise SystemExit(debug_exit()) from None
        print_internal_error(e)
        sys.exit(EXIT_INTERNAL)
    if terminated_by() is not None or code == 130:  # typer returns 130 for an interrupt it caught
        exit_interrupted(standalone)
    quiet_exit_on_signals()
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # python -m tracer.cli, as python -m tracer
    command()
