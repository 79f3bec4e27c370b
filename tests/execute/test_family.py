"""Model families as data: a family whose HF modules have other names is one TOML file.

The model is a tiny random-init Llama whose every module tracer looks at is renamed (``model`` →
``backbone``, ``layers`` → ``blocks``, ``self_attn`` → ``attention``, ``q_proj`` → ``wq``, ``mlp`` →
``ffn``, ...; the HF forward code is untouched: each old attribute name reads the renamed child).
Its config claims a model type no built-in descriptor lists. One descriptor, written here into a
temp folder named by ``$TRACER_HOOKS_PATH``, is all tracer gets. Oracles: HF's own
``output_hidden_states`` for the layer captures, the raw bits of the captured tensors for which
points differ, and a perturbation planted in one known module of run B. Last, a real HF family no
built-in descriptor fits (GPT-NeoX), saved as a folder and run through ``tracer run`` with one TOML file.
"""

from __future__ import annotations

import math

import pytest
import torch

import tracer
from tracer.errors import TracerError
from tracer.execute import family as F
from tracer.execute.points import discover_points
from tracer.load.models import LoadedModel, ModelInfo
from tracer.load.random_init import byte_tokenizer

RENAMES = {  # class attribute HF's forward uses → the module's new name
    "LlamaForCausalLM": {"model": "backbone", "lm_head": "unembed"},
    "LlamaModel": {"embed_tokens": "tok_embeddings", "layers": "blocks", "norm": "final_ln"},
    "LlamaDecoderLayer": {"self_attn": "attention", "mlp": "ffn", "input_layernorm": "ln_1",
                          "post_attention_layernorm": "ln_2"},
    "LlamaAttention": {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo"},
    "LlamaMLP": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "act_fn": "act"},
}

DESCRIPTOR = """
families = ["renamed_llama"]
embedding = "backbone.tok_embeddings"
layers = "backbone.blocks"
final_norm = "backbone.final_ln"
logits = "unembed"

[roles]
attn_norm = "ln_1"
attention = "attention"
q_proj = "attention.wq"
k_proj = "attention.wk"
v_proj = "attention.wv"
o_proj = "attention.wo"
mlp_norm = "ln_2"
mlp = "ffn"
gate_proj = "ffn.w1"
up_proj = "ffn.w3"
act = "ffn.act"
down_proj = "ffn.w2"
"""

N = 24


def _rename(module: torch.nn.Module, names: dict[str, str]) -> None:
    """Re-register ``module``'s children under new names; the old names stay readable (a property
    on a per-instance subclass), so HF's forward runs unchanged."""
    base = type(module)
    props = {old: property(lambda self, new=new: self._modules[new]) for old, new in names.items()}
    # same name and module as the base class: transformers keys its output recorders by str(class)
    props.update(__module__=base.__module__, __qualname__=base.__qualname__)
    module.__class__ = type(base.__name__, (base,), props)
    for old, new in names.items():
        module._modules[new] = module._modules.pop(old)


def renamed_llama(seed: int = 0) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()
    model.requires_grad_(False)
    for m in list(model.modules()):
        if type(m).__name__ in RENAMES:
            _rename(m, RENAMES[type(m).__name__])
    model.config.model_type = "renamed_llama"
    return model


@pytest.fixture(scope="module")
def renamed():
    return renamed_llama()


@pytest.fixture
def hooks(tmp_path, monkeypatch):
    folder = tmp_path / "hooks"
    folder.mkdir()
    (folder / "renamed.toml").write_text(DESCRIPTOR)
    monkeypatch.setenv(F.HOOKS_PATH_ENV, str(folder))
    return folder


def _loaded(model) -> LoadedModel:
    info = ModelInfo(name="renamed-llama", source="random-init", family="renamed_llama", dtype="float32", device="cpu",
                     attn_implementation="sdpa", weights_hash="seed=0", path=None, n_layers=2, hidden_size=64,
                     vocab_size=512)
    return LoadedModel(model=model, tokenizer=byte_tokenizer(), info=info)


def test_the_renamed_model_has_none_of_the_usual_names(renamed):
    names = {n for n, _ in renamed.named_modules()}
    assert "backbone.blocks.1.attention.wq" in names and "backbone.blocks.1.ffn.w3" in names
    assert not any(part in n.split(".") for n in names for part in ("model", "layers", "self_attn", "mlp", "q_proj"))


def test_without_its_descriptor_the_family_is_refused_in_one_line(renamed, monkeypatch):
    """Sublayers need the descriptor (one line saying so); layers are inferred from the modules alone."""
    monkeypatch.delenv(F.HOOKS_PATH_ENV, raising=False)
    with pytest.raises(TracerError, match=r"no family descriptor for model type 'renamed_llama'.*sublayers needs a "
                                          r"descriptor.*TRACER_HOOKS_PATH") as e:
        discover_points(renamed, "sublayers")
    assert "\n" not in str(e.value)
    names = [p.name for p in discover_points(renamed, "layers") if p.kind != "kv_cache"]
    assert names == ["backbone.tok_embeddings", "backbone.blocks.0", "backbone.blocks.1", "backbone.final_ln", "unembed"]


def test_layer_captures_are_hfs_hidden_states(renamed, hooks):
    from tracer.engines.hf.run import execute
    from tracer.plan.scenarios import RunPlan

    points = [p for p in discover_points(renamed, "layers") if p.kind != "kv_cache"]
    assert [p.name for p in points] == ["backbone.tok_embeddings", "backbone.blocks.0", "backbone.blocks.1",
                                        "backbone.final_ln", "unembed"]
    ids = [(7 * i + 3) % 500 for i in range(N)]
    rec = execute(renamed, ids, RunPlan("A", ((0, N),)), points, (0, N))
    with torch.no_grad():
        out = renamed(torch.tensor([ids]), output_hidden_states=True)
    hs = out.hidden_states  # (embedding, layer 0, norm(layer 1))
    assert torch.equal(rec.captures["backbone.tok_embeddings"].tensor, hs[0][0])
    assert torch.equal(rec.captures["backbone.blocks.0"].tensor, hs[1][0])
    assert torch.equal(rec.captures["backbone.final_ln"].tensor, hs[2][0])
    assert torch.equal(rec.captures["unembed"].tensor, out.logits[0])


def test_sublayer_points_carry_the_descriptors_roles(renamed, hooks):
    points = {p.name: p for p in discover_points(renamed, "sublayers")}
    assert points["backbone.blocks.1.attention.wq"].role == "q_proj"
    assert points["backbone.blocks.1.ln_2"].role == "mlp_norm"
    assert points["backbone.blocks.1.attention.core"].role == "attention_core"  # the input of wo
    assert points["backbone.blocks.1.attention.kv_cache"].role == "kv_cache"
    assert points["backbone.blocks.1.ffn.w2.input"].role == "mlp_hidden"        # act(w1) * w3


def _plant_in_run_b(model, module: str, feature: int):
    """A forward hook adding 0.5 to one feature of ``module``'s output at every position, from the
    model's second forward call on (the ``repeat`` scenario: run A is the first call, run B the second)."""
    calls = {"n": 0}

    def count(*_):
        calls["n"] += 1

    def plant(mod, args, output):
        if calls["n"] >= 2:
            out = output.clone()
            out[..., feature] += 0.5
            return out
        return None

    return [model.register_forward_pre_hook(count), model.get_submodule(module).register_forward_hook(plant)]


@pytest.mark.parametrize("granularity", ["sublayers", "layers"])
def test_tracer_run_finds_the_planted_origin(renamed, hooks, granularity, tmp_path):
    lm = _loaded(renamed)
    ids = [(11 * i + 5) % 500 for i in range(N)]
    clean = tracer.run(lm, scenario="repeat", token_ids=ids, granularity=granularity, progress=False)
    assert clean.comparison.identical, "this test needs a model whose repeated runs agree bit for bit"
    target = "backbone.blocks.1.ffn.w3"
    handles = _plant_in_run_b(renamed, target, feature=9)
    try:  # store="tensors": the result keeps both runs' tensors, for the independent check below
        res = tracer.run(lm, scenario="repeat", token_ids=ids, granularity=granularity, progress=False,
                         store="tensors", output=tmp_path / "t.h5")
    finally:
        for h in handles:
            h.remove()
    c = res.comparison
    rec_a, rec_b = res.runs
    differs = {n: not torch.equal(rec_a.captures[n].tensor, rec_b.captures[n].tensor) for n in rec_a.captures}
    order = list(rec_a.captures)
    if granularity == "sublayers":
        # independent: the planted module is the first capture that differs, everything before it agrees
        assert differs[target] and not any(differs[n] for n in order[: order.index(target)])
        assert [o.name for o in c.origins] == [target]
        by = {p.name: p for p in c.points}
        assert by[target].consumes.points == ("backbone.blocks.1.ln_2",) and by[target].consumes.rule == "structure"
        hidden = by["backbone.blocks.1.ffn.w2.input"]
        assert hidden.diverged and not hidden.origin and target in hidden.differing_inputs
    else:
        assert [o.name for o in c.origins] == ["backbone.blocks.1"]
        assert not differs["backbone.blocks.0"] and differs["backbone.blocks.1"]
    for p in c.points:
        assert p.diverged == differs[p.name], p.name
        if p.diverged and not p.origin:
            assert p.differing_inputs and all(differs[d] for d in p.differing_inputs), p.name


def test_the_trace_keeps_roles_and_the_descriptor(renamed, hooks, tmp_path, monkeypatch):
    lm = _loaded(renamed)
    ids = list(range(3, 3 + N))
    out = tmp_path / "r.h5"
    tracer.run(lm, scenario="repeat", token_ids=ids, granularity="sublayers", progress=False, output=out)
    with tracer.read_trace(out) as r:
        assert r.header["family"]["descriptor"] == str(hooks / "renamed.toml")
        assert r.header["family"]["layers"] == "backbone.blocks"
        assert r.capture_info("A", "backbone.blocks.0.attention.wk")["role"] == "k_proj"
        assert r.run("B", load_tensors=False).captures["backbone.blocks.0.ffn"].role == "mlp"
    # compared again from the file alone, without the descriptor: the stored roles give the dataflow
    monkeypatch.delenv(F.HOOKS_PATH_ENV)
    from tracer.diff.compare import compare_trace

    c = compare_trace(str(out))
    flow = {p.name: p.consumes for p in c.points}
    assert flow["backbone.blocks.0.attention.wq"].points == ("backbone.blocks.0.ln_1",)
    assert all(cons.rule == "structure" for cons in flow.values())


def test_a_path_the_model_lacks_is_an_error_naming_the_file(renamed, tmp_path, monkeypatch):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "typo.toml").write_text(DESCRIPTOR.replace('up_proj = "ffn.w3"', 'up_proj = "ffn.w4"'))
    monkeypatch.setenv(F.HOOKS_PATH_ENV, str(folder))
    with pytest.raises(TracerError, match=r"family descriptor .*typo\.toml: role up_proj = 'ffn.w4', but "
                                          r"backbone\.blocks\.0 of LlamaForCausalLM has no ffn\.w4"):
        discover_points(renamed, "sublayers")


@pytest.mark.parametrize("edit, message", [
    (('q_proj = "attention.wq"', 'queries = "attention.wq"'), "unknown role 'queries'"),
    (('logits = "unembed"', ''), "does not name logits"),
    (('families = ["renamed_llama"]', 'families = ["renamed_llama"]\noptional = ["sinks"]'), "optional names 'sinks'"),
    (('layers = "backbone.blocks"', 'layers = "backbone/../x"'), "hook maps are data"),
    (('k_proj = "attention.wk"', 'k_proj = "attention.wq"'), "'attention.wq' plays two roles"),
])
def test_malformed_descriptors_are_refused(edit, message, tmp_path, monkeypatch):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "x.toml").write_text(DESCRIPTOR.replace(*edit))
    monkeypatch.setenv(F.HOOKS_PATH_ENV, str(folder))
    with pytest.raises(TracerError, match=message):
        F.descriptors()


def test_hooks_path_must_name_folders(monkeypatch, tmp_path):
    monkeypatch.setenv(F.HOOKS_PATH_ENV, str(tmp_path / "missing"))
    with pytest.raises(TracerError, match="TRACER_HOOKS_PATH names .* not a folder"):
        F.descriptors()


def test_roles_are_inferred_for_names_alone():
    """A trace written before roles were stored: the best-fitting built-in descriptor's roles."""
    llama = ["input_layernorm", "self_attn", "self_attn.q_proj", "post_attention_layernorm", "mlp.down_proj.input"]
    assert F.infer_roles(llama) == {"input_layernorm": "attn_norm", "self_attn": "attention",
                                    "self_attn.q_proj": "q_proj", "post_attention_layernorm": "mlp_norm",
                                    "mlp.down_proj.input": "mlp_hidden"}
    gemma = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
    assert F.infer_roles(gemma)["post_attention_layernorm"] == "attn_post_norm"  # Gemma's is a post-norm


def test_notebook_capture_of_named_modules_needs_no_descriptor(renamed, monkeypatch):
    monkeypatch.delenv(F.HOOKS_PATH_ENV, raising=False)
    ids = torch.tensor([[(5 * i + 1) % 500 for i in range(N)]])
    with tracer.capture(renamed, ["backbone.blocks.0"]) as cap, torch.no_grad():
        out = renamed(ids, output_hidden_states=True)
    assert torch.equal(cap["backbone.blocks.0"].tensor, out.hidden_states[1][0])


NEOX_DESCRIPTOR = """
families = ["gpt_neox"]
embedding = "gpt_neox.embed_in"
layers = "gpt_neox.layers"
final_norm = "gpt_neox.final_layer_norm"
logits = "lm_head"

[roles]
attn_norm = "input_layernorm"
attention = "attention"
qkv_proj = "attention.query_key_value"
o_proj = "attention.dense"
mlp_norm = "post_attention_layernorm"
mlp = "mlp"
up_proj = "mlp.dense_h_to_4h"
act = "mlp.act"
down_proj = "mlp.dense_4h_to_h"
"""


def test_a_new_family_written_as_one_toml_file_runs_through_the_cli(tmp_path, cli_env):
    """GPT-NeoX (``embed_in``, ``query_key_value``, ``dense_h_to_4h``, ``final_layer_norm``): no built-in
    descriptor fits. Saved as an HF folder, ``tracer run DIR`` refuses it in one line (exit 2); with one
    TOML file in ``$TRACER_HOOKS_PATH`` it runs, and run A's captures are HF's own hidden states."""
    import subprocess
    import sys

    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gpt_neox", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                               num_attention_heads=4, vocab_size=512, use_parallel_residual=False)
    torch.manual_seed(0)
    folder = tmp_path / "neox"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    args = [sys.executable, "-m", "tracer", "run", str(folder), "--device", "cpu", "--dtype", "float32", "--length",
            str(N), "--granularity", "sublayers", "--positions", "all", "--store", "tensors", "-o", "t.h5"]
    cli_env.pop(F.HOOKS_PATH_ENV, None)
    refused = subprocess.run(args, capture_output=True, text=True, env=cli_env, cwd=tmp_path, timeout=300)
    err = [x for x in refused.stderr.splitlines() if x.startswith("error:")]
    assert refused.returncode == 2 and len(err) == 1 and "'gpt_neox'" in err[0] and F.HOOKS_PATH_ENV in err[0]
    assert not (tmp_path / "t.h5").exists()

    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "neox.toml").write_text(NEOX_DESCRIPTOR)  # the one file the new family takes
    proc = subprocess.run(args, capture_output=True, text=True, env={**cli_env, F.HOOKS_PATH_ENV: str(hooks)},
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "bit-identical" in proc.stdout and "gpt_neox.final_layer_norm" in proc.stdout

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    with tracer.read_trace(tmp_path / "t.h5") as r:
        assert r.header["family"]["descriptor"] == str(hooks / "neox.toml")
        assert r.capture_info("A", "gpt_neox.layers.1.attention.query_key_value")["role"] == "qkv_proj"
        assert r.capture_info("A", "gpt_neox.layers.0.mlp.dense_4h_to_h")["role"] == "down_proj"
        ids = r.run("A", load_tensors=False).token_ids
        with torch.no_grad():
            out = hf(torch.tensor([ids]), output_hidden_states=True)
        hs = out.hidden_states  # (embedding, layer 0, final_layer_norm(layer 1))
        assert torch.equal(r.tensor("A", "gpt_neox.embed_in"), hs[0][0])
        assert torch.equal(r.tensor("A", "gpt_neox.layers.0"), hs[1][0])
        assert torch.equal(r.tensor("A", "gpt_neox.final_layer_norm"), hs[2][0])
        assert torch.equal(r.tensor("A", "lm_head"), out.logits[0])


def test_points_are_discovered_once_per_model_and_granularity(tiny_llama, monkeypatch):
    """A run asks for its own granularity and for ``sublayers`` (the trace-size estimate): both stay
    cached side by side, and what the cache returns is what a fresh walk of the module tree finds."""
    from tracer.execute import points as P

    model = tiny_llama
    fresh = {g: P._discover(model, g, False, F.family_for(model)) for g in ("layers", "sublayers")}
    walks = []
    real = P._discover
    monkeypatch.setattr(P, "_discover", lambda *a: walks.append(a[1]) or real(*a))
    P._DISCOVERED.pop(model, None)
    for g in ("layers", "sublayers", "layers", "sublayers"):
        assert P.discover_points(model, g, kv_cache=False) == fresh[g]
    assert walks == ["layers", "sublayers"]
    hidden = model.config.hidden_size
    assert P.granularity_width(model, "sublayers", hidden, kv_cache=False) == P.point_widths(model, fresh["sublayers"], hidden)


#: a Gemma 3 whose heads are wider than hidden / heads (q_norm 4 x 32 = 128 wide, k_norm 1 x 32, hidden 64)
GEMMA3 = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1,
              head_dim=32, vocab_size=512, sliding_window=8, layer_types=["sliding_attention", "full_attention"])


def _width_model(name: str):
    """A tiny recipe loaded on the CPU (or, for ``gemma3_text``, built from :data:`GEMMA3`); skips
    a model type this transformers lacks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tracer.load.models import load_model

    model_type = {"tiny-llama": "llama", "tiny-qwen3": "qwen3", "tiny-gpt2": "gpt2",
                  "tiny-qwen3.5": "qwen3_5_text"}.get(name, name)
    try:
        cfg = AutoConfig.for_model(model_type, **(GEMMA3 if model_type == "gemma3_text" else {}))
    except (KeyError, ValueError):
        pytest.skip(f"transformers has no {model_type} here")
    if model_type == "gemma3_text":
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().eval(), cfg.hidden_size
    loaded = load_model(name, dtype="float32", device="cpu", progress=False, tokenizer=False)
    return loaded.model, loaded.info.hidden_size


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-gpt2", "tiny-qwen3.5", "gemma3_text"])
def test_point_widths_are_the_captured_tensors_feature_dims(name):
    """The sublayers size estimate counts, point by point, what a capture of every position stores:
    ``point_widths`` of each point is its captured tensor's ``shape[1:]`` multiplied out (the MLP's
    activation: intermediate wide; q_norm/k_norm: heads x head_dim; GPT-2's Conv1D projections and
    fused-qkv KV cache); a ``state`` point is one row per run, whatever N, and counts 0 per token."""
    from tracer.engines.hf.run import execute
    from tracer.execute.points import granularity_width, point_widths
    from tracer.plan.scenarios import RunPlan

    model, hidden = _width_model(name)
    points = discover_points(model, "sublayers")
    ids = [(7 * i + 3) % 500 for i in range(12)]
    rec = execute(model, ids, RunPlan("A", ((0, len(ids)),)), points, (0, len(ids)))
    assert {p.kind for p in points} >= {"kv_cache", "activation", "linear"}
    real = {}
    for p in points:
        tensor = rec.captures[p.name].tensor
        assert tensor.numel() > 0, p.name
        real[p.name] = 0 if p.kind == "state" else math.prod(tensor.shape[1:])
        if p.kind == "state":
            assert tensor.shape[0] == 1, p.name
        elif p.kind != "kv_cache" or name != "gemma3_text":  # a sliding layer's cache may hold fewer rows
            assert tensor.shape[0] == len(ids), p.name
    got = {p.name: point_widths(model, [p], hidden) for p in points}
    assert got == real
    assert granularity_width(model, "sublayers", hidden) == sum(real.values())
