"""The built-in prompt of ``tracer run`` with no ``--prompt``: a few hundred tokens of plain text.

Long enough to hold several KV blocks of 16 tokens and a non-aligned tail, so the default
prefix-cache split (the last block boundary below N) leaves a short suffix, as a cache hit does.
"""

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
