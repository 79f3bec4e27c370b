"""The ``tracer`` command: every command parses, makes one :mod:`tracer.api` call, renders.

No option is written here. Each command is built from its API function (:func:`_command`): the
run options come from :data:`tracer.config.OPTIONS` (help, type, flags), the function's own
parameters from its signature (default, type) and its docstring's ``Args:`` (help); the command
line adds only how the result is printed or saved (:data:`RENDER`: ``--format``, ``--report``,
...). So ``tracer run --help`` and ``help(tracer.run)`` list one set of options, worded once.
Rendering lives in :mod:`tracer.report.terminal` and :mod:`tracer.report.show`.

Bad input prints one line to stderr and exits with code 2 (no traceback), checked before any
model loads; nothing on disk is touched.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import typing
from typing import Annotated, Any, Callable, Optional

import typer
from rich.markup import escape

from tracer import api
from tracer.config import OPTIONS, cli_type
from tracer.config_help import PANELS
from tracer.errors import EXIT_ERROR, EXIT_INTERNAL, TracerError

class _HelpWithoutType:
    """click's ``--help`` option shown as the flag it is: typer's help listed it as ``--help <bool>``."""

    def get_help_option(self, ctx: Any) -> Any:
        opt = super().get_help_option(ctx)  # type: ignore[misc]
        if opt is not None:
            opt.metavar = ""
        return opt


class _Command(_HelpWithoutType, typer.core.TyperCommand):
    """Every ``tracer`` command (:class:`_HelpWithoutType`); an option given twice is refused
    (:meth:`parse_args`)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        """click's parsing, after refusing an option that takes one value given more than once (click
        keeps the last one without a word: ``--producer block_size=64 --producer dtype=float32`` would
        run with the dtype alone).

        Raises:
            click's UsageError: one line naming the option (``tracer`` prints it, exit 2).
        """
        if not ctx.resilient_parsing:
            _, _, order = self.make_parser(ctx).parse_args(args=list(args))
            seen: set[str] = set()
            for param in order:
                if getattr(param, "multiple", True) or getattr(param, "count", False) or param.is_eager:
                    continue
                if param.name in seen:
                    flag = max(param.opts, key=len)
                    ctx.fail(f"{flag} given twice: give it once (tracer would keep only the last)")
                seen.add(param.name)
        return super().parse_args(ctx, args)


class _Group(_HelpWithoutType, typer.core.TyperGroup):
    """``tracer`` itself (:class:`_HelpWithoutType`)."""


app = typer.Typer(
    name="tracer",
    cls=_Group,
    help="Layer-by-layer numeric divergence tracer for transformer inference.\n\n"
    "Runs one prompt two ways that a correct engine treats as equivalent (e.g. cache miss vs "
    "cache hit), captures every layer bit-exact into an HDF5 trace, and prints where and how "
    "much the runs diverge.\n\n"
    "tracer --version prints the versions of tracer, torch, transformers and Python.",
    no_args_is_help=False,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

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


#: how a command prints or saves its result (the API returns the result instead): name -> (type,
#: default, flags, help); ``no_store`` is the command line's spelling of ``--store none``
RENDER: dict[str, tuple[type, Any, tuple[str, ...], str]] = {
    "fmt": (str, "table", ("--format", "-f"), "table (default), json, csv, markdown"),
    "wide": (bool, False, ("--wide",), "table: every metric column (cosine, SQNR, ...)"),
    "columns": (str, None, ("--columns",), "table: these columns, e.g. diff,max_abs,ulp,sqnr"),
    "all_rows": (bool, False, ("--all-rows",), "table: every capture point, not the rows that matter"),
    "report": (str, None, ("--report",), "also write a single-file HTML report (.html)"),
    "plot": (str, None, ("--plot",), "also write the divergence map (.png/.svg/.pdf)"),
    "as_json": (bool, False, ("--json",), "print the result as JSON (same as --format json)"),
    "show_fmt": (str, "table", ("--format", "-f"), "table (key/value lines, default) or json"),
    "no_store": (bool, False, ("--no-store",), "write no file (same as --store none)"),
    "overwrite_report": (bool, False, ("--overwrite",), "replace an existing --report file"),
}
#: command-line spellings other than ``--name`` of the API functions' own parameters
FLAGS = {"engine_map": ("--map",), "run_name": ("--run",), "reference": ("--reference", "-r"),
         "output": ("--output", "-o"), "kind": ("--kind", "-k"), "levels": ("--levels", "-l"),
         "lengths": ("--lengths", "-l")}
#: what a command line cannot carry: a loaded model, callbacks, progress displays (the CLI chooses them)
IN_PROCESS = ("loaded", "progress", "status", "on_check", "on_row", "on_point")
METAVARS = {"model": "MODEL", "path": "TRACE", "run_a": "RUN_A", "run_b": "RUN_B", "dump": "DUMP"}


def _doc_args(fn: Callable[..., Any]) -> dict[str, str]:
    """The ``Args:`` entries of ``fn``'s docstring, as one-line help texts (RST roles stripped)."""
    out: dict[str, str] = {}
    lines = inspect.getdoc(fn).splitlines() if fn.__doc__ else []
    names: list[str] = []
    inside = False
    for line in lines:
        if line.strip() == "Args:":
            inside = True
            continue
        if inside and line and not line.startswith(" "):
            break
        m = re.match(r"^    (\w+(?:, \w+)*): (.*)$", line)
        if inside and m:
            names = m.group(1).split(", ")
            for n in names:
                out[n] = m.group(2)
        elif inside and line.startswith("        ") and names:
            for n in names:
                out[n] += " " + line.strip()
    clean = {k: re.sub(r":\w+:`~?([^`]+)`", r"\1", v).replace("``", "") for k, v in out.items()}
    return {k: v + ("" if v.endswith(".") else ".") for k, v in clean.items()}


def _int_list(param: typer.CallbackParam, value: str | None) -> tuple[int, ...] | None:
    """A comma-separated list of integers (``--token-ids 1,2,3``, ``--block-sizes 16,64``).

    Raises:
        TracerError: another value (one line and exit 2, as every input error; not click's framed box).
    """
    if value is None:
        return None
    try:
        return tuple(int(x) for x in value.split(",") if x.strip())
    except ValueError:
        example = "1,2,3" if param.name == "token_ids" else "16,64"
        raise TracerError(f"{param.opts[0]} {value!r} is not a list of integers such as {example}") from None


def _flags(name: str, kind: type, default: Any) -> tuple[str, ...]:
    flags = FLAGS.get(name) or (OPTIONS[name].flags if name in OPTIONS else ("--" + name.replace("_", "-"),))
    if kind is bool and default is True and "/" not in flags[0]:
        flags = (f"{flags[0]}/--no-{flags[0][2:]}", *flags[1:])  # on by default: the off switch
    return flags


def _hint(fn: Callable[..., Any], annotation: Any) -> Any:
    """A parameter's annotation evaluated in ``fn``'s module; a type named only for type checkers
    (``LoadedModel``, a ``TYPE_CHECKING`` import) reads as ``str``: the command line passes text."""
    if not isinstance(annotation, str):
        return str if annotation is inspect.Parameter.empty else annotation
    try:
        return eval(annotation, fn.__globals__)  # noqa: S307 - our own annotations
    except (NameError, TypeError):
        return str


#: the render options (:data:`RENDER`) of each command, as :func:`_command` registered them
RENDERED: dict[str, tuple[str, ...]] = {}


def render_options() -> list[dict[str, Any]]:
    """The command line's own output options (:data:`RENDER`) as ``tracer help output`` lists them:
    ``{"name", "flags", "brief", "help"}`` each, the help naming the commands that take it; options
    with the same flags (``--overwrite``; ``--format``, whose values differ by command) are one entry."""
    out: dict[tuple[str, ...], dict[str, Any]] = {}
    for name, (_, _, flags, help_) in RENDER.items():
        commands = [c for c, names in RENDERED.items() if name in names]
        if not commands:
            continue
        entry = out.setdefault(flags, {"name": name, "flags": list(flags), "brief": help_, "uses": {}})
        cmds = entry["uses"].setdefault(help_, [])
        cmds += [c for c in commands if c not in cmds]
    return [{**{k: v for k, v in e.items() if k != "uses"},
             "help": "; ".join(f"{brief}; in tracer {', '.join(cmds)}" if len(e["uses"]) == 1
                               else f"in tracer {', '.join(cmds)}: {brief}" for brief, cmds in e["uses"].items())}
            for e in out.values()]


#: the panel of the command line's own options (:data:`RENDER`) in ``--help``
OUTPUT_PANEL = PANELS["output"][0]


def _panel_rank(title: str, name: str) -> tuple[int, int]:
    """Where option ``name`` of panel ``title`` comes in ``--help``: a command's own panel first (its
    name: ``Sweep``), then :data:`tracer.config_help.PANELS` in order, each in its declared order."""
    titles = [t for t, _ in PANELS.values()]
    if title not in titles:
        return 0, 0
    keys = next(k for t, k in PANELS.values() if t == title)
    return titles.index(title) + 1, keys.index(name) if name in keys else len(keys)


def cli_parameters(fn: Callable[..., Any], render: tuple[str, ...] = (), command: str = "") -> list[inspect.Parameter]:
    """The command-line parameters of API function ``fn`` (and of the ``render`` options), as typer
    reads them: ``Annotated[type, typer.Option(flags, help=..., rich_help_panel=...)]`` with the API's
    default. A run option has its one-line ``brief`` and its ``panel`` (:data:`tracer.config.OPTIONS`),
    a render option the panel ``Output``, an option of ``fn``'s own (documented in its docstring) the
    panel named after the ``command`` (``Sweep``); the parameters come panel by panel, so the panels
    print in that order."""
    doc = _doc_args(fn)
    hints = {p.name: _hint(fn, p.annotation) for p in inspect.signature(fn).parameters.values()}
    own = command.capitalize()
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.name in IN_PROCESS or p.kind == p.VAR_KEYWORD:
            continue
        opt = OPTIONS.get(p.name)
        kind = opt.type if opt is not None else cli_type(hints.get(p.name, str))
        parse = {"callback": _int_list} if kind is tuple else {}
        kind = str if kind is tuple else kind
        ours = opt is not None and (p.name not in doc or p.name == "model")  # OPTIONS' words, else the docstring's
        help_ = opt.brief if ours else doc.get(p.name, "")
        help_ = escape(help_)  # rich markup is on for the help: an install hint's '.[extra]' must not read as a style tag
        panel = opt.panel if opt is not None else own
        default = ... if p.default is p.empty else p.default
        if p.name == "store":
            default = None  # the command writes a trace by default (store auto), a library call only when asked
        if p.kind == p.POSITIONAL_OR_KEYWORD and p.name not in FLAGS:
            info = typer.Argument(help=help_, metavar=METAVARS.get(p.name, p.name.upper()))
        else:
            info = typer.Option(*_flags(p.name, kind, default), help=help_, rich_help_panel=panel,
                                show_default=not ours, metavar="" if kind is bool else None, **parse)
        annotation = Annotated[kind if default is ... else Optional[kind], info]
        out.append(inspect.Parameter(p.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
    for name in render:
        kind, default, flags, help_ = RENDER[name]
        out.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                     annotation=Annotated[Optional[kind], typer.Option(
                                         *flags, help=escape(help_), rich_help_panel=OUTPUT_PANEL, show_default=False,
                                         metavar="" if kind is bool else None)]))
    return sorted(out, key=lambda q: _panel_rank(typing.get_args(q.annotation)[1].rich_help_panel or own, q.name))


def _command(name: str, fn: Callable[..., Any], render: tuple[str, ...] = (),
             inputs: tuple[str, ...] = ()) -> Callable[..., Any]:
    """Register ``tracer NAME`` with ``fn``'s parameters plus ``render``: the decorated body gets the
    API's keyword arguments as one dict, the render options as keywords, and returns the exit code.
    ``inputs``: the parameters naming input files or folders (``PATH`` or ``PATH:RUN``), refused in one
    line before the body runs (so before torch is imported) when they do not exist."""
    RENDERED[name] = render

    def register(body: Callable[..., int | None]) -> Callable[..., int | None]:
        def callback(**given: Any) -> None:
            view = {k: given.pop(k) for k in render}
            try:
                if inputs:
                    from tracer.files import check_exists

                    for spec in (given[k] for k in inputs if given.get(k) is not None):
                        check_exists(spec, "input")
                code = body(given, **view)
            except TracerError as e:
                from tracer.report.terminal import print_error

                print_error(str(e))
                raise typer.Exit(EXIT_ERROR) from None
            if code:
                raise typer.Exit(code)

        callback.__signature__ = inspect.Signature(cli_parameters(fn, render, name))  # type: ignore[attr-defined]
        # one paragraph per blank line: the command list of 'tracer --help' keeps a docstring's line breaks
        callback.__doc__ = escape(re.sub(r"(?<!\n)\n(?!\n)", " ", inspect.cleandoc(body.__doc__ or "")))
        callback.__name__ = body.__name__
        app.command(name, cls=_Command)(callback)
        return body
    return register


def _store(store: str | None, no_store: bool) -> str:
    """``--store`` and its alias ``--no-store``; the command writes its file unless told not to."""
    if no_store and store not in (None, "none"):
        raise TracerError(f"--no-store and --store {store} contradict each other; give one of them")
    return "none" if no_store else (store or "auto")


def _progress() -> bool | str:
    """A bar in a terminal, log lines otherwise (stderr)."""
    from tracer.report.terminal import err

    return True if err.is_terminal else "lines"


@_command("run", api.run, ("fmt", "wide", "columns", "all_rows", "report", "no_store"))
def run_cmd(opts: dict[str, Any], fmt: str, wide: bool, columns: str | None, all_rows: bool, report: str | None,
            no_store: bool) -> int:
    """Run a scenario on a model and print the layer-by-layer amplification table."""
    from tracer.progress import DELAY_S, StatusProgress
    from tracer.report.terminal import check_outputs, check_table, err, print_run, write_after, write_run_report

    from tracer.load.prompts import prompt_file_note

    cols = check_table(fmt, columns, wide)
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


@_command("audit", api.audit, ("fmt", "report", "no_store"))
def audit_cmd(opts: dict[str, Any], fmt: str, report: str | None, no_store: bool) -> int:
    """Run every level of the determinism hierarchy this machine can run and print the hierarchy table."""
    from tracer.report.terminal import check_outputs, check_table, print_audit

    check_table(fmt, audit=True)
    check_outputs(report=report, output=opts["output"], overwrite=opts["overwrite"])
    opts["store"] = _store(opts["store"], no_store)
    # the plan with each check's cost, then each result as it comes, on stderr
    return print_audit(api.audit(progress=_progress(), **opts), fmt, report, opts["overwrite"])


@_command("compare", api.compare_trace, ("fmt", "wide", "columns", "all_rows", "report", "overwrite_report"),
          inputs=("path", "reference"))
def compare_cmd(opts: dict[str, Any], fmt: str, wide: bool, columns: str | None, all_rows: bool,
                report: str | None, overwrite_report: bool) -> int:
    """Compare two stored runs (no model needed): TRACE [RUN_A [RUN_B]], or TRACE[:RUN] TRACE2[:RUN]
    for traces made on two machines (a file without :RUN uses the other side's run name, else its first run),
    or TRACE[:RUN] DUMP: an HF reference run against an engine dump (SGLang dumper folder, PassN.pt
    folder, .safetensors/.npz, or a trace written by 'tracer import'), or DUMP_A DUMP_B --reference
    TRACE[:RUN]: two engine dumps (SGLang, Megatron-LM as Miles writes it) against each other."""
    from tracer.progress import phase
    from tracer.report.terminal import check_outputs, check_table, fail_on_exit, print_comparison

    cols = check_table(fmt, columns, wide)
    check_outputs(report=report, output=None, overwrite=overwrite_report)  # before any work: nothing is clobbered
    refs = " ".join(str(opts[k]) for k in ("path", "run_a", "run_b") if opts[k] is not None)
    with phase("compare", f"comparing {refs}"):
        comparison = api.compare_trace(**opts)
    if report is not None:
        from tracer.report.html import comparison_html, write_report

        write_report(comparison_html(comparison), report, overwrite=overwrite_report)
    print_comparison(comparison, fmt, cols, all_rows, "compare")
    return fail_on_exit(comparison)


@_command("import", api.import_dump, inputs=("dump", "reference"))
def import_cmd(opts: dict[str, Any]) -> None:
    """Map an engine dump onto an HF reference run's capture points and write it as a trace
    (compare it with 'tracer compare REF.h5:RUN OUTPUT')."""
    from tracer.progress import phase
    from tracer.report.terminal import print_import

    with phase("import", f"mapping {opts['dump']} onto {opts['reference']}"):
        mapped = api.import_dump(**opts)
    print_import(mapped, opts["output"], opts["run_name"])


@_command("show", api.trace_info, ("show_fmt", "as_json"), inputs=("path",))
def show_cmd(opts: dict[str, Any], show_fmt: str, as_json: bool) -> None:
    """Print a trace's header (the numeric contract) and its runs. It shows traces (.h5) only: an
    engine dump is compared with 'tracer compare REF.h5:RUN DUMP' or made a trace by 'tracer import'."""
    from tracer.progress import phase
    from tracer.report.show import check_show_format, print_trace_info

    fmt = "json" if as_json else check_show_format(show_fmt)
    with phase("show", f"reading {opts['path']}"):
        info = api.trace_info(**opts)
    print_trace_info(info, opts["path"], fmt)


@_command("sweep", api.sweep, ("fmt", "plot", "report", "no_store"))
def sweep_cmd(opts: dict[str, Any], fmt: str, plot: str | None, report: str | None, no_store: bool) -> int:
    """Run a scenario for every prompt length (x block size): which lengths diverge, from which layer, how much."""
    from tracer.report.terminal import check_outputs, check_sweep_format, print_sweep

    check_sweep_format(fmt)
    check_outputs(report=report, plot=plot, output=opts["output"], overwrite=opts["overwrite"])
    opts["store"] = _store(opts["store"], no_store)
    return print_sweep(api.sweep(progress=_progress(), **opts), fmt, plot, report, opts["overwrite"])


@_command("plot", api.plot_file, inputs=("path",))
def plot_cmd(opts: dict[str, Any]) -> None:
    """Draw a figure from a stored trace or sweep file (no model needed)."""
    from tracer.progress import phase
    from tracer.report.terminal import print_path

    with phase("plot", f"drawing {opts['kind'] or 'the figure'} from {opts['path']}"):
        path = api.plot_file(**opts)
    print_path(path, f"the {opts['kind'] + ' ' if opts['kind'] else ''}figure of {opts['path']}")


@_command("report", api.report_file, inputs=("path",))
def report_cmd(opts: dict[str, Any]) -> None:
    """Write a single-file HTML report (summary, numeric contract, origin, tables, figures; audit matrix or
    sweep map) from a stored trace or sweep file: no model needed, nothing recomputed."""
    from tracer.progress import phase
    from tracer.report.terminal import print_path

    with phase("report", f"writing the HTML report of {opts['path']}"):
        path = api.report_file(**opts)
    print_path(path, f"the HTML report of {opts['path']}")


@_command("models", api.models)
def models_cmd(opts: dict[str, Any]) -> None:
    """List the built-in model names."""
    from tracer.report.terminal import print_models

    print_models(api.models())


@_command("help", api.options)
def help_cmd(opts: dict[str, Any]) -> None:
    """Explain one topic's options in full (tracer help scenarios, tracer help rl, ...) or list the topics:
    'tracer run --help' gives each option one line."""
    from tracer.report.terminal import print_options_help

    doc = api.options(**opts)
    if "output" in doc:  # the run options --output/--overwrite, then every command's own output options
        known = {tuple(o["flags"]) for o in doc["output"]["options"]}
        doc["output"]["options"] += [o for o in render_options() if tuple(o["flags"]) not in known]
    print_options_help(doc, opts["topic"])


@_command("bench", api.bench, ("fmt", "as_json"))
def bench_cmd(opts: dict[str, Any], fmt: str, as_json: bool) -> None:
    """Measure tracer's overhead over the bare forward pass and its I/O against the disk, side by
    side with peers doing the same comparison: HF output_hidden_states, naive forward hooks +
    .cpu(), and nnsight .save() when installed (the 'peers' extra). The bench refuses
    to report when a peer's per-layer differing counts are not tracer's."""
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

    _restore_signals()  # main() called again in one process: the last command's exit-time handlers go
    # SIGTERM/SIGHUP clean up like Ctrl-C: partials, scratch folders, ranks; each handler tells the watchdog
    raise_on_termination(on_signal=watchdog.ack if standalone else None)
    if standalone:
        watchdog.start()  # the backstop: a command stuck in native code (holding the GIL) still ends on a signal
        _dump_on_crash()
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
        _exit_interrupted(standalone)
    except click_errors.ClickException as e:  # pragma: no cover - other click errors: one line too
        print_error(e.format_message())
        sys.exit(e.exit_code or EXIT_ERROR)
    except TracerError as e:  # pragma: no cover - commands catch their own
        print_error(str(e))
        sys.exit(EXIT_ERROR)
    except (KeyboardInterrupt, SystemExit) as e:
        if isinstance(e, SystemExit) and terminated_by() is None:
            raise
        _exit_interrupted(standalone)
    except Exception as e:  # noqa: BLE001 - a bug: one line and code 3, never the code of "diverged"
        from tracer.errors import interrupted_in

        if interrupted_in(e):  # an interrupt that library code turned into another error
            _exit_interrupted(standalone)
        if os.environ.get("TRACER_DEBUG") == "1":
            raise SystemExit(_debug_exit()) from None
        print_internal_error(e)
        sys.exit(EXIT_INTERNAL)
    if terminated_by() is not None or code == 130:  # typer returns 130 for an interrupt it caught
        _exit_interrupted(standalone)
    _quiet_exit_on_signals()
    sys.exit(code if isinstance(code, int) else 0)


def _dump_on_crash() -> None:
    """A crash in native code (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) prints every thread's Python
    stack to stderr before the process dies of it (:mod:`faulthandler`; the exit status stays the
    signal's): a rare crash (a run once ended with SIGSEGV instead of exit 130 after Ctrl-C, under
    load, and did not recur in 20 runs) leaves the stacks that locate it."""
    import faulthandler

    if not faulthandler.is_enabled():
        try:
            faulthandler.enable(file=sys.stderr, all_threads=True)
        except (ValueError, OSError, AttributeError):  # stderr without a file descriptor (captured in-process)
            pass


def _quiet_exit_on_signals() -> None:
    """The command is done (result printed, files written and renamed): a Ctrl-C or SIGTERM that
    comes while Python shuts down (an in-process engine's exit hook takes seconds) ends the
    process at once with 130 / 128 + signum and one line, instead of a traceback from that hook."""
    import signal

    def now(signum: int, _frame: object) -> None:
        sys.stdout.flush()
        os.write(2, b"interrupted while exiting (the command had finished)\n")
        os._exit(130 if signum == signal.SIGINT else 128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            try:
                _BEFORE_EXIT.setdefault(sig, signal.signal(sig, now))
            except (ValueError, OSError):  # not the main thread
                pass


#: the handlers :func:`_quiet_exit_on_signals` replaced, for a later main() in the same process
_BEFORE_EXIT: dict[int, Any] = {}


def _restore_signals() -> None:
    """Put back the handlers :func:`_quiet_exit_on_signals` replaced: a command run in the same process
    after another (``main()`` called again) cleans up on Ctrl-C instead of ending the process at once."""
    import signal

    while _BEFORE_EXIT:
        sig, old = _BEFORE_EXIT.popitem()
        try:
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        except (ValueError, OSError):  # pragma: no cover - not the main thread
            pass


def _exit_interrupted(standalone: bool = True) -> None:
    """Exit 128 + signum after SIGTERM/SIGHUP ("terminated"), else 130 after Ctrl-C ("interrupted");
    a terminated command that is not the whole process (``standalone`` False) raises ``SystemExit``."""
    from tracer.errors import terminated_by
    from tracer.report.terminal import err

    signum = terminated_by()
    if signum is not None:  # the signal decides, whatever click or typer made of the interrupt
        err.print("terminated", highlight=False)
        if not standalone:
            sys.exit(128 + signum)
    else:
        err.print("interrupted")
    # Not sys.exit: when the KeyboardInterrupt passed through code that CPython ran as a string
    # (PyRun_*), the interpreter remembers it as unhandled and kills itself with SIGINT at exit
    # (exit -2, about 1 run in 10 here) although it was handled; and a terminated command must end
    # within seconds, while the interpreter's last garbage collection of a large comparison took 3 s
    # (30 s on a loaded machine). Every finally block has run: the exit hooks run, then the exit.
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(130 if signum is None else 128 + signum)


def _debug_exit() -> int:
    import traceback

    traceback.print_exc()
    return EXIT_INTERNAL
