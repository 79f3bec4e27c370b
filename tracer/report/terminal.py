"""What each ``tracer`` command prints and saves once its one API call has returned.

The command line (:mod:`tracer.cli`) parses, calls :mod:`tracer.api` once and hands the result
here: the report on stdout (styled in a terminal, plain when piped), notes and the ``--fail-on``
reason on stderr, and the files asked for (``--report`` HTML, ``--plot`` figures). The output
paths are checked before the API call (:func:`check_outputs`), so nothing runs for a file that
cannot be written.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from rich.console import Console
from rich.text import Text

from tracer.errors import EXIT_DIVERGED, EXIT_ERROR, TracerError
from tracer.store.budget import format_size
from tracer.report.textsafe import printable

err = Console(stderr=True)


def print_error(message: str) -> None:
    """``error: MESSAGE`` on stderr: one line (in a terminal broken between words, continuations under
    the message), no markup, control characters escaped (it may quote file names)."""
    from tracer.report.console import print_fitted

    print_fitted(err, printable(message), len("error: "), label=Text("error:", style="bold red"))


def print_internal_error(e: BaseException) -> None:
    """A tracer bug in one line on stderr (``TRACER_DEBUG=1`` prints the traceback instead)."""
    from tracer.report.console import print_fitted

    first = (str(e).splitlines() or [""])[0][:200]
    print_fitted(err, f"{type(e).__name__}: {printable(first)} (a tracer bug; set TRACER_DEBUG=1 for the traceback "
                      "and report it)", 4, label=Text("internal error:"))


def check_outputs(*, report: str | None = None, plot: str | None = None, output: str | None = None,
                  overwrite: bool = False) -> None:
    """Refuse a ``--report``/``--plot`` path that cannot be written, before anything runs.

    Raises:
        TracerError: the report is the trace's ``--output`` too, a bad suffix, an existing file
            without ``overwrite``, an unwritable folder.
    """
    if report is not None:
        from tracer.report.outputs import check_report_path

        if output is not None and os.path.abspath(report) == os.path.abspath(output):
            raise TracerError(f"--report {report} is the trace's --output too; give the report another name "
                              "(e.g. .html beside the .h5)")
        check_report_path(report, overwrite)
    if plot is not None:
        from tracer.report.outputs import check_figure_path

        check_figure_path(plot, overwrite)


def check_table(fmt: str, columns: str | None = None, wide: bool = False, audit: bool = False,
                all_rows: bool = False) -> tuple[str, ...]:
    """The table columns of a comparison report, checked with the format (one of
    :data:`tracer.report.layout.FORMATS`, which every result renders: :mod:`tracer.report.render`)
    before anything runs; ``audit``: an audit's report (its table has no column options).

    Raises:
        TracerError: unknown format or column; ``--wide``, ``--columns`` or ``--all-rows`` with a
            format other than ``table`` (json, csv and markdown hold every column and row: the
            option would do nothing).
    """
    from tracer.report.layout import check_columns, check_format

    check_format(fmt)
    given = [flag for flag, on in (("--wide", wide), ("--columns", columns is not None), ("--all-rows", all_rows)) if on]
    if given and fmt != "table":
        raise TracerError(f"{given[0]} picks the table's columns or rows, but --format {fmt} holds every column and "
                          f"row: drop {given[0]}, or use --format table")
    return check_columns(columns, wide)


def print_comparison(comparison: Any, fmt: str = "table", columns: tuple[str, ...] | None = None,
                     all_rows: bool = False, command: str = "run") -> None:
    """Render a comparison on stdout: styled in a terminal; piped, ``$COLUMNS`` or 120 wide with every
    asked-for column kept; its suggestions valid for the ``tracer`` ``command`` that prints it."""
    from tracer.report.console import stdout_console
    from tracer.report.layout import DEFAULT_COLUMNS
    from tracer.report.render import render

    console = stdout_console(explicit_columns=columns is not None and columns != DEFAULT_COLUMNS)
    text = render(comparison, fmt, console, columns=columns or DEFAULT_COLUMNS, all_rows=all_rows, command=command)
    if text is not None:
        text = printable(text, newlines=True)  # csv/markdown quote names from the trace
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def fail_on_exit(comparison: Any) -> int:
    """The exit code of the comparison's own ``--fail-on`` rule (the JSON's ``check``): 0, or
    :data:`~tracer.errors.EXIT_DIVERGED` with the reason on stderr."""
    failed, reason = comparison.check()
    if not failed:
        return 0
    from tracer.report.console import print_fitted

    print_fitted(err, f"fail-on {comparison.fail_on}: {printable(reason)}", 4)
    return EXIT_DIVERGED


def write_after(write: Callable[[], Any], done: str) -> int:
    """Write an output once the result has been printed: ``done`` on stderr, or, when the write
    fails (full disk, a folder made read-only meanwhile), the usual one-line error; returns the
    exit code (0, or :data:`~tracer.errors.EXIT_ERROR`)."""
    try:
        write()
    except TracerError as e:
        print_error(str(e))
        return EXIT_ERROR
    err.print(done, highlight=False)
    return 0


def write_run_report(result: Any, report: str | None, overwrite: bool = False, say: Any = None) -> None:
    """``tracer run --report``: the HTML report of the run's comparison (with its trace's header)."""
    if report is None or result.comparison is None:
        return
    from tracer.report.html import comparison_html, write_report

    header = None
    if result.trace:
        from tracer.store.trace import TraceReader

        with TraceReader(result.trace) as r:
            header = r.header
    if say is not None:
        say(f"writing the HTML report {report}")
    write_report(comparison_html(result.comparison, header), report, overwrite=overwrite)


def print_run(result: Any, fmt: str, columns: tuple[str, ...], all_rows: bool, mitigation: str | None = None) -> int:
    """``tracer run``: the comparison (:func:`print_comparison`) and whether a mitigation restored
    bitwise equality; returns the exit code (:func:`fail_on_exit`)."""
    c = result.comparison
    if c is None:  # a rank > 0 under torchrun: rank 0 reports
        return 0
    print_comparison(c, fmt, columns, all_rows)
    if mitigation is not None and fmt == "table":
        from tracer.report.console import print_fitted, stdout_console

        ok = c.identical
        print_fitted(stdout_console(), f"mitigation {mitigation}: {'restores' if ok else 'does NOT restore'} bitwise "
                                       f"equality ({'every' if ok else 'not every'} compared tensor is bit-identical)",
                     4, style="green" if ok else "red")
    return fail_on_exit(c)


def print_audit(result: Any, fmt: str, report: str | None = None, overwrite: bool = False) -> int:
    """``tracer audit``: the hierarchy table (or JSON/CSV/markdown) on stdout, then the ``--report``
    HTML (:func:`write_after`); returns the exit code."""
    from tracer.report.console import stdout_console
    from tracer.report.hierarchy import audit_html
    from tracer.report.render import render

    text = render(result, fmt, stdout_console())
    if text is not None:
        sys.stdout.write(text)
    if report is not None:  # after the result is printed: a failing write still shows it
        from tracer.report.html import write_report

        return write_after(lambda: write_report(audit_html(result), report, overwrite=overwrite), f"report: {report}")
    return 0


def print_import(mapped: Any, output: str, run_name: str) -> None:
    """``tracer import``: what was mapped, where it went, and the mapping's notes."""
    from tracer.report.console import print_fitted, stdout_console

    console = stdout_console()
    lo, hi = mapped.positions
    print_fitted(console, printable(f"imported {mapped.engine} {mapped.path}: {len(mapped.tensors)} capture points, "
                                    f"positions {lo}..{hi - 1} -> {output} (run {run_name})"), 2)
    for line in mapped.notes:
        print_fitted(console, printable(f"  {line}"), 4)


def print_path(path: Any, what: str | None = None) -> None:
    """``tracer plot``, ``tracer report``: the file written. In a terminal one sentence saying what it
    is and its size (``wrote x.html: the HTML report of T.h5, 402.3 KiB``); piped, the path alone on
    stdout (scripts read it)."""
    from tracer.report.console import print_fitted, stdout_console

    console = stdout_console()
    if what is None or not console.is_terminal:
        print(path)
        return
    try:
        size = f", {format_size(os.path.getsize(path))}"
    except OSError:
        size = ""
    print_fitted(console, f"wrote {printable(path)}: {what}{size}")


def print_models(models: list[dict[str, Any]]) -> None:
    """``tracer models``: the built-in recipes as a table; the default model marked, and for a recipe
    of real weights whether they are installed here (else the command that installs them)."""
    from rich.table import Table

    t = Table(title="built-in models (any HF model id in the local cache or a local directory also works)",
              title_justify="left")
    t.add_column("name", style="bold")
    t.add_column("kind")
    t.add_column("description")
    for m in models:
        name = m["name"] + ("\n(default)" if m.get("default") else "")
        kind = m["kind"] + {True: "\ninstalled", False: "\nnot installed"}.get(m.get("installed"), "")
        desc = m.get("description", "") + (f" (not installed: {m['install']})" if m.get("install") else "")
        t.add_row(name, kind, desc)
    from tracer.report.console import stdout_console

    stdout_console().print(t)


def print_options_help(doc: dict[str, dict[str, Any]], topic: str | None, console: Console | None = None) -> None:
    """``tracer help [TOPIC]``: without a topic, one line per topic (its title and options); with one,
    each option's flags and whole help, fitted to the terminal (continuations under the text)."""
    from tracer.report.console import print_fitted, stdout_console

    console = console or stdout_console()
    if topic is None:
        width = max(len(k) for k in doc) + 4
        console.print("tracer help TOPIC explains these options in full:", highlight=False)
        for key, entry in doc.items():
            names = ", ".join("MODEL" if o["name"] == "model" else o["flags"][0].split("/")[0] if o["flags"] else o["name"]
                              for o in entry["options"])
            print_fitted(console, f"{entry['title']}: {names}" if names else entry["title"], width,
                         label=Text(f"  {key}", style="bold"))
        return
    for key, entry in doc.items():
        console.print(Text(entry["title"], style="bold"))
        for o in entry["options"]:
            flags = "MODEL" if o["name"] == "model" else ", ".join(o["flags"]) if o["flags"] else o["name"]
            print_fitted(console, Text(flags, style="bold"), 4, label=Text("  "))
            print_fitted(console, o["help"], 6, label=Text("      "))


def print_bench(result: Any, fmt: str | bool = "table") -> None:
    """``tracer bench``: the table of medians and ratios, or the result in ``fmt`` (json, csv,
    markdown; a bool: JSON or not, as ``--json`` said)."""
    from tracer.report.console import stdout_console
    from tracer.report.render import render

    text = render(result, ("json" if fmt else "table") if isinstance(fmt, bool) else fmt, stdout_console())
    if text is not None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def check_bench_format(fmt: str, as_json: bool) -> str:
    """``--format`` of ``tracer bench`` (one of :data:`tracer.report.layout.FORMATS`, as every command),
    with ``--json`` its older spelling of ``--format json``.

    Raises:
        TracerError: an unknown format, or ``--json`` with another ``--format``.
    """
    from tracer.report.layout import check_format

    fmt = check_format(fmt)
    if as_json and fmt not in ("table", "json"):
        raise TracerError(f"--json and --format {fmt} contradict each other; give one of them (--json is --format json)")
    return "json" if as_json else fmt


def check_sweep_format(fmt: str) -> str:
    """``--format`` of ``tracer sweep``: one of :data:`tracer.report.layout.FORMATS`, as every command.

    Raises:
        TracerError: an unknown format.
    """
    from tracer.report.layout import check_format

    return check_format(fmt)


def print_sweep(result: Any, fmt: str = "table", plot: str | None = None, report: str | None = None,
                overwrite: bool = False) -> int:
    """``tracer sweep``: print the summary lines with the sweep file's name (``table``), the summary
    as JSON, or one CSV row per point; then write the ``plot`` figure and the ``report`` HTML
    (:func:`write_after`: their names on stderr). Returns the exit code."""
    from tracer.report.console import stdout_console
    from tracer.report.render import render

    text = render(result, fmt, stdout_console())
    if text is not None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    code = 0
    if plot is not None:
        from tracer.report.plot import save_figure, sweep_figure

        code = write_after(lambda: save_figure(sweep_figure(result), plot, overwrite=overwrite),
                           f"divergence map: {plot}")
    if report is not None:
        from tracer.report.html import write_report
        from tracer.report.pages import sweep_html

        code = write_after(lambda: write_report(sweep_html(result), report, overwrite=overwrite),
                           f"report: {report}") or code
    return code
