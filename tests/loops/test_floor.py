"""The bench's floor (mode a) makes the forward calls of the run it is the floor of, and nothing
else: recorded with a forward pre-hook on the model, independent of the bench's own bookkeeping,
for every scenario the bench measures; so do the peers. No timing assertions."""

from __future__ import annotations

import pytest
import torch

from tracer import pipeline
from tracer.config import RunConfig
from tracer.errors import TracerError
from tracer.load.devices import model_device
from tracer.load.hf_cache import cache_kwarg
from tracer.loops import floor
from tracer.loops.bench import bench
from tracer.loops.peers import make_peers
from tracer.validate import validate

N = 100  # every scenario the floor writes is valid at this length (block-size needs more than 64)


class _Calls:
    """Every forward call of the model: (batch, positions it computes, cached positions it reads,
    KV cache asked for), from its arguments alone."""

    def __init__(self, model) -> None:
        self.seen: list[tuple[int, int, int, bool]] = []
        self.handle = model.register_forward_pre_hook(self.pre, with_kwargs=True)

    def pre(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        cached = 0 if cache is None else int(cache.get_seq_length())
        self.seen.append((int(ids.shape[0]), int(ids.shape[1]), cached, bool(kwargs.get("use_cache"))))

    def take(self) -> list[tuple[int, int, int, bool]]:
        out, self.seen = self.seen, []
        return out


@pytest.fixture(scope="module")
def tiny():
    cfg = validate(RunConfig.from_options(model="tiny-llama", device="cpu", dtype="bfloat16", length=N))
    return pipeline.load(cfg)


@pytest.mark.parametrize("scenario", floor.SCENARIOS)
def test_the_floor_and_the_peers_make_the_calls_of_tracers_run(tiny, scenario):
    cfg = validate(RunConfig.from_options(model="tiny-llama", device="cpu", dtype="bfloat16", length=N,
                                          scenario=scenario, kv_cache=False, store="none"))
    prep = pipeline.prepare(cfg, tiny)
    ids, scen = prep.token_ids, prep.scenario
    model = tiny.model
    calls = _Calls(model)
    try:
        pipeline.run(cfg, tiny)  # the bench's mode (b)
        want = calls.take()
        floor.plain_forwards(model, torch.tensor([ids], device=model_device(model)), scen)()
        assert calls.take() == want
        for peer in make_peers(tiny, ids, scen, pipeline.capture_points(tiny, cfg.capture)):
            if peer.run is not None:
                peer.run()
                assert calls.take() == want, peer.name
    finally:
        calls.handle.remove()
    # the calls themselves: each plan's chunks in order, each reading the KV cache of the one before
    expect = [(1, e - s, s, True) for plan in (scen.plan_a, scen.plan_b) for s, e in plan.chunks]
    assert want == expect and len(want) >= 2


def test_the_floor_says_what_it_runs(tiny):
    cfg = validate(RunConfig.from_options(model="tiny-llama", device="cpu", length=64))
    scen = pipeline.prepare(cfg, tiny).scenario
    kw = cache_kwarg(tiny.model)
    assert floor.describe(scen, kw) == f"A: m(ids); B: o = m(ids[:, :48]), m(ids[:, 48:], {kw}=o.{kw})"


def test_the_peers_leave_no_hooks_on_the_model():
    """transformers' output recorders (and nnsight's forwards) are on the model only while their peer runs."""
    cfg = validate(RunConfig.from_options(model="tiny-llama", device="cpu", length=64, kv_cache=False))
    tiny = pipeline.load(cfg)  # a model of its own: the end leaves the recorders on it
    prep = pipeline.prepare(cfg, tiny)
    model = tiny.model

    def extras() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + ("forward" in m.__dict__) for m in model.modules())

    assert extras() == 0
    peers = [p for p in make_peers(tiny, prep.token_ids, prep.scenario, pipeline.capture_points(tiny, cfg.capture))
             if p.run is not None]
    seen = {}
    for peer in peers:
        assert extras() == 0, peer.name
        if peer.name == "peer_hf":  # the recorders are there during its run, and used
            inside = []
            handle = model.register_forward_pre_hook(lambda *a: inside.append(extras()))
            peer.run()
            handle.remove()
            seen[peer.name] = max(inside)
        else:
            peer.run()
        assert extras() == 0, peer.name
    assert seen["peer_hf"] > 1  # transformers' recorders, beyond the test's own pre-hook
    for peer in peers:  # the end of the bench: the model as the libraries left it
        if peer.leftovers is not None:
            peer.leftovers.restore()
    assert extras() > 0


def test_the_bench_refuses_a_scenario_it_cannot_write_as_plain_calls(tmp_path):
    with pytest.raises(TracerError, match="plain forward calls.*kv-quant"):
        bench("tiny-llama", length=64, device="cpu", reps=1, warmup=0, scenario="kv-quant", outdir=str(tmp_path))
    assert not list(tmp_path.iterdir())
