"""Real tensor parallelism over torch.distributed (gloo on the CPU): sums, TP-1 identity, failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import tracer
from tests.helpers import tracer_cli, tracer_warm
from tracer.errors import TracerError

CPU = dict(device="cpu", store="none", progress=False)


@pytest.fixture(scope="module")
def tiny32():
    return tracer.load_model("tiny-llama", dtype="float32", device="cpu", progress=False)


def test_tp2_partials_add_up_to_the_tp1_product(tiny32, tmp_path):
    res = tracer.run("tiny-llama", loaded=tiny32, scenario="tensor-parallel", tp=2, tp_mode="distributed",
                     tp_partials=True, length=24, granularity="sublayers", device="cpu", progress=False,
                     output=tmp_path / "t.h5")
    rec_a, rec_b = res.runs
    parts = res.partials.captures
    model = tiny32.model
    rows = [n for n, m in model.named_modules() if n.endswith(("o_proj", "down_proj"))]
    assert sorted(parts) == sorted(f"{n}.partial.rank{r}" for n in rows for r in (0, 1))
    for name in rows:
        p0, p1 = (parts[f"{name}.partial.rank{r}"].tensor for r in (0, 1))
        assert p0.dtype == torch.float32 and p0.shape == (24, 64)
        w = model.get_submodule(name).weight.double()  # (N, K) of the unsharded layer
        x_name = name.rsplit(".", 1)[0] + (".core" if name.endswith("o_proj") else ".down_proj.input")
        x = rec_b.captures[x_name].tensor.double()  # run B's input of the layer, gathered over the ranks: (24, K)
        half = w.shape[1] // 2
        # each rank's partial is its half of the contraction, computed in float32
        assert torch.allclose(p0.double(), x[:, :half] @ w[:, :half].T, rtol=1e-5, atol=1e-5)
        assert torch.allclose(p1.double(), x[:, half:] @ w[:, half:].T, rtol=1e-5, atol=1e-5)
        # the partials add up (float64) to the whole product, within float32 rounding
        total = p0.double() + p1.double()
        assert torch.allclose(total, x @ w.T, rtol=1e-5, atol=1e-5)
        # ... and to run A's TP-1 product of the same layer (its inputs differ from B's by rounding only)
        assert torch.allclose(total, rec_a.captures[name].tensor.double(), rtol=1e-3, atol=1e-4)
        # the real all_reduce of 2 ranks rounds p0 + p1 once: bit for bit the float32 sum
        assert torch.equal(rec_b.captures[name].tensor, p0 + p1)
    # sharded captures come back in the unsharded layout
    for pname in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.kv_cache", "model.layers.0.mlp.act_fn"):
        assert rec_b.captures[pname].tensor.shape == rec_a.captures[pname].tensor.shape
    # q_proj of layer 0 sees the same input in both runs: each rank's N/2 columns match the whole GEMM within rounding
    assert torch.allclose(rec_b.captures["model.layers.0.self_attn.q_proj"].tensor,
                          rec_a.captures["model.layers.0.self_attn.q_proj"].tensor, rtol=1e-5, atol=1e-6)


def test_tp1_distributed_is_bit_identical_to_the_plain_run(tmp_path):
    lm = tracer.load_model("tiny-llama", dtype="bfloat16", device="cpu", progress=False)
    res = tracer.run("tiny-llama", loaded=lm, scenario="tensor-parallel", tp=1, tp_mode="distributed",
                     length=20, device="cpu", progress=False, output=tmp_path / "t.h5")
    assert res.comparison.identical, res.comparison.first_divergent
    ids = torch.tensor([res.token_ids])
    with torch.inference_mode():
        ref = lm.model(ids).logits[0]  # (N, V) bf16, the plain HF forward
    assert torch.equal(res.runs[1].captures["lm_head"].tensor, ref)


def test_bad_input_is_refused_before_anything_is_spawned(tiny32, monkeypatch):
    with pytest.raises(TracerError, match="does not divide the 4 attention heads"):
        tracer.run("tiny-llama", loaded=tiny32, scenario="tensor-parallel", tp=3, tp_mode="distributed", length=8, **CPU)
    with pytest.raises(TracerError, match="--reduce"):
        tracer.run("tiny-llama", loaded=tiny32, scenario="tensor-parallel", tp=2, tp_mode="distributed",
                   reduce="tree", length=8, **CPU)
    with pytest.raises(TracerError, match="--verdict"):
        tracer.run("tiny-llama", loaded=tiny32, scenario="tensor-parallel", tp=2, tp_mode="distributed",
                   verdict=True, length=8, **CPU)
    import torch.distributed as dist

    from tracer.engines.tp import dist as tp_dist

    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(TracerError, match="--tp 2 needs 2 GPUs"):
        tp_dist.check_world(2, "cuda")
    monkeypatch.setattr(dist, "is_gloo_available", lambda: False)
    with pytest.raises(TracerError, match="no gloo backend"):
        tracer.run("tiny-llama", loaded=tiny32, scenario="tensor-parallel", tp=2, tp_mode="distributed", length=8, **CPU)


def test_cli_tp2_end_to_end(cli_env, tmp_path):
    out = tmp_path / "tp2.h5"
    p = tracer_cli(["run", "tiny-llama", "--device", "cpu", "--scenario", "tensor-parallel", "--tp", "2",
                    "--tp-mode", "distributed", "--tp-partials", "--tp-vocab-parallel", "--length", "24", "-o", str(out),
                    "--format", "json"], cli_env, tmp_path, check=False, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["scenario"] == "tensor-parallel" and doc["logits"]["n_total"] == 24 * 512
    # the vocab-parallel embedding adds exact zeros from the other rank: bit-identical to the unsharded lookup
    emb = next(p for p in doc["layers"] if p["name"] == "model.embed_tokens")
    assert emb["n_diff"] == 0 and emb["n_total"] == 24 * 64
    with tracer.read_trace(out) as r:
        assert r.runs == ["A", "B", "B.partials"]
        facts = r.header["tensor_parallel"]
        assert (facts["world_size"], facts["backend"], facts["mode"]) == (2, "gloo", "distributed")
        assert "vocab-parallel" in facts["sharding"] and r.tensor("B", "lm_head").shape == (24, 512)


def _marked(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in env:
            found.append(int(pid))
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to find orphans")
def test_a_rank_that_dies_stops_the_run_without_trace_or_orphans(cli_env, tmp_path):
    marker = f"tracer-test-{uuid.uuid4().hex}"
    env = dict(cli_env, TRACER_TP_FAULT_RANK="1", TRACER_TEST_MARKER=marker)
    out = tmp_path / "dead.h5"
    p = tracer_cli(["run", "tiny-llama", "--device", "cpu", "--scenario", "tensor-parallel", "--tp", "2",
                    "--tp-mode", "distributed", "--length", "24", "-o", str(out)], env, tmp_path, check=False,
                   timeout=300)
    assert p.returncode == 2
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]  # (transformers may warn too)
    assert len(errors) == 1 and "rank 1 of 2" in errors[0] and "SIGKILL" in errors[0], p.stderr
    assert "Traceback" not in p.stderr
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())  # no trace, no partial file
    deadline = time.monotonic() + 15
    while _marked(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _marked(marker) == []


def test_torchrun_ranks_give_what_the_spawned_ranks_give(cli_env, tmp_path):
    env = dict(cli_env, OMP_NUM_THREADS="2")  # spawned: 2 // 2 = 1 thread per rank; torchrun: 1 per rank
    args = ["run", "tiny-llama", "--device", "cpu", "--scenario", "tensor-parallel", "--tp", "2",
            "--tp-mode", "distributed", "--length", "24", "--format", "json"]
    assert tracer_warm(args + ["-o", str(tmp_path / "spawn.h5")], env, tmp_path, check=False,
                       timeout=300).returncode == 0
    tr = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         "-m", "tracer", *args, "-o", str(tmp_path / "torchrun.h5")], env=env, cwd=tmp_path,
                        capture_output=True, text=True, timeout=300)
    assert tr.returncode == 0, tr.stderr
    assert tr.stdout.count('"scenario"') == 1  # only rank 0 reports
    with tracer.read_trace(tmp_path / "torchrun.h5") as r:
        assert r.header["tensor_parallel"]["launcher"] == "torchrun"
    same = tracer_warm(["compare", f"{tmp_path / 'spawn.h5'}:B", f"{tmp_path / 'torchrun.h5'}:B", "-f", "json"], env,
                       tmp_path, check=False, timeout=300)
    assert json.loads(same.stdout)["identical"] is True


def test_per_head_norms_come_back_in_the_unsharded_layout(tmp_path):
    """Qwen3's q_norm/k_norm outputs are (T, heads, head_dim): each rank holds its heads, and run B's
    capture is them concatenated along the heads, equal to the unsharded norm of the same input."""
    lm = tracer.load_model("tiny-qwen3", dtype="float32", device="cpu", progress=False)
    res = tracer.run("tiny-qwen3", loaded=lm, scenario="tensor-parallel", tp=2, tp_mode="distributed",
                     granularity="sublayers", length=24, device="cpu", progress=False, store="tensors",
                     output=tmp_path / "q.h5")
    rec_a, rec_b = res.runs
    attn = lm.model.model.layers[0].self_attn
    x = rec_a.captures["model.layers.0.input_layernorm"].tensor  # (24, hidden): the same in both runs
    with torch.no_grad():
        for proj, norm, heads in (("q_proj", "q_norm", 4), ("k_proj", "k_norm", 2)):
            want = getattr(attn, norm)(getattr(attn, proj)(x).view(24, heads, 16))  # (T, heads, head_dim)
            got = rec_b.captures[f"model.layers.0.self_attn.{norm}"].tensor
            assert got.shape == want.shape == rec_a.captures[f"model.layers.0.self_attn.{norm}"].tensor.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
