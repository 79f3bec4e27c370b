"""Two engine dumps against each other (``tracer compare DUMP_A DUMP_B --reference REF.h5:RUN``): a rollout
engine's SGLang dump against a Megatron-LM trainer's dump as Miles writes it (megatron_parallel_info), both
written here from the tiny model's real activations in the exact file formats, mapped onto HF names."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import tracer
from tracer.diff.compare_dumps import compare_dumps
from tracer.diff.compare_dump import compare_dump, map_engine_dump
from tracer.errors import TracerError
from tracer.load.models import load_model
from tracer.engines.dumps.read import read_dump
from tracer.engines.dumps.megatron_writer import write_megatron_dump
from tracer.engines.dumps.sglang_writer import write_sglang_dump
from tests.helpers import cli_session

N, T = 24, 4  # prompt tokens, response tokens: the sequence is N + T ids, the logits at N-1 .. N+T-2 predict the response
OPTS = dict(scenario="rollout-vs-train", length=N, rollouts=2, new_tokens=T, granularity="sublayers", progress=False)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", dtype="bfloat16", device="cpu", progress=False)


@pytest.fixture(scope="module")
def refs(tiny, tmp_path_factory):
    """rollout-vs-train traces of the tiny model: at every position (``all``), at the response positions
    only (``window``), and ``planted`` (every position, the trainer's layer 2 down_proj output bumped by 0.25 at
    column 5; the rollout is unchanged, so the trainer recomputes the same sequence as in ``all``)."""
    import tracer.engines.hf.rollout as rollout

    d = tmp_path_factory.mktemp("refs")
    out = {"all": d / "all.h5", "window": d / "window.h5", "planted": d / "planted.h5"}
    tracer.run("tiny-llama", loaded=tiny, positions="all", output=out["all"], **OPTS)
    tracer.run("tiny-llama", loaded=tiny, output=out["window"], **OPTS)

    def bump(mod, args, y):
        y = y.clone()
        y[..., 5] += 0.25
        return y

    train = rollout.execute_train

    def planted_train(loaded, *args, **kwargs):  # the trainer's forward only: the rollout samples the same tokens
        h = loaded.model.model.layers[2].mlp.down_proj.register_forward_hook(bump)
        try:
            return train(loaded, *args, **kwargs)
        finally:
            h.remove()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rollout, "execute_train", planted_train)
        tracer.run("tiny-llama", loaded=tiny, positions="all", output=out["planted"], **OPTS)
    return {k: str(v) for k, v in out.items()}


def _rollout(ref: str, run: str, out: Path) -> str:
    """SGLang dump of a rollout: the prompt's prefill, then one decode step per token, next-token logits each step."""
    w0, w1 = tracer.read_trace(ref).run(run, load_tensors=False).window
    steps = [N - w0] + [1] * (w1 - N) if w0 < N else [1] * (w1 - w0)
    return str(write_sglang_dump(ref, run, out, tp=2, steps=steps, logits="every-step"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


# -- the formats and the join ---------------------------------------------------------------------------------


def test_megatron_files_are_megatron_s_layout(refs, tmp_path):
    """The synthetic trainer dump holds what Megatron's modules return: [s, b, ...] tensors, linear_qkv with each
    query group's [q heads | k | v] per TP rank, linear_fc1's [gate_r | up_r]: checked here with the test's own
    head arithmetic against the trace's unsharded HF tensors."""
    f = write_megatron_dump(refs["all"], "B", tmp_path / "mg", tp=2)
    r = tracer.read_trace(refs["all"])
    q, k, v = (r.tensor("B", f"model.layers.1.self_attn.{x}_proj") for x in "qkv")  # (27, 64), (27, 32), (27, 32)
    gate, up = r.tensor("B", "model.layers.1.mlp.gate_proj"), r.tensor("B", "model.layers.1.mlp.up_proj")
    hd, groups, tp = 16, 2, 2  # tiny-llama: 4 heads of 16, 2 KV heads (query groups)
    for rank in range(tp):
        qkv = torch.load(next(f.glob(f"*rank={rank}___*name=non_intrusive__module.module.decoder.layers.1."
                                     "self_attention.linear_qkv.output*")), weights_only=True)
        assert qkv["meta"]["megatron_parallel_info"]["tp_rank"] == rank and qkv["meta"]["layer_id"] == 1
        g = rank  # one query group per rank: heads 2g, 2g+1, then k head g, v head g
        expected = torch.cat([q[:, 2 * g * hd:(2 * g + 2) * hd], k[:, g * hd:(g + 1) * hd], v[:, g * hd:(g + 1) * hd]], -1)
        assert qkv["value"].shape == (27, 1, 64) and torch.equal(_bits(qkv["value"][:, 0]), _bits(expected))
        fc1 = torch.load(next(f.glob(f"*rank={rank}___*layers.1.mlp.linear_fc1.output*")), weights_only=True)["value"]
        half = gate.shape[1] // tp
        expected = torch.cat([gate[:, rank * half:(rank + 1) * half], up[:, rank * half:(rank + 1) * half]], -1)
        assert torch.equal(_bits(fc1[:, 0]), _bits(expected))
    assert groups * hd == k.shape[1]


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=2, sp=True), dict(tp=1, cp=2, tokens="thd"),
                                    dict(tp=2, cp=2, sp=True, pp=2, spec="te", tokens="bshd")])
def test_megatron_shards_join_to_the_unsharded_hf_tensors(refs, tmp_path, layout):
    """TP column shards, grouped QKV, SP sequence shards, CP zigzag chunks and PP stages joined back: every
    mapped point equals the trace's unsharded HF tensor bit for bit, at every position."""
    f = write_megatron_dump(refs["all"], "B", tmp_path / "mg", **layout)
    raw = read_dump(f)
    assert raw.facts["framework"] == "megatron" and raw.engine == "Megatron-LM dump"
    with tracer.read_trace(refs["all"]) as r:
        m = map_engine_dump(str(f), r, "B")
        assert m.positions == (0, N + T - 1)
        for name, t in m.tensors.items():
            assert torch.equal(_bits(t), _bits(r.tensor("B", name))), name
    names = set(m.tensors)
    assert {"model.layers.3.self_attn.k_proj", "model.layers.0.mlp.up_proj", "model.layers.2.self_attn.core", "lm_head"} <= names
    norms = {"model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm"}
    if layout.get("spec") == "te":  # IdentityOps: recognised by their inputs, never compared as norms
        assert not norms & names and any("identity modules" in n for n in m.notes)
    else:
        assert norms <= names
    if layout.get("tokens") in ("thd", "bshd") and layout.get("cp", 1) > 1:
        assert any("equal the reference's for their first" in n for n in m.notes)  # the padding after the sequence


def test_identical_dumps_are_bit_identical(refs, tmp_path):
    """A rollout's SGLang dump and a trainer's Megatron dump of the same activations: bit-identical, RL gap 0."""
    a = _rollout(refs["all"], "B", tmp_path / "a")
    b = str(write_megatron_dump(refs["all"], "B", tmp_path / "b", tp=2, sp=True, tokens="thd"))
    c = compare_dumps(a, b, (refs["all"], "B"))
    assert c.identical and c.verdict().startswith("bit-identical") and c.positions == (0, N + T - 1)
    assert (c.run_a, c.run_b) == ("SGLang dumper", "Megatron-LM dump")
    assert len(c.points) > 40 and c.rl is not None and c.rl.identical and c.rl.max_abs_dlogp == 0
    assert [s.position for s in c.rl.steps] == list(range(N - 1, N + T - 1))
    frame = tracer.to_pandas(c)
    assert frame.attrs["rl"]["n_tokens"] == T and len(tracer.to_pandas(c.rl)) == T
    c2 = compare_dumps(b, str(write_megatron_dump(refs["all"], "B", tmp_path / "c", tp=1, cp=2, spec="te")),
                       (refs["all"], "B"))
    assert c2.identical and c2.rl.identical  # two trainer layouts; the TE dump's identity norms are left out
    assert "model.layers.0.input_layernorm" not in {p.name for p in c2.points}


def test_planted_perturbation_in_dump_b_layer_k_is_the_origin(refs, tmp_path):
    """Dump B is the trainer with layer 2's down_proj output bumped: the origin is that op, layers 0-1 agree."""
    a = _rollout(refs["all"], "B", tmp_path / "a")
    b = str(write_megatron_dump(refs["planted"], "B", tmp_path / "b", tp=2))
    c = compare_dumps(a, b, (refs["all"], "B"))
    assert c.positions == (0, N + T - 1)  # one sequence: the trainer recomputed the rollout's tokens
    assert [p.name for p in c.origins] == ["model.layers.2.mlp.down_proj"]
    assert c.first_divergent == "model.layers.2.mlp.down_proj"
    assert not any(p.diverged for p in c.points if p.name.startswith(("model.layers.0.", "model.layers.1.")))
    down = next(p for p in c.points if p.name == "model.layers.2.mlp.down_proj")
    # column 5 only, at most one element per position (a bump that rounds away in bf16 leaves one unchanged)
    assert 0 < down.diff.n_diff <= N + T - 1 and abs(down.diff.max_abs_diff - 0.25) < 0.01
    assert c.rl.n_tokens == T and c.rl.max_abs_dlogp > 0 and c.rl.steps[0].first_point == "model.layers.2.mlp.down_proj"


# -- tokens aligned by id -------------------------------------------------------------------------------------


def test_tokens_aligned_by_id_across_different_token_ranges(refs, tmp_path):
    """The rollout dump holds the response positions only (its decode steps), the trainer's the whole padded
    sequence: compared at the common positions, each point exactly as the HF comparison of the same runs."""
    a = _rollout(refs["window"], "A", tmp_path / "a")  # 4 one-token steps at positions 23..26
    b = str(write_megatron_dump(refs["all"], "B", tmp_path / "b", tp=2, cp=2, tokens="thd"))  # 0..27 (+ padding)
    c = compare_dumps(a, b, (refs["all"], "B"))
    assert c.positions == (N - 1, N + T - 1)
    hf = tracer.compare_trace(refs["window"], "A", "B")  # the same tensors, compared by tracer's HF path
    by_name = {p.name: p for p in hf.points}
    assert len(c.points) > 40
    for p in c.points:
        assert (p.diff.n_diff, p.diff.max_abs_diff) == (by_name[p.name].diff.n_diff,
                                                            by_name[p.name].diff.max_abs_diff), p.name
    assert c.first_divergent == hf.first_divergent
    assert any("(other requests)" in n or "padding" in n or "for their first" in n for n in c.facts["notes"])


def test_rl_metrics_equal_an_independent_float64_computation(refs, tmp_path):
    """Δlogp, k3 KL, the ratios and PPL of the dumps' tokens from the trace's logits in float64."""
    a = _rollout(refs["all"], "A", tmp_path / "a")
    b = str(write_megatron_dump(refs["all"], "B", tmp_path / "b", tp=2))
    rl = compare_dumps(a, b, (refs["all"], "B")).rl
    r = tracer.read_trace(refs["all"])
    ids = r.run("B", load_tensors=False).token_ids
    pos = list(range(N - 1, N + T - 1))
    y = torch.tensor([ids[p + 1] for p in pos])
    la = torch.log_softmax(r.tensor("A", "lm_head")[pos].double(), -1)[range(T), y]
    lb = torch.log_softmax(r.tensor("B", "lm_head")[pos].double(), -1)[range(T), y]
    d = lb - la
    assert rl.n_tokens == T and list(rl.tokens[0]) == y.tolist()
    assert rl.mean_abs_dlogp == pytest.approx(float(d.abs().mean()), abs=2e-6)
    assert rl.max_abs_dlogp == pytest.approx(float(d.abs().max()), abs=2e-6)
    assert rl.k3_kl == pytest.approx(float((d.exp() - 1 - d).mean()), abs=1e-6)
    assert rl.seq_ratio_max == pytest.approx(math.exp(float(d.sum())), rel=1e-5)
    assert rl.train_ppl == pytest.approx(math.exp(-float(lb.mean())), rel=1e-5)
    pa = torch.softmax(r.tensor("A", "lm_head")[pos].double(), -1)
    kl = (pa * (pa.log() - torch.log_softmax(r.tensor("B", "lm_head")[pos].double(), -1))).sum(-1)
    assert rl.vocab_kl_max == pytest.approx(float(kl.max()), rel=1e-6, abs=1e-12)


def test_rl_metrics_at_the_rollouts_temperature_and_thresholds(refs, tmp_path):
    """A rollout sampled at τ = 0.7 is scored at τ = 0.7 (``tracer compare ... --temperature 0.7``; was τ = 1
    only, from the command line and tracer.compare_trace), the TIS cap and MIS band as given; checked against
    float64 log_softmax(logits / τ) of the trace's logits. The planted trace: its trainer differs from the
    rollout at every response token (the plain one's bf16 runs can agree at some, leaving no threshold
    between two tokens' values on some CPUs)."""
    a = _rollout(refs["planted"], "A", tmp_path / "a")
    b = str(write_megatron_dump(refs["planted"], "B", tmp_path / "b", tp=2))
    r = tracer.read_trace(refs["planted"])
    ids = r.run("B", load_tensors=False).token_ids
    pos = list(range(N - 1, N + T - 1))
    y = torch.tensor([ids[p + 1] for p in pos])
    la = torch.log_softmax(r.tensor("A", "lm_head")[pos].double() / 0.7, -1)[range(T), y]
    lb = torch.log_softmax(r.tensor("B", "lm_head")[pos].double() / 0.7, -1)[range(T), y]
    d = lb - la
    ratio = d.exp()
    r, dev = ratio.sort().values, d.abs().sort().values  # thresholds midway between two tokens' values
    assert r[2] - r[1] > 1e-5 and dev[2] - dev[1] > 1e-5  # 20 float32 spacings of a logprob near -6 apart
    cap, band = float(r[1] + r[2]) / 2, math.exp(float(dev[1] + dev[2]) / 2)
    rl = tracer.compare_trace(a, b, reference=f"{refs['planted']}:B", temperature=0.7, is_cap=cap, mask_threshold=band).rl
    assert (rl.tau, rl.is_cap, rl.mask_threshold) == (0.7, cap, band)
    assert rl.mean_abs_dlogp == pytest.approx(float(d.abs().mean()), abs=2e-6)
    assert list(rl.logp_a[0]) == pytest.approx(la.tolist(), abs=3e-6)
    assert rl.tis_clipped == pytest.approx(float((ratio > cap).double().mean()), abs=1e-9)
    assert rl.mis_masked == pytest.approx(float(((ratio > band) | (ratio < 1 / band)).double().mean()), abs=1e-9)
    with pytest.raises(TracerError, match="--temperature 0"):
        tracer.compare_trace(a, b, reference=f"{refs['planted']}:B", temperature=0.0)
    with pytest.raises(TracerError, match="applies to two engine dumps"):
        tracer.compare_trace(refs["all"], is_cap=3.0)


def test_a_trainer_dump_given_as_the_rollout_is_named(refs, tmp_path):
    """DUMP_A is read as the rollout: a Megatron (trainer) dump there flips Δlogp's sign and the summary's 'train'
    and 'rollout' labels; the notes say so (the rollout-first order gets no such note)."""
    a = _rollout(refs["all"], "A", tmp_path / "a")
    b = str(write_megatron_dump(refs["all"], "B", tmp_path / "b", tp=2))
    swapped = compare_dumps(b, a, (refs["all"], "B"))
    assert any(n.startswith("warning: dump A is a trainer's (Megatron-LM dump)") for n in swapped.facts["notes"])
    assert not any(n.startswith("warning: dump A") for n in compare_dumps(a, b, (refs["all"], "B")).facts["notes"])


def test_rl_metrics_never_score_a_token_the_dumps_do_not_hold(refs, tiny, tmp_path):
    """A reference of the same prompt with another response (sampled, not greedy): the dumps' response ids are
    not the reference's, so their positions are not compared, and the logits at N-1 must not be scored
    against the reference's token at N, which the rollout never sampled."""
    a = _rollout(refs["all"], "A", tmp_path / "a")
    b = str(write_megatron_dump(refs["all"], "B", tmp_path / "b", tp=2))
    other = tmp_path / "other.h5"
    tracer.run("tiny-llama", loaded=tiny, positions="all", output=str(other), sample=True, seed=7, **OPTS)
    ids = tracer.read_trace(refs["all"]).run("B", load_tensors=False).token_ids
    ids_other = tracer.read_trace(str(other)).run("B", load_tensors=False).token_ids
    assert ids_other[:N] == ids[:N] and ids_other[N] != ids[N]  # the same prompt, another first response token
    c = compare_dumps(a, b, (str(other), "B"))
    assert c.positions == (0, N)  # the prompt only: the responses' ids differ from the reference's
    assert c.rl is None
    assert any(f"token at position(s) {N} is not in both dumps" in n for n in c.facts["notes"])


def test_parallel_info_and_parts():
    """The meta's parallel info (Megatron's wins over SGLang's error flags), DP x CP parts as steps, zigzag positions."""
    from tracer.engines.dumps.parallel import infer_positions, part_steps, rank_of

    meta = {"sglang_parallel_info": {"distributed_error": True},
            "megatron_parallel_info": {"tp_rank": 1, "tp_size": 2, "cp_rank": 1, "cp_size": 2, "sp_size": 2, "pp_size": 1}}
    r = rank_of(meta)
    assert (r.framework, r.tp_rank, r.tp_size, r.cp_rank, r.cp_size, r.sp) == ("megatron", 1, 2, 1, 2, True)
    with pytest.raises(TracerError, match="both"):
        rank_of({**meta, "sglang_parallel_info": {"tp_rank": 0, "tp_size": 2}})
    assert part_steps([(0, 0, 0), (1, 0, 0)]) == {(0, 0, 0): 0, (1, 0, 0): 1}
    assert part_steps([(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]) == {(0, 0, 0): 0, (0, 1, 0): 1, (1, 0, 0): 2, (1, 1, 0): 3}
    # THD, two sequences of 8 and 4 tokens, CP 2: rank 1 holds chunks 1 and 2 of each (chunk = L / 4)
    slot = {"input_ids": torch.zeros(6, dtype=torch.long), "cu_seqlens_q": torch.tensor([0, 8, 12])}
    assert infer_positions(slot, r, "t").tolist() == [2, 3, 4, 5, 1, 2]
    with pytest.raises(TracerError, match="inconsistent"):
        infer_positions({"input_ids": torch.zeros(5, dtype=torch.long), "cu_seqlens_q": torch.tensor([0, 8, 12])}, r, "t")


# -- refusals and the command -----------------------------------------------------------------------------------


def test_bad_inputs_are_one_line_errors(refs, tmp_path):
    b = write_megatron_dump(refs["all"], "B", tmp_path / "b", tp=2, pp=2)
    with pytest.raises(TracerError, match="not an engine dump"):
        compare_dumps(refs["all"], str(b), (refs["all"], "B"))
    # a PP stage whose layers carry no layer_id tags: their global numbers are unknown
    for f in b.glob("*layer_id=*"):
        data = torch.load(f, weights_only=True)
        if data["meta"]["megatron_parallel_info"]["pp_rank"] == 1:
            lid = data["meta"].pop("layer_id")
            torch.save(data, f.with_name(f.name.replace(f"___layer_id={lid}", "")))
            f.unlink()
    with pytest.raises(TracerError, match="without layer_id tags"):
        read_dump(b)
    v = write_megatron_dump(refs["all"], "B", tmp_path / "v", tp=1)
    f = next(v.glob("*embedding.output*"))
    data = torch.load(f, weights_only=True)
    data["meta"]["megatron_parallel_info"]["vpp_size"] = 2
    torch.save(data, f)
    with pytest.raises(TracerError, match="virtual pipeline"):
        read_dump(v)
    other = write_megatron_dump(refs["all"], "B", tmp_path / "o", tp=1)
    for f in other.glob("*name=input_ids*"):
        data = torch.load(f, weights_only=True)
        data["value"] = (data["value"] + 1) % 500
        torch.save(data, f)
    with pytest.raises(TracerError, match="do not match the reference"):
        compare_dumps(str(other), str(write_megatron_dump(refs["all"], "B", tmp_path / "ok", tp=1)), (refs["all"], "B"))


def test_cli_compares_two_dumps_rl_summary_first(refs, tmp_path, cli_env):
    a = _rollout(refs["all"], "A", tmp_path / "a")
    b = str(write_megatron_dump(refs["all"], "B", tmp_path / "b", tp=2, sp=True))
    same = _rollout(refs["all"], "B", tmp_path / "same")
    ref = f"{refs['all']}:B"
    quiet = {**cli_env, "TRACER_PROGRESS": "off"}  # no 'compare: ... elapsed' line on a loaded machine
    r, js, ok, one, no_ref = cli_session([["compare", a, b, "--reference", ref, "--report", "dumps.html"],
                                          ["compare", a, b, "-r", ref, "--format", "json"],
                                          ["compare", same, b, "-r", ref, "--fail-on", "any"],
                                          ["compare", a, "-r", ref],
                                          ["compare", a, b]], quiet, tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.index("|Δlogp|:") < out.index("verdict:") < out.index("SGLang dumper vs Megatron-LM dump")
    assert "diverges from" in out and "the traced sequence (row 0)" in out
    html = (tmp_path / "dumps.html").read_text()
    assert "RL metrics" in html and "rl-steps" in html and "Megatron-LM dump" in html
    doc = json.loads(js.stdout)
    assert doc["runs"] == ["SGLang dumper", "Megatron-LM dump"] and doc["rl"]["n_tokens"] == T
    assert doc["facts"]["reference"] == ref and doc["first_divergent"]
    assert ok.returncode == 0 and "bit-identical" in ok.stdout, ok.stdout + ok.stderr
    assert one.returncode == 2 and one.stderr.count("\n") == 1 and "give DUMP_A DUMP_B" in one.stderr
    assert no_ref.returncode == 2 and no_ref.stderr.count("\n") == 1 and "add --reference REF.h5:RUN" in no_ref.stderr


def test_hf_reference_against_a_megatron_dump(refs, tmp_path):
    """The existing path, REF.h5:RUN DUMP, reads a Megatron dump too (its engine map chosen by its parallel info)."""
    c = compare_dump((refs["all"], "B"), str(write_megatron_dump(refs["all"], "B", tmp_path / "b", tp=2, pp=2)))
    assert c.identical and c.run_b == "Megatron-LM dump"
    assert any("[PP stage 1]" in n for n in c.facts["notes"])


def test_an_engine_dumps_kv_cache_records_the_consumers_contract_and_says_the_producers_is_unknown():
    """An engine dump carries no KV contract: the consumer's side (the reference) is recorded and one line
    says the producer's is unknown, nothing invented; a dump without KV-cache tensors gets no contract."""
    import torch

    from tracer.diff.compare_dump import PRODUCER_UNKNOWN, dump_kv_transfer
    from tracer.engines.dumps.namemap import MappedDump, RefLayout
    from tracer.load.kv_contract import KVContract, check_kv_contract
    from tracer.schema import decode

    kv = "model.layers.{}.self_attn.kv_cache"
    names = {"model.layers.0": ("layer", "LlamaDecoderLayer", (64,), "bfloat16"),
             **{kv.format(i): ("kv_cache", "LlamaAttention", (2 * 2 * 16,), "bfloat16") for i in range(2)}}
    layout = RefLayout(names=names, layer_prefix="model.layers", n_layers=2, token_ids=list(range(10)), window=(0, 10),
                       family="llama", kv_heads=2)
    plain = MappedDump("SGLang dumper", "/d", (0, 10), {"model.layers.0": torch.zeros(10, 64)}, {})
    assert dump_kv_transfer(plain, layout, {"dtype": "bfloat16"}) is None
    mapped = MappedDump("SGLang dumper", "/d", (0, 10), {kv.format(0): torch.zeros(10, 64)}, {})
    t = dump_kv_transfer(mapped, layout, {"dtype": "bfloat16", "device": "cpu"})
    assert t["role"] == "imported" and t.get("contract") is None and t["unknown"] == PRODUCER_UNKNOWN
    assert PRODUCER_UNKNOWN.startswith("producer contract unknown") and "\n" not in PRODUCER_UNKNOWN
    consumer = decode(KVContract, t["consumer"], "consumer")
    assert (consumer.layers, consumer.kv_heads, consumer.head_dim, consumer.storage_dtype) == (2, 2, 16, "bfloat16")
    assert not check_kv_contract(consumer, consumer).differences
