"""Hybrid models (linear-attention and attention layers) and models no family descriptor lists.

Tiny random-init models built from HF configs here (no hub). Oracles, each computed independently
of tracer: HF's own ``output_hidden_states`` for the layer outputs, HF's own cache object after the
same forward passes (run here by hand, the cache handed from the prefix pass to the suffix pass)
for the cache points, and a perturbation planted in one layer's cached recurrent state between the
prefix pass and the suffix pass, whose layer the origin analysis must name.

- Qwen3.5 (``qwen3_5_text``: GatedDeltaNet layers, then a gated full-attention layer) and Qwen3-Next
  run on the CPU through transformers' torch fallbacks (no fla / causal-conv1d kernels here).
- Nemotron-H (``nemotron_h``: Mamba-2, attention and MLP-only layers) has no descriptor: run at
  layer granularity from its inferred family (embedding, layers, final norm, LM head, and the cache
  points its HF cache holds); sublayers are refused in one line.

transformers releases without these model types (5.17 in the GPU image may lack ``qwen3_5``) skip.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import tracer
from tracer.errors import TracerError
from tracer.execute.points import discover_points
from tracer.load.models import LoadedModel, ModelInfo
from tracer.load.random_init import byte_tokenizer

N = 150  # prefix-cache: block 16 → P = 144 cached tokens (not a multiple of the delta rule's 64-token chunks)
LAYERS = 4  # 3 linear-attention layers, then a full-attention one (the config's default 3:1 pattern)
LINEAR = dict(num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=512, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
CONFIGS = {
    "qwen3_5_text": LINEAR,
    "qwen3_next": dict(LINEAR, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32),
    "nemotron_h": dict(num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=512, hybrid_override_pattern="M*M-",
                       mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16, n_groups=1, expand=2, chunk_size=32),
    "mamba": dict(num_hidden_layers=2, hidden_size=64, state_size=8, vocab_size=512),
    "qwen3_moe": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      vocab_size=512),
    "lfm2": dict(num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, conv_L_cache=3, block_ff_dim=128,
                 layer_types=["conv", "conv", "full_attention", "conv"]),
    "falcon_h1": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=512, mamba_d_ssm=128, mamba_n_heads=4,
                      mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_expand=2, mamba_chunk_size=32),
}


def _config(model_type: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(model_type, **CONFIGS[model_type])
    except (KeyError, ValueError) as e:  # this transformers does not know the model type
        pytest.skip(f"transformers has no {model_type} here ({str(e).splitlines()[0][:80]})")


def _model(model_type: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    attn = {} if model_type == "mamba" else {"attn_implementation": "sdpa"}  # Mamba has no attention to choose
    model = AutoModelForCausalLM.from_config(_config(model_type), dtype=torch.float32, **attn)
    return model.eval().requires_grad_(False)


def _loaded(model, name: str) -> LoadedModel:
    cfg = model.config
    info = ModelInfo(name=name, source="random-init", family=cfg.model_type, dtype="float32", device="cpu",
                     attn_implementation="sdpa", weights_hash="seed=0", path=None, n_layers=cfg.num_hidden_layers,
                     hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size)
    return LoadedModel(model=model, tokenizer=byte_tokenizer(), info=info)


#: the layer whose cached state the planted test perturbs; its decay is made slow (A = 0.01: about 0.99
#: per token, as some heads of trained models have) so that the perturbation outlives the suffix
#: pass: a random init draws A in [0.01, 16], and a state scaled by exp(-16) per token forgets it
SLOW = 1


@pytest.fixture(scope="module")
def qwen35():
    model = _model("qwen3_5_text")
    with torch.no_grad():
        model.model.layers[SLOW].linear_attn.A_log.fill_(math.log(0.01))
    return model


def _ids(n: int = N) -> list[int]:
    return [(37 * i + 11) % 500 for i in range(n)]


def _passes(model, ids: list[int], chunks: list[tuple[int, int]], plant=None):
    """HF's own forward passes over ``chunks``, each handing the previous one's cache on (the oracle);
    ``plant(cache)`` runs on the cache between the first and the second pass. Returns the cache."""
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    x = torch.tensor([ids])
    cache = None
    with torch.no_grad():
        for i, (s, e) in enumerate(chunks):
            if i == 1 and plant is not None:
                plant(cache)
            out = model(input_ids=x[:, s:e], use_cache=True, **({arg: cache} if cache is not None else {}))
            cache = out.cache if "cache" in getattr(out, "__dataclass_fields__", {}) else out.past_key_values
    return cache


def _hf_state(cache, layer: int) -> torch.Tensor:
    """The layer's recurrent state then its conv state, batch row 0, flattened: ``(1, F)``."""
    c = cache.layers[layer]
    return torch.cat([c.recurrent_states[0][0].reshape(-1), c.conv_states[0][0].reshape(-1)])[None]


def _hf_kv(cache, layer: int) -> torch.Tensor:
    """The layer's keys then values per position, heads flattened: ``(S, 2 * kv_heads * head_dim)``."""
    k, v = cache.layers[layer].keys[0], cache.layers[layer].values[0]  # (kv_heads, S, head_dim)
    return torch.cat([k.transpose(0, 1).flatten(1), v.transpose(0, 1).flatten(1)], dim=1)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_prefix_cache_state_points_are_hfs_own_cache(model_type, qwen35, tmp_path):
    """Cache hit vs miss: each linear-attention layer's ``state`` point in run A (one pass) and run B
    (the prefix pass, then the suffix pass reading its cache) is the state HF's cache object holds
    after the same passes, bit for bit; the full-attention layer's ``kv_cache`` too, and run A's
    layer outputs are HF's hidden states."""
    model = qwen35 if model_type == "qwen3_5_text" else _model(model_type)
    ids = _ids()
    res = tracer.run(_loaded(model, model_type), scenario="prefix-cache", token_ids=ids, granularity="layers",
                     progress=False, store="tensors", output=tmp_path / "t.h5")
    rec_a, rec_b = res.runs
    p = res.scenario.window[0]
    assert res.scenario.plan_b.chunks == ((0, p), (p, N)) and p % 64  # the chunked delta rule splits elsewhere
    caches = {"A": _passes(model, ids, [(0, N)]), "B": _passes(model, ids, [(0, p), (p, N)])}
    kinds = model.config.layer_types
    assert kinds[:3] == ["linear_attention"] * 3 and kinds[3] == "full_attention"
    by = {q.name: q for q in res.comparison.points}
    for i, kind in enumerate(kinds):
        name = f"model.layers.{i}.linear_attn.state" if kind == "linear_attention" else f"model.layers.{i}.self_attn.kv_cache"
        want = {r: (_hf_state if kind == "linear_attention" else _hf_kv)(c, i) for r, c in caches.items()}
        assert torch.equal(rec_a.captures[name].tensor, want["A"]), name
        assert torch.equal(rec_b.captures[name].tensor, want["B"]), name
        assert by[name].diverged == (not torch.equal(want["A"], want["B"])), name
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for i in range(LAYERS - 1):  # the last one HF gives after the final norm
        assert torch.equal(rec_a.captures[f"model.layers.{i}"].tensor, hs[i + 1][0, p:])
    assert torch.equal(rec_a.captures["model.norm"].tensor, hs[-1][0, p:])


def _plant_before_the_suffix_of_run_b(model, layer: int):
    """A forward pre-hook adding 0.5 to ``layer``'s cached recurrent state before the model's 4th call
    (``--mitigation aligned``: run A is calls 1-2, run B's prefix pass call 3, its suffix pass call 4)."""
    calls = {"n": 0}

    def plant(mod, args, kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            cache.layers[layer].recurrent_states[0] += 0.5
        return None

    return model.register_forward_pre_hook(plant, with_kwargs=True)


@pytest.mark.parametrize("granularity", ["layers", "sublayers"])
def test_a_planted_state_perturbation_is_found_at_its_layers_state(qwen35, granularity, tmp_path):
    """Both runs split at P (``--mitigation aligned``: bit-identical when clean); run B's cached state of
    layer 1 is perturbed between its two passes. The origin is layer 1's ``state`` point (the state
    after the run: the perturbation must outlive the suffix, see :data:`SLOW`), nothing before it
    differs, and run B's point is what HF's own cache holds after the same perturbed passes."""
    lm = _loaded(qwen35, "qwen3_5_text")
    ids = _ids()
    opts = dict(scenario="prefix-cache", mitigation="aligned", token_ids=ids, granularity=granularity, progress=False)
    assert tracer.run(lm, **opts).comparison.identical, "this test needs runs that agree bit for bit when clean"
    k = SLOW
    handle = _plant_before_the_suffix_of_run_b(qwen35, k)
    try:
        res = tracer.run(lm, **opts, store="tensors", output=tmp_path / "t.h5")
    finally:
        handle.remove()
    c = res.comparison
    rec_a, rec_b = res.runs
    target = f"model.layers.{k}.linear_attn.state"
    differs = {n: not torch.equal(rec_a.captures[n].tensor, rec_b.captures[n].tensor) for n in rec_a.captures}
    order = list(rec_a.captures)
    assert differs[target] and not any(differs[n] for n in order[: order.index(target)])
    assert [o.name for o in c.origins] == [target] and c.first_divergent == target
    from tracer.report.origins import origin_lines

    assert "recurrent state" in origin_lines(c)[0]
    p = res.scenario.window[0]

    def plant(cache):
        cache.layers[k].recurrent_states[0] += 0.5

    hf = _passes(qwen35, ids, [(0, p), (p, N)], plant=plant)
    assert torch.equal(rec_b.captures[target].tensor, _hf_state(hf, k))
    for q in c.points:  # every other differing point inherits it
        assert q.diverged == differs[q.name], q.name


def test_a_model_without_a_descriptor_runs_at_layers_and_refuses_sublayers(tmp_path, cli_env):
    """Nemotron-H, saved as a folder: ``tracer run DIR`` infers its embedding, decoder layers, final
    norm and LM head; run A's layer outputs are HF's hidden states, its ``state`` and ``kv_cache``
    points HF's cache after the same pass (none for its MLP-only layer). ``--granularity sublayers``
    is refused in one line (exit 2) naming what a descriptor adds, and writes no trace."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import cli_session

    folder = tmp_path / "nemotron"
    _model("nemotron_h").save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    args = ["run", str(folder), "--device", "cpu", "--dtype", "float32", "--length", "40", "--positions", "all"]
    done, refused = cli_session([[*args, "--store", "tensors", "-o", "t.h5"],
                                 [*args, "--granularity", "sublayers", "-o", "s.h5"]], cli_env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "layer-level capture inferred" in done.stdout  # the note under the table
    err = [x for x in refused.stderr.splitlines() if x.strip()]
    assert refused.returncode == 2 and len(err) == 1 and "Traceback" not in refused.stderr
    assert "'nemotron_h'" in err[0] and "sublayers needs a descriptor" in err[0] and "TRACER_HOOKS_PATH" in err[0]
    assert not (tmp_path / "s.h5").exists()

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with tracer.read_trace(tmp_path / "t.h5") as r:
        assert r.header["family"]["layers"] == "model.layers" and r.header["family"]["inferred"]
        ids = r.run("A", load_tensors=False).token_ids
        names = list(r.run("A", load_tensors=False).captures)
        with torch.no_grad():
            hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        assert torch.equal(r.tensor("A", "model.embeddings"), hs[0][0])
        for i in range(LAYERS - 1):
            assert torch.equal(r.tensor("A", f"model.layers.{i}"), hs[i + 1][0])
        assert torch.equal(r.tensor("A", "model.norm_f"), hs[-1][0])
        cache = _passes(hf, ids, [(0, len(ids))])
        assert torch.equal(r.tensor("A", "model.layers.0.state"), _hf_state(cache, 0))  # Mamba-2 ("M")
        assert torch.equal(r.tensor("A", "model.layers.1.kv_cache"), _hf_kv(cache, 1))  # attention ("*")
        assert not any(n.startswith("model.layers.3.") for n in names)  # MLP only ("-"): no cache


def test_inferred_families_and_hybrid_descriptors(qwen35):
    """No descriptor: the four model-level paths come from the modules, no roles; a hybrid descriptor:
    a state point for each linear-attention layer, a kv_cache point for the attention layer, each
    sitting right before the layer output (layers) or the mixer's output projection (sublayers)."""
    from tracer.execute.family import family_for, infer_family

    fam = infer_family(qwen35, "qwen3_5_text")
    assert (fam.embedding, fam.layers, fam.final_norm, fam.logits) == ("model.embed_tokens", "model.layers",
                                                                       "model.norm", "lm_head")
    assert not fam.roles
    assert family_for(qwen35).name == "qwen3_5"
    layers = [(p.name, p.kind) for p in discover_points(qwen35, "layers")]
    assert layers[1:4] == [("model.layers.0.linear_attn.state", "state"), ("model.layers.0", "layer"),
                           ("model.layers.1.linear_attn.state", "state")]
    assert ("model.layers.3.self_attn.kv_cache", "kv_cache") in layers
    subs = [p.name for p in discover_points(qwen35, "sublayers")]
    at = subs.index("model.layers.0.linear_attn.state")
    assert subs[at + 1] == "model.layers.0.linear_attn.out_proj"
    assert "model.layers.0.linear_attn.in_proj_qkv" in subs and "model.layers.3.self_attn.core" in subs
    assert not discover_points(qwen35, "layers", kv_cache=False)[1].name.endswith("state")


def test_the_sublayer_refusal_comes_from_discovery_too():
    """The notebook path (``discover_points``) refuses sublayers of an undescribed model in one line."""
    model = _model("nemotron_h")
    with pytest.raises(TracerError, match="sublayers needs a descriptor") as e:
        discover_points(model, "sublayers")
    assert "\n" not in str(e.value)
    assert [p.name for p in discover_points(model, "layers", kv_cache=False)] == [
        "model.embeddings", *(f"model.layers.{i}" for i in range(LAYERS)), "model.norm_f", "lm_head"]


@pytest.mark.parametrize("model_type", ["lfm2", "falcon_h1"])
def test_the_other_hybrid_descriptors(model_type, tmp_path):
    """LFM2 (conv layers: a conv state only) and Falcon-H1 (a Mamba-2 mixer beside the attention in every
    layer: a state and a KV cache per layer), at sublayers: run A's layer outputs are HF's hidden
    states, run B's cache points HF's cache after the same two passes."""
    from tracer.execute.family import family_for

    model = _model(model_type)
    assert family_for(model).name == model_type
    ids = _ids(40)
    res = tracer.run(_loaded(model, model_type), scenario="prefix-cache", token_ids=ids, granularity="sublayers",
                     progress=False, store="tensors", output=tmp_path / "t.h5")
    rec_a, rec_b = res.runs
    p = res.scenario.window[0]
    cache = _passes(model, ids, [(0, p), (p, len(ids))])
    mixer = "conv" if model_type == "lfm2" else "mamba"
    states = [n for n in rec_b.captures if n.endswith(f".{mixer}.state")]
    assert states
    for name in states:
        i = int(name.split(".")[2])
        c = cache.layers[i]
        parts = [t[0].reshape(-1) for t in (c.recurrent_states[0], c.conv_states[0]) if t is not None]
        assert torch.equal(rec_b.captures[name].tensor, torch.cat(parts)[None]), name
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    n_layers = model.config.num_hidden_layers
    for i in range(n_layers - 1):
        assert torch.equal(rec_a.captures[f"model.layers.{i}"].tensor, hs[i + 1][0, p:])


def test_a_hybrid_descriptor_does_not_claim_an_attention_only_model():
    """Qwen3-MoE is listed by no descriptor and has every required path of ``qwen3_5.toml`` (its mixer
    roles are optional): a descriptor fits an unlisted model only if each of its mixers is there, so
    Qwen3-MoE gets its inferred family, not the hybrid's."""
    from tracer.execute.family import family_for

    fam = family_for(_model("qwen3_moe"))
    assert fam.inferred and (fam.layers, fam.final_norm) == ("model.layers", "model.norm")


def test_a_pure_state_space_model_runs_a_cache_hit(tmp_path):
    """Mamba (no descriptor, no attention layer: ``get_seq_length`` of its cache raises): the cache hit
    passes each layer's state from the prefix pass to the suffix pass, and run B's ``state`` points are
    HF's own cache after the same two passes."""
    model = _model("mamba")
    ids = _ids(40)
    res = tracer.run(_loaded(model, "mamba"), scenario="prefix-cache", token_ids=ids, progress=False,
                     store="tensors", output=tmp_path / "t.h5")
    p = res.scenario.window[0]
    cache = _passes(model, ids, [(0, p), (p, len(ids))])
    for i in range(2):
        assert torch.equal(res.runs[1].captures[f"backbone.layers.{i}.state"].tensor, _hf_state(cache, i))
