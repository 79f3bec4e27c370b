"""The numeric contract in the header: buffer dtypes, casting after load, attention per layer kind."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tracer.load import models as M
from tracer.api import run
from tracer.load.contract import attention_kinds, cast_after_load, contract_differences, numeric_contract
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

    proc = subprocess.run([sys.executable, "-m", "tracer", "compare", str(paths[0]), str(paths[1])],
                          env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "warning: the numeric contract differs" in proc.stdout
    assert f"buffer {key} dtype float32 (A) vs bfloat16 (B)" in proc.stdout
    assert "model not cast (A) vs cast after loading (B)" in proc.stdout
    # the same contract on both sides: no warning
    proc = subprocess.run([sys.executable, "-m", "tracer", "compare", str(paths[0]), str(paths[0])],
                          env=cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
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
        "the numeric contract (buffer dtypes, casting, attention kinds) is recorded on one side only"]


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
