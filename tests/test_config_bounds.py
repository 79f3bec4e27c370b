"""Issue 24 item 10: bounds on every number, and no silently accepted combination: each is a one-line
error (or a one-line note where the value is legitimate), before the model loads where it can be."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tracer
from tracer.config import RunConfig
from tracer.errors import TracerError
from tracer.validate import validate


@pytest.mark.parametrize("options, words", [
    (dict(decode=10**30), "--decode 100000000000...(31 digits) is outside 0.."),
    (dict(scenario="tensor-parallel", reduce=""), "--reduce is empty"),
    (dict(max_trace_size="1.5", store="auto"), "not a whole number of bytes"),
    (dict(split_at=5, block_size=4, length=24), "--block-size 4 would only choose it"),
    (dict(op_replay=True), "add --granularity sublayers"),
    (dict(device_map="[" * 30000 + "]" * 30000), "nests deeper than a map"),
    (dict(prompt="caf\udce9"), "--prompt holds bytes that are not UTF-8"),
    (dict(scenario="generate-cache", new_tokens=10**7), "--new-tokens"),
    (dict(scenario="engine", engines="vllm:,hf"), "--engines vllm:: no attention backend after the colon"),
    (dict(scenario="engine", engines="hf,vllm: "), "no attention backend after the colon"),
])
def test_silently_accepted_values_are_one_line_errors_before_loading(options, words):
    with pytest.raises(TracerError) as e:
        validate(RunConfig.from_options(model="tiny-llama", **options))
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_legitimate_neighbours_still_pass():
    for options in (dict(max_trace_size="1.5G", store="auto"), dict(split_at=5, length=24), dict(block_size=4),
                    dict(op_replay=True, granularity="sublayers"), dict(device_map='{"model.embed_tokens": "cpu"}'),
                    dict(prompt="café")):
        validate(RunConfig.from_options(model="tiny-llama", **options))


@pytest.mark.parametrize("kw, words", [(dict(reps=10**30), "--reps"), (dict(warmup=10**30), "--warmup"),
                                       (dict(reps=0), "--reps")])
def test_bench_repetitions_are_bounded(kw, words):
    """bench --reps 10**30 ran for ever."""
    from tracer.loops.bench import bench

    with pytest.raises(TracerError, match=words):
        bench("tiny-llama", **kw)


@pytest.fixture(scope="module")
def tiny():
    from tracer.load.models import load_model

    return load_model("tiny-llama", dtype="float32", device="cpu", progress=False)


@pytest.mark.parametrize("kw, need", [
    (dict(length=16384), "16,384"),  # ran without a word on a 4,096-position model
    (dict(scenario="generate-cache", new_tokens=100000, length=24), "100,024"),  # ran for ever
    (dict(length=24, decode=5000), "5,024"),
])
def test_positions_beyond_the_model_are_refused(tiny, kw, need):
    with pytest.raises(TracerError) as e:
        tracer.run("tiny-llama", loaded=tiny, progress=False, store="none", **kw)
    assert f"needs {need} positions" in str(e.value) and "has 4,096 (max_position_embeddings)" in str(e.value)


def test_rope_scaled_models_get_a_note_not_an_error():
    from tracer.plan.checks import check_positions

    assert check_positions(100, 4096, False, "m") is None
    note = check_positions(8192, 4096, True, "m")
    assert note.startswith("note: this run needs 8,192 positions") and "RoPE scaling" in note
    with pytest.raises(TracerError):
        check_positions(8192, 4096, False, "m")


def test_empty_and_non_utf8_run_names_are_refused(tmp_path):
    """`compare div.h5 A ''` compared the default run; a non-UTF-8 --run gave exit 3."""
    import torch

    from tracer.execute.records import CaptureRecord, RunRecord
    from tracer.store.formats import check_name
    from tracer.store.trace import TraceWriter

    cap = CaptureRecord(name="model.layers.0", kind="layer", tensor=torch.zeros(2, 4), op="X")
    with TraceWriter(tmp_path / "t.h5", header={}) as w:
        for name in "AB":
            w.add_run(RunRecord(name=name, token_ids=[1, 2], plan={}, window=(0, 2), captures={cap.name: cap}, meta={}))
    with pytest.raises(TracerError, match="run '' is not a valid trace name"):
        tracer.compare_trace(str(tmp_path / "t.h5"), "A", "")
    with pytest.raises(TracerError, match="not UTF-8"):
        check_name("eng\udcffine", "--run")


def test_report_of_an_empty_path_is_one_line(tmp_path, cli_env):
    p = subprocess.run([sys.executable, "-m", "tracer", "report", ""], capture_output=True, text=True, env=cli_env,
                       cwd=tmp_path, timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("options", [dict(kernels=True), dict(decode=2),
                                     dict(op_replay=True, granularity="sublayers"),
                                     dict(op_replay=True)])  # not "add --granularity sublayers", then this
def test_prefill_decode_refuses_kernels_op_replay_and_decode_before_loading(options):
    """prefill-decode (vLLM) refused --kernels and --decode only after both engines had loaded (21-49 s):
    config validation (what every run does before it loads anything) refuses them, in one line."""
    with pytest.raises(TracerError) as e:
        validate(RunConfig.from_options(model="tiny-llama", engine="vllm", scenario="prefill-decode", store="none",
                                        **options))
    msg = str(e.value)
    assert msg.startswith("--kernels, --op-replay and --decode are not available with prefill-decode"), msg
    assert "drop them" in msg and "\n" not in msg
