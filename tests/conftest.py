"""Shared fixtures: small random-init HF models built straight from configs (independent of tracer.load.models)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# keep the CPU thread count fixed so CI machines of any size compute the same way
torch.set_num_threads(min(2, torch.get_num_threads()))

FAMILIES = {
    "llama": dict(num_hidden_layers=3, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512),
    "qwen2": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512),
    "qwen3": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512),
    "mistral": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=512, sliding_window=None),
    "gemma": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512),
    "phi3": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, pad_token_id=0),
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, bos_token_id=0, eos_token_id=0),
}


def make_model(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0, attn: str = "sdpa"):
    """A random-init causal LM of the given HF family, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **FAMILIES[model_type])
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(dtype).eval()
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="session")
def tiny_llama():
    return make_model("llama")


@pytest.fixture
def cli_env(tmp_path):
    """Environment for CLI subprocesses: run from the checkout, cwd in a temp dir."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRACER_CACHE_DIR", str(Path.home() / ".cache" / "tracer"))
    env["COLUMNS"] = "200"
    return env
