"""Each hierarchy scenario's two plans really differ in the way they claim (CPU, tiny random models)."""

from __future__ import annotations

import pytest
import torch

from tracer.execute.points import discover_points
from tracer.diff.compare import compare_records
from tracer.errors import TracerError
from tracer.load.hf_cache import output_cache
from tracer.plan.quant import fp8_e4m3
from tracer.engines.hf.run import batch_inputs, execute, forward_chunks
from tracer.plan.build import build
from tracer.plan.scenarios import SCENARIOS, Batch, RunPlan, Scenario


def execute_scenario(model, token_ids, scen, points, names=None):
    """Both plans of ``scen`` (A, then B) executed in this process, records named ``names`` (the
    plans' names by default), the scenario in each run's ``meta``: what the pipeline does per plan."""
    records = []
    for plan, name in zip((scen.plan_a, scen.plan_b), names or (scen.plan_a.name, scen.plan_b.name)):
        rec = execute(model, token_ids, plan, points, scen.window, meta={"scenario": scen.name, "level": scen.level})
        rec.name = name
        records.append(rec)
    return records[0], records[1]


IDS = [(7 * i + 3) % 500 for i in range(40)]
N = len(IDS)


def test_catalogue_has_every_level():
    from tracer.config import applicable_options

    levels = {build(name, 100, **({"devices": "cpu,cpu"} if "devices" in applicable_options(name) else {})).level
              for name in SCENARIOS}
    assert levels == set(range(8))


@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_batch_plan_puts_the_prompt_at_the_stated_row(padding):
    s = build("batch", N, batch_size=4, padding=padding, batch_row=1)
    spec = s.plan_b.batch
    assert spec.row == 1 and spec.size == 4 and spec.lengths[1] == N
    ids, mask, col = batch_inputs(IDS, spec, torch.device("cpu"))
    assert ids.shape == (4, spec.width)
    assert ids[1, col:col + N].tolist() == IDS and mask[1, col:col + N].tolist() == [1] * N
    assert int(mask[1].sum()) == N  # every other column of the row is padding, masked out
    if padding == "none":
        assert spec.width == N and col == 0 and bool(mask.all())
    else:
        assert spec.width > N  # the traced row really is padded
        assert col == (spec.width - N if padding == "left" else 0)
        for j, length in enumerate(spec.lengths):
            real = mask[j].nonzero().flatten().tolist()
            start = spec.width - length if padding == "left" else 0
            assert real == list(range(start, start + length))
    assert [ids[j, :].tolist() for j in range(4) if j != 1] != [IDS] * 3  # other rows hold other prompts


@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_batched_row_equals_a_standalone_run(tiny_llama, padding):
    s = build("batch", N, batch_size=3, padding=padding, batch_row=2 if padding == "left" else 0)
    points = discover_points(tiny_llama)
    a, b = execute_scenario(tiny_llama, IDS, s, points)
    for name, ra in a.captures.items():
        rb = b.captures[name]
        assert rb.tensor.shape == ra.tensor.shape == (N, ra.tensor.shape[-1])  # only the N real positions
        # float32: a batch changes rounding only; padding leaking into attention would not be this close
        assert torch.allclose(ra.tensor, rb.tensor, rtol=1e-4, atol=1e-4), name
    assert b.captures["model.layers.0"].calls[0]["in"][0][0] == 3  # the layer saw 3 rows


def test_chunked_prefill_and_block_size_plans():
    s = build("chunked-prefill", N, chunk_size=16)
    assert s.plan_b.chunks == ((0, 16), (16, 32), (32, 40)) and s.window == (0, N)
    assert build("chunked-prefill", N, chunk_size=1).plan_b.gemm_m() == [1] * N
    s = build("block-size", 100, block_sizes=(16, 64))
    assert s.plan_a.chunks == ((0, 96), (96, 100)) and s.plan_b.chunks == ((0, 64), (64, 100))
    assert s.window == (96, 100)


def test_decode_step_case_of_prefix_cache():
    s = build("prefix-cache", N, split_at=N - 1)
    assert s.plan_b.gemm_m() == [N - 1, 1] and s.window == (N - 1, N)


def test_generate_cache_matches_hf_generate(tiny_llama):
    t = 5
    s = build("generate-cache", N, new_tokens=t)
    assert s.window == (N - 1, N - 1 + t) and s.plan_b.gemm_m() == [N + i for i in range(t)]
    a, b = execute_scenario(tiny_llama, IDS, s, discover_points(tiny_llama))
    with torch.inference_mode():
        ref = tiny_llama.generate(torch.tensor([IDS]), max_new_tokens=t, do_sample=False,
                                  pad_token_id=0)[0, N:].tolist()
    assert a.meta["generated"] == ref
    assert len(b.meta["generated"]) == t
    assert a.captures["lm_head"].tensor.shape == (t, 512) == b.captures["lm_head"].tensor.shape
    # step t's logits from the recomputing run: the last position of a fresh forward over N + t tokens
    seq = IDS + b.meta["generated"][:2]
    with torch.inference_mode():
        fresh = tiny_llama(torch.tensor([seq])).logits[0, -1]
    assert torch.equal(b.captures["lm_head"].tensor[2], fresh)


def test_kv_quant_rounds_the_cache_between_chunks(tiny_llama):
    s = build("kv-quant", N, kv_format="fp8-e4m3", split_at=30)
    assert s.params["kv_block_format"]["name"] == "fp8-e4m3"
    ids = torch.tensor([IDS])
    with torch.inference_mode():
        out_b = forward_chunks(tiny_llama, ids, s.plan_b)
        out_a = forward_chunks(tiny_llama, ids, s.plan_a)
    kb, ka = output_cache(out_b).layers[0].keys, output_cache(out_a).layers[0].keys
    assert torch.equal(kb, fp8_e4m3(kb))  # every cached key is an E4M3 value
    assert not torch.equal(ka, fp8_e4m3(ka))
    assert torch.equal(kb[:, :, :30], fp8_e4m3(ka[:, :, :30]))  # the prefix was rounded, not recomputed differently


def test_attention_plan_switches_and_restores(tiny_llama):
    assert tiny_llama.config._attn_implementation == "sdpa"
    s = build("attention", N)
    points = discover_points(tiny_llama)
    a, b = execute_scenario(tiny_llama, IDS, s, points)
    assert tiny_llama.config._attn_implementation == "sdpa"
    ref = execute(tiny_llama, IDS, RunPlan("X", ((0, N),)), points, (0, N))
    assert torch.equal(b.captures["lm_head"].tensor, ref.captures["lm_head"].tensor)  # B is sdpa
    assert torch.allclose(a.captures["lm_head"].tensor, ref.captures["lm_head"].tensor, atol=1e-4)
    with pytest.raises(TracerError, match="attention"):
        build_bad = build("attention", N, attn_b="nonexistent")
        execute_scenario(tiny_llama, IDS, build_bad, points)
    assert tiny_llama.config._attn_implementation == "sdpa"


def test_tensor_parallel_plan(tiny_llama):
    points = discover_points(tiny_llama)
    a, b = execute_scenario(tiny_llama, IDS, build("tensor-parallel", N, tp=1), points)
    assert compare_records(a, b, scenario="tp", model="m").identical  # k = 1 is the unsharded model
    a, b = execute_scenario(tiny_llama, IDS, build("tensor-parallel", N, tp=4, reduce="tree"), points)
    assert torch.allclose(a.captures["lm_head"].tensor, b.captures["lm_head"].tensor, atol=1e-4)
    assert {k: b.plan["tp"][k] for k in ("k", "reduce", "dtype")} == {"k": 4, "reduce": "tree", "dtype": "activation"}


def test_device_and_disaggregated_plans_on_one_device(tiny_llama):
    points = discover_points(tiny_llama)
    for name in ("device", "disaggregated"):
        s = build(name, N, devices="cpu,cpu")
        a, b = execute_scenario(tiny_llama, IDS, s, points)
        assert compare_records(a, b, scenario=name, model="m").identical
    assert build("disaggregated", N, devices="cpu,cuda").plan_b.devices == ("cpu", "cuda")
    with pytest.raises(TracerError, match="two devices"):
        build("device", N, devices="cpu")


def test_deterministic_mitigation_sets_and_restores_flags(tiny_llama):
    import os

    before = (torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    s = build("repeat", N, mitigation="deterministic")
    assert s.plan_a.deterministic and s.plan_b.deterministic
    execute_scenario(tiny_llama, IDS, s, discover_points(tiny_llama))
    assert (torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")) == before
    with pytest.raises(TracerError, match="prefix-cache only"):
        build("repeat", N, mitigation="aligned")


def test_user_defined_scenario_through_the_api():
    import tracer

    def mine(n):
        return Scenario("mine", 1, "batch size", RunPlan("A", ((0, n),)),
                        RunPlan("B", ((0, n),), batch=Batch(size=2, row=1, padding="none", lengths=(n, n))), (0, n))

    res = tracer.run("tiny-llama", scenario=mine, length=24, device="cpu", dtype="float32", store=False, progress=False)
    assert res.comparison.scenario == "mine" and res.comparison.n_positions == 24


def test_bad_scenario_options():
    with pytest.raises(TracerError, match="padding"):
        build("batch", N, padding="middle")
    with pytest.raises(TracerError, match="batch-row"):
        build("batch", N, batch_size=2, batch_row=5)
    with pytest.raises(TracerError, match="kv-format"):
        build("kv-quant", N, kv_format="int3")
    with pytest.raises(TracerError, match="reduce"):
        build("tensor-parallel", N, reduce="butterfly")
    with pytest.raises(TracerError, match="chunk-size"):
        build("chunked-prefill", N, chunk_size=0)


def test_compile_plan_or_clear_skip(tiny_llama):
    points = discover_points(tiny_llama)
    try:
        a, b = execute_scenario(tiny_llama, IDS[:16], build("compile", 16), points)
    except TracerError as e:  # no compiler toolchain here: the reason is one line naming the scenario
        assert "compile" in str(e)
        pytest.skip(str(e))
    assert b.plan["compile"] is True
    assert torch.allclose(a.captures["lm_head"].tensor, b.captures["lm_head"].tensor, atol=1e-4)
    assert "forward" not in tiny_llama.__dict__  # the model itself is left uncompiled
