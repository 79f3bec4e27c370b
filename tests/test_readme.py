"""README.md works as written (issue 25, item 3).

- Every fenced ``python`` block is pasted into an interactive interpreter line by line
  (``code.InteractiveConsole``: what typing or pasting into ``python`` does; a block needs its blank
  line after an indented ``with``) and must raise nothing.
- Every shell session (a fenced block of ``$ command`` lines) runs, command by command, in a scratch
  folder and each must exit 0; the first README command's ``tracer run`` too. What is run differs
  from the text only as :func:`runnable` says: to keep the suite's time bounded every ``tracer run``
  (and the dump script) runs at ``--length 32`` (the README shows each command's output from a
  named machine at its own length; here the output is not compared, only success), ``--device
  cuda`` becomes ``--device cpu`` on a machine without CUDA, ``/tmp/`` becomes the scratch folder.
- Every other ``tracer ...`` command line (the usage synopsis, inline commands in the prose) names
  a command that exists and only options that command has.
- The test command of the README is the one ``.ci/run`` runs.

The model runs cost about two minutes on a quiet 2-core machine (marked ``slow``; CI runs them).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
LENGTH = "32"


def blocks() -> list[tuple[str, int, list[str]]]:
    """``(info string, first line number, lines)`` of every fenced block."""
    out, cur = [], None
    for i, line in enumerate(README.splitlines(), 1):
        if line.startswith("```"):
            if cur is None:
                cur = (line[3:].strip(), i + 1, [])
            else:
                out.append(cur)
                cur = None
        elif cur is not None:
            cur[2].append(line)
    return out


def sessions() -> list[tuple[int, list[str]]]:
    return [(n, [x[2:] for x in lines if x.startswith("$ ")]) for lang, n, lines in blocks()
            if any(x.startswith("$ ") for x in lines)]


def runnable(command: str, tmp: Path) -> str:
    """The README command as this test runs it (see the module docstring)."""
    import torch

    words = shlex.split(command.split("  #")[0])
    env = [w for w in words if re.match(r"^[A-Z_]+=", w)]
    words = words[len(env):]
    if words[0] == "tracer":
        words = [sys.executable, "-m", "tracer", *words[1:]]
    if words[0] == "python3" and words[1].startswith("scripts/"):
        words = [sys.executable, str(ROOT / words[1]), *words[2:]]
    if words[:4] == [sys.executable, "-m", "tracer", "run"] or words[1].endswith("make-sglang-dump.py"):
        if "--length" in words:
            words[words.index("--length") + 1] = LENGTH
        else:
            words += ["--length", LENGTH]
    if not torch.cuda.is_available():
        words = ["cpu" if w == "cuda" and prev == "--device" else w for prev, w in zip([""] + words, words)]
    words = [w.replace("/tmp/", f"{tmp}/") for w in words]
    return shlex.join(words)


@pytest.mark.slow
@pytest.mark.parametrize("start, commands", sessions(), ids=[f"README.md:{n}" for n, _ in sessions()])
def test_shell_session_runs(start, commands, tmp_path, cli_env):
    for command in commands:
        line = runnable(command, tmp_path)
        proc = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                              env={**cli_env, "PYTHONPATH": str(ROOT), "TRACER_PROGRESS": "off"})
        assert proc.returncode == 0, f"README.md:{start}: {command}\n-> {line}\n{proc.stderr[-2000:]}"


@pytest.mark.slow
def test_first_command_runs(tmp_path, cli_env):
    first = blocks()[0][2][0]
    assert first.endswith("&& tracer run")
    proc = subprocess.run(["bash", "-c", runnable("tracer run", tmp_path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900, env={**cli_env, "TRACER_PROGRESS": "off"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("verdict:")


CONSOLE = """
import code, sys
errors = []
class Console(code.InteractiveConsole):
    def showsyntaxerror(self, *a, **k):
        errors.append("syntax"); super().showsyntaxerror(*a, **k)
    def showtraceback(self):
        errors.append("exception"); super().showtraceback()
console = Console()
for line in open(sys.argv[1]).read().splitlines():
    console.push(line)
console.push("")
sys.exit(1 if errors else 0)
"""


@pytest.mark.slow
@pytest.mark.parametrize("start, lines", [(n, lines) for lang, n, lines in blocks() if lang == "python"])
def test_python_block_pastes_into_python(start, lines, tmp_path, cli_env):
    (tmp_path / "block.py").write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-c", CONSOLE, str(tmp_path / "block.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=1200,
                          env={**cli_env, "PYTHONPATH": str(ROOT), "TRACER_PROGRESS": "off", "MPLBACKEND": "Agg"})
    assert proc.returncode == 0, f"README.md:{start}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("start, lines", [(n, lines) for lang, n, lines in blocks() if lang == "python"])
def test_python_block_prints_as_a_script(start, lines):
    """Run as a script, the block printed nothing: its results were bare expressions, which only an
    interactive interpreter echoes. Every top-level expression is now a call (print, render, ...)."""
    import ast

    bare = [node.lineno for node in ast.parse("\n".join(lines)).body
            if isinstance(node, ast.Expr) and not isinstance(node.value, ast.Call)]
    assert not bare, f"README.md:{start}: lines {[start + n for n in bare]} show a value only in an interpreter"


def _cli_flags() -> dict[str, set[str]]:
    from tracer.cli import app

    return {name: {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
            for name, cmd in typer.main.get_command(app).commands.items()}


def other_command_lines() -> list[tuple[int, str]]:
    """``tracer ...`` lines of the synopsis blocks and inline spans of the prose (not run here)."""
    out = []
    for lang, n, lines in blocks():
        if lang != "python" and not any(x.startswith("$ ") for x in lines):
            out += [(n + i, x) for i, x in enumerate(lines) if re.match(r"^(torchrun .* -m )?tracer ", x)]
    in_block = set()
    for lang, n, lines in blocks():
        in_block |= set(range(n - 1, n + len(lines) + 1))
    for i, line in enumerate(README.splitlines(), 1):
        if i not in in_block:
            out += [(i, m) for m in re.findall(r"`(tracer [a-z]+[^`]*)`", line)]
    return out


def test_every_other_command_line_names_real_options():
    flags = _cli_flags()
    lines = other_command_lines()
    assert len(lines) > 40  # the synopsis and the prose were found
    for n, line in lines:
        line = line[line.index("tracer "):]  # torchrun's own options come before
        cmd = re.search(r"tracer ([a-z]+)", line).group(1)
        assert cmd in flags, f"README.md:{n}: no command 'tracer {cmd}': {line}"
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-z])\b", line.split("#")[0]):
            assert flag in flags[cmd], f"README.md:{n}: 'tracer {cmd}' has no {flag}: {line}"


def test_ci_runs_the_readme_test_command():
    test_command = blocks()[1][2][0]
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    pytest_lines = [line for line in ci if "pytest" in line and not line.lstrip().startswith("#")]
    # the README's test command, verbatim, is the first test run of CI (the vLLM environment's follows it)
    assert pytest_lines and pytest_lines[0] == test_command and "--durations=15" in test_command
