"""Random-init models: an HF config from a recipe, initialised from a seed, with a byte-level tokenizer."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tracer.errors import TracerError
from tracer.load.devices import cast_weights, dtype_kwarg
from tracer.load.quiet import quiet_transformers, status
from tracer.load.recipes import Recipe

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

#: the byte-level tokenizer given to random-init models: 256 byte tokens, then these


#: the byte-level tokenizer given to random-init models: 256 byte tokens, then these
BYTE_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")

_BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level tokenizer: ids 0..255 are the bytes, then :data:`BYTE_SPECIAL_TOKENS` (256..260).

    ByteLevel BPE with no merges: every UTF-8 byte of the text is one token, so any text
    round-trips through encode → decode. No BOS is added by ``encode``; the chat template
    (ChatML-like, ``<|im_start|>role\\ncontent<|im_end|>``) starts with ``<|bos|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _bytes_to_unicode()  # byte value → the printable stand-in ByteLevel uses
    assert set(chars.values()) == set(pre_tokenizers.ByteLevel.alphabet()), "ByteLevel alphabet mismatch"
    vocab = {chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(BYTE_SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], model_max_length=1 << 20,
    )
    fast.chat_template = _BYTE_CHAT_TEMPLATE
    assert len(fast) == 256 + len(BYTE_SPECIAL_TOKENS), len(fast)
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def random_init_model(recipe: Recipe, dtype: torch.dtype, attn: str, seed: int,
                      progress: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model of a ``random-init`` recipe and its byte tokenizer: ``AutoConfig.for_model(**[config])``
    initialised in float32 on the CPU under ``torch.manual_seed(seed)`` (same seed → bit-identical
    weights), then cast to ``dtype`` (:func:`tracer.load.devices.cast_weights`). The caller puts it
    on its device.

    Raises:
        TracerError: a bad ``[config]``, or a vocabulary smaller than the byte tokenizer's.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = byte_tokenizer()
    fields = dict(recipe.data["config"])
    model_type = fields.pop("model_type")
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    for key, value in ids.items():
        fields.setdefault(key, value)
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError) as exc:
        raise TracerError(f"recipe {recipe.path}: bad [config]: {exc}; fix the recipe") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(text.vocab_size)
    if vocab < len(tokenizer):
        raise TracerError(
            f"recipe {recipe.path}: vocab_size={vocab} is smaller than the byte tokenizer's {len(tokenizer)} tokens; "
            "raise vocab_size"
        )
    with status(progress, f"initialising {recipe.name} (seed={seed})"), quiet_transformers(progress):
        # float32 init on the CPU from a private RNG stream: bit-identical for a given seed
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, **dtype_kwarg(torch.float32))
        cast_weights(model, dtype)
    return model, tokenizer
