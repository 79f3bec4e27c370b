"""How run plans become vLLM requests (tracer/execute/vllm_plan.py): no vLLM needed."""

from __future__ import annotations

import pytest

from tracer.errors import TracerError
from tracer.execute.vllm_plan import VllmSettings, check_schedule, chunk_mode, refuse_unsupported, settings_of, waves
from tracer.plan import scenarios as S

N = 100
IDS = list(range(1000, 1000 + N))


def test_prefix_cache_hit_is_a_prefix_request_then_the_prompt():
    scen = S.prefix_cache(N, block_size=32)
    mode = chunk_mode(scen.plan_b, {}, {"scenario": scen.name})
    assert mode == "prefix-cache"
    assert waves(IDS, scen.plan_b, mode, 32) == [([IDS[:96]], [True]), ([IDS], [True])]
    assert waves(IDS, scen.plan_a, chunk_mode(scen.plan_a, {}, {}), 32) == [([IDS], [True])]


def test_a_cached_prefix_off_the_block_grid_is_refused():
    scen = S.prefix_cache(N, split_at=50)
    with pytest.raises(TracerError, match="not a multiple of vLLM's KV block size 32"):
        waves(IDS, scen.plan_b, "prefix-cache", 32)


def test_chunked_prefill_sets_the_token_budget():
    scen = S.chunked_prefill(N, chunk_size=32)
    mode = chunk_mode(scen.plan_b, {}, {"scenario": scen.name})
    assert mode == "chunked" and settings_of(scen.plan_b, mode, {}).max_num_batched_tokens == 32
    assert waves(IDS, scen.plan_b, mode, 32) == [([IDS], [True])]
    with pytest.raises(TracerError, match="unknown vLLM chunk mode"):
        chunk_mode(scen.plan_b, {"chunks": "sideways"}, {})


def test_batch_rows_are_the_hf_batch_rows_without_padding():
    import torch

    from tracer.execute.runner import batch_inputs

    scen = S.batch(N, batch_size=4, padding="left")
    [(rows, traced)] = waves(IDS, scen.plan_b, "one-step", 32)
    ids, mask, _col = batch_inputs(IDS, scen.plan_b.batch, torch.device("cpu"))
    assert rows == [ids[j][mask[j].bool()].tolist() for j in range(4)]  # the same tokens as HF's padded batch
    assert traced == [j == scen.plan_b.batch.row for j in range(4)]


def test_a_schedule_other_than_the_plan_is_refused():
    scen = S.prefix_cache(N, block_size=32)
    req = lambda c, i: {"traced": True, "num_cached_tokens": c, "internal_id": i}  # noqa: E731
    steps = [{"requests": 1, "traced": [{"request": "a", "positions": [0, 96]}]},
             {"requests": 1, "traced": [{"request": "b", "positions": [96, 100]}]}]
    check_schedule(scen.plan_b, "prefix-cache", [req(0, "a"), req(96, "b")], steps)
    with pytest.raises(TracerError, match=r"num_cached_tokens \[0, 64\].*needs \[0, 96\]"):
        check_schedule(scen.plan_b, "prefix-cache", [req(0, "a"), req(64, "b")], steps)
    split = [{"requests": 1, "traced": [{"request": "b", "positions": [0, 50]}]},
             {"requests": 1, "traced": [{"request": "b", "positions": [50, 100]}]}]
    with pytest.raises(TracerError, match="split the prompt into 2 steps"):
        check_schedule(scen.plan_a, "one-step", [req(0, "b")], split)


def test_compilation_graphs_and_unsupported_plan_features_are_refused():
    with pytest.raises(TracerError, match="CUDA graphs"):
        VllmSettings(enforce_eager=False).check()
    with pytest.raises(TracerError, match="torch.compile"):
        VllmSettings(compilation_mode=3).check()
    tp = S.tensor_parallel(N, tp=2).plan_b
    with pytest.raises(TracerError, match="tensor parallelism is not available with the vllm engine"):
        refuse_unsupported(tp, False, False)
    with pytest.raises(TracerError, match="--kernels"):
        refuse_unsupported(S.repeat(N).plan_a, True, False)
