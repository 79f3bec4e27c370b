"""Issue 27: tracing at the cost of the forward pass. The launch-bound mode's shortcuts give the
numbers of the plain computation, bit for bit: the batched comparison against each point compared
alone, captures kept by reference against copies, the trace's coalesced writes and parallel
CRC-32 against zlib; on a GPU, the online comparison against the one from a stored trace."""

from __future__ import annotations

import json
import os
import zlib

import numpy as np
import pytest
import torch

import tracer
from tracer.diff.batch import tensor_diff
from tracer.diff.compare import compare_trace
from tracer.execute.records import CaptureRecord, RunRecord
from tracer.load.models import load_model
from tracer.store import crc
from tracer.store.trace import TraceReader, TraceWriter

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPT = "x" * 70 + " cache hit versus cache miss"


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-qwen3", dtype="bfloat16", device="cpu", progress=False)


def _same(a, b) -> bool:
    """Equal to the last bit, NaN included (JSON keeps every float's shortest exact repr)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_batched_comparison_equals_each_point_compared_alone(lm, tmp_path):
    """Every point of a real run (kv-quant, bf16: the runs differ from the first KV cache on) goes
    through one batch; each point's numbers equal a batch of that point alone."""
    kw = dict(loaded=lm, scenario="kv-quant", length=300, progress=False)
    res = tracer.run(**kw, store="none")
    out = tracer.run(**kw, store="tensors", output=str(tmp_path / "t.h5"))  # the runs keep their tensors too
    rec_a, rec_b = out.runs
    assert rec_a.captures and out.comparison.to_dict()["layers"] == res.comparison.to_dict()["layers"]
    differing = 0
    for p in out.comparison.points:
        alone = tensor_diff(rec_a.captures[p.name].tensor, rec_b.captures[p.name].tensor)
        assert _same(p.diff.to_dict(), alone.to_dict()), p.name
        differing += p.diff.n_diff > 0
    assert differing >= 2
    logits = out.comparison.logits.tensor
    name = out.comparison.logits_name
    assert _same(logits.to_dict(), tensor_diff(rec_a.captures[name].tensor, rec_b.captures[name].tensor).to_dict())


def test_crc32_combine_and_parallel_crc_equal_zlib(monkeypatch):
    rng = np.random.default_rng(3)
    for la, lb in [(0, 5), (5, 0), (1, 1), (100, 7), (12345, (2 << 20) + 3)]:
        a, b = rng.bytes(la), rng.bytes(lb)
        assert crc.crc32_combine(zlib.crc32(a), zlib.crc32(b), lb) == zlib.crc32(a + b)
    monkeypatch.setattr(crc, "crc_threads", lambda: 4)
    monkeypatch.setattr(crc, "PARALLEL_CRC_BYTES", 1 << 16)
    monkeypatch.setattr(crc, "_CRC_PIECE", 1 << 14)
    data = np.frombuffer(rng.bytes((1 << 18) + 13), dtype=np.uint8)
    assert crc.crc32_bytes(data, 77) == zlib.crc32(data.tobytes(), 77)
    assert crc.crc32_bytes(data[5:].view(np.uint8)) == zlib.crc32(data[5:].tobytes())


def test_points_laid_end_to_end_are_written_together_and_read_back(tmp_path):
    """host_copies lays a run's points end to end in one buffer per dtype; the writer stores such
    neighbours with one write: what is read back is every point, bit for bit, with its CRC-32."""
    buf = torch.randn(5 * 48, generator=torch.Generator().manual_seed(1)).bfloat16()
    caps = {f"l{i}": CaptureRecord(f"l{i}", "layer", buf[i * 48:(i + 1) * 48].view(6, 8)) for i in range(4)}
    caps["other"] = CaptureRecord("other", "layer", torch.randn(6, 8).bfloat16())  # another buffer
    caps["norm"] = CaptureRecord("norm", "final_norm", torch.randn(6, 8))  # another dtype
    caps["l4"] = CaptureRecord("l4", "layer", buf[4 * 48:].view(6, 8))  # adjacent in memory, not in the file
    run = RunRecord("A", list(range(10)), {}, (0, 6), caps)
    with TraceWriter(tmp_path / "t.h5", header={}) as w:
        w.add_run(run)
    with TraceReader(tmp_path / "t.h5") as r:
        got = r.run("A")
    for name, c in caps.items():
        iv = torch.int16 if c.tensor.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.captures[name].tensor.view(iv), c.tensor.view(iv)), name


@pytest.mark.parametrize("background", [True, "process"])
def test_background_writer_reports_a_failed_set_up_at_close(tmp_path, background):
    """The file's set-up runs on the writing thread (or in the writer process); when it fails the
    error is one line at close and nothing is left on disk."""
    from tracer.errors import TracerError

    folder = tmp_path / "ro"
    folder.mkdir()
    w = TraceWriter(folder / "t.h5", header={}, background=background)
    os.chmod(folder, 0o500)
    try:
        if os.access(folder, os.W_OK):  # root: permissions do not stop the set-up; nothing to test
            w.abort()
            pytest.skip("running as root")
        with pytest.raises(TracerError, match="cannot create"):
            w.close()
    finally:
        os.chmod(folder, 0o700)
    assert list(folder.iterdir()) == []


# ---------------------------------------------------------------- on a GPU


@pytest.fixture(scope="module")
def lm_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return load_model("tiny-qwen3", dtype="bfloat16", device="cuda", progress=False)


def _doc(comparison) -> dict:
    d = comparison.to_dict()
    for k in ("trace", "facts"):
        d.pop(k, None)
    return d


@CUDA
def test_cuda_online_comparison_equals_the_stored_one_and_the_cpu_counts(tmp_path, lm_cuda):
    """On the GPU: captures by reference, dense logits chunks, one transfer per statistic; the
    online comparison equals the comparison of the stored tensors on the GPU, bit for bit, and its
    integer counts equal those computed on the CPU from the same tensors."""
    kw = dict(loaded=lm_cuda, scenario="kv-quant", length=300, progress=False)  # runs that differ
    online = tracer.run(**kw, store="none")
    stored = tracer.run(**kw, store="tensors", output=tmp_path / "t.h5")
    assert _same(_doc(online.comparison), _doc(stored.comparison))
    assert _same(_doc(online.comparison), _doc(compare_trace(str(tmp_path / "t.h5"), device="cuda")))
    on_cpu = compare_trace(str(tmp_path / "t.h5"), device="cpu")
    for p, q in zip(online.comparison.points, on_cpu.points):
        assert (p.name, p.diff.n_diff, p.diff.ulp_hist, p.diff.max_abs_diff) == (q.name, q.diff.n_diff, q.diff.ulp_hist,
                                                                                q.diff.max_abs_diff)
    assert [f.position for f in online.comparison.logits.argmax_flips] == [f.position for f in on_cpu.logits.argmax_flips]
    assert all(isinstance(r.meta["wall_s"], float) and r.meta["wall_s"] > 0 for r in stored.runs)
    with TraceReader(tmp_path / "t.h5") as r:
        assert r.run("A", load_tensors=False).meta["wall_s"] > 0


@CUDA
def test_cuda_captures_by_reference_equal_copies(lm_cuda):
    from tracer.execute.capture import Capture
    from tracer.execute.points import discover_points
    from tracer.engines.hf.run import forward_chunks
    from tracer.plan.scenarios import prefix_cache

    model = lm_cuda.model
    points = [p for p in discover_points(model, "sublayers") if p.kind != "kv_cache"]
    scen = prefix_cache(40, block_size=16)
    ids = torch.tensor([[(7 * i + 3) % 500 for i in range(40)]], device="cuda")
    for plan in (scen.plan_a, scen.plan_b):
        got = {}
        for reference in (None, False):  # None: the default on a GPU, by reference
            with torch.inference_mode(), Capture(model, points, scen.window, keep_on_device=True,
                                                 reference=reference) as cap:
                forward_chunks(model, ids, plan, cap)
            got[reference] = cap.records()
        for name, rec in got[False].items():
            assert torch.equal(got[None][name].tensor.view(torch.int16), rec.tensor.view(torch.int16)), name


# ---------------------------------------------------------------- CUDA graphs


def test_cuda_graphs_off_a_gpu_is_a_one_line_error(lm, cli_env, tmp_path):
    import subprocess
    import sys

    from tracer.errors import TracerError

    for args, says in ((["--cuda-graphs"], "drop --cuda-graphs"), (["--scenario", "cuda-graph"], "choose another scenario")):
        proc = subprocess.run([sys.executable, "-m", "tracer", "run", "tiny-qwen3", "--device", "cpu", "--no-store", *args],
                              capture_output=True, text=True, env=cli_env, cwd=tmp_path)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert "need a CUDA GPU" in proc.stderr and says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    with pytest.raises(TracerError, match="need a CUDA GPU; the model runs on cpu"):
        tracer.capture(lm, cuda_graphs=True)


def test_plans_that_cannot_be_recorded_are_refused():
    from tracer.errors import TracerError
    from tracer.execute.graphs import check_graph_plan
    from tracer.plan.plans import with_cuda_graphs
    from tracer.plan.build import build

    for name, opts, why in (("kv-quant", {}, "a KV-cache format"), ("batch", {}, "a batch"),
                            ("compile", {}, "torch.compile"), ("generate-cache", {}, "token-by-token generation")):
        scen = with_cuda_graphs(build(name, 64, **opts))
        with pytest.raises(TracerError, match=f"cannot be recorded in CUDA graphs: it uses {why}"):
            for plan in (scen.plan_a, scen.plan_b):
                check_graph_plan(plan)
    plain = with_cuda_graphs(build("prefix-cache", 64))
    assert plain.plan_a.cuda_graph and plain.plan_b.cuda_graph and plain.params["cuda_graphs"]
    check_graph_plan(plain.plan_b)
    with pytest.raises(TracerError, match="kernels"):
        check_graph_plan(plain.plan_b, kernels=True)
    with pytest.raises(TracerError, match="already compares eager"):
        with_cuda_graphs(build("cuda-graph", 64))


def _hidden_in_graph(model, ids):
    """An independent oracle: HF's own output_hidden_states inside a CUDA graph (references to the
    graph's static tensors), after a replay."""
    static = ids.clone()
    with torch.inference_mode():
        model(input_ids=static, output_hidden_states=True)  # warm-up
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = model(input_ids=static, output_hidden_states=True)
    g.replay()
    torch.cuda.synchronize()
    return [h[0].clone() for h in out.hidden_states], out.logits[0].clone()


@CUDA
def test_capture_inside_a_cuda_graph_refreshes_at_every_replay(lm_cuda):
    """tracer.capture(cuda_graphs=True) around the recording of a graph: after each replay the
    captures hold that replay's tensors, equal bit for bit to HF's hidden states of the same input
    in a graph of their own."""
    model = lm_cuda.model
    static = torch.tensor([[(7 * i + 3) % 500 for i in range(40)]], device="cuda")
    with torch.inference_mode():
        model(input_ids=static)  # warm-up
        with tracer.capture(lm_cuda, cuda_graphs=True) as cap:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = model(input_ids=static)
    layers = [n for n, r in cap.records().items() if r.kind == "layer"]
    for ids in ([(7 * i + 3) % 500 for i in range(40)], [(11 * i + 5) % 500 for i in range(40)]):
        static.copy_(torch.tensor([ids], device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        hs, logits = _hidden_in_graph(model, static)
        for i, name in enumerate(layers[:-1]):
            assert torch.equal(cap[name].tensor.view(torch.int16), hs[i + 1].view(torch.int16)), name
        assert torch.equal(cap["lm_head"].tensor.view(torch.int16), logits.view(torch.int16))
        assert torch.equal(cap["lm_head"].tensor.view(torch.int16), out.logits[0].view(torch.int16))
        assert cap.token_ids == ids


@CUDA
def test_capture_with_warm_ups_inside_the_block_is_the_buffer_the_graph_replays_into(lm_cuda):
    """Issue 37 item 11, PyTorch's recipe inside one capture block: two warm-up forwards on a side
    stream, then the recording. On the H200 cap["lm_head"] differed from the graph's own logits in
    155,581,439 of 155,582,464 elements: its tensor held 3 × N rows (the warm-ups' and a copy of the
    recording's buffers made before any replay). Now every point is the buffer the graph replays into:
    after a replay on new ids, equal bit for bit to the graph's own outputs of that replay."""
    model = lm_cuda.model
    n = 48
    static = torch.tensor([[(7 * i + 3) % 500 for i in range(n)]], device="cuda")
    with torch.inference_mode():
        with tracer.capture(lm_cuda, cuda_graphs=True) as cap:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    model(input_ids=static, output_hidden_states=True)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = model(input_ids=static, output_hidden_states=True)
    recs = cap.records()
    layers = [name for name, r in recs.items() if r.kind == "layer"]
    for ids in ([(11 * i + 5) % 500 for i in range(n)], [(13 * i + 1) % 500 for i in range(n)]):
        static.copy_(torch.tensor([ids], device="cuda"))
        g.replay()
        torch.cuda.synchronize()
        bits = lambda t: t.contiguous().view(torch.int16)  # noqa: E731
        assert all(r.tensor.shape[0] == n for r in recs.values() if r.tensor.numel()), "one recording's rows"
        assert torch.equal(bits(cap["model.embed_tokens"].tensor), bits(out.hidden_states[0][0]))
        for i, name in enumerate(layers[:-1]):  # the last hidden state is after the final norm
            assert torch.equal(bits(cap[name].tensor), bits(out.hidden_states[i + 1][0])), name
        assert torch.equal(bits(cap["model.norm"].tensor), bits(out.hidden_states[-1][0]))
        assert torch.equal(bits(cap["lm_head"].tensor), bits(out.logits[0]))
        assert cap.token_ids == ids and cap["lm_head"].calls[0]["positions"] == [0, n]


@CUDA
def test_a_graph_recorded_before_the_block_is_an_error_not_an_empty_capture(lm_cuda):
    from tracer.errors import TracerError

    model = lm_cuda.model
    static = torch.tensor([list(range(16))], device="cuda")
    with torch.inference_mode():
        model(input_ids=static)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            model(input_ids=static)
        with pytest.raises(TracerError, match="no capture point fired"):
            with tracer.capture(lm_cuda, cuda_graphs=True):
                g.replay()


@CUDA
def test_runs_under_cuda_graphs_capture_what_eager_runs_capture(lm_cuda):
    """--cuda-graphs on prefix-cache (run B: two graphs sharing the KV cache): every point compared,
    as eager; the cuda-graph scenario compares eager with replay, every point captured in both."""
    kw = dict(loaded=lm_cuda, prompt=PROMPT, store="none", progress=False)
    eager = tracer.run(**kw)
    graphs = tracer.run(**kw, cuda_graphs=True)
    assert [(p.name, p.diff.n_total) for p in graphs.comparison.points] == \
           [(p.name, p.diff.n_total) for p in eager.comparison.points]
    assert not graphs.comparison.skipped and graphs.scenario.plan_b.cuda_graph
    print("eager vs graphs n_diff:", [(p.diff.n_diff, q.diff.n_diff) for p, q in zip(eager.comparison.points,
                                                                                  graphs.comparison.points)])
    replay = tracer.run(loaded=lm_cuda, prompt=PROMPT, scenario="cuda-graph", store="tensors", progress=False)
    a, b = replay.runs
    assert set(a.captures) == set(b.captures) and all(c.tensor.numel() for c in b.captures.values())


@CUDA
def test_a_hook_that_cannot_be_recorded_is_a_one_line_error(lm_cuda):
    from tracer.errors import TracerError

    model = lm_cuda.model
    handle = model.get_submodule("model.layers.0").register_forward_hook(lambda m, a, o: float(o[0].sum()))
    try:
        with pytest.raises(TracerError, match="cannot be recorded in a CUDA graph") as e:
            tracer.run(loaded=lm_cuda, prompt=PROMPT, store="none", progress=False, cuda_graphs=True)
        assert "\n" not in str(e.value)
    finally:
        handle.remove()
    assert tracer.run(loaded=lm_cuda, prompt=PROMPT, store="none", progress=False).comparison.points


@pytest.mark.parametrize("sparse_ratio", [0, 10**9])  # the float64 pass on whole blocks / on differing elements
def test_float64_results_kept_for_one_transfer_equal_those_folded_per_chunk(monkeypatch, sparse_ratio):
    """A GPU keeps every chunk's float64 results on the device and moves them in one transfer (as
    64-bit words side by side); the CPU folds them chunk by chunk: the same numbers, bit for bit."""
    from tracer.diff import batch as batch_module
    from tracer.diff import metrics, passes

    monkeypatch.setattr(passes, "SPARSE_RATIO", sparse_ratio)
    monkeypatch.setattr(metrics, "CHUNK_ELEMENTS", 1 << 12)  # several chunks
    g = torch.Generator().manual_seed(4)
    pairs = []
    for shape in ((40, 64), (3, 7), (100, 33), (16, 512)):
        a = torch.randn(shape, generator=g).bfloat16()
        b = a.clone()
        b.view(torch.int16).view(-1)[::5] += 3
        b.view(-1)[1] = float("nan")
        pairs.append((a, b))
    got = {}
    for defer in (False, True):
        monkeypatch.setattr(passes, "_defer", lambda device, defer=defer: defer)
        batch = batch_module.DiffBatch(tolerance=(1e-3, 1e-2))
        for a, b in pairs:
            batch.add(a, b, split=17)
        got[defer] = [(d.to_dict(), batch.outside_tolerance(i), batch.n_diff_before(i))
                      for i, d in enumerate(batch.results())]
    assert _same(got[True], got[False])


def test_a_small_chunk_in_one_pass_equals_the_two_passes(monkeypatch):
    """A GPU compares a small chunk (a run's compared window) in one pass over every block, no host
    synchronisation between the passes: the numbers of the two passes on the blocks that differ,
    computed on whole blocks, bit for bit (forced here on the CPU)."""
    from tracer.diff import batch as batch_module
    from tracer.diff import passes

    monkeypatch.setattr(passes, "SPARSE_RATIO", 0)  # the two passes' float64 pass on whole blocks
    g = torch.Generator().manual_seed(5)
    pairs = []
    for shape in ((40, 64), (3, 7), (100, 33), (16, 512), (8, 300)):
        a = torch.randn(shape, generator=g).bfloat16()
        b = a.clone()
        if shape != (8, 300):  # one pair without a difference: its blocks add zeros
            b.view(torch.int16).view(-1)[::7] += 2
        b.view(-1)[2] = float("inf")
        pairs.append((a, b))
    got = {}
    for dense in (False, True):
        monkeypatch.setattr(passes, "_dense", lambda device, elements, dense=dense: dense)
        monkeypatch.setattr(passes, "_defer", lambda device: True)
        batch = batch_module.DiffBatch(tolerance=(1e-3, 1e-2))
        for a, b in pairs:
            batch.add(a, b, split=11)
        got[dense] = [(d.to_dict(), batch.outside_tolerance(i), batch.n_diff_before(i))
                      for i, d in enumerate(batch.results())]
    assert _same(got[True], got[False])
    assert got[True][-1][0]["n_diff"] == 1 and got[True][0][0]["n_diff"] > 100


def test_the_gpu_comparison_reads_the_host_once_and_gives_the_cpu_numbers(lm, monkeypatch):
    """The decisions a GPU takes (captures by reference, the one-pass comparison of a small chunk,
    every logits row, the results kept on the device), taken on the CPU: one device-to-host read
    for the whole comparison, and the numbers of the CPU's own path (its float64 pass on whole
    blocks), bit for bit."""
    from tracer.diff import logits as logits_module
    from tracer.diff import passes
    from tracer.execute import capture as capture_module

    monkeypatch.setattr(passes, "SPARSE_RATIO", 0)  # the CPU's float64 pass on whole blocks too
    kw = dict(loaded=lm, scenario="kv-quant", length=300, progress=False, store="none")
    cpu = tracer.run(**kw).comparison
    monkeypatch.setattr(passes, "_dense", lambda device, elements: elements <= passes.DENSE_ELEMENTS)
    monkeypatch.setattr(passes, "_defer", lambda device: True)
    acc_init = logits_module.LogitsAccumulator.__init__
    monkeypatch.setattr(logits_module.LogitsAccumulator, "__init__",
                        lambda self, vocab, dense=None: acc_init(self, vocab, dense=True))
    cap_init = capture_module.Capture.__init__

    def by_reference(self, *a, **k):
        cap_init(self, *a, **k)
        self.reference = True

    monkeypatch.setattr(capture_module.Capture, "__init__", by_reference)
    reads = []
    to_host = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: reads.append(self.shape) or to_host(self, *a, **k))
    gpu = tracer.run(**kw).comparison
    assert len(reads) == 1  # the batch, the per-position table and the logits' statistics in one read
    assert sum(p.diff.n_diff > 0 for p in gpu.points) >= 2 and gpu.logits.tensor.n_diff > 0
    assert _same(_doc(gpu), _doc(cpu))


def test_streamed_compare_reading_both_runs_at_once_equals_in_turn(tmp_path, monkeypatch):
    """With spare cores run B's blocks are read beside run A's: the same comparison, and a damaged
    point still fails its checksum."""
    from tracer.store import stream

    g = torch.Generator().manual_seed(2)
    caps = {f"model.layers.{i}": torch.randn(12, 40, generator=g).bfloat16() for i in range(3)}
    runs = []
    for name in ("A", "B"):
        c = {k: v.clone() for k, v in caps.items()}
        if name == "B":
            c["model.layers.1"].view(torch.int16)[::2] += 1
        runs.append(RunRecord(name, list(range(12)), {}, (0, 12), {k: CaptureRecord(k, "layer", v) for k, v in c.items()}))
    with TraceWriter(tmp_path / "t.h5", header={}) as w:
        for r in runs:
            w.add_run(r)
    monkeypatch.setattr(stream, "BLOCK_BYTES", 200)  # several blocks per point
    got = {}
    for threads in (1, 4):
        monkeypatch.setattr(crc, "crc_threads", lambda threads=threads: threads)
        got[threads] = compare_trace(str(tmp_path / "t.h5"), device="cpu").to_dict()
    assert _same(got[1]["layers"], got[4]["layers"]) and got[4]["layers"][1]["n_diff"] > 0


@pytest.mark.parametrize("budget", ["1GiB", "40KB"])
def test_store_auto_writing_run_a_early_gives_the_trace_of_writing_it_late(tmp_path, lm, monkeypatch, budget):
    """--store auto hands run A to the writer before run B runs when the whole trace will fit
    (its write overlaps run B); the trace equals the one written after the comparison: the same
    runs, meta (store_auto included) and tensors. When the budget drops points, run A is taken
    back and written with the kept points only."""
    from tracer.store import handoff

    kw = dict(loaded=lm, scenario="kv-quant", length=64, store="auto", max_trace_size=budget, progress=False)
    handed = []
    real = handoff.early_run_a
    monkeypatch.setattr(handoff, "early_run_a", lambda *a: handed.append(real(*a)) or handed[-1])
    tracer.run(**kw, output=tmp_path / "early.h5")
    assert (handed[0] is not None) == (budget == "1GiB")  # 40KB: run A alone is over half the budget
    monkeypatch.setattr(handoff, "early_run_a", lambda *a, **k: None)
    tracer.run(**kw, output=tmp_path / "late.h5")
    docs = []
    for name in ("early.h5", "late.h5"):
        with TraceReader(tmp_path / name) as r:
            runs = [r.run(n) for n in r.runs]
            docs.append([(x.name, {k: v for k, v in x.meta.items() if k != "wall_s"}, isinstance(x.meta["wall_s"], float),
                          {n: c.tensor.view(torch.int16).tolist() for n, c in x.captures.items()}) for x in runs])
    assert docs[0] == docs[1]
    dropped = docs[0][0][1]["store_auto"]["dropped"]
    assert bool(dropped) == (budget == "40KB")


@pytest.mark.parametrize("background", [False, True, "process"])
def test_writer_takes_a_run_back_and_completes_a_meta(tmp_path, background):
    caps = {"l0": CaptureRecord("l0", "layer", torch.arange(12.0).view(3, 4))}
    a = RunRecord("A", [1, 2, 3], {}, (0, 3), caps, meta={"x": 1})
    # --store auto's whole record (the trace format 3 reads it by its schema: a partial one is refused)
    auto = {"kept": ["l0"], "dropped": [], "kept_bytes": 48, "total_bytes": 48, "budget": 1024, "reasons": {},
            "logits": None, "kinds": {}}
    with TraceWriter(tmp_path / "t.h5", header={}, background=background) as w:
        w.add_run(a)
        w.remove_run("A")
        w.add_run(RunRecord("A", [1, 2, 3], {}, (0, 3), {}, meta={"x": 2}))
        w.add_run(RunRecord("B", [1, 2, 3], {}, (0, 3), caps, meta={"x": 3}))
        w.set_meta("B", {"x": 4, "store_auto": auto})
    with TraceReader(tmp_path / "t.h5") as r:
        assert r.runs == ["A", "B"]
        assert r.run("A").meta == {"x": 2} and r.run("A").captures == {}
        b = r.run("B")
        assert b.meta == {"x": 4, "store_auto": auto} and torch.equal(b.captures["l0"].tensor, caps["l0"].tensor)
