"""tracer/diff/replay.py: the decode replay's comparison and its line for people."""

from __future__ import annotations

from tracer.diff.replay import replay_diff


def test_the_first_differing_generated_token_is_counted_from_one():
    """Continuations that differ at their first generated token said "differ from generated token 0
    of 4" (the 0-based index, which reads as no token at all); the line counts from one, as the
    logits line's "A's top token at worst #1 in B" does: token 1 of 4 here, token 3 of 4 below."""
    assert replay_diff([5, 6, 7, 8], [9, 6, 7, 8]).line() == \
        "the greedy continuations differ from generated token 1 of 4"
    assert replay_diff([5, 6, 7, 8], [5, 6, 9, 8]).line() == \
        "the greedy continuations differ from generated token 3 of 4"
    assert replay_diff([5, 6], [5, 6]).line() == "the 2 greedy tokens after the prompt are identical in both runs"
