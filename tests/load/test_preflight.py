"""Errors before anything heavy loads: every input error of `tracer run` is one line, exit 2, and
found before torch or transformers is imported; a newcomer's 22 mistakes across the commands are
refused before any model or trace body loads (the times are measured by benchmarks/input_errors.py,
not here)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("input_errors", ROOT / "benchmarks" / "input_errors.py")
input_errors = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(input_errors)

DRIVER = """
import sys
sys.argv = ["tracer", "run", *{args!r}]
from tracer.cli import main
code = 0
try:
    main()
except SystemExit as e:
    code = e.code
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
sys.stderr.write("HEAVY=" + ",".join(heavy) + "\\n")
sys.exit(code)
"""


@pytest.fixture(scope="module")
def folder():
    return input_errors.scratch()


def _cuda_build() -> bool:
    from importlib.metadata import version

    return "+cpu" not in version("torch")


@pytest.mark.parametrize("argv, about", input_errors.CASES, ids=[" ".join(a) for a, _ in input_errors.CASES])
def test_input_error_is_one_line_before_torch_loads(argv, about, folder, cli_env):
    if argv == ["--device", "cuda"] and _cuda_build():
        pytest.skip("a CUDA build of torch: --device cuda is not an input error here")
    proc = subprocess.run([sys.executable, "-c", DRIVER.format(args=argv)], capture_output=True, text=True,
                          cwd=folder, env={**cli_env, "TRACER_PROGRESS": "off"}, timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert lines[-1] == "HEAVY=", f"{argv}: imported {lines[-1]} before the error"
    assert len(lines) == 2 and lines[0].startswith("error: ") and about in lines[0], proc.stderr


def test_a_typo_of_a_recipe_gets_no_download_hint(folder, cli_env):
    proc = subprocess.run([sys.executable, "-m", "tracer", "run", "smollm2-135"], capture_output=True, text=True,
                          cwd=folder, env=cli_env, timeout=120)
    assert proc.returncode == 2 and "did you mean smollm2-135m?" in proc.stderr and "hf download" not in proc.stderr


def test_a_trace_given_as_the_model_points_to_compare_and_show(folder, cli_env):
    """A newcomer's trial: ``tracer run traces/x.h5`` was told to download ``traces/x.h5`` from the hub."""
    (Path(folder) / "x.h5").write_bytes(b"not read")
    proc = subprocess.run([sys.executable, "-m", "tracer", "run", "x.h5"], capture_output=True, text=True,
                          cwd=folder, env=cli_env, timeout=120)
    assert proc.returncode == 2 and "hf download" not in proc.stderr, proc.stderr
    assert "'x.h5' is a file, not a model" in proc.stderr and "tracer compare x.h5" in proc.stderr


def test_did_you_mean_for_options_scenarios_and_api_names(folder, cli_env):
    import tracer
    from tracer.errors import TracerError

    proc = subprocess.run([sys.executable, "-m", "tracer", "run", "--prompt-fil", "x"], capture_output=True,
                          text=True, cwd=folder, env=cli_env, timeout=120)
    assert proc.returncode == 2 and "--prompt-file" in proc.stderr  # click's own suggestion
    with pytest.raises(TracerError, match=r"unknown option\(s\) granularty \(did you mean granularity\?\)"):
        tracer.run("tiny-llama", granularty="layers")
    with pytest.raises(TracerError, match=r"unknown scenario 'prefix_cache' \(did you mean prefix-cache\?\)"):
        tracer.run("tiny-llama", scenario="prefix_cache")
    with pytest.raises(TracerError, match=r"unknown --positions 'al'; .* \(did you mean all\?\)$"):
        tracer.run("tiny-llama", positions="al")
    with pytest.raises(TracerError, match=r"unknown --store 'tensor'; .* \(did you mean tensors\?\)$"):
        tracer.run("tiny-llama", store="tensor")


def test_prompt_naming_a_file_gets_a_note(folder):
    import tracer

    res = tracer.run("tiny-llama", prompt=str(folder / "exists.txt"), length=20, device="cpu", progress=False)
    note = [n for n in res.comparison.facts.get("notes", []) if "--prompt-file" in n]
    assert note == [f"--prompt {str(folder / 'exists.txt')!r} is the name of an existing file: the text traced is "
                    f"that name; to trace the file's content, use --prompt-file {folder / 'exists.txt'}"]
    res = tracer.run("tiny-llama", prompt="hello world", length=20, device="cpu", progress=False)
    assert not any("--prompt-file" in n for n in res.comparison.facts.get("notes", []))


def test_prompt_naming_a_file_is_noted_before_the_run(folder):
    """The CLI says it first (it used to come only under the table, after the whole run): in this
    process loading a model raises, so the note is shown before anything loads."""
    from tests.helpers import cli_batch

    [(_, err)] = cli_batch([["run", "tiny-llama", "--device", "cpu", "--prompt", "exists.txt"]], folder)
    assert err.startswith("note: --prompt 'exists.txt' is the name of an existing file"), err


def _as_tested(argv: list[str]) -> list[str]:
    """A mistake of :data:`MISTAKES` as this test runs it: a ``run`` without a model names tiny-llama (its
    tokenizer is always at hand; the default model's GGUF cache may not be built yet)."""
    if argv[0] == "run" and (len(argv) == 1 or argv[1].startswith("-")):
        return ["run", "tiny-llama", *argv[1:]]
    return argv


def test_first_hour_mistakes_are_refused_before_any_model_or_trace_loads(folder):
    """Each of the 22 mistakes: exit 2, one line naming it, and nothing loaded first: in the process that
    runs them a model load or a trace read raises (so a late refusal fails here), and no progress line
    (``loading ...``) comes before the error. Those about the prompt's length load the tokenizer alone."""
    from tests.helpers import cli_batch

    cases = [(_as_tested(argv), about) for argv, about in input_errors.MISTAKES
             if not (argv == ["run", "--device", "cuda"] and _cuda_build())]
    assert len(input_errors.MISTAKES) == 22 and {a[0] for a, _ in cases} >= {"run", "plot", "compare", "sweep",
                                                                             "audit", "report"}
    for (argv, about), (code, err) in zip(cases, cli_batch([a for a, _ in cases], folder, timeout=600,
                                                           refuse_reads=True)):
        lines = err.strip().splitlines()
        assert code == 2, (argv, err)
        assert len(lines) == 1 and lines[0].startswith("error: ") and about in lines[0], (argv, err)


def test_gpu_as_a_device_is_answered_with_cuda():
    """A newcomer's trial: ``--device gpu`` was asked 'did you mean cpu?'."""
    from tracer.errors import TracerError
    from tracer.load.preflight import check_device

    with pytest.raises(TracerError, match=r"unknown device 'gpu'; valid: cpu, cuda, cuda:N, mps \(did you mean cuda\?\)"):
        check_device("gpu")
