"""Every command's output fits the terminal: at 60, 80 and 120 columns no line is longer than the
terminal and no word is split across two lines (a line ending inside a token that continues on the
next), and a name shortened with "…" is cut at a dot (or an underscore inside its last component).

The commands run through the real CLI (one process for all widths, rich told it writes to a
terminal: ``TTY_COMPATIBLE=1``, ``COLUMNS``), on files built once by a module fixture (a trace with
sublayers, a sweep file, an audit trace, an engine dump) from tiny random-init models, no real
weights; the words of the other widths' outputs are the words one width may not split. The results
that cost a computation each time (the RL step with ``--mitigations``, ``tracer bench``) are made
once, as JSON, and rendered at every width in-process by the functions the commands call; so is an
engine report (HF vs vLLM facts, as vLLM runs make them; vLLM itself is not needed).
"""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.cells import cell_len
from rich.console import Console

from tests.helpers import cli_env, cli_session

WIDTHS = (60, 80, 120)
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")
#: box-drawing verticals: a table row's cell borders
CELL = re.compile("[│┃║]")
PUNCT = ",;:()[]'\"`"
MODEL = ["tiny-llama", "--dtype", "float32"]  # float32: its GEMMs diverge between a cache hit and a miss here


def _commands(d: str) -> dict[str, list[str]]:
    """The commands run at every width (``d``: the folder of the built files)."""
    return {
        "audit": ["audit", *MODEL, "--levels", "0,2", "--length", "48", "-o", f"{d}/audit.h5"],  # resumed: no work
        "run": ["run", *MODEL, "--length", "64", "--no-store"],
        "compare": ["compare", f"{d}/run.h5"],
        "compare-all": ["compare", f"{d}/run.h5", "--all-rows"],
        "show": ["show", f"{d}/run.h5"],
        "report": ["report", f"{d}/run.h5", "-o", f"{d}/r.html", "--overwrite"],
        "plot": ["plot", f"{d}/run.h5", "-o", f"{d}/p.png", "--overwrite"],
        "sweep": ["sweep", *MODEL, "--lengths", "40,64", "-o", f"{d}/sweep.h5"],  # resumed: the summary only
        "import": ["import", f"{d}/dump", "-o", f"{d}/imp.h5", "-r", f"{d}/run.h5:A", "--overwrite"],
        "models": ["models"],
        "help": ["help"],
        "help-rl": ["help", "rl"],
        "run-help": ["run", "--help"],
        "error": ["run", "tiny-llama", "--columns", "nope"],
    }


def _render(width: int, monkeypatch: pytest.MonkeyPatch, draw) -> str:
    """What ``draw()`` prints to stdout in a terminal ``width`` columns wide (the consoles it makes
    read ``TTY_COMPATIBLE`` and ``COLUMNS``)."""
    import contextlib

    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("COLUMNS", str(width))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        draw()
    return ANSI.sub("", buf.getvalue())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The files the commands read, and the JSON of an RL step with --mitigations and of a bench."""
    d = tmp_path_factory.mktemp("widths")
    env = cli_env({"TRACER_PROGRESS": "off"})
    cmds = _commands(str(d))
    done = cli_session([["run", *MODEL, "--length", "64", "--granularity", "sublayers", "-o", f"{d}/run.h5"],
                        cmds["sweep"], cmds["audit"],
                        ["run", *MODEL, "--scenario", "rollout-vs-train", "--length", "20", "--new-tokens", "4",
                         "--rollouts", "2", "--mitigations", "--no-store", "--format", "json"],
                        ["bench", "tiny-llama", "--length", "40", "--reps", "1", "--warmup", "0", "--no-peers",
                         "--outdir", f"{d}/bench", "--json"]], env, d)
    assert [p.returncode for p in done] == [0] * 5, [p.stderr[-2000:] for p in done]
    from tracer.engines.dumps.sglang_writer import write_sglang_dump

    write_sglang_dump(str(d / "run.h5"), "B", d / "dump", tp=2)
    return d, json.loads(done[3].stdout), json.loads(done[4].stdout)


def _session(d, piped: bool) -> dict[tuple[str, int], str]:
    """``{(command, width): output}`` of every command of :func:`_commands` at each width: in a
    terminal (``TTY_COMPATIBLE=1``) stdout + stderr; ``piped``, stdout alone (a piped stderr keeps
    each error and note on one line for the script that reads it: README "Exit codes")."""
    env = cli_env({"TRACER_PROGRESS": "off"})
    env.pop("COLUMNS")  # each case says its own (the consoles made at import then read it as they print)
    cmds = _commands(str(d))
    cases = [(name, w) for w in WIDTHS for name in cmds]
    tty = {} if piped else {"TTY_COMPATIBLE": "1"}
    done = cli_session([{"args": cmds[name], "env": {"COLUMNS": str(w), **tty}} for name, w in cases],
                       env, d, timeout=1200)
    out = {}
    for (name, w), p in zip(cases, done):
        assert p.returncode == (2 if name == "error" else 0), (name, w, p.stderr[-2000:])
        out[name, w] = ANSI.sub("", p.stdout if piped else p.stdout + p.stderr)
    return out


@pytest.fixture(scope="module")
def outputs(built):
    """``{(command, width): stdout + stderr}`` of every command of :func:`_commands` at each width."""
    return _session(built[0], piped=False)


@pytest.fixture(scope="module")
def piped(built):
    """``{(command, width): stdout}`` of every command piped with ``COLUMNS`` at each width."""
    return _session(built[0], piped=True)


def _tokens(text: str) -> list[str]:
    return [t.strip(PUNCT) for t in CELL.sub(" ", text).split() if t.strip(PUNCT)]


def split_words(text: str, vocabulary: set[str]) -> list[str]:
    """Places where a word of ``vocabulary`` is cut over two lines: the last word of a line and the first
    of the next make a word of ``vocabulary`` that neither is alone; in two rows of one table, cell by cell."""
    lines = text.split("\n")
    out = []
    for a, b in zip(lines, lines[1:]):
        ca, cb = CELL.split(a), CELL.split(b)
        pairs = list(zip(ca, cb)) if len(ca) == len(cb) > 1 else [(a, b)]
        for x, y in pairs:
            tx, ty = _tokens(x), _tokens(y)
            if not tx or not ty:
                continue
            joined = tx[-1] + ty[0]
            if joined in vocabulary and not (tx[-1] in vocabulary and ty[0] in vocabulary):
                out.append(f"{tx[-1]!r} / {ty[0]!r}")
    return out


def cut_names(text: str, vocabulary: set[str]) -> list[str]:
    """Names shortened with "…" that do not start at a dot (or an underscore) of a word of ``vocabulary``."""
    bad = []
    for tok in _tokens(text):
        if not tok.startswith("…"):
            continue
        rest = tok[1:]
        if "…" in rest:  # the middle elided to keep a layer index: "…layers.0…kv_cache", each piece at dots
            pieces = rest.split("…")
            pat = re.compile("(?:^|.*[._])" + re.escape(pieces[0])
                             + "".join(r"\..*[._]" + re.escape(x) for x in pieces[1:]) + "$")
            if not any(pat.match(v) for v in vocabulary):
                bad.append(tok)
        elif rest and not any(v.endswith(("." + rest, "_" + rest)) for v in vocabulary if len(v) > len(rest)):
            bad.append(tok)
    return bad


def _problems(texts: dict[int, str], width: int) -> dict[str, list[str]]:
    """Lines longer than ``width``, split words and names cut inside a word in ``texts[width]``; the
    words of the other widths' texts are the vocabulary."""
    text = texts[width]
    vocabulary = {t for w, other in texts.items() if w != width for t in _tokens(other)}
    found = {"longer": [line for line in text.split("\n") if cell_len(line) > width][:3],
             "split": split_words(text, vocabulary)[:5], "cut": cut_names(text, vocabulary)[:5]}
    return {k: v for k, v in found.items() if v}


@pytest.mark.parametrize("width", WIDTHS)
def test_every_command_fits_the_terminal(outputs, width):
    """No line longer than the terminal, no word split over two lines, names cut at a dot only."""
    problems = {}
    for name in sorted({name for name, _ in outputs}):
        found = _problems({w: outputs[name, w] for w in WIDTHS}, width)
        if found:
            problems[name] = found
    assert not problems, problems


@pytest.mark.parametrize("width", WIDTHS)
def test_piped_output_fits_columns(piped, width):
    """Piped (``| cat``, ``| less``), stdout is fitted to ``$COLUMNS`` as a terminal is: no line longer,
    no word split (``COLUMNS=80 tracer help scenarios | cat`` printed lines of 792 characters)."""
    problems = {}
    for name in sorted({name for name, _ in piped}):
        found = _problems({w: piped[name, w] for w in WIDTHS}, width)
        if found:
            problems[name] = found
    assert not problems, problems
    assert any(len(line) > 60 for line in piped["help-rl", 120].split("\n"))  # 120 is used, not a fixed 80


def test_piped_width_without_columns_is_80(monkeypatch):
    """No ``$COLUMNS`` and no terminal: 80 columns, as rich's own console (a line of the help breaks there)."""
    from tracer.report.console import stdout_console
    from tracer.report.terminal import print_options_help

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    buf = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(buf):
        console = stdout_console()
        assert not console.is_terminal and console.width == 80
        print_options_help({"t": {"title": "T", "options": [{"name": "x", "flags": ["--x"], "help": "word " * 60}]}},
                           "t", console)
    lines = buf.getvalue().splitlines()
    assert len(lines) > 3 and max(len(line) for line in lines) <= 80
    assert " ".join(" ".join(lines[2:]).split()) == ("word " * 60).strip()


def test_the_rl_report_and_the_bench_fit_the_terminal(built, monkeypatch):
    """An RL step with --mitigations (summary, per-token and knob tables) and tracer bench's table,
    rendered by the functions the commands call, at every width."""
    from tracer.diff.stored import comparison_from_dict
    from tracer.loops.bench import BenchResult
    from tracer.report.console import stdout_console
    from tracer.report.tables import print_report
    from tracer.report.terminal import print_bench

    _, rl_doc, bench_doc = built
    c = comparison_from_dict(rl_doc)
    assert c.rl is not None and c.rl.mitigations
    bench = BenchResult.from_dict(bench_doc)
    for name, draw in (("rl", lambda: print_report(c, stdout_console())), ("bench", lambda: print_bench(bench, False))):
        texts = {w: _render(w, monkeypatch, draw) for w in WIDTHS}
        assert "which knob closes the gap" in texts[120] or name == "bench"
        for w in WIDTHS:
            assert not _problems(texts, w), (name, w, _problems(texts, w))


def test_the_checks_catch_what_they_look_for():
    """The checker itself: a word cut at the edge, a table cell folded mid-word, a name cut inside a word."""
    vocabulary = {"positions", "model.layers.2.post_attention_layernorm", "flips"}
    assert split_words("0 argmax flips in 10 po\nsitions", vocabulary) == ["'po' / 'sitions'"]
    assert split_words("│ fl │ x │\n│ ips │ y │", vocabulary) == ["'fl' / 'ips'"]
    assert split_words("0 argmax flips in\n10 positions", vocabulary) == []
    assert cut_names("…ers.2.post_attention_layernorm", vocabulary) == ["…ers.2.post_attention_layernorm"]
    assert cut_names("…post_attention_layernorm", vocabulary) == []


@pytest.mark.parametrize("width", WIDTHS)
def test_the_engine_report_fits_and_names_each_side(width):
    """HF vs vLLM: the contracts differ in attention and GEMM, agree in the rest; the notes name the
    libraries on both sides and say what is the same, fitted like every other line."""
    from tests.helpers import make_runs
    from tracer.diff.compare import compare_records
    from tracer.diff.engine import engine_facts
    from tracer.report.tables import print_report

    hf = {"engine": "hf", "version": "5.19.0", "attention_backend": "sdpa", "norm": "LlamaRMSNorm (PyTorch ops)",
          "gemm": "torch F.linear on ATen's CPU GEMM (AVX2)", "activation_dtype": "bfloat16",
          "logits_dtype": "bfloat16", "kv_cache_dtype": "bfloat16", "block_size": 0}
    vl = {**hf, "engine": "vllm", "version": "0.32.0", "attention_backend": "CPU_ATTN", "block_size": 32,
          "gemm": {"self_attn.qkv_proj": "oneDNN onednn_mm", "lm_head": "oneDNN onednn_mm"},
          "compilation_mode": 0, "cudagraph_mode": "NONE"}
    a, b = make_runs()
    facts = engine_facts("A", {"engine": hf}, "B", {"engine": vl})
    c = compare_records(a, b, scenario="engine", model="smollm2-135m", facts=facts)
    text = {}
    for w in WIDTHS:
        buf = io.StringIO()
        print_report(c, Console(file=buf, width=w, force_terminal=True, color_system=None))
        text[w] = ANSI.sub("", buf.getvalue())
    flat = " ".join(text[120].split())
    assert "engines differ in GEMM: A torch F.linear on ATen's CPU GEMM (AVX2) | B oneDNN onednn_mm" in flat
    assert "same in both engines: norm implementation (LlamaRMSNorm (PyTorch ops))" in flat
    assert "engines differ in activation dtype" not in flat
    assert not _problems(text, width), _problems(text, width)
