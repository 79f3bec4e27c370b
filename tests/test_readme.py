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


def runnable(command: str, tmp: Path, *, root: Path = ROOT, python: str = sys.executable,
             cuda: bool | None = None) -> str:
    """The README command as this test runs it (see the module docstring).

    Only the README's own words are rewritten: its ``/tmp/`` becomes ``tmp``; the checkout ``root``
    and the ``python`` put in for ``tracer`` and ``python3 scripts/...`` are never touched, so a
    clone (and its venv) under ``/tmp`` runs them as they are. ``cuda``: whether this machine has
    CUDA (None: ask torch)."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    words = shlex.split(command.split("  #")[0])
    env = [w for w in words if re.match(r"^[A-Z_]+=", w)]
    words = [w.replace("/tmp/", f"{tmp}/") for w in words[len(env):]]  # before any path of this machine goes in
    if not cuda:
        words = ["cpu" if w == "cuda" and prev == "--device" else w for prev, w in zip([""] + words, words)]
    script = words[0] == "python3" and words[1].startswith("scripts/")
    if words[0] == "tracer" and words[1:2] == ["run"] or script and words[1].endswith("make-sglang-dump.py"):
        if "--length" in words:
            words[words.index("--length") + 1] = LENGTH
        else:
            words += ["--length", LENGTH]
    if words[0] == "tracer":
        words = [python, "-m", "tracer", *words[1:]]
    elif script:
        words = [python, str(root / words[1]), *words[2:]]
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


def test_commands_of_a_clone_under_tmp_keep_its_paths():
    """A checkout and its venv under /tmp (README command 2 in a fresh clone there): only the README's
    own /tmp/ paths move to the scratch folder; the venv's Python and the checkout's scripts stay."""
    clone, scratch = Path("/tmp/x"), Path("/tmp/pytest-of-me/test0")
    python = "/tmp/x/.venv/bin/python"
    commands = [c for _, cs in sessions() for c in cs]
    dump = next(c for c in commands if "make-sglang-dump.py" in c)
    assert shlex.split(runnable(dump, scratch, root=clone, python=python, cuda=False)) == [
        python, "/tmp/x/scripts/make-sglang-dump.py", "--out", "/tmp/pytest-of-me/test0/sg",
        "--reference", "/tmp/pytest-of-me/test0/ref.h5", "--length", LENGTH]
    compare = next(c for c in commands if c.startswith("tracer compare /tmp/ref.h5:B "))
    assert shlex.split(runnable(compare, scratch, root=clone, python=python, cuda=False)) == [
        python, "-m", "tracer", "compare", "/tmp/pytest-of-me/test0/ref.h5:B", "/tmp/pytest-of-me/test0/sg/dump_synthetic",
        "--fail-on", "any"]
    for command in commands:
        words = shlex.split(runnable(command, scratch, root=clone, python=python, cuda=False))
        given = [w for w in shlex.split(command.split("  #")[0]) if not re.match(r"^[A-Z_]+=", w)]
        assert words[0] == python, command
        moved = [w for w in words if w.startswith(f"{scratch}/")]
        assert len(moved) == sum("/tmp/" in w for w in given), command


def _clone_under_tmp() -> Path:
    """A ``git clone`` of this checkout under /tmp holding the working tree as it is (modified and new
    files copied over, deleted ones removed), with a venv of its own that sees this interpreter's packages."""
    import shutil
    import site
    import tempfile

    clone = Path(tempfile.mkdtemp(prefix="tracer-clone-", dir="/tmp")) / "x"
    git = ["git", "-C", str(ROOT)]
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)], check=True, timeout=300)
    changed = subprocess.run([*git, "ls-files", "-z", "--modified", "--others", "--exclude-standard"],
                             capture_output=True, check=True).stdout.decode().split("\0")
    deleted = set(subprocess.run([*git, "ls-files", "-z", "--deleted"], capture_output=True,
                                 check=True).stdout.decode().split("\0"))
    for name in filter(None, changed):
        if name in deleted:
            (clone / name).unlink(missing_ok=True)
        elif (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(clone / ".venv")], check=True, timeout=120)
    inner = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    Path(inner, "outer-packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return clone


@pytest.mark.slow
def test_readme_commands_run_from_a_clone_under_tmp():
    """README command 2 from a fresh clone under /tmp (its tests of the README's commands): the clone's
    own venv Python runs the first README command and the path rewriting, all paths under /tmp."""
    import os
    import shutil

    if shutil.which("git") is None or subprocess.run(["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    clone = _clone_under_tmp()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
        proc = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "tests/test_readme.py::test_first_command_runs",
                               "tests/test_readme.py::test_commands_of_a_clone_under_tmp_keep_its_paths"],
                              cwd=clone, env={**env, "PYTHONPATH": str(clone)}, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    finally:
        shutil.rmtree(clone.parent, ignore_errors=True)


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
