"""The ``tracer`` command and the Python API take one option set (issue 22, item 3).

Each command line is compared with the API function it calls, parameter by parameter, read from
the built click command (what ``--help`` shows and the parser accepts) and from
``inspect.signature`` of the API function (what ``help(tracer.run)`` and tab completion show):
the same names, the same defaults, and every option with a help text. The only differences allowed
are declared in the CLI: how the result is printed or saved (``RENDER``) and what a command line
cannot carry (``IN_PROCESS``: a loaded model, callbacks).
"""

from __future__ import annotations

import inspect

import pytest
import typer

import tracer
from tracer import api
from tracer.cli import IN_PROCESS, RENDER, app
from tracer.config import OPTIONS

COMMANDS = {"run": tracer.run, "audit": tracer.audit, "sweep": tracer.sweep, "bench": tracer.bench,
            "compare": tracer.compare_trace, "import": tracer.import_dump, "show": tracer.trace_info,
            "plot": tracer.plot_file, "report": tracer.report_file, "models": tracer.models, "help": tracer.options}


def _cli(name: str) -> dict:
    return {p.name: p for p in typer.main.get_command(app).commands[name].params}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_cli_and_api_take_the_same_options(name):
    fn = COMMANDS[name]
    cli = _cli(name)
    api_params = {k: p for k, p in inspect.signature(fn).parameters.items()
                  if k not in IN_PROCESS and p.kind != p.VAR_KEYWORD}
    assert set(cli) - set(RENDER) == set(api_params), name
    for k, p in api_params.items():
        if k == "store":  # the command writes a trace unless --no-store; a library call only when asked
            assert p.default is None and cli[k].default is None
            continue
        want = None if p.default is inspect.Parameter.empty else p.default
        got = cli[k].default
        if isinstance(want, tuple):
            want = list(want)
        assert got == want or (got is None and want is None), (name, k, got, want)
    for k, p in cli.items():  # every option and argument says what it is
        assert getattr(p, "help", None), (name, k)


@pytest.mark.parametrize("name, options", [("run", api.RUN_OPTIONS), ("audit", api.AUDIT_OPTIONS),
                                           ("sweep", api.SWEEP_OPTIONS), ("bench", api.BENCH_OPTIONS),
                                           ("compare", api.COMPARE_OPTIONS)])
def test_run_options_carry_their_one_help_text(name, options):
    """A run option's help on the command line is OPTIONS' text (or the API docstring's wording for
    that command), its flags OPTIONS' flags."""
    cli = _cli(name)
    for k in options:
        if k == "model":
            continue
        p = cli[k]
        assert p.help, (name, k)
        assert OPTIONS[k].flags[0].split("/")[0] in p.opts, (name, k, p.opts)


def test_options_of_the_audit_and_sweep_the_issue_named():
    """`tracer.audit(attn_a=...)` worked but `tracer audit` had no --attn-a; sweep lacked --chat and --tp-mode."""
    assert "--attn-a" in _cli("audit")["attn_a"].opts
    assert "--chat" in _cli("sweep")["chat"].opts and "--tp-mode" in _cli("sweep")["tp_mode"].opts


def test_no_help_text_is_written_twice():
    """The command line's modules (tracer/cli.py and the builder, tracer/cli_parser.py) declare no option
    by hand: typer.Option/Argument are called only by the builder (one Argument, one Option for API
    parameters, one for the render options), never with a literal help."""
    import ast
    from pathlib import Path

    import tracer.cli
    import tracer.cli_parser

    calls = [n for m in (tracer.cli, tracer.cli_parser) for n in ast.walk(ast.parse(Path(m.__file__).read_text()))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("Option", "Argument")]
    assert len(calls) == 3
    assert not any(isinstance(kw.value, ast.Constant) for c in calls for kw in c.keywords if kw.arg == "help")


@pytest.mark.parametrize("name", [None, *sorted(COMMANDS)])
def test_every_help_reads_whole_at_80_columns(name):
    """`tracer [COMMAND] --help` in an 80-column terminal: every line within 80 characters and no word cut to
    '…' (rich ellipsizes a word longer than the help column: an example such as 0=20GiB,1=20GiB,cpu=64GiB or a
    default file name could not be read or pasted); a command's description is one paragraph, not broken at
    its docstring's line ends."""
    from typer.testing import CliRunner

    args = ["--help"] if name is None else [name, "--help"]
    out = CliRunner().invoke(app, args, env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"}, terminal_width=80).output
    assert "Usage:" in out
    assert "…" not in out, [line for line in out.splitlines() if "…" in line]
    assert max(len(line) for line in out.splitlines()) <= 80
    if name is not None:
        doc = typer.main.get_command(app).commands[name].help
        assert "\n" not in doc.replace("\n\n", ""), name


def test_scenario_help_lists_every_scenario():
    """--scenario's help is built from SCENARIOS: a scenario added there is listed (cuda-graph and
    engine were once missing from a hand-written list)."""
    from tracer.config import OPTIONS
    from tracer.plan.scenarios import SCENARIOS

    listed = OPTIONS["scenario"].help
    missing = [name for name in SCENARIOS if name not in listed.replace("(", " ").replace(",", " ").split()]
    assert not missing, missing


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_keeps_square_brackets(name):
    """The help is rendered with rich markup on, where ``[vllm]`` is a style tag and vanished: `tracer run
    --help` told to `pip install 'tracer'` for vLLM (the text said 'tracer[vllm]'). Every bracketed word of a help text (OPTIONS, the API
    docstrings, the render options) shows in the rendered --help as written (the text given to click
    escapes it: ``\\[vllm]``)."""
    import re

    from typer.testing import CliRunner

    out = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"},
                             terminal_width=200).output
    flat = re.sub(r"[\s│]+", " ", out)
    raw = [p.help or "" for p in _cli(name).values()]  # as given to click: OPTIONS' text or the docstring's
    words = {w for text in raw for w in re.findall(r"\S*\[[a-z][^\]\s]*\]\S*", text.replace("\\[", "["))}
    if name == "run":  # the case that was lost (then written 'tracer[vllm]'): its whole text is in `tracer help engines`
        whole = CliRunner().invoke(app, ["help", "engines"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"},
                                   terminal_width=200).output
        assert "-e '.[vllm]'" in re.sub(r"\s+", " ", whole)
    for w in words:
        assert w.strip(".,;()'") in flat, (name, w)


#: what a newcomer reaches for first: they must be on the first screen of `tracer run --help`
NEWCOMER = ("MODEL", "--scenario", "--prompt", "--length", "--dtype", "--device", "--granularity", "--positions",
            "--output", "--format", "--report", "--no-store")


def test_run_help_first_screen_holds_the_newcomers_options():
    """`tracer run --help` at 80 columns was 333 lines with 68 options in one panel; its first 40 lines
    now show what a newcomer needs (each option one line of help), and the whole is far shorter."""
    from typer.testing import CliRunner

    out = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"},
                             terminal_width=80).output
    lines = out.splitlines()
    first = "\n".join(lines[:40])
    missing = [flag for flag in NEWCOMER if not any(f" {flag} " in f" {x} " for x in first.replace("│", " ").splitlines())]
    assert not missing, (missing, first)
    assert len(lines) < 150, len(lines)
    assert "What to run" in first and "Output" in first


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_is_in_a_named_panel(name):
    """Each option of every command is listed under a named panel (its topic, the command's own, or
    Output): none falls into typer's catch-all 'Options' panel, which only --help is left in; a run
    option's panel is the one tracer.config.PANELS gives it."""
    from tracer.config import PANELS

    for k, p in _cli(name).items():
        if p.param_type_name == "argument":
            continue
        assert getattr(p, "rich_help_panel", None), (name, k)
        if k in OPTIONS and k not in RENDER:
            assert p.rich_help_panel == OPTIONS[k].panel, (name, k)
    listed = [k for _, keys in PANELS.values() for k in keys]
    assert sorted(listed) == sorted(OPTIONS), "every run option in exactly one panel"


def test_help_topics_give_each_option_its_whole_text(tmp_path):
    """`tracer help TOPIC` holds what the one-line --help leaves out: each option's whole help text
    (OPTIONS' own words), and `tracer help scenarios` every scenario; an unknown topic is one line."""
    from tests.helpers import cli_batch
    from tracer.config import PANELS
    from tracer.plan.scenarios import SCENARIOS

    doc = tracer.options("rl")["rl"]
    assert doc["title"] == PANELS["rl"][0] and [o["name"] for o in doc["options"]] == list(PANELS["rl"][1])
    assert all(o["help"] == OPTIONS[o["name"]].help for o in doc["options"])
    assert [o["name"] for o in tracer.options("scenarios")["scenarios"]["options"]] == list(SCENARIOS)
    from typer.testing import CliRunner

    out = CliRunner().invoke(app, ["help", "rl"], env={"COLUMNS": "200"}).output
    assert OPTIONS["train_batching"].help in " ".join(out.split())
    (code, err), = cli_batch([["help", "nope"]], tmp_path)
    assert code == 2 and "unknown help topic 'nope'" in err and len(err.strip().splitlines()) == 1


def test_dtype_help_lists_the_aliases_it_accepts():
    """`--dtype bf16` was accepted but the help listed bfloat16, float16, float32, float64 only: every
    name the dtype table accepts is listed, in --help and in the whole text."""
    from typer.testing import CliRunner

    from tracer.dtypes import ALIASES, FLOATS, canonical

    out = " ".join(CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"}, terminal_width=200).output.split())
    for name in (*FLOATS, *ALIASES):
        assert canonical(name) in FLOATS  # accepted ...
        assert name in OPTIONS["dtype"].help and name in out.split("--dtype", 1)[1].split("--", 1)[0]  # ... and listed


def test_help_output_lists_every_output_option_of_every_command():
    """`tracer help output` listed only --output and --overwrite: every option a command shows in its
    Output panel (``--format``, ``--report``, ``--plot``, ``--json``, ...) is in the topic, read from the
    built click commands (what each command's --help shows)."""
    import re

    from typer.testing import CliRunner

    from tracer.cli import OUTPUT_PANEL

    wanted = {p.opts[0] for name in COMMANDS for p in _cli(name).values()
              if getattr(p, "rich_help_panel", None) == OUTPUT_PANEL}
    assert {"--format", "--report", "--plot", "--json", "--no-store", "--wide", "--columns"} <= wanted
    out = CliRunner().invoke(app, ["help", "output"], env={"COLUMNS": "200"}, terminal_width=200).output
    listed = set(re.findall(r"^ {4}(--[\w-]+)", out, re.M))
    assert wanted <= listed, wanted - listed
    assert re.search(r"--plot\n +also write the divergence map.*; in tracer sweep\n", out)


def test_help_scenarios_speaks_in_cli_options():
    """`tracer help scenarios` showed docstring markup (``:mod:``, double backticks) and Python names
    (``batch_row``, ``kv_format``, ``attn_a``): a user reads plain text with the --flags they type,
    and each scenario lists the options its builder takes."""
    import inspect
    import re

    from typer.testing import CliRunner

    from tracer.plan.scenarios import SCENARIOS

    out = CliRunner().invoke(app, ["help", "scenarios"], env={"COLUMNS": "200"}, terminal_width=200).output
    flat = " ".join(out.split())
    assert not re.search(r":(mod|func|class|data|meth):|``", flat), flat
    python_names = [k for k in OPTIONS if "_" in k and re.search(rf"(?<![\w.-]){k}(?![\w-])", flat)]
    assert python_names == [], python_names
    assert "as row --batch-row of a batch of --batch-size" in flat
    assert "--attn-a versus --attn-b" in flat and "quantize-dequantized as --kv-format" in flat
    docs = {o["name"]: o["help"] for o in tracer.options("scenarios")["scenarios"]["options"]}
    for name, fn in SCENARIOS.items():
        for p in inspect.signature(fn).parameters:
            if p in OPTIONS and p not in ("mitigation",):
                assert OPTIONS[p].flags[0].split("/")[0] in docs[name], (name, p)


def test_version_names_tracer_torch_transformers_and_python(tmp_path):
    """There was no `tracer --version`: it prints tracer's, torch's, transformers' and Python's versions
    (as the imported modules report them) in one line, exit 0, before any command runs."""
    import platform

    import torch
    import transformers

    from tests.helpers import tracer_cli

    out = tracer_cli(["--version"], cwd=tmp_path).stdout
    assert out.strip() == (f"tracer {tracer.__version__} · torch {torch.__version__} · transformers "
                           f"{transformers.__version__} · Python {platform.python_version()}")


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["models", "--help"]])
def test_help_shows_flags_without_a_type(args):
    """`--help` was listed as `--help <bool>`: a flag takes no value, so no flag shows a type, and
    the options that take one still show theirs (`--length <int>`)."""
    import re

    from typer.testing import CliRunner

    out = CliRunner().invoke(app, args, env={"COLUMNS": "120"}, terminal_width=120).output
    assert "<bool>" not in out and re.search(r"--help +Show this message", out), out
    if args == ["run", "--help"]:
        assert re.search(r"--length +-n +<int>", out), out
