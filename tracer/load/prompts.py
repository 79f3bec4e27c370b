"""The prompt: the built-in text, the prompt options resolved, and tokenizing to the N token ids.

The built-in prompt of ``tracer run`` with no ``--prompt`` is a few hundred tokens of plain text,

long enough to hold several KV blocks of 16 tokens and a non-aligned tail, so the default
prefix-cache split (the last block boundary below N) leaves a short suffix, as a cache hit does.
"""

from __future__ import annotations

import weakref

from typing import Any

from tracer.errors import TracerError
from tracer.files import read_text_file, read_token_ids

DEFAULT_PROMPT = """\
Serving engines reuse work to answer requests faster. When two requests share a prefix, such as \
a long system prompt or the earlier turns of a conversation, the engine keeps the keys and values \
that the first request computed for that prefix in a paged KV cache, split into blocks of a fixed \
number of tokens. The second request finds those blocks in the cache and computes only the tokens \
that follow them. This is called a cache hit, and it saves most of the prefill time for long prompts.

The answer should not depend on whether the cache was hit. Yet the cache-miss request multiplies a \
matrix with one row per prompt token, while the cache-hit request multiplies a matrix with one row \
per uncached token. The matrix libraries choose different tile shapes for different row counts, the \
partial sums are added in a different order, and floating-point addition is not associative. A \
difference of one unit in the last place appears in an early layer, the normalisation layers spread \
it across the hidden state, attention stretches it, and after a few dozen layers the top token of \
the next-word distribution can change.

To study this, we run the same prompt twice, once in a single forward pass and once as a cached \
prefix followed by the suffix, and compare every layer of the two runs bit for bit. The table shows \
where the first difference appears, how many elements differ at each layer, and how large the \
largest difference grows on its way to the logits. Explain in two sentences why the two runs differ."""


def check_prompt_sources(prompt: str | None = None, prompt_file: str | None = None,
                         token_ids_file: str | None = None, token_ids: Any = None) -> None:
    """Refuse more than one prompt source (nothing is read).

    Raises:
        TracerError: more than one of text, text file, token ids and token-id file given.
    """
    given = [x for x in (prompt, prompt_file, token_ids, token_ids_file) if x is not None]
    if len(given) > 1:
        raise TracerError("give only one of --prompt, --prompt-file, --token-ids-file (or token_ids)")


def prompt_file_note(prompt: str | None) -> str | None:
    """A note when ``--prompt`` names an existing file (the name itself is then the text traced), else None."""
    import os

    if not prompt or "\n" in prompt or len(prompt) > 4096 or not os.path.isfile(prompt):
        return None
    return (f"--prompt {prompt!r} is the name of an existing file: the text traced is that name; "
            f"to trace the file's content, use --prompt-file {prompt}")


def read_prompt(prompt: str | None = None, prompt_file: str | None = None,
                token_ids_file: str | None = None, token_ids: Any = None) -> tuple[str | None, list[int] | None]:
    """Resolve the prompt options into ``(text, None)`` or ``(None, token_ids)``.

    Raises:
        TracerError: more than one source given, unreadable files, malformed token id JSON.
    """
    check_prompt_sources(prompt, prompt_file, token_ids_file, token_ids)
    if token_ids is not None:
        return None, [int(i) for i in token_ids]

    if prompt_file is not None:  # regular UTF-8 files only: a FIFO or device would block
        return read_text_file(prompt_file, "--prompt-file"), None
    if token_ids_file is not None:
        return None, read_token_ids(token_ids_file)
    if prompt is not None:
        return prompt, None
    return DEFAULT_PROMPT, None


def check_prompt(text: str | None, token_ids: list[int] | None, *, chat: bool) -> None:
    """What can be said of a resolved prompt (:func:`read_prompt`) before a model loads.

    Raises:
        TracerError: an empty prompt, a negative token id, ``chat`` with token ids.
    """
    if text == "" or token_ids == []:
        raise TracerError("the prompt is empty; give a --prompt with some text or a non-empty --token-ids-file")
    if token_ids is not None:
        if chat:
            raise TracerError(CHAT_IDS)
        if min(token_ids) < 0:
            raise TracerError(f"token id {min(token_ids)} is negative; token ids are 0..vocabulary size - 1")


#: ``--chat`` with token ids (the template applies to text)
CHAT_IDS = "--chat applies to text prompts, not to token ids (--token-ids, --token-ids-file); drop one of them"


def tokenize(tokenizer: Any, text: str | None, token_ids: list[int] | None, *, chat: bool,
             vocab_size: int, length: int | None = None) -> list[int]:
    """Token ids of the prompt: plain text as-is (no special tokens added), or the chat template.

    ``length`` fixes N: the first ``length`` tokens, the prompt repeated as often as needed to
    reach it (so any N can be traced with the built-in prompt). ``tokenizer`` None (a model saved
    without one, or loaded with ``tokenizer=False``) takes token ids only.

    Raises:
        TracerError: empty prompt, ids outside the vocabulary, no chat template, length < 2,
            text for a model without a tokenizer.
    """
    if token_ids is None and tokenizer is None:
        raise TracerError("this model has no tokenizer, so a text prompt cannot be tokenized; pass token ids "
                          "(--token-ids-file FILE.json / token_ids=[...]) or save a tokenizer next to the weights "
                          "(tokenizer.save_pretrained(DIR))")
    if token_ids is None:
        token_ids = _encode(tokenizer, text, chat)
    elif chat:
        raise TracerError(CHAT_IDS)
    if not token_ids:
        raise TracerError("the prompt is empty; give a --prompt with some text or a non-empty --token-ids-file")
    if length is not None:
        if length < 2:
            raise TracerError(f"--length {length} is too short; a comparison needs at least 2 tokens")
        reps = -(-length // len(token_ids))
        token_ids = (token_ids * reps)[:length]
    bad = [i for i in token_ids if not 0 <= i < vocab_size]
    if bad:
        raise TracerError(f"token id {bad[0]} is outside the model's vocabulary (0..{vocab_size - 1}); "
                          "the ids were made for another tokenizer")
    return token_ids


#: tokenizer → {(text, chat): ids}: a run of the same prompt tokenizes it once (the built-in
#: prompt costs milliseconds, which a launch-bound forward pass of ~80 ms notices)
_ENCODED: "weakref.WeakKeyDictionary[Any, dict[tuple[str, bool], tuple[int, ...]]]" = weakref.WeakKeyDictionary()
_ENCODED_PER_TOKENIZER = 8


def _encode(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """``text``'s token ids (no special tokens added), or the chat template's with the text as the
    user's message; the last few answers per tokenizer are remembered.

    Raises:
        TracerError: ``chat`` and the tokenizer has no chat template.
    """
    try:
        memo = _ENCODED.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable
        memo = {}
    hit = memo.get((text, chat))
    if hit is not None:
        return list(hit)
    if chat:
        if getattr(tokenizer, "chat_template", None) is None:
            raise TracerError("this tokenizer has no chat template; drop --chat")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        token_ids = [int(i) for i in ids]
    else:
        token_ids = [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    if len(memo) >= _ENCODED_PER_TOKENIZER:
        memo.pop(next(iter(memo)))
    memo[(text, chat)] = tuple(token_ids)
    return token_ids
