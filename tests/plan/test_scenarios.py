"""The prefix-cache scenario's plans do what they claim."""

from __future__ import annotations

import pytest

from tracer.errors import TracerError
from tracer.plan.build import build
from tracer.plan.scenarios import RunPlan, default_split, prefix_cache


@pytest.mark.parametrize("n,block,expected", [(31, 16, 16), (32, 16, 16), (33, 16, 32), (100, 16, 96),
                                              (250, 16, 240), (1000, 16, 992), (17, 16, 16), (5, 2, 4)])
def test_default_split_is_last_block_boundary_below_n(n, block, expected):
    # independent: the largest k*block with k*block < n
    assert expected == max(k * block for k in range(1, n) if k * block < n)
    assert default_split(n, block) == expected


def test_prefix_cache_plans():
    s = prefix_cache(250, block_size=16)
    assert s.plan_a.chunks == ((0, 250),)
    assert s.plan_b.chunks == ((0, 240), (240, 250))
    assert s.plan_a.gemm_m() == [250] and s.plan_b.gemm_m() == [240, 10]
    assert s.window == (240, 250)
    assert s.level == 2


def test_aligned_mitigation_splits_run_a_at_p():
    s = prefix_cache(250, block_size=16, mitigation="aligned")
    assert s.plan_a.chunks == s.plan_b.chunks == ((0, 240), (240, 250))


def test_split_at_overrides_block_size():
    s = prefix_cache(100, split_at=99)  # the decode-step case: one token after the cache
    assert s.plan_b.chunks == ((0, 99), (99, 100)) and s.window == (99, 100)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(n_tokens=16, block_size=16), "more than one KV block"),
    (dict(n_tokens=10, block_size=0), "positive"),
    (dict(n_tokens=10, split_at=10), "outside 1..9"),
    (dict(n_tokens=10, split_at=0), "outside 1..9"),
    (dict(n_tokens=40, mitigation="magic"), "unknown mitigation"),
])
def test_bad_parameters(kwargs, msg):
    n = kwargs.pop("n_tokens")
    with pytest.raises(TracerError, match=msg):
        prefix_cache(n, **kwargs)


def test_plans_must_tile_the_prompt():
    with pytest.raises(TracerError, match="tile"):
        RunPlan("A", ((0, 10), (11, 20)))


def test_unknown_scenario():
    with pytest.raises(TracerError, match="unknown scenario"):
        build("nope", 10)


@pytest.mark.parametrize("engines, refused", [("vllm:TRITON_ATTN,vllm:CPU_ATTN", True), ("hf,vllm:CPU_ATTN", True),
                                              ("vllm:CPU_ATTN,vllm", False), ("hf,vllm", False)])
def test_an_attention_backend_no_run_would_use_is_refused(engines, refused):
    """`--engines vllm:A,vllm:B --attention-backend C` ran A and B and dropped C silently (a plan's own
    backend wins): refused in one line when every engine that takes a backend names its own; kept
    when one of them names none (that run gets C)."""
    from tracer.plan.engines import check_engine_options

    options = {"engines": engines, "attention_backend": "FLEX_ATTENTION"}
    if refused:
        with pytest.raises(TracerError, match=r"^--attention-backend FLEX_ATTENTION would apply to no run: "
                                              rf"--engines {engines} names the backend"):
            check_engine_options(None, "engine", options)
    else:
        check_engine_options(None, "engine", options)


def test_prefill_decode_plans_count_generated_tokens_and_decode_steps():
    """--new-tokens 4: the prefill gives token 1, three decode steps (fed tokens 1..3) give tokens 2..4;
    the plan lines say so instead of "4 tokens decoded" (which reads as four decode steps)."""
    from tracer.plan.engines import prefill_decode

    scen = prefill_decode(130, new_tokens=4)
    a, b = scen.plan_a, scen.plan_b
    assert "4 tokens generated (3 decode steps)" in a.description
    assert "generates 4 tokens" in b.description
    assert "1 decode step)" in prefill_decode(130, new_tokens=2).plan_a.description


@pytest.mark.parametrize(("given", "guess"), [("align", "aligned"), ("determinstic", "deterministic"), ("hope", None),
                                             ("ALIGNED", "aligned")])
def test_an_unknown_mitigation_suggests_the_near_one(given, guess):
    """A near-miss names the mitigation meant (in capitals too); a word near none lists the choices alone."""
    with pytest.raises(TracerError, match="unknown mitigation") as e:
        prefix_cache(40, mitigation=given)
    assert ("did you mean" in str(e.value)) == (guess is not None)
    if guess:
        assert str(e.value).endswith(f"(did you mean {guess}?)")
