"""tracer.store.trace: bit-exact round trips, atomic completion, reader errors, h5py-only reading.

Expected bits come from the numpy arrays the tensors were built from; the h5py-only reader
follows traces/README.md, not tracer's code.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from tracer.errors import TracerError
from tracer.execute.records import CaptureRecord, RunRecord
from tracer.store.trace import (
    FORMAT,
    FORMAT_VERSION,
    READ_VERSIONS,
    TraceWriter,
    collect_environment,
    read_row_blocks,
)
from tracer import read_trace

# name → (torch dtype, unsigned bits, signed view, special patterns: NaN payloads, ±inf, ±0, subnormals)
SPECIAL = {
    "bfloat16": (torch.bfloat16, np.uint16, np.int16, [0x7FC0, 0x7FC1, 0xFFC3, 0x7F81, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F]),
    "float16": (torch.float16, np.uint16, np.int16, [0x7E00, 0x7E01, 0xFE05, 0x7C01, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x83FF]),
    "float32": (torch.float32, np.uint32, np.int32, [0x7FC00000, 0x7FC00001, 0xFFC0BEEF, 0x7F800001, 0x7F800000, 0xFF800000, 0, 0x80000000, 1, 0x807FFFFF]),
    "float64": (torch.float64, np.uint64, np.int64, [0x7FF8000000000000, 0x7FF8000000000001, 0xFFF800000000BEEF, 0x7FF0000000000001,
                                                    0x7FF0000000000000, 0xFFF0000000000000, 0, 0x8000000000000000, 1, 0x800FFFFFFFFFFFFF]),
}
NAMES = list(SPECIAL)


def bits_tensor(name: str, shape, rng) -> tuple[torch.Tensor, np.ndarray]:
    """A tensor of dtype ``name`` with random bit patterns plus every special pattern; and those bits."""
    tdtype, ubits, sbits, special = SPECIAL[name]
    n = int(np.prod(shape))
    width = np.dtype(ubits).itemsize * 8
    bits = rng.integers(0, 2**width, size=n, dtype=np.uint64 if width == 64 else np.int64).astype(ubits)
    bits[: len(special)] = np.array(special, dtype=np.uint64).astype(ubits)
    bits = bits.reshape(shape)
    return torch.from_numpy(bits.view(sbits).copy()).view(tdtype), bits


def tensor_bits(t: torch.Tensor) -> np.ndarray:
    """The bit patterns of a tensor as unsigned numpy ints."""
    sbits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(sbits).numpy().view({2: np.uint16, 4: np.uint32, 8: np.uint64}[t.element_size()])


def make_run(name: str, rng, names=NAMES, t=5) -> tuple[RunRecord, dict[str, np.ndarray]]:
    captures, expected = {}, {}
    order = ["model.embed_tokens", "model.layers.0", "model.layers.0.mlp.down_proj", "model.layers.1", "model.norm", "lm_head"]
    for i, cap in enumerate(order):
        dname = names[i % len(names)]
        tensor, bits = bits_tensor(dname, (t, 16 + i), rng)
        calls = [{"positions": [3, 3 + t], "in": [[1, 8, 16 + i]], "out": [1, 8, 16 + i]}]
        captures[cap] = CaptureRecord(name=cap, kind="layer" if "layers" in cap else "logits", tensor=tensor, calls=calls, op=f"Op{i}")
        expected[cap] = bits
    plan = {"chunks": [[0, 3], [3, 8]], "batch": 1, "nested": {"x": [1.5, None, True]}}
    run = RunRecord(name=name, token_ids=[5, 7, 11, 13, 17, 19, 23, 29], plan=plan, window=(3, 8), captures=captures,
                    meta={"wall_s": 0.25, "device": "cpu"})
    return run, expected


HEADER = {"device": "cpu", "torch": "2.x", "model": {"name": "tiny", "hash": "abc"}, "split_points": [3, 5], "nan_ok": math.inf}


def write_trace(path, runs, **kw):
    with TraceWriter(path, header=HEADER, **kw) as w:
        for r in runs:
            w.add_run(r)
        w.add_comparison("A_vs_B", {"n_diff": 3, "max_abs": math.inf, "points": ["a", "b"]})


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("version", READ_VERSIONS)
@pytest.mark.parametrize("compression", [None, "lzf", "gzip"])
def test_round_trip_bit_exact(tmp_path, compression, version):
    rng = np.random.default_rng(0)
    run_a, bits_a = make_run("A", rng)
    run_b, bits_b = make_run("B", rng, names=NAMES[::-1])
    path = tmp_path / "sub" / "dir" / "t.h5"  # parents are created
    write_trace(path, [run_a, run_b], compression=compression, format_version=version)
    assert path.exists() and not list(tmp_path.rglob("*.partial-*"))
    with read_trace(path) as r:
        assert r.format_version == version
        assert r.runs == ["A", "B"]
        assert r.header == HEADER
        assert r.comparisons() == {"A_vs_B": {"n_diff": 3, "max_abs": math.inf, "points": ["a", "b"]}}
        for run, bits in ((run_a, bits_a), (run_b, bits_b)):
            got = r.run(run.name)
            assert got.name == run.name and got.token_ids == run.token_ids and got.window == (3, 8)
            assert got.plan == run.plan and got.meta == run.meta
            assert list(got.captures) == list(run.captures)  # execution order, not name order
            assert r.capture_names(run.name) == list(run.captures)
            for cap, rec in run.captures.items():
                g = got.captures[cap]
                assert g.tensor.dtype == rec.tensor.dtype and g.tensor.shape == rec.tensor.shape
                np.testing.assert_array_equal(tensor_bits(g.tensor), bits[cap])
                np.testing.assert_array_equal(tensor_bits(r.tensor(run.name, cap)), bits[cap])
                assert (g.kind, g.op, g.calls) == (rec.kind, rec.op, rec.calls)
                info = r.capture_info(run.name, cap)
                assert info == {"kind": rec.kind, "op": rec.op, "calls": rec.calls,
                                "dtype": str(rec.tensor.dtype).removeprefix("torch."), "shape": list(rec.tensor.shape)}


@pytest.mark.parametrize("version", READ_VERSIONS)
@pytest.mark.parametrize("name", NAMES)
def test_special_values_per_dtype_and_odd_shapes(tmp_path, name, version):
    rng = np.random.default_rng(1)
    tdtype = SPECIAL[name][0]
    big, big_bits = bits_tensor(name, (300, 1000), rng)  # several chunks
    caps = {
        "big": big,
        "empty": torch.empty((0, 7), dtype=tdtype),
        "vector": bits_tensor(name, (10,), rng)[0],
        "scalar": torch.tensor(-0.0, dtype=tdtype),
        "noncontig": big[:20, :30].t(),
        "3d": bits_tensor(name, (2, 3, 10), rng)[0],
    }
    # kind "tensor": not one whose rows the trace validator checks against the window
    run = RunRecord("A", [1], {}, (0, 1), {k: CaptureRecord(k, "tensor", v) for k, v in caps.items()})
    write_trace(tmp_path / "t.h5", [run], format_version=version)
    with read_trace(tmp_path / "t.h5") as r:
        for k, v in caps.items():
            got = r.tensor("A", k)
            assert got.dtype == tdtype and got.shape == v.shape, k
            np.testing.assert_array_equal(tensor_bits(got), tensor_bits(v))
        np.testing.assert_array_equal(tensor_bits(r.tensor("A", "big", rows=slice(100, 103))), big_bits[100:103])
        np.testing.assert_array_equal(tensor_bits(r.tensor("A", "big", rows=slice(290, 400))), big_bits[290:])
        np.testing.assert_array_equal(tensor_bits(r.tensor("A", "big", rows=slice(1, 9, 3))), big_bits[1:9:3])
        for cap, (_, handle) in r.captures("A").items():  # streamed in row blocks: the same bits
            blocks = list(read_row_blocks(handle, 7))
            if caps[cap].dim() and caps[cap].shape[0]:
                assert [b[0] for b in blocks] == list(range(0, caps[cap].shape[0], 7))
                np.testing.assert_array_equal(tensor_bits(torch.cat([b[1] for b in blocks])), tensor_bits(caps[cap]))
        lazy = r.run("A", load_tensors=False)
        assert lazy.captures["big"].tensor.device.type == "meta" and lazy.captures["big"].tensor.shape == (300, 1000)


def _readme_run():
    rng = np.random.default_rng(2)
    t, bits = bits_tensor("bfloat16", (4, 8), rng)
    half, half_bits = bits_tensor("float16", (4, 8), rng)
    logits, logit_bits = bits_tensor("float32", (4, 5), rng)
    run = RunRecord("A", [1, 2, 3, 4], {}, (0, 4), {
        "model.layers.0": CaptureRecord("model.layers.0", "layer", t),
        "model.layers.1": CaptureRecord("model.layers.1", "layer", half),
        "model.layers.2": CaptureRecord("model.layers.2", "layer", t[:0]),  # not captured: empty
        "model.layers.3": CaptureRecord("model.layers.3", "layer", t.flip(0)),
        "lm_head": CaptureRecord("lm_head", "logits", logits),
    })
    return run, {"model.layers.0": bits, "model.layers.1": half_bits, "model.layers.2": bits[:0],
                 "model.layers.3": bits[::-1], "lm_head": logit_bits}


def test_h5py_only_reading_per_readme(tmp_path):
    """Format version 3 (version 2's layout) read with plain h5py + numpy + zlib as traces/README.md describes it: the
    index, the tiling of data/<dtype>, each point's CRC-32 and its bits."""
    import zlib

    run, expected = _readme_run()
    path = tmp_path / "example.h5"
    write_trace(path, [run])
    with h5py.File(path, "r") as f:
        # string attributes are fixed-length UTF-8 (h5py gives bytes), see traces/README.md
        assert f.attrs["format"].decode() == FORMAT and f.attrs["format_version"] == FORMAT_VERSION == 3
        assert f.attrs["complete"]
        g = f["runs/A"]
        assert sorted(g) == ["data", "token_ids"] and sorted(g["data"]) == ["bfloat16", "float16", "float32"]
        index = json.loads(g.attrs["index"])
        assert [e["name"] for e in index] == list(run.captures)  # execution order
        ends: dict[str, int] = {}
        for e in index:
            n = int(np.prod(e["shape"]))
            assert e["offset"] == ends.get(e["dtype"], 0)  # the points tile their dataset
            ends[e["dtype"]] = e["offset"] + n
            raw = g["data"][e["dtype"]][e["offset"]:e["offset"] + n]
            assert zlib.crc32(raw.tobytes()) == e["crc32"]
            np.testing.assert_array_equal(raw.reshape(e["shape"]).view(expected[e["name"]].dtype), expected[e["name"]])
            assert e["kind"] == run.captures[e["name"]].kind and e["calls"] == []
        assert {k: v.shape[0] for k, v in g["data"].items()} == ends
        sums = json.loads(g.attrs["index_crc32"])
        text = g.attrs["index"]
        assert text == ("[" + ", ".join(json.dumps(e) for e in index) + "]").encode()
        pos = 1
        for (length, crc), e in zip(sums, index):
            assert zlib.crc32(text[pos:pos + length]) == crc and json.loads(text[pos:pos + length]) == e
            pos += length + 2
        as_f32 = (g["data/bfloat16"][:32].astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal((as_f32.view(np.uint32) >> 16).astype(np.uint16), expected["model.layers.0"].ravel())
        assert list(g.attrs["window"]) == [0, 4]
        assert json.loads(f["runs"].attrs["order"]) == ["A"]
        assert f["header"].attrs["model.name"].decode() == "tiny"  # flat copy for h5ls
        assert json.loads(f["header"].attrs["json"])["split_points"] == [3, 5]


def test_every_seal_is_the_crc_of_the_attributes_as_read_back(tmp_path):
    """The writer seals each object from the values it wrote (no read-back): every ``crc32`` must
    equal the CRC-32 of each attribute as h5py reads it (text as its bytes, numbers as numpy's dtype
    string and bytes; traces/README.md), for text, booleans, ints, floats and arrays."""
    import zlib

    def canonical(v):
        if isinstance(v, bytes):
            return b"b" + v
        if isinstance(v, str):
            return b"s" + v.encode()
        a = np.asarray(v)
        return a.dtype.str.encode() + a.tobytes()

    header = {**HEADER, "flag": True, "count": 7, "ratio": 0.5, "empty": "", "nested": {"deep": False, "n": -3}}
    run, _ = make_run("A", np.random.default_rng(0))
    path = tmp_path / "t.h5"
    with TraceWriter(path, header=header) as w:
        w.add_run(run)
        w.add_comparison("A_vs_B", {"n_diff": 3})
    seen = []
    with h5py.File(path, "r") as f:
        def check(name, obj):
            if "crc32" not in obj.attrs:
                return
            sums = json.loads(obj.attrs["crc32"])
            sums.pop("@data", None)
            names = [n for n in obj.attrs if n != "crc32" and not (obj.name == "/" and n == "complete")]
            assert sums == {n: zlib.crc32(canonical(obj.attrs[n])) for n in names}, name
            seen.append(name)
        check("/", f)
        f.visititems(check)
        assert f["header"].attrs["flag"] and f["header"].attrs["nested.n"] == -3
    assert {"/", "header", "runs", "runs/A", "runs/A/token_ids", "comparisons/A_vs_B"} <= set(seen)


def test_h5py_only_reading_of_version_1(tmp_path):
    """The kept version-1 writer: one dataset per capture point, read with plain h5py as the
    README's "Format version 1" describes, and by tracer bit for bit."""
    run, expected = _readme_run()
    path = tmp_path / "old.h5"
    write_trace(path, [run], format_version=1)
    with h5py.File(path, "r") as f:
        assert f.attrs["format_version"] == 1
        assert json.loads(f["runs/A"].attrs["capture_order"]) == list(run.captures)
        for name, bits in expected.items():
            ds = f[f"runs/A/captures/{name}"]
            assert ds.attrs["dtype"].decode() == str(run.captures[name].tensor.dtype).removeprefix("torch.")
            np.testing.assert_array_equal(ds[()].view(bits.dtype), bits)
    with read_trace(path) as r:
        assert r.format_version == 1
        for name, bits in expected.items():
            np.testing.assert_array_equal(tensor_bits(r.tensor("A", name)), bits)


def test_version_2_has_few_objects_whatever_the_number_of_points(tmp_path):
    counts = {}
    for n in (3, 60):
        caps = {f"p{i}": CaptureRecord(f"p{i}", "tensor", torch.full((2, 3), float(i), dtype=torch.bfloat16))
                for i in range(n)}
        path = tmp_path / f"{n}.h5"
        write_trace(path, [RunRecord("A", [1], {}, (0, 1), caps)])
        with h5py.File(path, "r") as f:
            names: list[str] = []
            f.visit(names.append)
        counts[n] = len(names)
        with read_trace(path) as r:
            assert [float(r.tensor("A", f"p{i}")[0, 0]) for i in range(n)] == [float(i) for i in range(n)]
    # header, comparisons + its entry, runs, runs/A, token_ids, data, data/bfloat16
    assert counts[3] == counts[60] == 8


def test_readme_snippet_runs_as_written(tmp_path):
    """The python block of traces/README.md, run verbatim on a trace, yields the stored bits."""
    readme = (Path(__file__).resolve().parents[2] / "traces" / "README.md").read_text()
    section = readme.split("## Reading a bf16 tensor without tracer", 1)[1]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    rng = np.random.default_rng(12)
    t, bits = bits_tensor("bfloat16", (3, 64), rng)
    run = RunRecord("A", [1, 2, 3], {}, (0, 3), {"model.layers.0": CaptureRecord("model.layers.0", "layer", t)})
    write_trace(tmp_path / "traces" / "example.h5", [run])
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        scope: dict = {}
        exec(code, scope)  # noqa: S102 - our own documentation
    finally:
        os.chdir(cwd)
    np.testing.assert_array_equal(tensor_bits(scope["x"]), bits)


# ---------------------------------------------------------------- atomic writing


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_overwrite_refused_leaves_existing_file(tmp_path):
    rng = np.random.default_rng(3)
    path = tmp_path / "t.h5"
    write_trace(path, [make_run("A", rng)[0]])
    before = sha(path)
    with pytest.raises(TracerError, match="exists; pass --overwrite or choose another --output"):
        TraceWriter(path, header=HEADER)
    assert sha(path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.h5"]


def test_overwrite_replaces_only_when_complete(tmp_path):
    rng = np.random.default_rng(4)
    path = tmp_path / "t.h5"
    write_trace(path, [make_run("A", rng)[0]])
    before = sha(path)
    with pytest.raises(RuntimeError):
        with TraceWriter(path, header=HEADER, overwrite=True) as w:
            w.add_run(make_run("B", rng)[0])
            assert sha(path) == before  # not replaced while writing
            raise RuntimeError("boom")
    assert sha(path) == before
    write_trace(path, [make_run("B", rng)[0]], overwrite=True)
    with read_trace(path) as r:
        assert r.runs == ["B"]


def test_exception_leaves_no_file(tmp_path):
    rng = np.random.default_rng(5)
    path = tmp_path / "t.h5"
    with pytest.raises(RuntimeError, match="boom"):
        with TraceWriter(path, header=HEADER) as w:
            w.add_run(make_run("A", rng)[0])
            assert w.partial_path.exists()
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_partial_file_is_marked_incomplete_while_writing(tmp_path):
    rng = np.random.default_rng(6)
    path = tmp_path / "t.h5"
    w = TraceWriter(path, header=HEADER)
    w.add_run(make_run("A", rng)[0])
    w._ops.file.flush()
    with pytest.raises(TracerError, match="incomplete"):
        read_trace(w.partial_path)
    w.close()
    assert not w.partial_path.exists()
    with read_trace(path) as r:
        assert r.runs == ["A"]


def test_writer_validation(tmp_path):
    rng = np.random.default_rng(7)
    with pytest.raises(TracerError, match="compression"):
        TraceWriter(tmp_path / "a.h5", header={}, compression="zstd")
    with pytest.raises(TracerError, match="JSON"):
        TraceWriter(tmp_path / "a.h5", header={"x": object()})
    with pytest.raises(TracerError, match="folder"):
        TraceWriter(tmp_path, header={})
    run, _ = make_run("A", rng)
    with pytest.raises(TracerError, match="already"):
        with TraceWriter(tmp_path / "b.h5", header={}) as w:
            w.add_run(run)
            w.add_run(run)
    bad = RunRecord("A/B", [1], {}, (0, 1), {})
    with pytest.raises(TracerError, match="not a valid trace name"):
        with TraceWriter(tmp_path / "c.h5", header={}) as w:
            w.add_run(bad)
    ints = RunRecord("A", [1], {}, (0, 1), {
        "ok": CaptureRecord("ok", "layer", torch.zeros(2)),
        "x": CaptureRecord("x", "layer", torch.zeros(2, dtype=torch.int32)),
    })
    with pytest.raises(TracerError, match="int32"):
        with TraceWriter(tmp_path / "d.h5", header={}) as w:
            w.add_run(ints)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # a refused run leaves the trace as it was: the writer can go on
    with TraceWriter(tmp_path / "e.h5", header={}) as w:
        with pytest.raises(TracerError, match="int32"):
            w.add_run(ints)
        w.add_run(run)
    with read_trace(tmp_path / "e.h5") as r, h5py.File(tmp_path / "e.h5", "r") as f:
        assert r.runs == ["A"] and list(f["runs"]) == ["A"] and len(r.capture_names("A")) == 6


# ---------------------------------------------------------------- reader errors


def test_reader_missing(tmp_path):
    with pytest.raises(TracerError, match=r"trace file .*nope\.h5 not found"):
        read_trace(tmp_path / "nope.h5")


def test_reader_garbage_and_truncated(tmp_path):
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(TracerError, match=r"is not a readable HDF5 file \(truncated or corrupt\?\); pass a trace written by"):
        read_trace(garbage)
    good = tmp_path / "good.h5"
    write_trace(good, [make_run("A", np.random.default_rng(8))[0]])
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(good.read_bytes()[:1000])
    with pytest.raises(TracerError, match="truncated or corrupt"):
        read_trace(truncated)


def _plain_h5(path, **attrs):
    with h5py.File(path, "w") as f:
        for k, v in attrs.items():
            f.attrs[k] = v
        f.create_group("header").attrs["json"] = "{}"
        f.create_group("runs").attrs["order"] = "[]"


def test_reader_not_a_trace(tmp_path):
    path = tmp_path / "plain.h5"
    _plain_h5(path)
    with pytest.raises(TracerError, match="is not a tracer trace"):
        read_trace(path)


def test_reader_wrong_version(tmp_path):
    path = tmp_path / "v99.h5"
    _plain_h5(path, format=FORMAT, format_version=99, complete=True)
    with pytest.raises(TracerError, match=r"format_version 99; this tracer reads version 1") as e:
        read_trace(path)
    assert all(str(v) in str(e.value) for v in READ_VERSIONS)


def test_reader_incomplete(tmp_path):
    path = tmp_path / "inc.h5"
    _plain_h5(path, format=FORMAT, format_version=FORMAT_VERSION, complete=False)
    with pytest.raises(TracerError, match="is incomplete: the run that wrote it did not finish; re-run it"):
        read_trace(path)
    _plain_h5(path, format=FORMAT, format_version=FORMAT_VERSION)  # no complete attribute at all
    with pytest.raises(TracerError, match="incomplete"):
        read_trace(path)


def test_reader_unknown_run_and_capture(tmp_path):
    path = tmp_path / "t.h5"
    write_trace(path, [make_run("A", np.random.default_rng(9))[0], make_run("B", np.random.default_rng(10))[0]])
    with read_trace(path) as r:
        with pytest.raises(TracerError, match="run 'C' not in .*available runs: A, B"):
            r.run("C")
        with pytest.raises(TracerError, match="capture 'nope' not in run 'A'; available: model.embed_tokens"):
            r.tensor("A", "nope")
    with pytest.raises(TracerError, match="closed"):
        r.run("A")


# ---------------------------------------------------------------- environment header


def test_collect_environment_is_json_and_merges_extra():
    env = collect_environment("cpu", {"model": "tiny", "block_size": 16, "torch": "overridden"})
    assert json.loads(json.dumps(env)) == env
    for key in ("python", "numpy", "h5py", "tracer_version", "hostname", "cpu", "device_name",
                "matmul_allow_tf32", "matmul_allow_bf16_reduced_precision_reduction",
                "matmul_allow_fp16_reduced_precision_reduction", "cudnn_allow_tf32",
                "deterministic_algorithms", "CUBLAS_WORKSPACE_CONFIG", "num_threads", "float32_matmul_precision",
                "cuda", "cudnn", "cublas", "driver", "device_capability"):
        assert key in env, key
    assert env["model"] == "tiny" and env["block_size"] == 16 and env["torch"] == "overridden"
    assert env["num_threads"] == torch.get_num_threads()
    assert env["deterministic_algorithms"] == torch.are_deterministic_algorithms_enabled()
    with pytest.raises(TracerError, match="JSON"):
        collect_environment("cpu", {"bad": {1, 2}})


def test_environment_header_round_trip(tmp_path):
    env = collect_environment("cpu", {"model": {"name": "tiny", "weights_sha256": "00ff"}, "split_points": [16, 32]})
    run = RunRecord("A", [1], {}, (0, 1), {})
    with TraceWriter(tmp_path / "t.h5", header=env) as w:
        w.add_run(run)
    with read_trace(tmp_path / "t.h5") as r:
        assert r.header == env and r.runs == ["A"] and r.run("A").captures == {}
    with h5py.File(tmp_path / "t.h5", "r") as f:
        assert f["header"].attrs["torch"].decode() == torch.__version__  # flat copy, a plain string
        assert f["header"].attrs["model.weights_sha256"].decode() == "00ff"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_collect_environment_cuda():
    env = collect_environment("cuda")
    assert env["device_name"] == torch.cuda.get_device_name(0)
    major, minor = torch.cuda.get_device_capability(0)
    assert env["device_capability"] == f"{major}.{minor}" and env["cuda"] == torch.version.cuda


# ---------------------------------------------------------------- background writer (issue 6)

def _bg_run(name: str, seed: int) -> RunRecord:
    g = torch.Generator().manual_seed(seed)
    caps = {}
    for i, dt in enumerate((torch.bfloat16, torch.float16, torch.float32, torch.float64)):
        t = torch.randn(64, 96, generator=g).to(dt)
        caps[f"model.layers.{i}"] = CaptureRecord(name=f"model.layers.{i}", kind="layer", tensor=t,
                                                  calls=[{"positions": [0, 64]}], op="Block")
    return RunRecord(name=name, token_ids=list(range(64)), plan={"chunks": [[0, 64]]}, window=(0, 64), captures=caps)


def test_background_writer_equals_synchronous_write(tmp_path):
    runs = [_bg_run("A", 1), _bg_run("B", 2)]
    paths = {}
    for background in (False, True):
        paths[background] = tmp_path / f"bg-{background}.h5"
        with TraceWriter(paths[background], header={"x": 1}, background=background) as w:
            for r in runs:
                w.add_run(r)
    from tracer.store.trace import TraceReader

    with TraceReader(paths[False]) as s, TraceReader(paths[True]) as b:
        assert s.runs == b.runs == ["A", "B"]
        for run in s.runs:
            assert s.capture_names(run) == b.capture_names(run)
            for name in s.capture_names(run):
                ts, tb = s.tensor(run, name), b.tensor(run, name)
                assert ts.dtype == tb.dtype
                # byte-identical: compare the raw bytes of both datasets
                assert ts.contiguous().view(torch.uint8).equal(tb.contiguous().view(torch.uint8))


@pytest.mark.parametrize("background", [True, "process"])
def test_exception_in_forward_leaves_no_writer_thread_and_no_complete_file(tmp_path, background):
    import threading

    path = tmp_path / "planted.h5"
    with pytest.raises(RuntimeError, match="planted"):
        with TraceWriter(path, header={"x": 1}, background=background) as w:
            w.add_run(_bg_run("A", 1))  # written in the background while "run B" executes
            raise RuntimeError("planted failure inside the forward of run B")
    assert not path.exists()
    assert not list(tmp_path.glob("planted.h5.partial-*"))
    assert not [t for t in threading.enumerate() if t.name.startswith("tracer-writer")]


@pytest.mark.parametrize("background", [True, "process"])
def test_ready_callback_runs_on_the_writer_thread_before_the_write(tmp_path, background):
    """add_run(ready=...) (used to wait for non-blocking device-to-host copies) is called on the
    writing thread before the run is read; a failing ready aborts the trace."""
    import threading

    seen = []
    run = _bg_run("A", 1)
    original = run.captures

    class Watched(dict):
        def items(self):  # the writer reads the captures through items()
            seen.append(("read", threading.current_thread().name))
            return super().items()

    run.captures = Watched(original)
    path = tmp_path / "ready.h5"
    with TraceWriter(path, header={"x": 1}, background=background) as w:
        w.add_run(run, ready=lambda: seen.append(("ready", threading.current_thread().name)))
    assert [s[0] for s in seen[:2]] == ["ready", "read"]
    assert seen[0][1].startswith("tracer-writer") and seen[0][1] == seen[1][1]

    def broken():
        raise RuntimeError("planted: copy failed")

    bad = tmp_path / "broken.h5"
    with pytest.raises(RuntimeError, match="planted"):
        with TraceWriter(bad, header={"x": 1}, background=background) as w:
            w.add_run(_bg_run("A", 1), ready=broken)
    assert not bad.exists() and not list(tmp_path.glob("broken.h5.partial-*"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_read_and_host_copies_are_bit_exact(tmp_path):
    from tracer.execute.capture import host_copies
    from tracer.execute.records import CaptureRecord
    from tracer.store.trace import TraceReader

    run = _bg_run("A", 3)
    with TraceWriter(tmp_path / "p.h5", header={"x": 1}) as w:
        w.add_run(run)
    with TraceReader(tmp_path / "p.h5") as r:
        for name in r.capture_names("A"):
            plain, pinned = r.tensor("A", name), r.tensor("A", name, pin=True)
            assert pinned.is_pinned() and pinned.dtype == plain.dtype
            assert pinned.view(torch.uint8).equal(plain.contiguous().view(torch.uint8))
    caps = {n: CaptureRecord(name=n, kind=c.kind, tensor=c.tensor.cuda(), calls=c.calls, op=c.op)
            for n, c in run.captures.items()}
    host, wait = host_copies(caps)
    wait()
    for n, c in run.captures.items():
        assert host[n].tensor.device.type == "cpu" and host[n].tensor.is_pinned()
        assert host[n].tensor.view(torch.uint8).equal(c.tensor.contiguous().view(torch.uint8))


def test_a_second_open_gets_its_own_copy_of_the_validated_index(tmp_path):
    """The validation of an unchanged file is kept per process; each open gets its own index
    entries (changing one reader's entries changes no later reader's), and a file written since
    is validated again."""
    from tracer.store.reader import TraceReader

    rng = np.random.default_rng(3)
    path = tmp_path / "t.h5"
    write_trace(path, [make_run("A", rng)[0]])
    with TraceReader(path) as first:
        name = next(iter(first._entries["A"]))
        want = dict(first._entries["A"][name])
        first._entries["A"][name]["shape"] = "changed by the caller"
    with TraceReader(path) as second:
        assert second._entries["A"][name] == want
    write_trace(path, [make_run("B", rng)[0]], overwrite=True)
    with TraceReader(path) as third:
        assert list(third._entries) == ["B"]


def test_a_trace_replaced_while_it_is_opened_is_refused_not_cached(tmp_path, monkeypatch):
    """A finished run renames its trace onto the path, maybe while a reader is opening the old file:
    that open is refused in one line (what HDF5 validated is not what the reader would read), and
    the next open validates the new file on its own (its own runs, not the old file's entries)."""
    import os
    import shutil

    import tracer.store.heap as heap
    from tracer.errors import TracerError
    from tracer.store.reader import TraceReader

    rng = np.random.default_rng(4)
    path, other = tmp_path / "t.h5", tmp_path / "other.h5"
    write_trace(path, [make_run("A", rng)[0]])
    write_trace(other, [make_run("B", rng)[0]])
    check = heap.check_heap

    def finished_meanwhile(*a, **k):
        check(*a, **k)
        monkeypatch.setattr(heap, "check_heap", check)  # once
        shutil.copy(other, str(path) + ".partial")
        os.replace(str(path) + ".partial", path)

    monkeypatch.setattr(heap, "check_heap", finished_meanwhile)
    with pytest.raises(TracerError, match="was replaced while it was being opened"):
        TraceReader(path)
    with TraceReader(path) as r:
        assert r.runs == ["B"] and list(r._entries) == ["B"]
