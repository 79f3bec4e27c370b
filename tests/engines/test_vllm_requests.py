"""Which rows of a vLLM step are which request (tracer/engines/vllm/requests.py), without vLLM.

Steps are built by hand the way vLLM's runners lay them out: requests flattened one after the
other, V1 in arrival order, V2 sorted by their number of tokens; each token's KV slot is its
request's block times the block size plus its offset. The expected rows come from how the step
was built, not from the tracker.
"""

from __future__ import annotations

import numpy as np
import pytest

from tracer.engines.vllm.requests import StepInputs, Tracker, boundaries_from_positions
from tracer.errors import TracerError

BS = 4


def _step(runs, table=None):
    """``runs``: ``(ids, first position, blocks)`` per request in the step's order → StepInputs."""
    ids, pos, slots, starts = [], [], [], [0]
    for tok, p0, blocks in runs:
        for i, t in enumerate(tok):
            p = p0 + i
            ids.append(t)
            pos.append(p)
            slots.append(blocks[p // BS] * BS + p % BS)
        starts.append(len(ids))
    tab = None if table is None else (lambda: np.array(table))
    return StepInputs(np.array(ids), np.array(pos), np.array(starts), np.array(slots), tab)


PROMPT = [11, 12, 13, 14, 15, 16]
OTHER = [21, 22, 23, 24, 25, 26, 27, 28, 29]
SHORT = [31, 32]


@pytest.mark.parametrize("order", ["v1", "v2"])
def test_the_traced_request_is_found_by_content_whatever_the_order(order):
    """V1 keeps arrival order (traced first); V2 sorts by tokens (the 2-token request first, the
    9-token one last): the traced prompt's rows are where the step put them."""
    runs = {"t": (PROMPT, 0, [0, 1]), "o": (OTHER, 0, [2, 3, 4]), "s": (SHORT, 0, [5])}
    names = ["t", "o", "s"] if order == "v1" else ["s", "t", "o"]
    tr = Tracker(BS)
    tr.follow("me", PROMPT)
    got, notes = tr.assign(_step([runs[n] for n in names]))
    assert got == {"me": names.index("t")} and notes == []


def test_a_prefix_cache_hit_starts_at_its_first_uncached_position_and_a_rotation_is_not_it():
    tr = Tracker(BS)
    tr.follow("hit", PROMPT)
    rotated = PROMPT[2:] + PROMPT[:2]  # another request: the prompt rotated, at positions 4..
    got, _ = tr.assign(_step([(rotated[4:], 4, [7, 8]), (PROMPT[4:], 4, [0, 1])]))
    assert got == {"hit": 1}


def test_decode_steps_follow_the_request_by_its_kv_slots():
    """Three requests decode at the same position with the same token: inside a block the traced
    one is the run whose slot follows its last slot; at a block boundary, the run whose
    block-table row holds its last block."""
    tr = Tracker(BS)
    tr.follow("a", [1, 2, 3, 4, 5, 6])
    tr.follow("b", [7, 8, 9, 10, 11, 12], traced=False)
    tr.follow("c", [13, 14, 15, 16, 17, 18], traced=False)
    blocks = {"a": [3, 4], "b": [5, 6], "c": [1, 2]}
    prefill = [(tr.followed[k].prompt.tolist(), 0, blocks[k]) for k in ("c", "a", "b")]
    got, _ = tr.assign(_step(prefill))
    assert got == {"c": 0, "a": 1, "b": 2}
    # position 6, same token 99 everywhere, in an order unlike the prefill's (slot continuity)
    got, notes = tr.assign(_step([([99], 6, blocks["b"]), ([99], 6, blocks["a"]), ([99], 6, blocks["c"])]))
    assert got == {"a": 1, "b": 0, "c": 2} and notes == []
    tr.assign(_step([([5], 7, blocks["a"]), ([5], 7, blocks["b"]), ([5], 7, blocks["c"])]))
    # position 8 starts a new block (new block ids 9, 10, 11): the block table decides
    new = {"a": [3, 4, 10], "b": [5, 6, 11], "c": [1, 2, 9]}
    order = ["c", "b", "a"]
    got, notes = tr.assign(_step([([0], 8, new[k]) for k in order], table=[new[k] for k in order]))
    assert got == {"a": 2, "b": 1, "c": 0} and notes == []


def test_without_a_block_table_an_ambiguous_boundary_is_named():
    tr = Tracker(BS)
    tr.follow("a", [1, 2, 3, 4])
    tr.follow("b", [5, 6, 7, 8])
    tr.assign(_step([([1, 2, 3, 4], 0, [0]), ([5, 6, 7, 8], 0, [1])]))
    got, notes = tr.assign(_step([([9], 4, [1, 3]), ([9], 4, [0, 2])]))
    assert set(got) == {"a", "b"} and len(notes) == 1 and "first in the step's order" in notes[0]


def test_identical_requests_are_named_and_a_finished_request_is_never_matched_again():
    tr = Tracker(BS)
    tr.follow("x", PROMPT)
    got, notes = tr.assign(_step([(PROMPT, 0, [0, 1]), (PROMPT, 0, [2, 3])]))
    assert got == {"x": 0} and "identical requests" in notes[0]
    tr.close("x")
    assert tr.assign(_step([([5], 6, [0, 1])]))[0] == {}


def test_a_chunked_prefill_continues_with_the_prompts_ids_and_a_decode_run_has_one_token():
    tr = Tracker(BS)
    tr.follow("p", PROMPT)
    assert tr.assign(_step([(PROMPT[:4], 0, [0, 1])]))[0] == {"p": 0}
    wrong = [99, 98]  # a run at the right position with other ids is not the prompt's next chunk
    assert tr.assign(_step([(wrong, 4, [5, 6]), (PROMPT[4:], 4, [0, 1])]))[0] == {"p": 1}
    assert tr.assign(_step([([7, 8], 6, [0, 1, 2])]))[0] == {}  # two tokens past the prompt: not a decode step


def test_follow_first_takes_the_first_run_then_follows_it_and_closes_when_it_is_gone():
    tr = Tracker(BS)
    tr.follow("first", None, close_when_absent=True)
    assert tr.assign(_step([(SHORT, 0, [5]), (PROMPT, 0, [0, 1])]))[0] == {"first": 0}
    assert tr.assign(_step([([40], 2, [5]), ([41], 6, [0, 1])]))[0] == {"first": 0}
    assert tr.assign(_step([([41], 7, [0, 1])]))[0] == {}
    assert not tr.followed["first"].open


def test_boundaries_from_positions_and_slots():
    pos = np.array([0, 1, 2, 0, 1, 5, 3, 4])
    slots = np.array([0, 1, 2, 8, 9, 20, 30, 31])
    assert boundaries_from_positions(pos, slots).tolist() == [0, 3, 5, 6, 8]
    # adjacent positions, but the slots jump: two requests
    assert boundaries_from_positions(np.array([0, 1, 2, 3]), np.array([0, 1, 8, 9])).tolist() == [0, 2, 4]


def test_a_run_whose_positions_are_not_consecutive_is_refused():
    step = StepInputs(np.array([1, 2, 3]), np.array([0, 1, 5]), np.array([0, 3]))
    tr = Tracker(BS)
    tr.follow("x", [1, 2, 3])
    with pytest.raises(TracerError, match="not consecutive"):
        tr.assign(step)
