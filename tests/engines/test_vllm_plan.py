"""How run plans become vLLM requests (tracer/engines/vllm/plan.py): no vLLM needed."""

from __future__ import annotations

import pytest

from tracer.errors import TracerError
from tracer.engines.vllm.plan import VllmSettings, check_schedule, chunk_mode, refuse_unsupported, settings_of, waves
from tracer.engines.door import realise
from tracer.plan import scenarios as S
from tracer.plan.build import build as plan_build

N = 100
IDS = list(range(1000, 1000 + N))


def build(name, n, **params):
    """The catalogue scenario, realised on the engine it names (as the pipeline plans it)."""
    return realise(plan_build(name, n, **params), params.get("engine"))


def test_prefix_cache_hit_is_a_prefix_request_then_the_prompt():
    scen = S.prefix_cache(N, block_size=32)
    mode = chunk_mode(scen.plan_b, {}, {"scenario": scen.name})
    assert mode == "prefix-cache"
    assert waves(IDS, scen.plan_b, mode, 32) == [([IDS[:96]], [True]), ([IDS], [True])]
    assert waves(IDS, scen.plan_a, chunk_mode(scen.plan_a, {}, {}), 32) == [([IDS], [True])]


def test_a_cached_prefix_off_the_block_grid_is_refused():
    scen = S.prefix_cache(N, split_at=50)
    with pytest.raises(TracerError, match="not a multiple of vLLM's KV block size 32"):
        waves(IDS, scen.plan_b, "prefix-cache", 32)


def test_chunked_prefill_sets_the_token_budget():
    scen = S.chunked_prefill(N, chunk_size=32)
    mode = chunk_mode(scen.plan_b, {}, {"scenario": scen.name})
    assert mode == "chunked" and settings_of(scen.plan_b, mode, {}).max_num_batched_tokens == 32
    assert waves(IDS, scen.plan_b, mode, 32) == [([IDS], [True])]
    with pytest.raises(TracerError, match="unknown vLLM chunk mode"):
        chunk_mode(scen.plan_b, {"chunks": "sideways"}, {})


def test_batch_rows_are_the_hf_batch_rows_without_padding():
    import torch

    from tracer.engines.hf.run import batch_inputs

    scen = S.batch(N, batch_size=4, padding="left")
    [(rows, traced)] = waves(IDS, scen.plan_b, "one-step", 32)
    ids, mask, _col = batch_inputs(IDS, scen.plan_b.batch, torch.device("cpu"))
    assert rows == [ids[j][mask[j].bool()].tolist() for j in range(4)]  # the same tokens as HF's padded batch
    assert traced == [j == scen.plan_b.batch.row for j in range(4)]


def test_a_schedule_other_than_the_plan_is_refused():
    scen = S.prefix_cache(N, block_size=32)
    req = lambda c, i: {"traced": True, "num_cached_tokens": c, "request_id": i}  # noqa: E731  (steps name requests by it)
    steps = [{"requests": 1, "traced": [{"request": "a", "positions": [0, 96]}]},
             {"requests": 1, "traced": [{"request": "b", "positions": [96, 100]}]}]
    check_schedule(scen.plan_b, "prefix-cache", [req(0, "a"), req(96, "b")], steps)
    with pytest.raises(TracerError, match=r"num_cached_tokens \[0, 64\].*needs \[0, 96\]"):
        check_schedule(scen.plan_b, "prefix-cache", [req(0, "a"), req(64, "b")], steps)
    split = [{"requests": 1, "traced": [{"request": "b", "positions": [0, 50]}]},
             {"requests": 1, "traced": [{"request": "b", "positions": [50, 100]}]}]
    with pytest.raises(TracerError, match="split the prompt into 2 steps"):
        check_schedule(scen.plan_a, "one-step", [req(0, "b")], split)


def test_compilation_graphs_and_unsupported_plan_features_are_refused():
    with pytest.raises(TracerError, match="CUDA graphs"):
        VllmSettings(enforce_eager=False).check()
    with pytest.raises(TracerError, match="torch.compile"):
        VllmSettings(compilation_mode=3).check()
    tp = S.tensor_parallel(N, tp=2).plan_b
    with pytest.raises(TracerError, match="tensor parallelism is not available with the vllm engine"):
        refuse_unsupported(tp, False, False)
    with pytest.raises(TracerError, match="--op-replay"):
        refuse_unsupported(S.repeat(N).plan_a, False, True)
    refuse_unsupported(S.repeat(N).plan_a, True, False)  # --kernels: recorded inside vLLM (tracer.engines.vllm.kernels)


# ---------------------------------------------------------------- --engine and --scenario engine (tracer/engines/vllm/realise.py)


def test_engine_vllm_hands_both_plans_to_vllm_with_their_settings():
    from tracer.engines.door import executor_name

    pc = build("prefix-cache", N, engine="vllm")
    assert pc.params["block_size"] == 32 and pc.window == (96, N)  # vLLM's CPU block size: the cached prefix is 96
    assert (pc.plan_a.engine, pc.plan_b.engine) == ("vllm", "vllm")
    assert dict(pc.plan_b.engine_settings) == {"block_size": 32, "chunks": "prefix-cache"}
    assert executor_name(pc.plan_a) == executor_name(pc.plan_b) == "vllm"
    aligned = build("prefix-cache", N, engine="vllm", mitigation="aligned")  # the miss, chunked at P by the budget
    assert dict(aligned.plan_a.engine_settings)["chunks"] == "chunked" and aligned.plan_a.chunks == ((0, 96), (96, N))
    assert settings_of(aligned.plan_a, chunk_mode(aligned.plan_a, {}, {}), {}).max_num_batched_tokens == 96
    bs = build("block-size", N, engine="vllm")
    assert [dict(p.engine_settings)["block_size"] for p in (bs.plan_a, bs.plan_b)] == [32, 64]
    assert [settings_of(p, "prefix-cache", {}).block_size for p in (bs.plan_a, bs.plan_b)] == [32, 64]
    cp = build("chunked-prefill", N, engine="vllm", chunk_size=32)
    assert chunk_mode(cp.plan_b, {}, {}) == "chunked"
    rl = build("rollout-vs-train", N, engine="vllm")
    assert (rl.plan_a.engine, rl.plan_b.engine) == ("vllm", "hf")
    assert (executor_name(rl.plan_a), executor_name(rl.plan_b)) == ("vllm-rollout", "hf-train")
    # one GEMM M per step: vLLM flattens the K requests of the prefill (no padding), then K per decode step;
    # the description says no M of its own (it once said M=272 beside a GEMM M of 320, the HF rollout's K × W)
    spec = rl.plan_a.rl
    assert rl.plan_a.gemm_m() == [sum(spec.lengths)] + [spec.rollouts] * (spec.new_tokens - 1)
    assert build("rollout-vs-train", N).plan_a.gemm_m()[0] == spec.rollouts * max(spec.lengths)  # HF: left-padded
    assert "M=" not in rl.plan_a.description and "M=" not in rl.plan_b.description
    assert build("prefix-cache", N) == build("prefix-cache", N, engine="hf")  # hf: today's plans, unchanged


def test_a_prompt_longer_than_the_default_max_model_len_gets_room_for_it():
    """The default max_model_len (2048) must not refuse a longer prompt that the model's positions
    allow: `tracer run smollm2-135m --engine vllm --length 5000` has no CLI option to raise it."""
    assert settings_of(S.prefix_cache(N, block_size=32).plan_b, "prefix-cache", {}).max_model_len is None  # default
    for n in (2048, 2100, 5000):
        scen = build("prefix-cache", n, engine="vllm")
        for plan in (scen.plan_a, scen.plan_b):
            got = settings_of(plan, chunk_mode(plan, {}, {}), {}).max_model_len
            assert got is not None and got >= n + 1 and got % 1024 == 0, (n, got)
    batch = build("batch", 3000, engine="vllm", batch_size=2).plan_b  # every row's request must fit too
    assert settings_of(batch, "one-step", {}).max_model_len >= max(batch.batch.lengths) + 1
    # an explicit value is the user's
    assert settings_of(build("prefix-cache", 5000, engine="vllm").plan_a, "one-step",
                       {"settings": {"max_model_len": 6000}}).max_model_len == 6000


@pytest.mark.parametrize("name, params, match", [
    ("attention", {}, "does not run in vllm"),
    ("kv-quant", {}, "does not run in vllm"),
    ("prefix-cache", {"mitigation": "deterministic"}, "batch-invariant mode"),
    ("prefix-cache", {"split_at": 50}, "not a multiple of the block size 32"),
    ("prefix-cache", {"split_at": 32, "mitigation": "aligned"}, "splits the 68-token suffix again"),
    ("rollout-vs-train", {"mitigations": True}, "use it with --engine hf"),
    ("tensor-parallel", {"tp_mode": "distributed"}, "drop --tp-mode distributed, --reduce and --reduce-dtype"),
    ("tensor-parallel", {"reduce": "tree"}, "drop --tp-mode distributed, --reduce and --reduce-dtype"),
])
def test_what_vllm_cannot_realise_is_refused_at_plan_time(name, params, match):
    with pytest.raises(TracerError, match=match) as e:
        build(name, N, engine="vllm", **params)
    assert "\n" not in str(e.value)


def test_tensor_parallel_in_vllm_is_tp1_vs_tpk_of_vllms_own_ranks():
    """--scenario tensor-parallel --engine vllm --tp 2: both plans in vLLM (no simulated TP left in
    them), A with tensor_parallel_size 1 and B with 2, both engine cores in their own processes; a
    model whose heads or KV heads 2 does not divide is refused before any engine starts."""
    from types import SimpleNamespace

    from tracer.engines.vllm.plan import check_tp_heads

    scen = build("tensor-parallel", N, engine="vllm", tp=2)
    a, b = scen.plan_a, scen.plan_b
    assert (a.engine, b.engine, a.tp, b.tp) == ("vllm", "vllm", None, None)
    assert [dict(p.engine_settings)["tensor_parallel_size"] for p in (a, b)] == [1, 2]
    assert all(dict(p.engine_settings)["multiprocess"] for p in (a, b))
    assert [settings_of(p, "one-step", {}).tensor_parallel_size for p in (a, b)] == [1, 2]
    refuse_unsupported(b, False, False)
    model = lambda heads, kv: SimpleNamespace(config=SimpleNamespace(num_attention_heads=heads,  # noqa: E731
                                                                       num_key_value_heads=kv))
    check_tp_heads([a, b], model(4, 2))
    for heads, kv in ((9, 3), (4, 1)):
        with pytest.raises(TracerError, match=f"attention heads \\({heads}\\) and KV heads \\({kv}\\) divisible by 2"):
            check_tp_heads([a, b], model(heads, kv))
    with pytest.raises(TracerError, match="tensor_parallel_size 0 must be a positive"):
        VllmSettings(tensor_parallel_size=0).check()
    with pytest.raises(TracerError, match="TP 1 on both sides is the control"):  # --tp 1 started two TP-1 engines
        build("tensor-parallel", N, engine="vllm", tp=1)


def test_engine_scenario_is_level_six_on_two_engines():
    scen = build("engine", N)
    assert scen.level == 6 and scen.window == (0, N) and scen.params["engines"] == ["hf", "vllm"]
    assert (scen.plan_a.engine, scen.plan_b.engine) == ("hf", "vllm") and scen.plan_a.chunks == scen.plan_b.chunks
    assert build("engine", N, engines="vllm,hf").plan_a.engine == "vllm"
    for bad, match in (("hf", "two engines"), ("hf,sglang", "unknown engine 'sglang'")):
        with pytest.raises(TracerError, match=match):
            build("engine", N, engines=bad)
    with pytest.raises(TracerError, match="--engines A,B"):
        build("engine", N, engine="vllm")


def test_engine_option_is_declared_once_for_cli_and_api(monkeypatch):
    import importlib.util
    import inspect

    import tracer
    from tracer.config import OPTIONS, RunConfig
    from tracer.validate import validate

    assert OPTIONS["engine"].group == "scenario" and OPTIONS["engines"].group == "scenario_options"
    for fn in (tracer.run, tracer.audit, tracer.sweep):
        assert "engine" in inspect.signature(fn).parameters
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    for opts, flag in (({"engine": "vllm"}, "--engine"), ({"scenario": "engine"}, "--engines")):
        with pytest.raises(TracerError, match=rf"{flag} vllm needs the package 'vllm', which is not installed"):
            validate(RunConfig.from_options(store="none", **opts))
    with pytest.raises(TracerError, match="unknown engine 'trt'"):
        validate(RunConfig.from_options(store="none", engine="trt"))
    with pytest.raises(TracerError, match="--engines does not apply to scenario prefix-cache"):
        RunConfig.from_options(engines="hf,vllm")


def test_engine_contracts_side_by_side_name_what_differs():
    from tracer.diff.engine import engine_facts

    hf = {"engine": "hf", "version": "5.19.0", "attention_backend": "sdpa", "norm": "LlamaRMSNorm", "gemm": "torch F.linear",
          "activation_dtype": "bfloat16", "logits_dtype": "bfloat16", "kv_cache_dtype": "bfloat16"}
    vl = {**hf, "engine": "vllm", "version": "0.32.0", "attention_backend": "CPU_ATTN",
          "gemm": {"self_attn.qkv_proj": "oneDNN onednn_mm", "lm_head": "oneDNN onednn_mm"}, "block_size": 32}
    meta_b = {"engine": vl, "cached_tokens": 96, "scheduler": {"requests": [{"traced": True, "num_cached_tokens": 0},
              {"traced": True, "num_cached_tokens": 96}], "steps": [{"requests": 1}], "chunks": [[96, 100]],
              "chunks_as": "prefix-cache"}}
    f = engine_facts("A", {"engine": hf}, "B", meta_b)
    assert f["engine_differences"] == {"attention backend": ["sdpa", "CPU_ATTN"], "GEMM": ["torch F.linear", "oneDNN onednn_mm"]}
    assert f["cached_tokens_b"] == 96 and "cached_tokens_a" not in f
    assert any("num_cached_tokens [0, 96]" in line and "positions 96..99" in line for line in f["notes"])
    assert engine_facts("A", {}, "B", meta_b) == {}  # an HF-only comparison gains nothing


def test_logits_where_vllm_samples_are_compared_at_those_positions_only():
    """Run A holds logits at the whole window 6..9, run B (vLLM) only at 9, where it sampled; B's
    row is A's with the top-2 swapped. Expected from the planted rows themselves: one position
    compared, one flip at absolute position 9, every logit of that row differing where planted."""
    import torch

    from tracer.diff.compare import compare_records
    from tracer.diff.engine import sampled_logits
    from tracer.execute.records import CaptureRecord, RunRecord

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 8, generator=g).to(torch.bfloat16)
    logits_a = torch.randn(4, 16, generator=g).to(torch.bfloat16)
    row_b = logits_a[3].clone()
    top = torch.topk(row_b.float(), 2).indices
    row_b[top[0]], row_b[top[1]] = logits_a[3, top[1]], logits_a[3, top[0]]
    ids, window = list(range(10)), (6, 10)
    cap = lambda name, kind, t: {name: CaptureRecord(name=name, kind=kind, tensor=t, calls=[], op="x")}  # noqa: E731
    a = RunRecord("A", ids, {}, window, {**cap("model.layers.0", "layer", hidden), **cap("lm_head", "logits", logits_a)})
    b = RunRecord("B", ids, {}, window, cap("model.layers.0", "layer", hidden.clone()),
                  extras={"partial_logits": {"lm_head": ([9], row_b[None])}})
    c = compare_records(a, b, scenario="engine", model="m")
    assert c.logits is None and [s.name for s in c.skipped] == ["lm_head"]
    c = sampled_logits(c, a, b)
    assert c.logits.n_positions == 1 and c.facts["logits_positions"] == [9] and not c.skipped
    flips = c.to_dict()["logits"]["flips"]
    assert [(f["position"], f["token_a"], f["token_b"]) for f in flips] == [(9, int(top[0]), int(top[1]))]
    assert c.logits.tensor.n_diff == int((logits_a[3] != row_b).sum()) == 2
    assert c.logits_origin and "in 1 position" in c.verdict()


def test_points_an_engine_does_not_compute_are_named_not_failed_and_grouped():
    """HF computes mlp.act_fn, vLLM does not (SiluAndMul is act(gate)·up): with the engine's reason
    the points are skipped without failing the comparison, and the table shows them as one row."""
    import torch

    from tracer.diff.compare import compare_records
    from tracer.diff.engine import engine_skips
    from tracer.execute.records import CaptureRecord, RunRecord
    from tracer.report.tables import skip_rows

    h = torch.ones(2, 4, dtype=torch.bfloat16)
    rec = lambda name, kind: CaptureRecord(name=name, kind=kind, tensor=h.clone(), calls=[], op="x")  # noqa: E731
    names = [f"model.layers.{i}.mlp.act_fn" for i in range(4)]
    a = RunRecord("A", [1, 2], {}, (0, 2), {"model.layers.0": rec("model.layers.0", "layer"),
                                            **{n: rec(n, "activation") for n in names}}, meta={"engine": {"engine": "hf"}})
    b = RunRecord("B", [1, 2], {}, (0, 2), {"model.layers.0": rec("model.layers.0", "layer")},
                  meta={"engine": {"engine": "vllm"}, "not_captured": {n: "no vLLM module computes it" for n in names}})
    c = compare_records(a, b, scenario="engine", model="m")
    assert not c.identical and len(c.not_compared) == 4  # missing in B: fails until the engine says why
    c = engine_skips(c, a, b)
    assert c.identical and not c.not_compared and len(c.skipped) == 4
    assert c.skipped[0].reason == "not computed by vllm (run B): no vLLM module computes it"
    assert [name for name, _mark, _fails in skip_rows(c.skipped, grouped=True)] == ["model.layers.*.mlp.act_fn ×4"]


def test_vllm_is_imported_only_when_a_vllm_plan_runs():
    """``import tracer``, the table, the door and realising a scenario on vLLM (its folder's package)
    load neither vllm nor torch: the engine's package is imported when its executor is asked for."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, tracer; from tracer.engines.door import engine, realise; from tracer.plan.build import build; "
            "s = realise(build('prefix-cache', 100, engine='vllm'), 'vllm'); engine('tp'); "
            "print(s.plan_b.engine, 'vllm' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.split()
    assert out == ["vllm", "False", "False"]


# ---------------------------------------------------------------- engine options, and the model vLLM would run


def test_attention_backend_and_batch_invariant_are_engine_options_of_the_vllm_plans():
    """--attention-backend and --batch-invariant land in every vLLM plan's engine settings (and so
    in the LLM it runs on); vllm:BACKEND in --engines names a plan's own backend; on HF they are
    refused in one line, as is a backend on an engine that takes none."""
    from tracer.config import RunConfig
    from tracer.validate import validate

    pc = build("prefix-cache", N, engine="vllm", attention_backend="triton_attn", batch_invariant=True)
    for plan in (pc.plan_a, pc.plan_b):
        got = dict(plan.engine_settings)
        assert got["attention_backend"] == "TRITON_ATTN" and got["batch_invariant"] is True
        s = settings_of(plan, chunk_mode(plan, {}, {}), {})
        assert s.attention_backend == "TRITON_ATTN" and s.batch_invariant
    two = build("engine", N, engines="vllm:TRITON_ATTN,vllm:FLEX_ATTENTION")
    assert [dict(p.engine_settings)["attention_backend"] for p in (two.plan_a, two.plan_b)] == ["TRITON_ATTN", "FLEX_ATTENTION"]
    assert (two.plan_a.engine, two.plan_b.engine) == ("vllm", "vllm") and "FLEX_ATTENTION" in two.plan_b.description
    mixed = build("engine", N, attention_backend="FLEX_ATTENTION")  # --engines hf,vllm: the vLLM run takes it
    assert dict(mixed.plan_a.engine_settings) == {} and dict(mixed.plan_b.engine_settings)["attention_backend"] == "FLEX_ATTENTION"
    for opts, match in (({"attention_backend": "TRITON_ATTN"}, "--attention-backend is an option of the vllm engine"),
                        ({"batch_invariant": True}, "--batch-invariant is an option of the vllm engine"),
                        ({"scenario": "engine", "engines": "hf:TRITON_ATTN,vllm"}, "hf takes no attention backend")):
        with pytest.raises(TracerError, match=match) as e:
            validate(RunConfig.from_options(model="tiny-llama", **opts))
        assert "\n" not in str(e.value)


def test_a_folder_whose_architecture_is_not_the_class_hf_loads_is_refused(tmp_path):
    """config.json saying GemmaForCausalLM with model_type llama: HF's AutoModel builds Llama by
    model_type, vLLM would build Gemma by architectures, on the same weights. Refused before vLLM
    starts (the folder is built here from the tiny-llama recipe)."""
    import json

    from tracer.engines.vllm.plan import check_architecture
    from tracer.load.models import load_model

    tiny = load_model("tiny-llama", dtype="float32", device="cpu", progress=False, tokenizer=False)
    folder = tmp_path / "m"
    tiny.model.save_pretrained(folder)
    check_architecture(tiny, folder)  # as saved: the class HF loaded
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    cfg["architectures"] = ["GemmaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(str(folder), dtype="float32", device="cpu", progress=False, tokenizer=False)
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    with pytest.raises(TracerError, match="GemmaForCausalLM.*LlamaForCausalLM") as e:
        check_architecture(loaded, folder)
    assert "\n" not in str(e.value)
