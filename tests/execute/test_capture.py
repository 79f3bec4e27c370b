"""Capture hooks against HF's own output_hidden_states, bit for bit, on several families."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import FAMILIES, make_model
from tracer.execute.capture import Capture
from tracer.execute.points import discover_points
from tracer.errors import TracerError
from tracer.load.hf_cache import cache_kwarg, output_cache
from tracer.engines.hf.run import execute
from tracer.plan.scenarios import RunPlan, prefix_cache

# families whose hidden_states[0] is exactly the input-embedding module's output
# (Gemma scales it by sqrt(hidden), GPT-2 adds position embeddings)
EMBEDDING_IS_HS0 = {"llama", "qwen2", "qwen3", "mistral", "phi3"}

IDS = [(7 * i + 3) % 500 for i in range(40)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_captures_equal_hf_hidden_states(family, dtype):
    model = make_model(family, dtype)
    all_points = discover_points(model, "layers")
    n_layers = model.config.num_hidden_layers
    assert [p.kind for p in all_points] == ["embedding"] + ["kv_cache", "layer"] * n_layers + ["final_norm", "logits"]
    points = [p for p in all_points if p.kind != "kv_cache"]

    plan = RunPlan("A", ((0, len(IDS)),))
    rec = execute(model, IDS, plan, points, (0, len(IDS)))
    with torch.no_grad():
        out = model(torch.tensor([IDS]), output_hidden_states=True)
    hs = out.hidden_states  # (emb, layer0, ..., layer L-2, norm(layer L-1))
    names = [p.name for p in points]
    layer_names = names[1 : 1 + n_layers]
    for i in range(n_layers - 1):
        got = rec.captures[layer_names[i]].tensor
        assert got.dtype == dtype
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           hs[i + 1][0].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    final = rec.captures[names[-2]].tensor
    assert torch.equal(final, hs[n_layers][0])
    assert torch.equal(rec.captures[names[-1]].tensor, out.logits[0])
    if family in EMBEDDING_IS_HS0:
        assert torch.equal(rec.captures[names[0]].tensor, hs[0][0])


def test_window_keeps_only_compared_positions_and_records_gemm_m(tiny_llama):
    scen = prefix_cache(len(IDS), block_size=16)  # P = 32, window 32..39
    assert scen.window == (32, 40)
    points = discover_points(tiny_llama, "sublayers")
    rec_b = execute(tiny_llama, IDS, scen.plan_b, points, scen.window)
    with torch.no_grad():
        full = tiny_llama(torch.tensor([IDS]), output_hidden_states=True).hidden_states
    layer0 = rec_b.captures["model.layers.0"]
    assert layer0.tensor.shape == (8, 64)
    # run B computed the window in its second call; its first layer output agrees with a full pass
    # to rounding, and has the exact positions: compare against HF within float32 tolerance
    torch.testing.assert_close(layer0.tensor, full[1][0, 32:40], rtol=1e-5, atol=1e-5)
    q = rec_b.captures["model.layers.0.self_attn.q_proj"]
    # GEMM M per call = rows of the input: 32 (cached prefix) then 8 (suffix); K = hidden 64
    assert [c["in"][0] for c in q.calls] == [[1, 32, 64], [1, 8, 64]]
    assert [c["positions"] for c in q.calls] == [[0, 32], [32, 40]]


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
def test_kv_cache_points_equal_hf_cache(family):
    model = make_model(family, torch.bfloat16)
    scen = prefix_cache(len(IDS), block_size=16)
    points = discover_points(model, "sublayers")
    rec = execute(model, IDS, scen.plan_b, points, scen.window)
    with torch.no_grad():  # an independent cache-hit prefill: prefix pass, then suffix pass
        out = model(torch.tensor([IDS[:32]]), use_cache=True)
        out = model(torch.tensor([IDS[32:]]), use_cache=True, **{cache_kwarg(model): output_cache(out)})
    cache = output_cache(out)
    kv_names = [n for n, r in rec.captures.items() if r.kind == "kv_cache"]
    assert len(kv_names) == len(cache.layers)
    for i, name in enumerate(kv_names):
        k, v = cache.layers[i].keys[0], cache.layers[i].values[0]  # (heads, N, head_dim)
        want = torch.cat([k.permute(1, 0, 2).reshape(len(IDS), -1), v.permute(1, 0, 2).reshape(len(IDS), -1)], 1)
        assert torch.equal(rec.captures[name].tensor.view(torch.int16), want.view(torch.int16)), name
        # recorded right before the attention core of its layer (execution order)
        names = list(rec.captures)
        assert names[names.index(name) + 1].endswith(".core")


def test_down_proj_input_is_what_down_proj_consumed(tiny_llama):
    points = discover_points(tiny_llama, "sublayers")
    rec = execute(tiny_llama, IDS[:20], RunPlan("A", ((0, 20),)), points, (0, 20))
    mlp = tiny_llama.model.layers[1].mlp
    hidden = rec.captures["model.layers.1.mlp.down_proj.input"].tensor
    assert torch.equal(mlp.down_proj(hidden), rec.captures["model.layers.1.mlp.down_proj"].tensor)
    gate, up = (rec.captures[f"model.layers.1.mlp.{n}"].tensor for n in ("gate_proj", "up_proj"))
    assert torch.equal(hidden, mlp.act_fn(gate) * up)


def test_sublayer_order_is_execution_order(tiny_llama):
    points = discover_points(tiny_llama, "sublayers")
    rec = execute(tiny_llama, IDS[:20], RunPlan("A", ((0, 20),)), points, (0, 20))
    names = list(rec.captures)
    layer0 = [n for n in names if n.startswith("model.layers.0.") or n == "model.layers.0"]
    assert layer0.index("model.layers.0.input_layernorm") < layer0.index("model.layers.0.self_attn.q_proj")
    assert layer0.index("model.layers.0.self_attn.o_proj") < layer0.index("model.layers.0.self_attn")
    assert layer0.index("model.layers.0.self_attn.core") < layer0.index("model.layers.0.self_attn.o_proj")
    assert layer0[-1] == "model.layers.0"
    # the attention core is the o_proj input: o_proj(core) must equal the o_proj output exactly
    core = rec.captures["model.layers.0.self_attn.core"].tensor
    o = rec.captures["model.layers.0.self_attn.o_proj"].tensor
    assert torch.equal(tiny_llama.model.layers[0].self_attn.o_proj(core), o)


def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_hooks_removed_when_forward_raises(tiny_llama):
    points = discover_points(tiny_llama, "sublayers")
    before = _hook_count(tiny_llama)

    def boom(module, args, output):
        raise RuntimeError("planted failure")

    h = tiny_llama.model.layers[1].register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="planted"):
            execute(tiny_llama, IDS, RunPlan("A", ((0, len(IDS)),)), points, (0, len(IDS)))
    finally:
        h.remove()
    assert _hook_count(tiny_llama) == before


def test_capture_outside_declared_call_is_ignored(tiny_llama):
    points = discover_points(tiny_llama, "layers")
    with Capture(tiny_llama, points, (0, 5)) as cap, torch.no_grad():
        tiny_llama(torch.tensor([IDS[:5]]))  # no forward_call: a warm-up, not recorded
    assert all(r.tensor.numel() == 0 for r in cap.records().values())


def test_unknown_granularity(tiny_llama):
    with pytest.raises(TracerError, match="granularity"):
        discover_points(tiny_llama, "neurons")


def test_notebook_capture_refuses_what_would_compare_nothing(tiny_llama):
    """tracer.capture(model, []) compared two runs of different weights as 'bit-identical: all 0
    capture points agree'; a block with no forward crashed compare with a ValueError; a model name
    or None crashed with an AttributeError. Each is one TracerError line now."""
    import tracer

    for points in ([], (), 5, [1, 2]):
        with pytest.raises(TracerError, match="non-empty list of module paths"):
            tracer.capture(tiny_llama, points)
    with pytest.raises(TracerError, match="not a str: load it first"):
        tracer.capture("tiny-llama")
    with pytest.raises(TracerError, match="not a NoneType"):
        tracer.capture(None)
    with tracer.capture(tiny_llama) as a:
        pass
    with tracer.capture(tiny_llama) as b:
        pass
    with pytest.raises(TracerError, match="no forward pass of the model ran inside"):
        tracer.compare(a, b)


def test_a_notebook_capture_says_what_it_ran(tiny_llama):
    """The report's run lines of two ``tracer.capture`` blocks said "A: tracer.capture" and "B:
    tracer.capture" (a newcomer could not tell them apart): each now says its tokens and the GEMM M of
    each forward call, as the forward calls made here (40 tokens at once; 32, then 8 on the cache)."""
    import tracer

    ids = torch.arange(1, 41)[None]
    with torch.inference_mode():
        with tracer.capture(tiny_llama) as full:
            tiny_llama(input_ids=ids)
        with tracer.capture(tiny_llama) as hit:
            out = tiny_llama(input_ids=ids[:, :32], use_cache=True)
            tiny_llama(input_ids=ids[:, 32:], past_key_values=out.past_key_values, use_cache=True)
    plans = [full.run_record("A").plan["description"], hit.run_record("B").plan["description"]]
    assert plans == ["tracer.capture: 40 tokens in 1 forward call (GEMM M per step: 40)",
                     "tracer.capture: 40 tokens in 2 forward calls (GEMM M per step: 32, 8)"]


def test_a_batched_notebook_capture_says_the_gemm_m_of_every_row(tiny_llama):
    """A forward of 4 rows of 17 tokens multiplies matrices of M = 4 x 17 = 68 rows; the run line said
    "GEMM M per step: 17" (the traced row 0's positions alone), which reads as an unbatched run."""
    import tracer

    ids = torch.arange(1, 18)[None].repeat(4, 1)
    with torch.inference_mode():
        with tracer.capture(tiny_llama) as batch:
            tiny_llama(input_ids=ids)
    assert batch.run_record("A").plan["description"] == \
        "tracer.capture: 17 tokens of row 0 of 4 in 1 forward call (GEMM M per step: 68)"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_captures_by_reference_equal_copies(family):
    """The residual stream and the logits kept by reference (no copy kernel, the default on a GPU)
    hold the same bits as copies made when the hooks fired: nothing modified those outputs later,
    in either plan of a prefix-cache hit (two forward calls sharing the KV cache)."""
    from tracer.execute.capture import REFERENCE_KINDS
    from tracer.engines.hf.run import forward_chunks

    model = make_model(family, torch.bfloat16)
    points = [p for p in discover_points(model, "sublayers") if p.kind != "kv_cache"]
    scen = prefix_cache(len(IDS), block_size=16)
    ids = torch.tensor([IDS])
    for plan in (scen.plan_a, scen.plan_b):
        got = {}
        for reference in (True, False):
            with torch.inference_mode(), Capture(model, points, scen.window, keep_on_device=True,
                                                 reference=reference) as cap:
                forward_chunks(model, ids, plan, cap)
            got[reference] = cap.records()
        refs = 0
        for name, rec in got[False].items():
            by_ref = got[True][name].tensor
            assert torch.equal(by_ref.view(torch.int16), rec.tensor.view(torch.int16)), (family, plan.name, name)
            if rec.kind in REFERENCE_KINDS and plan is scen.plan_a:  # a view of the whole call's output
                assert by_ref.untyped_storage().nbytes() > by_ref.nbytes, name
            refs += rec.kind in REFERENCE_KINDS
        assert refs >= model.config.num_hidden_layers + 2  # layers, final norm and logits were kept by reference


# ---------------------------------------------------------------- CUDA-graph bookkeeping, on the CPU


def test_a_recorded_forward_after_eager_warm_ups_is_captured_alone(monkeypatch):
    """What tracer.capture(cuda_graphs=True) keeps of a block with warm-ups before the recording (issue
    37 item 11), on the CPU: the forward made while "recording" is every point's value, as its own
    buffer (no copy, so a replay would refresh it), its ids and positions 0..N-1; the eager warm-ups
    are not the graph's. Recording is simulated (tracer.execute.capture._recording)."""
    import tracer.execute.capture as capture_module
    from tracer.execute.captured import Captured

    model = make_model("llama")
    recording = {"on": False}
    monkeypatch.setattr(capture_module, "_recording", lambda t: recording["on"])
    cap = Captured(model, "layers")
    cap.cuda_graphs = True  # the GPU check is for real graphs; the bookkeeping is what is tested here
    warm, new = torch.tensor([IDS]), torch.tensor([[(11 * i + 5) % 500 for i in range(len(IDS))]])
    with torch.no_grad(), cap:
        model(warm)
        model(warm)
        recording["on"] = True
        model(new)
        recording["on"] = False
    with torch.no_grad():
        hs = model(new, output_hidden_states=True).hidden_states
    layers = [n for n, r in cap.records().items() if r.kind == "layer"]
    for i, name in enumerate(layers[:-1]):
        assert torch.equal(cap[name].tensor, hs[i + 1][0]), name
        assert cap[name].tensor is cap._capture._chunks[name][2]  # the recorded chunk itself
        assert [c["positions"] for c in cap[name].calls] == [[0, len(IDS)]]
    assert torch.equal(cap["model.embed_tokens"].tensor, hs[0][0])
    assert cap.token_ids == new[0].tolist()


def test_a_point_recorded_twice_in_one_block_is_refused():
    from tracer.execute.graphs import graph_chunks

    a, b, c = torch.zeros(2, 4), torch.ones(2, 4), torch.full((2, 4), 2.0)
    calls = [{"positions": [0, 2]}, {"positions": [2, 4]}, {"positions": [4, 6]}]
    assert graph_chunks("x", [a, b], [False, False], calls[:2], [False, False]) == ([a, b], calls[:2])
    kept, kept_calls = graph_chunks("x", [a, b, c], [False, False, True], calls, [False, False, True])
    assert kept[0] is c and kept_calls == calls[2:]
    with pytest.raises(TracerError, match="recorded in 2 forwards inside CUDA graphs") as e:
        graph_chunks("x", [a, b, c], [False, True, True], calls, [False, True, True])
    assert "\n" not in str(e.value)


def _own_forwards(model: torch.nn.Module) -> dict[str, object]:
    """Module name → the ``forward`` set on the instance (none, normally)."""
    return {n: m.__dict__["forward"] for n, m in model.named_modules() if "forward" in m.__dict__}


def test_forward_wrappers_capture_what_hooks_capture_and_leave_nothing_behind(tiny_llama):
    """The eager runner's forward wrappers (Capture(wrap_forward=True)) keep the same tensors and calls
    as forward hooks; afterwards every module's forward is what it was: none of its own, or, on a
    module with a forward of its own (as accelerate sets), that same object, also after a forward
    that raised."""
    points = discover_points(tiny_llama, "sublayers")
    ids = torch.tensor([IDS])
    mlp = tiny_llama.model.layers[0].mlp
    own = mlp.forward  # a bound method, set on the instance: a forward of its own
    mlp.forward = own
    try:
        got = {}
        hooks = {n: len(m._forward_hooks) for n, m in tiny_llama.named_modules()}  # transformers' own, if any
        for wrap in (False, True):
            with torch.no_grad(), Capture(tiny_llama, points, (0, len(IDS)), wrap_forward=wrap) as cap:
                if wrap:  # wrapped: a hook of the capture's only where transformers put one of its own
                    now = {n: len(m._forward_hooks) for n, m in tiny_llama.named_modules()}
                    assert {n for n in now if now[n] != hooks[n]} <= {n for n in hooks if hooks[n]}
                    assert any(now[p.module] == 0 for p in points)
                with cap.forward_call(0, len(IDS)):
                    tiny_llama(ids)
            got[wrap] = cap.records()
            assert _own_forwards(tiny_llama) == {"model.layers.0.mlp": own}
        assert list(got[True]) == list(got[False])
        for name, rec in got[False].items():
            assert torch.equal(got[True][name].tensor, rec.tensor) and got[True][name].calls == rec.calls, name

        def boom(*args, **kwargs):
            raise RuntimeError("planted failure")

        tiny_llama.model.layers[1].self_attn.forward = boom
        with pytest.raises(RuntimeError, match="planted"), torch.no_grad():
            with Capture(tiny_llama, points, (0, len(IDS)), wrap_forward=True) as cap:
                with cap.forward_call(0, len(IDS)):
                    tiny_llama(ids)
        assert _own_forwards(tiny_llama) == {"model.layers.0.mlp": own, "model.layers.1.self_attn": boom}
    finally:
        for m in (mlp, tiny_llama.model.layers[1].self_attn):
            m.__dict__.pop("forward", None)


def test_a_forward_hook_of_the_users_is_seen_through_wrappers(tiny_llama):
    """A module with a forward hook of its own keeps a hook for the capture (registered after it), so
    the capture holds what the user's hook returned, as downstream modules consume it."""
    points = [p for p in discover_points(tiny_llama, "layers") if p.kind == "layer"]
    layer = tiny_llama.model.layers[0]
    with torch.no_grad():  # the layer's own output, before any hook of the user's
        hs = tiny_llama(torch.tensor([IDS]), output_hidden_states=True).hidden_states
    h = layer.register_forward_hook(lambda m, a, out: out + 1.0)
    try:
        with torch.no_grad(), Capture(tiny_llama, points, (0, len(IDS)), wrap_forward=True) as cap:
            with cap.forward_call(0, len(IDS)):
                tiny_llama(torch.tensor([IDS]))
    finally:
        h.remove()
    assert torch.equal(cap.records()["model.layers.0"].tensor, hs[1][0] + 1.0)  # what the user's hook returned
    assert "forward" not in layer.__dict__


def test_simulated_tp_points_are_captured_through_forward_wrappers(tiny_llama):
    """A simulated-TP plan sets the row-parallel Linears' forward on the instance; the eager runner's
    capture (forward wrappers) still holds what those modules computed: the output of o_proj and
    down_proj under the plan, as a plain forward hook sees it (hooks fire whatever the forward)."""
    from tracer.execute.tp_sim import simulate_tp
    from tracer.plan.scenarios import TPSpec

    points = discover_points(tiny_llama, "sublayers")
    names = ["model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"]
    seen = {}
    with torch.no_grad(), simulate_tp(tiny_llama, 2):  # the oracle: forward hooks of our own
        hs = [tiny_llama.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: seen.update({n: o[0].clone()}))
              for n in names]
        try:
            tiny_llama(torch.tensor([IDS]))
        finally:
            for h in hs:
                h.remove()
    rec = execute(tiny_llama, IDS, RunPlan("B", ((0, len(IDS)),), tp=TPSpec(2)), points, (0, len(IDS)))
    for n in names:
        assert rec.captures[n].calls, n
        assert torch.equal(rec.captures[n].tensor, seen[n]), n
    assert _own_forwards(tiny_llama) == {}


def test_two_wrapping_captures_left_out_of_order_leave_nothing_behind(tiny_llama):
    """Two eager captures of one model, the first left first: every module's forward is again the
    class's, and no wrapper (nor the first capture's hooks and tensors) stays reachable from the model."""
    import gc
    import weakref

    points = [p for p in discover_points(tiny_llama, "layers") if p.kind == "layer"]
    first = Capture(tiny_llama, points, (0, len(IDS)), wrap_forward=True).__enter__()
    second = Capture(tiny_llama, points, (0, len(IDS)), wrap_forward=True).__enter__()
    with torch.no_grad(), first.forward_call(0, len(IDS)), second.forward_call(0, len(IDS)):
        tiny_llama(torch.tensor([IDS]))
    gone = weakref.ref(first)
    first.__exit__(None, None, None)
    second.__exit__(None, None, None)
    assert torch.equal(first.records()["model.layers.0"].tensor, second.records()["model.layers.0"].tensor)
    assert _own_forwards(tiny_llama) == {}
    del first
    gc.collect()
    assert gone() is None  # nothing of the model's holds the first capture


def test_a_forward_defined_as_a_property_gets_a_hook_not_a_wrapper():
    """A module class whose ``forward`` is a property (a data descriptor wins over the instance's
    dict): the capture falls back to a forward hook, so its call is still seen."""
    from tracer.execute.handles import Hooks

    class Doubler(torch.nn.Module):
        @property
        def forward(self):
            return lambda x: 2 * x

    m, seen = Doubler(), []
    hooks = Hooks()
    hooks.hook(m, lambda mod, args, kwargs, out: seen.append(out), with_kwargs=True, wrap=True)
    m(torch.ones(3))
    hooks.remove()
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((3,), 2.0))
    assert "forward" not in m.__dict__ and not m._forward_hooks
