"""rollout-vs-train (RL): plans, the rollout and trainer executors, the RL metrics against independent
float64 computations, a planted perturbation in the trainer, packed vs padded, renderings (CPU, tiny models)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import make_model
from tracer.diff.compare import compare_records
from tracer.diff.rl import HIST_LABELS, RLComparison, rl_comparison
from tracer.errors import TracerError
from tracer.execute.points import discover_points
from tracer.engines.door import execute_plan, executor_name
from tracer.engines.hf.run import batch_inputs
from tracer.plan.rollout import KNOBS, mitigation_variants
from tracer.plan.build import build
from tracer.plan.scenarios import Batch

IDS = [(7 * i + 3) % 500 for i in range(20)]
N = len(IDS)


def _run(model, scen, granularity="layers", plant=None):
    """Both plans of ``scen`` on ``model``; ``plant(enter: bool)`` is called around run B."""
    loaded = SimpleNamespace(model=model)
    pts = discover_points(model, granularity)
    a, _ = execute_plan(loaded, IDS, scen.plan_a, pts, scen.window)
    if plant is not None:
        plant(True)
    try:
        b, _ = execute_plan(loaded, IDS, scen.plan_b, pts, scen.window, rollout=a)
    finally:
        if plant is not None:
            plant(False)
    return a, b


@pytest.fixture(scope="module")
def llama32():
    return make_model("llama", dtype=torch.float32)


@pytest.fixture(scope="module")
def llama16():
    return make_model("llama", dtype=torch.bfloat16)


# -- plans -------------------------------------------------------------------------------------------------------


def test_plans_shapes_window_and_executors():
    s = build("rollout-vs-train", 40, rollouts=4, new_tokens=6)
    a, b = s.plan_a.rl, s.plan_b.rl
    assert s.window == (39, 45) and s.level == 2
    assert a.lengths[a.row] == 40 and a.row == 2 and len(set(a.lengths)) > 1  # the traced prompt among others
    w = max(a.lengths)
    assert s.plan_a.gemm_m() == [4 * w] + [4] * 5  # prefill of the left-padded batch, then decode M = K
    assert s.plan_b.gemm_m() == [4 * (w + 6)]  # right-padded prompt + response
    packed = build("rollout-vs-train", 40, rollouts=4, new_tokens=6, train_batching="packed")
    assert packed.plan_b.gemm_m() == [sum(a.lengths) + 4 * 6]
    assert executor_name(s.plan_a) == "hf-rollout" and executor_name(s.plan_b) == "hf-train"
    assert executor_name(replace(s.plan_a, engine="vllm")) == "vllm-rollout"  # the rollout sampled by vLLM
    with pytest.raises(TracerError, match="no train executor"):  # the trainer stays HF: refused, never run as a prefill
        executor_name(replace(s.plan_b, engine="vllm"))
    assert s.to_dict()["plan_b"]["rl"]["role"] == "train"


@pytest.mark.parametrize("kwargs, msg", [
    (dict(temperature=0.7), "--sample"),
    (dict(seed=3), "--sample"),
    (dict(sample=True, temperature=0.0), "--temperature"),
    (dict(sample=True, temperature=1e-300), "below 1e-05: float32"),  # logits / τ overflowed: exit 3 in multinomial
    (dict(is_cap=0.0), "--is-cap"),
    (dict(mask_threshold=1.0), "--mask-threshold"),
    (dict(rollouts=0), "--rollouts"),
    (dict(new_tokens=0), "--new-tokens"),
    (dict(train_batching="ragged"), "--train-batching"),
    (dict(batch_row=7), "--batch-row"),
    (dict(train_dtype="int8"), "int8"),
])
def test_bad_options_are_one_line_errors(kwargs, msg):
    with pytest.raises(TracerError, match=msg):
        build("rollout-vs-train", 40, **kwargs)


def test_a_temperature_that_overflows_is_refused_before_the_model_loads(tmp_path):
    """Issue 37 item 7: --temperature 1e-300 ran the model and died in torch.multinomial ('probability
    tensor contains either inf, nan or element < 0', exit 3): float32(logits) / 1e-300 is ±inf."""
    from tests.helpers import cli_batch

    assert torch.isinf(torch.tensor([3.0]) / 1e-300).all()  # why: the quotient leaves float32's range
    [(code, err)] = cli_batch([["run", "tiny-llama", "--scenario", "rollout-vs-train", "--sample",
                                "--temperature", "1e-300", "--no-store"]], tmp_path)
    assert code == 2 and "--temperature 1e-300 is below 1e-05" in err and len(err.strip().splitlines()) == 1, err
    build("rollout-vs-train", 40, sample=True, temperature=1e-5)  # the floor itself is accepted


def test_options_apply_to_their_scenario_only():
    from tracer.config import RunConfig

    with pytest.raises(TracerError, match="--tp"):
        RunConfig.from_options(scenario="rollout-vs-train", tp=2)
    with pytest.raises(TracerError, match="--rollouts"):
        RunConfig.from_options(scenario="prefix-cache", rollouts=2)
    cfg = RunConfig.from_options(scenario="rollout-vs-train", rollouts=2, sample=True, is_cap=3.0, new_tokens=4)
    assert dict(cfg.scenario.options)["rollouts"] == 2


def test_mitigation_variants_change_one_knob_each():
    s = build("rollout-vs-train", 30, rollouts=4, new_tokens=4)
    v = {k: scen for k, _, scen in mitigation_variants(s)}
    assert list(v) == list(KNOBS)
    assert v["same-attention"] is None  # the trainer already uses the loaded attention
    assert v["fp32-lm-head"].plan_a.rl.lm_head_fp32 and v["fp32-lm-head"].plan_b.rl.lm_head_fp32
    assert v["no-padding"].plan_a.rl.lengths == (30,) * 4
    assert v["batch-of-one"].plan_b.rl.rollouts == 1 and v["batch-of-one"].plan_a.gemm_m() == [30, 1, 1, 1]
    assert v["deterministic"].plan_a.deterministic and v["deterministic"].plan_b.deterministic
    other = build("rollout-vs-train", 30, train_attn="eager")
    same = dict((k, scen) for k, _, scen in mitigation_variants(other))["same-attention"]
    assert other.plan_b.attn == "eager" and same.plan_b.attn is None


# -- the executors ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rollout_is_hf_generate(dtype, llama32, llama16):
    model = llama32 if dtype == torch.float32 else llama16
    s = build("rollout-vs-train", N, rollouts=3, new_tokens=6)
    a, _ = _run(model, s)
    spec = s.plan_a.rl
    ids, mask, _ = batch_inputs(IDS, Batch(3, spec.row, "left", spec.lengths), torch.device("cpu"))
    g = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_logits=True,
                       return_dict_in_generate=True, pad_token_id=0)
    assert g.sequences[:, ids.shape[1]:].tolist() == a.meta["rollout"]["tokens"]
    logits = a.extras["rl_logits"]  # (K, T, vocab)
    # generate computes the prefill's LM head at the last position only (M = K), the rollout at all W
    assert torch.allclose(torch.stack(g.logits, 1).float(), logits.float(), atol=1e-5, rtol=0)
    assert torch.equal(logits[spec.row], a.captures["lm_head"].tensor)  # the captured logits are the ones used
    lp = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(a.meta["rollout"]["tokens"])[..., None])[..., 0]
    assert torch.allclose(torch.tensor(a.meta["rollout"]["logprobs"], dtype=torch.float64), lp, atol=2e-6, rtol=0)
    assert a.token_ids == IDS + a.meta["rollout"]["tokens"][spec.row]
    assert a.captures["model.layers.0.self_attn.kv_cache"].tensor.shape[0] == N + 6 - 1  # every cached position


def test_sampling_is_seeded_and_logprobs_use_the_temperature(llama32):
    s = build("rollout-vs-train", N, rollouts=2, new_tokens=5, sample=True, temperature=0.7, seed=11)
    a1, _ = _run(llama32, s)
    a2, _ = _run(llama32, s)
    a3, _ = _run(llama32, build("rollout-vs-train", N, rollouts=2, new_tokens=5, sample=True, temperature=0.7, seed=12))
    assert a1.meta["rollout"]["tokens"] == a2.meta["rollout"]["tokens"] != a3.meta["rollout"]["tokens"]
    tok = torch.tensor(a1.meta["rollout"]["tokens"])
    lp = torch.log_softmax(a1.extras["rl_logits"].double() / 0.7, -1).gather(-1, tok[..., None])[..., 0]
    assert torch.allclose(torch.tensor(a1.meta["rollout"]["logprobs"], dtype=torch.float64), lp, atol=2e-6, rtol=0)


def test_decode_is_refused(llama32):
    s = build("rollout-vs-train", N, rollouts=1, new_tokens=2)
    with pytest.raises(TracerError, match="--decode"):
        execute_plan(SimpleNamespace(model=llama32), IDS, s.plan_a, discover_points(llama32), s.window, decode=3)


# -- RL metrics against an independent float64 computation ------------------------------------------------------


def test_rl_metrics_equal_an_independent_float64_computation(llama16):
    cap, band = 1.0005, 1.001  # thresholds inside the spread of this run's ratios, so the shares are not all 0
    s = build("rollout-vs-train", N, rollouts=3, new_tokens=6, sample=True, temperature=0.8, seed=5,
              is_cap=cap, mask_threshold=band)
    a, b = _run(llama16, s)
    rl = rl_comparison(a, b, s.params, compare_records(a, b, scenario=s.name, model="tiny"))
    row = s.plan_a.rl.row
    la, lb = a.extras["rl_logits"], b.extras["rl_logits"]
    assert torch.equal(la[row], a.captures["lm_head"].tensor) and torch.equal(lb[row], b.captures["lm_head"].tensor)
    tok = torch.tensor(a.meta["rollout"]["tokens"])
    tau = 0.8
    ref_a = torch.log_softmax(la.double() / tau, -1)  # (K, T, vocab) float64, written here
    ref_b = torch.log_softmax(lb.double() / tau, -1)
    pa, pb = ref_a.gather(-1, tok[..., None])[..., 0].numpy(), ref_b.gather(-1, tok[..., None])[..., 0].numpy()
    # the per-token logprobs are the runs' float32 values: equal to float64 up to float32 rounding
    assert np.allclose(rl.logp_a, pa, atol=3e-6, rtol=0) and np.allclose(rl.logp_b, pb, atol=3e-6, rtol=0)
    d64 = pb - pa
    assert np.abs(d64).max() > 1e-4  # a real gap (bf16, different GEMM shapes), well above float32 rounding
    assert np.allclose(rl.dlogp, d64, atol=6e-6, rtol=0)
    assert math.isclose(rl.mean_abs_dlogp, np.abs(d64).mean(), rel_tol=0, abs_tol=6e-6)
    assert math.isclose(rl.max_abs_dlogp, np.abs(d64).max(), rel_tol=0, abs_tol=6e-6)
    # full-vocabulary KL(A || B) per position
    kl = (ref_a.exp() * (ref_a - ref_b)).sum(-1).numpy()
    assert np.allclose(rl.vocab_kl, kl, rtol=1e-9, atol=1e-15)
    assert math.isclose(rl.vocab_kl_mean, kl.mean(), rel_tol=1e-9) and math.isclose(rl.vocab_kl_max, kl.max(), rel_tol=1e-9)
    assert rl.argmax_flips == int((la.double().argmax(-1) != lb.double().argmax(-1)).sum())
    # every aggregate from the per-token Δlogp, by its formula (README), in float64
    d = np.array(rl.dlogp, dtype=np.float64)
    r = np.exp(d)
    seq = np.exp(d.sum(1))
    assert math.isclose(rl.k1_kl, float(-d.mean()), rel_tol=1e-12, abs_tol=1e-18)
    assert math.isclose(rl.k3_kl, float((r - 1 - np.log(r)).mean()), rel_tol=1e-6, abs_tol=1e-15)
    assert rl.k3_kl >= 0
    assert math.isclose(rl.p99_abs_dlogp, float(np.quantile(np.abs(d), 0.99)), rel_tol=1e-12)
    assert (rl.token_ratio_min, rl.token_ratio_max) == pytest.approx((r.min(), r.max()), rel=1e-12)
    assert (rl.seq_ratio_min, rl.seq_ratio_max) == pytest.approx((seq.min(), seq.max()), rel=1e-12)
    assert rl.tis_clipped == pytest.approx(float((r > cap).mean())) and 0 < rl.tis_clipped < 1
    assert rl.mis_masked == pytest.approx(float(((r > band) | (r < 1 / band)).mean())) and rl.mis_masked > 0
    assert rl.seq_tis_clipped == pytest.approx(float((seq > cap).mean()))
    assert rl.seq_mis_masked == pytest.approx(float(((seq > band) | (seq < 1 / band)).mean()))
    la32, lb32 = np.array(rl.logp_a, dtype=np.float64), np.array(rl.logp_b, dtype=np.float64)
    ppl_a, ppl_b = np.exp(-la32.mean(1)).mean(), np.exp(-lb32.mean(1)).mean()
    assert (rl.rollout_ppl, rl.train_ppl, rl.ppl_ratio) == pytest.approx((ppl_a, ppl_b, ppl_b / ppl_a), rel=1e-12)
    counts = [0] * len(HIST_LABELS)
    for x in np.abs(d).ravel():
        counts[0 if x == 0 else (len(HIST_LABELS) - 1 if x > 1 else 1 + max(0, math.ceil(math.log10(x)) + 8))] += 1
    assert list(rl.hist) == counts and sum(rl.hist) == rl.n_tokens == 18
    assert rl.n_equal == int((np.array(rl.logp_a, np.float32) == np.array(rl.logp_b, np.float32)).sum())
    # per-token picture of the traced sequence
    assert [st.dlogp for st in rl.steps] == list(rl.dlogp[row]) and rl.steps[0].position == N - 1
    first = next((i for i in range(6) if not torch.equal(la[row, i], lb[row, i])), None)
    assert rl.first_divergent_step == first


# -- a planted perturbation in the trainer ----------------------------------------------------------------------


def _rowwise_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """Attention computed one query row at a time over exactly its causal keys (batch 1, no padding): the
    same operations whatever the number of queries, so a decode step and a prefill agree bit for bit."""
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    q, kv = query.shape[2], key.shape[2]
    out = torch.empty_like(query)
    for i in range(q):
        p = kv - q + i  # the query's absolute position
        w = torch.softmax((key[:, :, :p + 1] * query[:, :, i:i + 1]).sum(-1) * scaling, dim=-1)
        out[:, :, i] = (w[..., None] * value[:, :, :p + 1]).sum(-2)
    return out.transpose(1, 2).contiguous(), None


def _rowwise_linear(self, x):
    """nn.Linear one row at a time: batch-invariant (the same GEMV for every M)."""
    flat = x.reshape(-1, x.shape[-1])
    rows = [F.linear(flat[i:i + 1], self.weight, self.bias) for i in range(flat.shape[0])]
    return torch.cat(rows).reshape(*x.shape[:-1], -1)


@pytest.fixture
def batch_invariant(monkeypatch):
    from transformers import AttentionInterface

    AttentionInterface.register("tracer_test_rowwise", _rowwise_attention)
    monkeypatch.setattr(torch.nn.Linear, "forward", _rowwise_linear)
    return make_model("llama", dtype=torch.bfloat16, seed=3, attn="tracer_test_rowwise")


@pytest.mark.parametrize("k", [0, 2])
def test_planted_perturbation_in_the_trainer_is_the_origin_at_layer_k(batch_invariant, k):
    model = batch_invariant
    s = build("rollout-vs-train", N, rollouts=1, new_tokens=5)
    a, b = _run(model, s, "sublayers")
    base = compare_records(a, b, scenario=s.name, model="tiny")
    assert base.identical and rl_comparison(a, b, s.params).identical  # batch-invariant kernels close the gap
    target = model.model.layers[k].mlp.down_proj
    handles = []

    def plant(on: bool) -> None:
        if on:  # the trainer's layer k computes one element differently
            def bump(mod, args, out):
                out = out.clone()
                out[..., 5] += 0.25
                return out
            handles.append(target.register_forward_hook(bump))
        else:
            handles.pop().remove()

    a, b = _run(model, s, "sublayers", plant=plant)
    c = compare_records(a, b, scenario=s.name, model="tiny")
    assert [p.name for p in c.origins] == [f"model.layers.{k}.mlp.down_proj"]
    assert c.first_divergent == f"model.layers.{k}.mlp.down_proj"
    assert all(not p.diverged for p in c.points if p.name.startswith(tuple(f"model.layers.{i}." for i in range(k))))
    rl = rl_comparison(a, b, s.params, c)
    assert rl.max_abs_dlogp > 0 and rl.first_divergent_step == 0
    assert rl.steps[0].first_point == f"model.layers.{k}.mlp.down_proj"


# -- packed vs padded --------------------------------------------------------------------------------------------


def _train(model, scen, a, batching):
    plan = replace(scen.plan_b, rl=replace(scen.plan_b.rl, batching=batching))
    b, _ = execute_plan(SimpleNamespace(model=model), IDS, plan, discover_points(model), scen.window, rollout=a)
    return b


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_packed_and_padded_give_the_same_logprobs(dtype, atol, llama32, llama16):
    model = llama32 if dtype == torch.float32 else llama16
    s = build("rollout-vs-train", N, rollouts=3, new_tokens=5)
    a, _ = _run(model, s)
    padded, packed = _train(model, s, a, "padded"), _train(model, s, a, "packed")
    lp, lk = torch.tensor(padded.meta["train"]["logprobs"]), torch.tensor(packed.meta["train"]["logprobs"])
    assert torch.allclose(lp, lk, atol=atol, rtol=0)  # the same math: no token sees padding or another sequence
    # each sequence packed with others equals that sequence trained alone (no attention across sequences)
    for j, seq in enumerate(a.meta["rollout"]["sequences"]):
        alone = build("rollout-vs-train", len(seq) - 5, rollouts=1, new_tokens=5)
        ra = replace(a, meta={"rollout": {**a.meta["rollout"], "sequences": [seq], "tokens": [seq[-5:]]}})
        b1, _ = execute_plan(SimpleNamespace(model=model), seq[:-5], alone.plan_b, discover_points(model),
                             alone.window, rollout=ra)
        assert torch.allclose(torch.tensor(b1.meta["train"]["logprobs"][0]), lk[j], atol=atol, rtol=0)
    # K = 1: neither padding nor packing: one row, the same operations, bit-identical
    s1 = build("rollout-vs-train", N, rollouts=1, new_tokens=5)
    a1, _ = _run(model, s1)
    p1, k1 = _train(model, s1, a1, "padded"), _train(model, s1, a1, "packed")
    assert p1.meta["train"]["logprobs"] == k1.meta["train"]["logprobs"]
    assert all(torch.equal(p1.captures[n].tensor, k1.captures[n].tensor) for n in p1.captures)


# -- trainer knobs ----------------------------------------------------------------------------------------------


def test_fp32_lm_head_and_train_dtype(llama16):
    model = llama16
    bits = model.model.layers[0].mlp.down_proj.weight.clone()
    s = build("rollout-vs-train", N, rollouts=2, new_tokens=3, lm_head_fp32=True, train_dtype="float32")
    a, b = _run(model, s)
    assert a.captures["lm_head"].tensor.dtype == torch.bfloat16
    assert b.captures["lm_head"].tensor.dtype == torch.float32 and b.captures["model.layers.0"].tensor.dtype == torch.float32
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, bits)  # cast back bit for bit
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    from tracer.diff.rl import comparable

    wa, wb, _ = comparable(a, b)
    c = compare_records(wa, wb, scenario=s.name, model="tiny")
    assert c.logits is not None and c.logits_cross_dtype is not None
    assert (c.logits_cross_dtype.compared_in, c.logits_cross_dtype.ulps_in) == ("float32", "bfloat16")
    assert any("values compared in float32" in n and "ULPs in bfloat16" in n for n in c.facts["notes"])
    assert a.captures["lm_head"].tensor.dtype == torch.bfloat16  # the records themselves keep their dtypes
    with pytest.raises(TracerError, match="not wider"):
        _run(model, build("rollout-vs-train", N, rollouts=1, new_tokens=2, train_dtype="float16"))


def test_train_attn_switches_the_trainer_only_and_is_restored(llama32):
    s = build("rollout-vs-train", N, rollouts=2, new_tokens=4, train_attn="eager")
    seen = []
    hook = llama32.model.layers[0].self_attn.register_forward_pre_hook(
        lambda mod, args: seen.append(llama32.config._attn_implementation))
    try:
        a, b = _run(llama32, s)
    finally:
        hook.remove()
    assert seen[0] == "sdpa" and seen[-1] == "eager" and seen.count("eager") == 1  # the trainer's one pass
    assert llama32.config._attn_implementation == "sdpa"
    la, lb = torch.tensor(a.meta["rollout"]["logprobs"]), torch.tensor(b.meta["train"]["logprobs"])
    assert torch.allclose(la, lb, atol=1e-4, rtol=0)  # another kernel, the same math


# -- the pipeline and every rendering ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def result():
    import tracer

    lm = tracer.load_model("tiny-llama", dtype="bfloat16", device="cpu")
    return tracer.run(lm, scenario="rollout-vs-train", length=24, new_tokens=4, rollouts=3, mitigations=True,
                      granularity="sublayers", progress=False)


def test_pipeline_result_and_mitigations(result):
    c = result.comparison
    assert c.rl is not None and c.rl.n_tokens == 12 and c.positions == (23, 27)
    assert [m.knob for m in c.rl.mitigations] == list(KNOBS)
    assert not c.rl.mitigations[0].ran  # same attention already
    assert all(m.ran for m in c.rl.mitigations[1:])
    assert c.origins  # the gap is located
    assert any(s.reason.startswith("no KV cache in run B") for s in c.skipped)  # the trainer keeps no cache


def test_next_steps_name_options_an_rl_run_takes(result):
    from tracer.report.summary import next_steps

    c = result.comparison
    assert not c.identical
    steps = " ".join(next_steps(c))
    assert "--decode" not in steps and "--mitigations" not in steps  # refused by the scenario; already run
    steps = " ".join(next_steps(replace(c, rl=replace(c.rl, mitigations=()))))
    assert "--decode" not in steps and "`--mitigations`" in steps


def test_renderings_carry_the_rl_metrics(result):
    import io

    from rich.console import Console

    import tracer
    from tracer.diff.stored import comparison_from_dict
    from tracer.report.html import comparison_html
    from tracer.report.tables import print_report, to_csv, to_json, to_markdown

    c = result.comparison
    doc = json.loads(to_json(c))
    assert doc["rl"]["mean_abs_dlogp"] == c.rl.mean_abs_dlogp and len(doc["rl"]["mitigations"]) == len(KNOBS)
    assert comparison_from_dict(doc).rl == c.rl  # stored and read back: the same result
    assert RLComparison.from_dict(c.rl.to_dict()) == c.rl
    import csv

    rows = list(csv.DictReader(io.StringIO(to_csv(c))))
    assert "rl_k3_kl" in rows[0] and "rl_tis_clipped" in rows[0]
    assert all(float(r["rl_mean_abs_dlogp"]) == c.rl.mean_abs_dlogp for r in rows)
    for m in c.rl.mitigations:  # the knob table in the CSV too
        assert float(rows[0][f"rl_knob_{m.knob.replace('-', '_')}_mean_abs_dlogp"]) == m.mean_abs_dlogp
    html = comparison_html(c, figures=False)
    assert "RL metrics" in to_markdown(c) and "rl-steps" in html and "rl-mitigations" in html
    assert c.origins[0].name in html  # and where the gap is born
    frame = tracer.to_pandas(result)
    assert frame.attrs["rl"]["k3_kl"] == c.rl.k3_kl and len(frame.attrs["rl"]["mitigations"]) == len(KNOBS)
    tokens = tracer.to_pandas(c.rl)
    assert len(tokens) == 12 and set(tokens["sequence"]) == {0, 1, 2} and tokens["traced"].sum() == 4
    traced = tokens[tokens["traced"]]  # the per-token picture rides on the traced sequence's rows
    assert list(traced["position"]) == [s.position for s in c.rl.steps]
    # a missing point is pandas' missing value (None or NaN, as the pandas version stores a str column)
    import pandas as pd

    assert [None if pd.isna(x) else x for x in traced["first_point"]] == [s.first_point for s in c.rl.steps]
    assert tokens[~tokens["traced"]]["first_point"].isna().all()
    buf = io.StringIO()
    print_report(c, Console(file=buf, width=80, no_color=True))
    lines = buf.getvalue().splitlines()
    firsts = [x for x in lines if not x.startswith(" ")]  # a fact's first line (80 columns: continuations indented)
    assert firsts[0].startswith("RL step:") and firsts[1].startswith("|Δlogp|:") and "k3" in firsts[2]
    assert firsts[3].startswith("clipped:")
    assert min(i for i, x in enumerate(firsts) if x.startswith("origin:")) > 3  # then where the gap is born
    table = lines.index(next(x for x in lines if x.startswith("the traced sequence (row")))
    head = next(i for i in range(table, len(lines)) if lines[i].startswith("tok "))  # the title may wrap
    for st, line in zip(c.rl.steps, lines[head + 1:]):
        assert len(line) <= 80 and str(st.token) in line  # whole, at 80 columns
    knobs = lines.index(next(x for x in lines if x.startswith("which knob closes the gap")))
    assert all(len(x) <= 80 for x in lines[knobs:knobs + 2 + len(KNOBS)])


def test_fail_on_judges_every_sequence_of_the_rl_step(result):
    """The RL summary reported "flips: 1 of 32 positions" while --fail-on flip passed (exit 0): the check counted
    the traced sequence only. Now a flip, or a differing logprob (--fail-on any), in any sequence fails."""
    c = result.comparison
    rl = replace(c.rl, argmax_flips=1)
    quiet = replace(c, logits=replace(c.logits, argmax_flips=()), rl=rl)  # no flip in the traced sequence
    failed, why = quiet.check("flip")
    assert failed and "1 argmax flip in the RL step's 12 positions (0 in the traced sequence)" in why
    assert not replace(quiet, rl=replace(rl, argmax_flips=0)).check("flip")[0]
    same = replace(c, points=(), logits=None, skipped=())  # the traced sequence bit-identical
    assert same.identical and not c.rl.identical
    failed, why = same.check("any")
    assert failed and f"{c.rl.n_tokens - c.rl.n_equal} of the RL step's 12 logprobs differ" in why
    assert not replace(same, rl=replace(c.rl, n_equal=c.rl.n_tokens)).check("any")[0]


def test_markdown_rl_tables_have_one_cell_per_column(result):
    """``last |Δ|``, ``mean|Δlogp|``: a pipe inside a heading or cell is escaped, so every row of the RL tables
    splits into as many cells as the table has columns (unescaped, the heading row had one more)."""
    import re

    from tracer.report.rl import MITIGATION_COLUMNS, STEP_COLUMNS, markdown_lines

    lines = markdown_lines(result.comparison.rl)
    tables, cur = [], []
    for line in lines + [""]:
        if line.startswith("|"):
            cur.append(line)
        elif cur:
            tables.append(cur)
            cur = []
    assert [len(t) for t in tables] == [2 + len(result.comparison.rl.steps), 2 + len(KNOBS)]
    for table, ncol in zip(tables, (len(STEP_COLUMNS), len(MITIGATION_COLUMNS))):
        for line in table:
            assert len(re.split(r"(?<!\\)\|", line)) - 2 == ncol, line


def test_positions_all_and_a_stored_trace(tmp_path):
    import tracer
    from tracer.diff.stored import stored_comparison

    out = tmp_path / "rl.h5"
    r = tracer.run("tiny-llama", scenario="rollout-vs-train", length=12, new_tokens=3, rollouts=2, positions="all",
                   store="tensors", output=str(out), progress=False)
    assert r.comparison.positions == (0, 12 + 3 - 1)
    assert stored_comparison(out).rl == r.comparison.rl


def test_tracer_compare_of_a_stored_rl_trace_keeps_its_rl_metrics(tmp_path):
    """``tracer compare TRACE`` recomputes the layer table from the file; the RL metrics (from every sequence's
    logits, held in memory at run time only) come with it, and a trainer in another dtype (compared in the wider
    dtype at run time) gives the run-time comparison instead of a dtype error."""
    import tracer
    from tracer.report.summary import next_steps

    opts = dict(scenario="rollout-vs-train", length=12, new_tokens=3, rollouts=2, store="tensors", progress=False)
    same, wide = tmp_path / "rl.h5", tmp_path / "rl-fp32.h5"
    r = tracer.run("tiny-llama", output=str(same), **opts)
    c = tracer.compare_trace(str(same))
    assert c.rl is not None and c.rl == r.comparison.rl
    assert [p.diff.n_diff for p in c.points] == [p.diff.n_diff for p in r.comparison.points]
    assert tracer.compare_trace(str(same), "B", "A").rl is None  # swapped runs: no RL metrics of the wrong sign
    assert "--decode" not in " ".join(next_steps(replace(c, rl=None), "compare"))  # the scenario refuses it
    w = tracer.run("tiny-llama", output=str(wide), train_dtype="float32", lm_head_fp32=True, **opts)
    cw = tracer.compare_trace(str(wide))
    assert cw.rl == w.comparison.rl and cw.first_divergent == w.comparison.first_divergent
    assert any("float32 in run B" in n for n in cw.facts["notes"])


def test_smollm2_cli_prints_the_rl_summary_first_then_where_the_gap_is_born(cli_env, tmp_path):
    from tests.helpers import tracer_warm

    out = tracer_warm(["run", "smollm2-135m", "--scenario", "rollout-vs-train", "--length", "32", "--new-tokens", "8",
                       "--no-store"], cli_env, tmp_path, check=False)
    assert out.returncode == 0, out.stderr
    lines = [x for x in out.stdout.splitlines() if x.strip()]
    assert lines[0].startswith("RL step:") and "4 sequences × 8 response tokens" in lines[0]
    assert lines[1].startswith("|Δlogp|:") and "mean" in lines[1] and "max" in lines[1]
    assert lines[2].startswith("KL:") and "k3" in lines[2]
    assert lines[3].startswith("clipped:") and "%" in lines[3]
    mean = float(lines[1].split("mean ")[1].split(" ")[0])
    assert mean > 0  # real weights in bf16: the rollout and the trainer do disagree on this CPU
    origin = next(i for i, x in enumerate(lines) if x.startswith("origin:"))
    assert origin > 8 and "model.layers." in lines[origin]
