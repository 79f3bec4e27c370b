"""The numeric contract in the header: buffer dtypes, casting after load, attention per layer kind."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from tracer.errors import TracerError
from tracer.load import models as M
from tracer.api import run
from tracer.load.contract import attention_kinds, cast_after_load, contract_differences, numeric_contract
from tracer.load.kv_contract import (KV_CONTRACT_FILE, KVContract, check_kv_contract, read_kv_contract, require_kv,
                                     tokens_sha256, write_kv_contract)
from tracer.load.hf_cache import cache_kwarg, output_cache
from tracer.store.trace import TraceReader

IDS = [(7 * i + 3) % 250 for i in range(24)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """tiny-llama saved as a float32 checkpoint with its tokenizer."""
    folder = tmp_path_factory.mktemp("tiny")
    src = M.load_model("tiny-llama", dtype="float32", device="cpu", progress=False)
    src.model.save_pretrained(folder)
    src.tokenizer.save_pretrained(folder)
    return folder


def _cast_model(folder):
    """The other way to get a bf16 model: load float32, then a blanket .to(bfloat16)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(torch.bfloat16).eval()
    model.requires_grad_(False)
    return model


def test_cast_vs_dtype_header_and_compare_warning(saved, tmp_path, cli_env):
    loaded = M.load_model(str(saved), dtype="bfloat16", device="cpu", progress=False)
    cast = M.LoadedModel(model=_cast_model(saved), tokenizer=loaded.tokenizer, info=loaded.info)
    # the independent facts, read off the two models
    assert loaded.model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert cast.model.model.rotary_emb.inv_freq.dtype == torch.bfloat16

    paths = []
    for name, lm in (("dtype", loaded), ("cast", cast)):
        path = tmp_path / f"{name}.h5"
        run(str(saved), loaded=lm, token_ids=IDS, scenario="repeat", output=path, progress=False)
        paths.append(path)
    with TraceReader(paths[0]) as ra, TraceReader(paths[1]) as rb:
        ha, hb = ra.header["numeric_contract"], rb.header["numeric_contract"]
    key = "model.rotary_emb.inv_freq"
    assert (ha["buffers"][key]["dtype"], hb["buffers"][key]["dtype"]) == ("float32", "bfloat16")
    assert ha["buffers"][key]["device"] == hb["buffers"][key]["device"] == "cpu"
    assert ha["cast_after_load"]["detected"] is False
    assert hb["cast_after_load"]["detected"] is True and key in hb["cast_after_load"]["evidence"][0]

    from tests.helpers import tracer_warm

    proc = tracer_warm(["compare", str(paths[0]), str(paths[1])], cli_env, tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())  # piped output is fitted to the width: lines wrap at words
    assert "warning: the numeric contract differs" in out
    assert f"buffer {key} dtype float32 (A) vs bfloat16 (B)" in out
    assert "model not cast (A) vs cast after loading (B)" in out
    # the same contract on both sides: no warning
    proc = tracer_warm(["compare", str(paths[0]), str(paths[0])], cli_env, tmp_path, check=False)
    assert proc.returncode == 0 and "numeric contract differs" not in proc.stdout


def test_float32_cast_is_not_flagged_and_differences_are_named():
    model = M.load_model("tiny-llama", dtype="float32", device="cpu", progress=False).model
    assert cast_after_load(model) == {"detected": False, "evidence": []}
    a = numeric_contract(model)
    b = numeric_contract(model)
    assert contract_differences({"numeric_contract": a}, {"numeric_contract": b}) == []
    b["attention"]["full_attention"]["implementation"] = "eager"
    assert contract_differences({"numeric_contract": a}, {"numeric_contract": b}) == [
        "full_attention attention sdpa on 4 layers (A) vs eager on 4 layers (B)"]
    assert contract_differences({}, {"numeric_contract": a}) == [
        "recorded in one trace only (buffer dtypes, casting, attention kinds)"]
    # said after "warning: the numeric contract differs: ": the phrase does not say it again
    assert "numeric contract" not in contract_differences({}, {"numeric_contract": a})[0]


def _tiny_gemma3(attn="sdpa"):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    cfg = AutoConfig.for_model("gemma3_text", num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
                               sliding_window=8, layer_types=types)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation=attn).eval()
    model.requires_grad_(False)
    return model, types


def test_attention_kinds_and_gemma_buffers():
    model, types = _tiny_gemma3()
    kinds = attention_kinds(model)
    assert kinds == {
        "sliding_attention": {"implementation": "sdpa", "layers": [i for i, t in enumerate(types) if t == "sliding_attention"],
                              "sliding_window": 8},
        "full_attention": {"implementation": "sdpa", "layers": [2], "sliding_window": None},
    }
    buffers = numeric_contract(model)["buffers"]
    scale = model.model.embed_tokens.embed_scale
    assert buffers["model.embed_tokens.embed_scale"]["dtype"] == str(scale.dtype).removeprefix("torch.")
    assert all(b["dtype"] == "float32" for n, b in buffers.items() if n.endswith("inv_freq"))


def test_report_marks_sliding_layers(tmp_path):
    model, types = _tiny_gemma3()
    info = M.ModelInfo(name="tiny-gemma3", source="hf", family="gemma3_text", dtype="bfloat16", device="cpu",
                       attn_implementation="sdpa", weights_hash=None, path=None, n_layers=4, hidden_size=64,
                       vocab_size=300)
    lm = M.LoadedModel(model=model, tokenizer=None, info=info)  # no tokenizer: the run takes token ids
    res = run("tiny-gemma3", loaded=lm, token_ids=IDS, store="none", progress=False)
    assert res.comparison.facts["sliding_layers"] == [0, 1, 3] and res.comparison.facts["sliding_window"] == 8
    from tracer.report.render import render

    md = render(res.comparison, "markdown")
    for i, kind in enumerate(types):
        row = next(line for line in md.splitlines() if line.startswith(f"| model.layers.{i} "))
        assert ("(sliding)" in row) == (kind == "sliding_attention"), row


def test_cache_argument_follows_the_installed_transformers(tiny_llama):
    import inspect

    takes_cache = "cache" in inspect.signature(type(tiny_llama).forward).parameters
    assert cache_kwarg(tiny_llama) == ("cache" if takes_cache else "past_key_values")
    with torch.no_grad():
        out = tiny_llama(torch.tensor([IDS[:10]]), use_cache=True)
        first = output_cache(out)
        assert first is not None and first.get_seq_length() == 10
        out = tiny_llama(torch.tensor([IDS[10:12]]), use_cache=True, **{cache_kwarg(tiny_llama): first})
    assert output_cache(out).get_seq_length() == 12


def test_cache_hit_beyond_the_sliding_window(tmp_path):
    """Tiny Gemma 3 with an 8-token window, cached prefix P = 32: sliding layers keep their last
    positions only; every KV point equals HF's own cache of a cache-hit prefill, bit for bit."""
    model, types = _tiny_gemma3()
    info = M.ModelInfo(name="tiny-gemma3", source="hf", family="gemma3_text", dtype="bfloat16", device="cpu",
                       attn_implementation="sdpa", weights_hash=None, path=None, n_layers=4, hidden_size=64,
                       vocab_size=300)
    ids = [(7 * i + 3) % 250 for i in range(40)]
    res = run("tiny-gemma3", loaded=M.LoadedModel(model=model, tokenizer=None, info=info), token_ids=ids,
              output=tmp_path / "t.h5", progress=False, granularity="sublayers")
    assert res.scenario.window == (32, 40)
    with torch.no_grad():  # an independent cache hit: prefix pass, then suffix pass
        out = model(torch.tensor([ids[:32]]), use_cache=True)
        out = model(torch.tensor([ids[32:]]), use_cache=True, **{cache_kwarg(model): output_cache(out)})
    cache = output_cache(out)
    rec_b = res.runs[1]
    for i, kind in enumerate(types):
        k, v = cache.layers[i].keys[0], cache.layers[i].values[0]  # (kv_heads, S, head_dim)
        s = k.shape[1]
        assert (s < 40) == (kind == "sliding_attention")
        expected = torch.cat([k.transpose(0, 1).reshape(s, -1), v.transpose(0, 1).reshape(s, -1)], dim=1)
        got = rec_b.captures[f"model.layers.{i}.self_attn.kv_cache"].tensor
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), i
    # Gemma 3 normalises q after the head transpose: (B, H, S, D); the capture is (S, H, D)
    seen = {}
    norm = model.model.layers[0].self_attn.q_norm
    handle = norm.register_forward_hook(lambda mod, args, out: seen.setdefault("q", out))
    with torch.no_grad():
        model(torch.tensor([ids]))
    handle.remove()
    assert seen["q"].shape == (1, 4, 40, 16)  # (B, heads, S, head_dim)
    got = res.runs[0].captures["model.layers.0.self_attn.q_norm"].tensor  # run A: one pass of 40
    assert torch.equal(got.view(torch.int16), seen["q"][0].transpose(0, 1)[32:40].view(torch.int16))


# ---------------------------------------------------------------- the KV cache's contract

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
