"""The comparison's passes replayed from CUDA graphs (tracer.diff.graphed) give the eager numbers.

The oracle is the same comparison with the graphs off (``TRACER_COMPARE_GRAPHS=off``), on the same
tensors: three comparisons of one shape with different data each (the first eager, the second
recorded, the third replayed), every one equal to its eager twin in every number it reports.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tracer.diff import graphed
from tracer.diff.compare import compare_pairs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _pairs(seed: int, device: str) -> list[tuple]:
    """30 layer-like points (16, 256) bf16 with planted differences, a NaN, and logits (16, 3000)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(30):
        a = torch.randn(16, 256, generator=g).bfloat16()
        b = a.clone()
        if i >= 3:  # the first differing point is layer 3; each later one differs in more elements
            b.view(torch.int16)[:, :: max(1, 40 - i)] += 1
        if i == 20:
            b[7, 9] = math.nan
        out.append((f"model.layers.{i}", "layer", "Qwen3DecoderLayer", a.to(device), b.to(device), [], []))
    la = torch.randn(16, 3000, generator=g).bfloat16()
    lb = la.clone()
    lb.view(torch.int16)[::2, ::5] += 3
    lb[4, int(la[4].float().argmax())] = -10  # an argmax flip at position 4
    out.append(("lm_head", "logits", "Linear", la.to(device), lb.to(device), [], []))
    return out


def _compare(pairs: list[tuple]) -> str:
    """The comparison's whole document as JSON text (NaN-safe equality)."""
    c = compare_pairs(iter(pairs), scenario="s", model="m", positions=(0, 16), atol=1e-3, rtol=1e-2)
    return json.dumps(c.to_dict(), sort_keys=True)


def test_cpu_tensors_run_eagerly():
    """On the CPU there is no graph: every call is eager, and the key is never stored."""
    graphed.clear()
    before = dict(graphed.counts)
    first, second = _compare(_pairs(1, "cpu")), _compare(_pairs(1, "cpu"))
    assert first == second
    assert graphed.counts["recorded"] == before["recorded"] and graphed.counts["replayed"] == before["replayed"]
    assert not graphed._entries


@cuda
def test_recorded_and_replayed_comparisons_equal_the_eager_ones(monkeypatch):
    graphed.clear()
    before = dict(graphed.counts)
    got = [_compare(_pairs(seed, "cuda")) for seed in (1, 2, 3)]  # eager, recorded, replayed
    assert graphed.counts["recorded"] - before["recorded"] >= 3  # the dense chunk, the logits rows, the positions
    assert graphed.counts["replayed"] - before["replayed"] >= 3
    monkeypatch.setenv("TRACER_COMPARE_GRAPHS", "off")
    want = [_compare(_pairs(seed, "cuda")) for seed in (1, 2, 3)]
    for g, w in zip(got, want):
        assert g == w
    assert got[1] != got[2]  # different data: a replay that returned stale numbers would fail above
    doc = json.loads(got[2])
    layers = {p["name"]: p for p in doc["layers"]}
    assert layers["model.layers.3"]["n_diff"] > 0 and layers["model.layers.2"]["n_diff"] == 0
    assert layers["model.layers.20"]["n_nan_b"] == 1
    assert [f["position"] for f in doc["logits"]["flips"]] == [4]


@cuda
def test_a_pass_that_synchronises_runs_eagerly_and_leaves_the_stream_as_it_was():
    """A pass reading the device inside (``.item()``) cannot be recorded: its recording fails, the
    caller's stream is current again and every call (before and after) gives the eager result."""
    graphed.clear()
    x = torch.arange(8, dtype=torch.float64, device="cuda")
    stream = torch.cuda.current_stream()

    def reads(t: torch.Tensor) -> tuple[torch.Tensor]:
        return (t * float(t.sum().item()),)

    outs = [graphed.run("reads", reads, (x + i,)) for i in range(4)]
    assert all(torch.equal(o[0], (x + i) * float((x + i).sum())) for i, o in enumerate(outs))
    assert torch.cuda.current_stream() == stream
    assert [e.failed for e in graphed._entries.values()] == [True]


@cuda
def test_graphs_beyond_the_limit_are_evicted_and_the_numbers_stay_right(monkeypatch):
    """With room for one graph, two shapes taking turns evict each other's graph; every call still
    returns its own inputs' numbers."""
    graphed.clear()
    monkeypatch.setattr(graphed, "MAX_GRAPHS", 1)

    def double(t: torch.Tensor) -> tuple[torch.Tensor]:
        return (t * 2,)

    for i in range(4):
        for n in (5, 7):
            x = torch.full((n,), float(i), dtype=torch.float64, device="cuda")
            assert torch.equal(graphed.run("double", double, (x,))[0], x * 2)
            assert len(graphed._entries) <= 1


@cuda
def test_a_crowded_device_records_nothing(monkeypatch):
    """Below the free-memory share (here: more than the whole device) a shape seen twice runs
    eagerly and keeps no graph."""
    graphed.clear()
    monkeypatch.setattr(graphed, "MIN_FREE", 1.01)
    before = dict(graphed.counts)
    x = torch.arange(6, dtype=torch.float64, device="cuda")
    for _ in range(3):
        assert torch.equal(graphed.run("double", lambda t: (t * 2,), (x,))[0], x * 2)
    assert graphed.counts["recorded"] == before["recorded"] and graphed.counts["replayed"] == before["replayed"]
    assert all(e.failed for e in graphed._entries.values())
