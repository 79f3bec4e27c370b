"""--fail-on exit codes, tolerances, --decode/--verdict/--wide through the `tracer` command (subprocess)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from test_cli import _bad, tracer
from tracer.store.trace import TraceReader


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    """A tiny-llama float32 cache-hit/miss trace of the default prompt (CPU)."""
    import os
    from pathlib import Path

    tmp = tmp_path_factory.mktemp("cli3")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent), COLUMNS="200")
    out = tmp / "t.h5"
    proc = tracer(["run", "tiny-llama", "--dtype", "float32", "--device", "cpu", "-o", str(out)], env, tmp)
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
    proc = tracer(args, env, tmp, check=False)
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
    proc = tracer(["run", "tiny-llama", "--dtype", "float32", "--device", "cpu", "--no-store", "--fail-on", "any",
                   "--format", "json"], env, tmp, check=False)
    doc = json.loads(proc.stdout)
    assert proc.returncode == (0 if doc["identical"] else 1)
    assert doc["check"]["failed"] == (not doc["identical"])
    assert "fail-on any" in proc.stderr or doc["identical"]


def test_wide_table_and_origins(trace):
    path, env, tmp = trace
    proc = tracer(["compare", str(path), "--wide"], env, tmp)
    for col in ("SQNR dB", "cosine", "<1‰", "<5‰", "NaN/Inf", "max ULP (line)", "ULP histogram"):
        assert col in proc.stdout
    doc = json.loads(tracer(["compare", str(path), "--format", "json"], env, tmp).stdout)
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
    _bad(["compare", str(path), *args], env, tmp, needle)
    _bad(["run", "tiny-llama", "--device", "cpu", "--no-store", *args], env, tmp, needle)


def test_bad_decode_and_verdict_exit_2(trace):
    _, env, tmp = trace
    _bad(["run", "tiny-llama", "--device", "cpu", "--decode", "-3"], env, tmp, "--decode -3")
    _bad(["run", "tiny-llama", "--device", "cpu", "--dtype", "float64", "--verdict"], env, tmp,
         "--verdict needs a precision above float64")


def test_decode_and_verdict_through_the_cli(trace):
    _, env, tmp = trace
    proc = tracer(["run", "tiny-llama", "--device", "cpu", "--no-store", "--length", "40", "--decode", "4",
                   "--verdict"], env, tmp)
    assert "replay:" in proc.stdout and "noise verdict:" in proc.stdout
