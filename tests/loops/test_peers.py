"""The bench's peers do tracer's work: their per-layer differing counts equal tracer's and an
independent computation on a planted perturbation, and a peer that counts otherwise is refused.
No timing assertions."""

from __future__ import annotations

import pytest
import torch

from tracer import pipeline
from tracer.config import CaptureConfig
from tracer.errors import TracerError
from tracer.load.models import load_model
from tracer.loops import peers as peers_mod
from tracer.loops.peers import Peer, check_counts, make_peers
from tracer.plan.scenarios import prefix_cache

N = 64  # block 16: cached prefix P = 48, suffix 16 tokens
LAYER = 1  # the decoder layer whose output run B's suffix pass perturbs
PLANTED = [(0, 0), (3, 5), (7, 63), (15, 10), (15, 11)]  # (suffix position, feature): one bit flipped in each


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", dtype="bfloat16", device="cpu")


def _ids() -> list[int]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(1, 500, (N,), generator=g).tolist()


class _Plant:
    """Flip a mantissa bit of the PLANTED elements of decoder layer LAYER's output, in place, in
    run B's last (suffix) pass: every method runs plan A's chunks then plan B's, one forward call
    each, so that is every ``calls``-th call. In place, so every method sees it, whatever the order
    of its hooks."""

    def __init__(self, model, scen) -> None:
        self.calls = len(scen.plan_a.chunks) + len(scen.plan_b.chunks)
        self.seen = 0
        self.handle = model.get_submodule(f"model.layers.{LAYER}").register_forward_hook(self.hook)

    def hook(self, module, args, output):
        self.seen += 1
        if self.seen % self.calls == 0:
            bits = (output[0] if isinstance(output, tuple) else output).view(torch.int16)
            for pos, feat in PLANTED:
                bits[0, pos, feat] ^= 1 << 6  # a mantissa bit high enough to reach the later layers

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def _independent(model, ids: list[int], scen) -> dict[str, int]:
    """Per-layer differing counts by hand: plain HF calls chunk by chunk with one KV cache,
    ``output_hidden_states``, the window sliced, bits compared as int16."""
    x = torch.tensor([ids])
    runs = []
    with torch.inference_mode():
        for plan in (scen.plan_a, scen.plan_b):
            cache, pieces = None, []
            for s, e in plan.chunks:
                out = model(input_ids=x[:, s:e], past_key_values=cache, use_cache=True, output_hidden_states=True)
                cache = out.past_key_values
                lo, hi = max(s, scen.window[0]), min(e, scen.window[1])
                if lo < hi:
                    pieces.append([h[0, lo - s:hi - s].clone() for h in out.hidden_states[1:]])
            runs.append([torch.cat(p) for p in zip(*pieces)])
    n_layers = len(runs[0])
    names = [f"model.layers.{i}" for i in range(n_layers - 1)] + ["model.norm"]
    return {n: int((a.view(torch.int16) != b.view(torch.int16)).sum()) for n, a, b in zip(names, *runs)}


@pytest.mark.parametrize("mitigation", [None, "aligned"])
def test_peers_count_what_tracer_counts(tiny, mitigation):
    ids = _ids()
    scen = prefix_cache(N, block_size=16, mitigation=mitigation)
    capture = CaptureConfig("layers", kv_cache=False)
    points = pipeline.capture_points(tiny, capture)
    with _Plant(tiny.model, scen):
        tracer_counts = {q.name: q.diff.n_diff
                         for q in pipeline.run_scenario(tiny, ids, scen, capture).comparison.points}
        expected = _independent(tiny.model, ids, scen)
        got = {}
        for peer in make_peers(tiny, ids, scen, points):
            if peer.skipped:
                assert peer.name == "peer_nnsight" and "nnsight" in peer.skipped
                continue
            got[peer.name] = peer.run()
            check_counts(peer.name, got[peer.name], tracer_counts)  # raises if they differ
    layers = [f"model.layers.{i}" for i in range(4)]
    assert set(got["peer_hooks"]) == set(layers)
    assert set(got["peer_hf"]) == set(layers[:-1]) | {"model.norm"}
    for name, counts in got.items():
        for point, c in counts.items():
            assert c == tracer_counts[point], (name, point)
            if point in expected:
                assert c == expected[point], (name, point)
    assert tracer_counts["model.layers.3"] > 0  # the planted bits propagate
    if mitigation == "aligned":  # same chunks in both runs: only the planted bits differ at LAYER
        assert [tracer_counts[q] for q in layers[:LAYER]] == [0] * LAYER
        assert tracer_counts[layers[LAYER]] == len(PLANTED) == expected[layers[LAYER]]


def test_nnsight_peer_counts_what_tracer_counts(tiny):
    pytest.importorskip("nnsight", reason="nnsight is optional (the 'peers' extra)")
    ids = _ids()
    scen = prefix_cache(N, block_size=16)
    capture = CaptureConfig("layers", kv_cache=False)
    peer = peers_mod.peer_nnsight(tiny, ids, scen, pipeline.capture_points(tiny, capture))
    assert peer.skipped is None, peer.skipped
    with _Plant(tiny.model, scen):
        want = {q.name: q.diff.n_diff for q in pipeline.run_scenario(tiny, ids, scen, capture).comparison.points}
        got = peer.run()
    assert set(got) == {f"model.layers.{i}" for i in range(4)} and got[f"model.layers.{LAYER}"] >= len(PLANTED)
    check_counts("peer_nnsight", got, want)


def test_a_peer_that_counts_otherwise_is_refused():
    want = {"model.layers.0": 0, "model.layers.1": 5, "model.norm": 9}
    check_counts("peer_x", {"model.layers.0": 0, "model.layers.1": 5}, want)
    with pytest.raises(TracerError, match=r"peer_x did not do tracer's work.*model.layers.1: peer_x 4 vs tracer 5"):
        check_counts("peer_x", {"model.layers.0": 0, "model.layers.1": 4}, want)
    with pytest.raises(TracerError, match="not compared by tracer"):
        check_counts("peer_x", {"model.layers.9": 0}, want)
    with pytest.raises(TracerError, match="no counts"):
        check_counts("peer_x", {}, want)


def test_bench_refuses_a_peer_doing_different_work(tmp_path, monkeypatch):
    from tracer.loops import bench as bench_mod

    def liar(loaded, ids, scen, points):
        layers = [q.name for q in points if q.kind == "layer"]
        return [Peer("peer_hooks", "liar", "all layers", lambda: {n: 123456 for n in layers})]

    monkeypatch.setattr(peers_mod, "make_peers", liar)
    with pytest.raises(TracerError, match="peer_hooks did not do tracer's work"):
        bench_mod.bench("tiny-llama", length=32, device="cpu", reps=1, warmup=0, outdir=str(tmp_path))
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_bench_json_and_table_show_peers_and_skips(tmp_path, monkeypatch):
    from rich.console import Console

    from tracer.loops.bench import bench
    from tracer.report.bench import table

    monkeypatch.setattr(peers_mod, "nnsight_missing", lambda: "nnsight is not installed (pip install 'tracer[peers]')")
    r = bench("tiny-llama", length=32, device="cpu", reps=1, warmup=0, outdir=str(tmp_path), kv_cache=False)
    d = r.to_dict()
    assert {"peer_hf", "peer_hooks"} <= set(d["median_s"]) and "peer_nnsight" not in d["median_s"]
    assert d["ratios"]["peer_hooks_over_a"] == r.median("peer_hooks") / r.median("a")
    assert d["peers"]["peer_hf"]["status"] == "checked" and d["peers"]["peer_hf"]["points"] == 4
    assert d["peers"]["peer_nnsight"] == {"status": "skipped", "label": peers_mod.LABELS["peer_nnsight"],
                                          "reason": "nnsight is not installed (pip install 'tracer[peers]')"}
    console = Console(width=250, record=True)
    console.print(table(r))
    text = console.export_text()
    assert "nnsight .save() of the" in text and "skipped" in text
    assert "nnsight is not installed (pip install 'tracer[peers]')" in text
    assert "(peer_hooks)/(a)" in text and "fastest peer" in text
    assert d["ratios"]["b_over_fastest_peer"] == r.median("b") / min(r.median("peer_hf"), r.median("peer_hooks"))
    none = bench("tiny-llama", length=32, device="cpu", reps=1, warmup=0, outdir=str(tmp_path), peers=False)
    assert not any(m.startswith("peer_") for m in none.times) and none.peers == {}
