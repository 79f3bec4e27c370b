"""--decode (replay divergence) and --verdict (noise or defect), with planted differences in run B."""

from __future__ import annotations

import pytest
import torch

import tracer
from tracer.load.hf_cache import cache_kwarg, output_cache
from tracer.load.models import load_model

IDS = [(13 * i + 7) % 250 for i in range(40)]  # N = 40, block 16: P = 32, run B's prefix pass has 32 tokens
P = 32


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", dtype="bfloat16", device="cpu", progress=False)


def _perturb_prefix_pass(delta: float):
    """Forward hook for a k_proj: adds ``delta`` to the keys of every position of a 32-token call,
    i.e. only run B's cached-prefix pass (run A computes 40 tokens at once; decode steps 1)."""
    def hook(module, args, output):
        if output.shape[1] == P:
            return output + delta
        return None
    return hook


def _greedy(model, ids, chunks, steps):
    """Independent oracle: prefill in ``chunks`` with an HF cache, then greedy-decode ``steps`` tokens."""
    cache, out = None, None
    with torch.no_grad():
        for s, e in chunks:
            out = model(input_ids=torch.tensor([ids[s:e]]), use_cache=True, **{cache_kwarg(model): cache})
            cache = output_cache(out)
        toks = []
        logits = out.logits[0, -1]
        for _ in range(steps):
            toks.append(int(logits.argmax()))
            out = model(input_ids=torch.tensor([[toks[-1]]]), use_cache=True, **{cache_kwarg(model): cache})
            cache, logits = output_cache(out), out.logits[0, -1]
    return toks


def test_decode_identical_caches(tiny):
    r = tracer.run("tiny-llama", loaded=tiny, token_ids=IDS, store=False, progress=False, decode=6)
    rp = r.comparison.replay
    assert r.comparison.identical  # precondition: no natural divergence here
    assert rp.first_diff is None and rp.tokens_a == rp.tokens_b
    assert list(rp.tokens_a) == _greedy(tiny.model, IDS, [(0, 40)], 6)
    assert r.to_dict()["replay"]["first_diff"] is None


def test_decode_planted_cache_difference(tiny):
    steps = 12
    h = tiny.model.model.layers[0].self_attn.k_proj.register_forward_hook(_perturb_prefix_pass(4.0))
    try:
        want_a = _greedy(tiny.model, IDS, [(0, 40)], steps)
        want_b = _greedy(tiny.model, IDS, [(0, P), (P, 40)], steps)
        r = tracer.run("tiny-llama", loaded=tiny, token_ids=IDS, store=False, progress=False, decode=steps)
    finally:
        h.remove()
    first = next((i for i, (x, y) in enumerate(zip(want_a, want_b)) if x != y), None)
    assert first is not None, "the planted cache difference must change the continuation"
    rp = r.comparison.replay
    assert list(rp.tokens_a) == want_a and list(rp.tokens_b) == want_b
    assert rp.first_diff == first
    assert rp.text_a == tiny.tokenizer.decode(want_a) and rp.text_b == tiny.tokenizer.decode(want_b)
    # the compared window's captures are unaffected by decoding: same as a run without --decode
    h = tiny.model.model.layers[0].self_attn.k_proj.register_forward_hook(_perturb_prefix_pass(4.0))
    try:
        plain = tracer.run("tiny-llama", loaded=tiny, token_ids=IDS, store=False, progress=False)
    finally:
        h.remove()
    assert [p.diff for p in plain.comparison.points] == [p.diff for p in r.comparison.points]


def _state_bits(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_verdict_on_planted_defect(tiny):
    before = _state_bits(tiny.model)
    h = tiny.model.model.layers[1].self_attn.k_proj.register_forward_hook(_perturb_prefix_pass(0.25))
    try:
        r = tracer.run("tiny-llama", loaded=tiny, token_ids=IDS, store=False, progress=False, verdict=True)
    finally:
        h.remove()
    v = r.comparison.noise
    assert [lv.dtype for lv in v.levels] == ["bfloat16", "float32", "float64"]
    # independent reading of the numbers: the logits divergence does not fall with epsilon
    base, top = v.levels[0], v.levels[-1]
    assert base.logits_max_abs > 0 and top.logits_max_abs > base.logits_max_abs / 100
    assert v.verdict == "defect suspected"
    assert r.to_dict()["noise_verdict"]["verdict"] == "defect suspected"
    # the model is back at bf16 with bit-identical weights
    after = _state_bits(tiny.model)
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before)


def test_verdict_bit_identical_is_inconclusive(tiny):
    r = tracer.run("tiny-llama", loaded=tiny, token_ids=IDS, store=False, progress=False, verdict=True)
    assert r.comparison.identical and r.comparison.noise.verdict == "inconclusive"


def test_verdict_rules():
    from tracer.diff.verdict import Level, judge

    base = Level("bfloat16", 2**-7, 0.5, 8.0, False)
    noise = Level("float32", 2**-23, 4e-5, 3e-4, False)
    same = Level("float32", 2**-23, 0.4, 7.0, False)
    assert judge(base, [noise])[0] == "rounding noise"
    assert judge(base, [same])[0] == "defect suspected"
    assert judge(base, [Level("float32", 2**-23, 0.0, 0.0, True)])[0] == "rounding noise"
    # fell by 64 (exponent 0.375 for a 65536 drop in epsilon): between the thresholds
    assert judge(base, [Level("float32", 2**-23, 0.5 / 64, 8.0 / 64, False)])[0] == "inconclusive"


def _smollm2():
    try:
        return load_model("smollm2-135m", dtype="bfloat16", device="cpu", progress=False)
    except tracer.TracerError as e:
        pytest.skip(f"smollm2-135m unavailable: {e}")


def test_verdict_on_genuine_prefix_cache_rounding():
    """smollm2-135m, bf16 on this CPU: the cache hit diverges from the miss at N = 50 (a real GEMM /
    reduction-order difference). At float32 and float64 the divergence must shrink with epsilon."""
    lm = _smollm2()
    r = tracer.run("smollm2-135m", loaded=lm, length=50, store=False, progress=False, verdict=True)
    if r.comparison.identical:
        pytest.skip("no bf16 divergence at N=50 on this CPU")
    v = r.comparison.noise
    base, f32 = v.levels[0], v.levels[1]
    assert f32.logits_max_abs < base.logits_max_abs / 256
    assert v.verdict == "rounding noise", v.lines()
