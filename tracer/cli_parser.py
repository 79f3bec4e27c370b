"""How an API function becomes a ``tracer`` command: its options, their help and panels, the parser.

:func:`api_command` registers ``tracer NAME`` on :data:`app` from the API function's signature:
the run options from :data:`tracer.config.OPTIONS` (help, type, flags), the function's own
parameters from its signature (default, type) and its docstring's ``Args:`` (help)
(:func:`cli_parameters`); the command line adds only how the result is printed or saved
(:data:`RENDER`). The parser refuses an option given twice (:class:`_Command`). The commands
themselves, and the process around them, are :mod:`tracer.cli`.
"""

from __future__ import annotations

import inspect
import re
import typing
from typing import Annotated, Any, Callable, Optional

import typer
from rich.markup import escape

from tracer.config import OPTIONS, cli_type
from tracer.config_help import PANELS
from tracer.errors import EXIT_ERROR, TracerError


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


#: the render options (:data:`RENDER`) of each command, as :func:`api_command` registered them
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


def api_command(name: str, fn: Callable[..., Any], render: tuple[str, ...] = (),
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
