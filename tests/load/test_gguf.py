"""Any GGUF file as a model (`tracer run FILE.gguf`), and models without a tokenizer (token ids only)."""

from __future__ import annotations

import json

import pytest
import torch

from tracer.load import models as M
from tracer.load import gguf as G
from tracer.api import run
from tracer.errors import TracerError

gguf = pytest.importorskip("gguf")

# qwen3 (another architecture than the GGUF recipes' llama and gemma3); head_dim 128 because
# transformers' GGUF reader does not read it and takes Qwen3's default
QWEN3 = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
             num_key_value_heads=1, head_dim=128, vocab_size=300, max_position_embeddings=256,
             tie_word_embeddings=False, rope_theta=10000.0)
IDS = [(11 * i + 5) % 300 for i in range(40)]


def tiny_qwen3(**overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(3)
    cfg = AutoConfig.for_model("qwen3", **{**QWEN3, **overrides})
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def write_gguf(model, path, head_dim_ok=True):
    """The model's float32 tensors under llama.cpp's names (gguf's own name map), no tokenizer."""
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    for key, value in model.state_dict().items():
        base, suffix = key.rsplit(".", 1)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", value.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    model = tiny_qwen3()
    return model, write_gguf(model, folder / "tiny-qwen3.gguf")


def test_gguf_file_loads_as_model_and_is_cached(qwen3_gguf, tmp_path, monkeypatch):
    model, path = qwen3_gguf
    monkeypatch.setenv("TRACER_CACHE_DIR", str(tmp_path / "cache"))
    lm = M.load_model(str(path), dtype="float32", device="cpu", progress=False)
    assert (lm.info.name, lm.info.source, lm.info.family, lm.info.n_layers) == ("tiny-qwen3", "gguf", "qwen3", 2)
    assert lm.tokenizer is None  # the GGUF holds no tokenizer
    ref = model.state_dict()
    got = lm.model.state_dict()
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    (entry,) = list((tmp_path / "cache").iterdir())
    assert entry.name == f"gguf-{G.sha256_file(path)[:16]}"  # keyed by the file's content, not its name
    monkeypatch.setattr(G, "_build_gguf_cache", lambda *a, **k: pytest.fail("cache was rebuilt"))
    again = M.load_model(str(path), dtype="bfloat16", device="cpu", progress=False)
    assert again.model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    # the same bytes under another name (a recipe's file, a copy) share the entry: nothing is built again
    import shutil

    copy = tmp_path / "renamed.gguf"
    shutil.copy(path, copy)
    other = M.load_model(str(copy), dtype="float32", device="cpu", progress=False)
    assert other.info.weights_hash == lm.info.weights_hash and list((tmp_path / "cache").iterdir()) == [entry]


def test_an_entry_built_under_a_name_is_reused(qwen3_gguf, tmp_path, monkeypatch):
    """A cache entry built before the cache was keyed by content alone (``<name>-<sha256[:16]>``) is the
    same file's dequantization: a load by path reuses it instead of building a second copy."""
    model, path = qwen3_gguf
    monkeypatch.setenv("TRACER_CACHE_DIR", str(tmp_path / "cache"))
    M.load_model(str(path), dtype="float32", device="cpu", progress=False)
    digest = G.sha256_file(path)
    legacy = tmp_path / "cache" / f"smollm2-135m-{digest[:16]}"
    (tmp_path / "cache" / f"gguf-{digest[:16]}").rename(legacy)
    monkeypatch.setattr(G, "_build_gguf_cache", lambda *a, **k: pytest.fail("cache was rebuilt"))
    lm = M.load_model(str(path), dtype="float32", device="cpu", progress=False)
    assert G.cached_gguf_dir(digest) == legacy and list((tmp_path / "cache").iterdir()) == [legacy]
    assert all(torch.equal(lm.model.state_dict()[k], v) for k, v in model.state_dict().items())


def test_gguf_file_errors(qwen3_gguf, tmp_path):
    _, path = qwen3_gguf
    with pytest.raises(TracerError, match="does not exist; check the path"):
        M.load_model(str(tmp_path / "nope.gguf"), device="cpu", progress=False)
    with pytest.raises(TracerError, match="is a GGUF file already; drop --gguf"):
        M.load_model(str(path), gguf=str(path), device="cpu", progress=False)
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(TracerError, match="is not a GGUF file"):
        M.load_model(str(tmp_path / "text.gguf"), device="cpu", progress=False)


def test_gguf_with_unreadable_head_dim_is_refused(tmp_path, monkeypatch):
    """head_dim 32 is not in the file; transformers would build 128-wide heads: a one-line error."""
    monkeypatch.setenv("TRACER_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tiny_qwen3(head_dim=32), tmp_path / "odd.gguf")
    with pytest.raises(TracerError, match=r"do not have the shape .*q_proj.weight: \(64, 64\) vs \(256, 64\)"):
        M.load_model(str(path), device="cpu", progress=False)
    assert list((tmp_path / "cache").iterdir()) == []


def test_cli_runs_gguf_file_on_token_ids(qwen3_gguf, tmp_path, cli_env):
    model, path = qwen3_gguf
    cli_env["TRACER_CACHE_DIR"] = str(tmp_path / "cache")
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps(IDS))
    from tests.helpers import tracer_warm

    proc = tracer_warm(["run", str(path), "--token-ids-file", str(ids_file), "--device", "cpu", "--dtype", "float32",
                        "--scenario", "repeat", "--format", "json", "--no-store"], cli_env, tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["model"] == "tiny-qwen3" and out["identical"] is True
    # 1 embedding + 2 layers + 2 KV caches + final norm, then the logits
    assert [p["kind"] for p in out["layers"]].count("kv_cache") == 2 and len(out["layers"]) == 6
    # text on a tokenizer-less model: one line, exit 2, says what to do
    proc = tracer_warm(["run", str(path), "--device", "cpu", "--no-store"], {**cli_env, "TRACER_PROGRESS": "off"},
                       tmp_path, check=False)  # the error is the only line: no progress line of a slow load
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "has no tokenizer" in proc.stderr and "--token-ids-file" in proc.stderr


def test_tokenizer_less_folder_runs_on_token_ids(tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_qwen3()
    src.save_pretrained(tmp_path / "m")  # weights and config only: no tokenizer files
    lm = M.load_model(str(tmp_path / "m"), dtype="float32", device="cpu", progress=False)
    assert lm.tokenizer is None
    res = run(str(tmp_path / "m"), token_ids=IDS, device="cpu", dtype="float32", output=tmp_path / "t.h5",
              progress=False, granularity="layers", kv_cache=False)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    with torch.no_grad():
        hs = ref(torch.tensor([IDS]), output_hidden_states=True).hidden_states
    p = res.scenario.window[0]
    got = res.runs[0].captures["model.layers.0"].tensor
    assert torch.equal(got, hs[1][0, p:])  # run A is the full prefill: bit-identical to HF's
    with pytest.raises(TracerError, match=r"no tokenizer.*pass token ids.*or save a tokenizer"):
        run(str(tmp_path / "m"), prompt="hello", device="cpu", store="none", progress=False)
