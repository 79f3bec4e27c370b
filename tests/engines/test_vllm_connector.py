"""prefill-decode planned (no vLLM needed): the scenario, its vLLM settings and window, the refusal
before any engine starts (tracer/plan/scenarios.py, tracer/engines/vllm/connector.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tracer.engines.door import realise
from tracer.engines.vllm.connector import check_before_start, sides, transferred
from tracer.errors import TracerError
from tracer.plan.build import build
from tracer.plan.scenarios import producer_difference


def _scen(n=130, **options):
    return realise(build("prefill-decode", n, engine="vllm", **options), "vllm")


@pytest.mark.parametrize("n, block, moved", [(130, 32, 128), (128, 32, 96), (129, 32, 96), (130, 64, 128), (34, 32, 32)])
def test_transferred_is_whole_blocks_of_the_first_n_minus_1_tokens(n, block, moved):
    # vLLM's align_to_block_size(N - 1, B) = (N - 1 - 1) // B * B, written out
    assert transferred(n, block) == moved == ((n - 1) - 1) // block * block


def test_vllm_realises_both_runs_on_one_consumer_and_starts_the_window_at_the_transfer():
    scen = _scen(130, new_tokens=4)
    assert scen.window == (128, 133) and scen.params["transferred"] == 128
    consumer_a, producer_a = sides(scen.plan_a)
    consumer_b, producer_b = sides(scen.plan_b)
    assert consumer_a == consumer_b == {"block_size": 32, "enable_prefix_caching": False}
    assert producer_a == {} and producer_b == consumer_b
    assert scen.plan_a.generate == scen.plan_b.generate == 4
    assert scen.plan_b.gemm_m() == [130, 1, 1, 1]


def test_producer_difference_is_one_setting():
    assert producer_difference("block_size=64") == {"block_size": 64}
    assert producer_difference(None) == {}
    assert sides(_scen(130, producer="max_num_batched_tokens=32").plan_b)[1]["max_num_batched_tokens"] == 32
    for bad, words in (("block_size=64,dtype=float32", "one difference at a time"), ("foo=1", "unknown setting"),
                       ("block_size=x", "number of tokens"), ("block_size=0", "positive number of tokens"),
                       ("max_num_batched_tokens=-5", "positive number of tokens"), ("attention_backend=", "give a value"),
                       ("block_size", "expected KEY=VALUE"), ("dtype=banana", "unknown dtype"),
                       ("kv_cache_dtype=banana", "unknown KV-cache dtype")):
        with pytest.raises(TracerError, match=words):
            producer_difference(bad)


def test_producer_dtype_names_go_through_the_dtype_table():
    # bf16 is the CLI's alias of bfloat16 (run --help): the same dtype as a bfloat16 consumer, not a mismatch
    assert producer_difference("dtype=bf16") == {"dtype": "bfloat16"}
    assert producer_difference("kv_cache_dtype=FP8_E4M3") == {"kv_cache_dtype": "fp8_e4m3"}
    assert producer_difference("kv_cache_dtype=fp16") == {"kv_cache_dtype": "float16"}


def test_reference_engine_refuses_the_scenario():
    with pytest.raises(TracerError, match="runs inside an engine.*--engine vllm"):
        realise(build("prefill-decode", 130), None)


def test_prompt_without_a_whole_block_to_hand_over_is_refused():
    with pytest.raises(TracerError, match="at least 34 tokens"):
        _scen(33)


def _model(dtype):
    cfg = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, num_hidden_layers=30)
    return SimpleNamespace(config=cfg, parameters=lambda: iter([torch.zeros(1, dtype=dtype)]))


def test_fp32_consumer_of_a_bf16_producer_is_refused_before_any_engine_starts():
    scen = _scen(130, producer="dtype=bfloat16")
    with pytest.raises(TracerError) as e:
        check_before_start([scen.plan_a, scen.plan_b], _model(torch.float32))
    assert "KV storage dtype: producer bfloat16, consumer float32" in str(e.value) and "\n" not in str(e.value)
    check_before_start([scen.plan_a, scen.plan_b], _model(torch.bfloat16))  # the same dtype on both sides: no refusal


@pytest.mark.parametrize("producer, words", [("block_size=64", "KV block size: producer 64, consumer 32"),
                                              ("kv_cache_dtype=fp8_e4m3", "producer float8_e4m3fn, consumer bfloat16")])
def test_byte_meaning_differences_are_refused_before_any_engine_starts(producer, words):
    scen = _scen(130, producer=producer)
    with pytest.raises(TracerError, match=words):
        check_before_start([scen.plan_a, scen.plan_b], _model(torch.bfloat16))


def test_gpu_token_rows_make_a_block_size_difference_a_row_not_a_refusal():
    # vLLM 0.26's TRITON_ATTN / FLEX_ATTENTION files hold token rows (their paged view is logical), so a
    # producer of KV block 64 hands the consumer of block 32 the same 128 tokens, each in its own row;
    # CPU_ATTN's block rows of another block size would land in the wrong slots (refused above)
    scen = _scen(130, producer="block_size=64", attention_backend="TRITON_ATTN")
    assert dict(scen.plan_b.engine_settings)["attention_backend"] == "TRITON_ATTN"
    check_before_start([scen.plan_a, scen.plan_b], _model(torch.bfloat16), "cuda")
    with pytest.raises(TracerError, match="KV block size: producer 64, consumer 32"):
        check_before_start([scen.plan_a, scen.plan_b], _model(torch.bfloat16), "cpu")


def test_token_rows_decode_to_keys_then_values(tmp_path):
    from safetensors.torch import save_file

    from tracer.engines.vllm.connector import contract, layout_of, transferred_kv, unit_of

    n, h, d = 64, 3, 4
    keys, values = torch.randn(n, h, d), torch.randn(n, h, d)
    save_file({"kv_cache": torch.cat([keys, values], dim=2)}, str(tmp_path / "model.layers.2.self_attn.attn.safetensors"))
    got = transferred_kv(tmp_path, {2: "model.layers.2.self_attn.kv_cache"}, n, 32, "cpu", "token")[2]
    assert torch.equal(got, torch.cat([keys.reshape(n, h * d), values.reshape(n, h * d)], dim=1))
    # the unit follows the backend and the device: token rows on a GPU for the logical-view backends
    assert unit_of(layout_of("TRITON_ATTN", {"device": "cuda"}))[0] == "token"
    assert unit_of(layout_of("CPU_ATTN", {"device": "cpu"}))[0] == "block-row"
    assert unit_of(layout_of("FLASH_ATTN", {"device": "cuda"})) == ("", "")
    side = contract({"attention_backend": "FLEX_ATTENTION"}, (2, 3, 4, "bfloat16"), 130, facts={"device": "cuda"})
    assert (side.transfer_unit, side.layout) == ("token", "NHD")
