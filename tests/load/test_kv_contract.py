"""The KV cache's numeric contract (tracer/load/contract.py): written beside a cache, read back, held
against a consumer's; fatal differences refused in one line naming both sides."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import numpy as np
import pytest

from tracer.errors import TracerError
from tracer.load.contract import (KV_CONTRACT_FILE, KVContract, check_kv_contract, read_kv_contract, require_kv,
                                  tokens_sha256, write_kv_contract)

PRODUCER = KVContract(engine="vllm", version="0.32.0", device="cpu", model_dtype="bfloat16", storage_dtype="bfloat16",
                      layout="HND (keys HDN)", transfer_unit="block-row", block_size=32, layers=30, kv_heads=3,
                      head_dim=64, positions=(0, 128), tokens_sha256=tokens_sha256(list(range(128))),
                      attention_backend="CPU_ATTN", accumulator={"self_attn.qkv_proj": "torch F.linear"},
                      settings={"max_num_batched_tokens": 4096})


def test_written_contract_reads_back_equal(tmp_path):
    path = write_kv_contract(PRODUCER, tmp_path)
    assert path.name == KV_CONTRACT_FILE
    doc = json.loads(path.read_text())
    assert doc["format"] == "tracer-kv-contract" and doc["format_version"] == 1
    assert read_kv_contract(tmp_path) == PRODUCER == read_kv_contract(path)


def test_tokens_sha256_is_of_int64_little_endian_ids():
    ids = [5, 70000, 3]
    assert tokens_sha256(ids) == hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()


def test_same_contract_has_no_difference():
    result = check_kv_contract(PRODUCER, PRODUCER, "here")
    assert result.differences == () and require_kv(result) is result
    assert "agree on every field" in result.summary()


def test_layout_mismatch_is_refused_in_one_line_naming_both_layouts():
    result = check_kv_contract(PRODUCER, replace(PRODUCER, layout="NHD"), "vLLM ExampleConnector")
    with pytest.raises(TracerError) as e:
        require_kv(result)
    msg = str(e.value)
    assert "\n" not in msg and "KV layout: producer HND (keys HDN), consumer NHD" in msg


@pytest.mark.parametrize("field, value, words", [
    ("storage_dtype", "float32", "KV storage dtype: producer bfloat16, consumer float32"),
    ("block_size", 64, "KV block size: producer 32, consumer 64"),
    ("positions", (0, 96), "cached positions: producer 0..128, consumer 0..96"),
    ("kv_heads", 4, "KV heads: producer 3, consumer 4"),
])
def test_fatal_differences_name_both_sides(field, value, words):
    result = check_kv_contract(PRODUCER, replace(PRODUCER, **{field: value}))
    assert [d.field for d in result.fatal] == [field]
    with pytest.raises(TracerError, match=words.replace("(", r"\(").replace(")", r"\)")):
        require_kv(result)


def test_block_size_is_free_when_token_rows_cross():
    token = replace(PRODUCER, transfer_unit="token")
    result = check_kv_contract(token, replace(token, block_size=64))
    assert [d.field for d in result.differences] == ["block_size"] and not result.fatal


def test_other_differences_are_named_not_refused_and_come_after_fatal_ones():
    consumer = replace(PRODUCER, attention_backend="TRITON_ATTN", device="cuda", storage_dtype="float16",
                       settings={"max_num_batched_tokens": 32})
    result = check_kv_contract(PRODUCER, consumer)
    assert result.differences[0].field == "storage_dtype" and result.differences[0].fatal
    named = {d.field: d for d in result.differences[1:]}
    assert set(named) == {"attention_backend", "device", "settings"} and not any(d.fatal for d in named.values())
    assert named["settings"].line() == "engine settings: producer max_num_batched_tokens 4096, consumer max_num_batched_tokens 32"


def test_unknown_side_is_no_difference():
    assert check_kv_contract(PRODUCER, replace(PRODUCER, attention_backend="", tokens_sha256="")).differences == ()


def test_missing_or_foreign_contract_is_one_line(tmp_path):
    with pytest.raises(TracerError, match="no KV contract at"):
        read_kv_contract(tmp_path)
    (tmp_path / KV_CONTRACT_FILE).write_text(json.dumps({"format": "other"}))
    with pytest.raises(TracerError, match="is not a tracer KV contract"):
        read_kv_contract(tmp_path)
    (tmp_path / KV_CONTRACT_FILE).write_text(json.dumps({"format": "tracer-kv-contract", "format_version": 9}))
    with pytest.raises(TracerError, match="format_version 9"):
        read_kv_contract(tmp_path)
    (tmp_path / KV_CONTRACT_FILE).write_text("{")
    with pytest.raises(TracerError, match="not readable JSON"):
        read_kv_contract(tmp_path)
