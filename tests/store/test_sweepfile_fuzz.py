"""Issue 24 items 4 and 8: seeded mutation fuzz of a sweep file, as for traces.

Two modes:

- **raw**: bit flips, random bytes, zeroed blocks, truncations anywhere in the file. Every outcome
  must be the original answer or a one-line TracerError (on main before issue 24, 160 such
  mutations gave 12 silent wrong answers, 79 exit 3 and 2 hangs).
- **re-sealed**: a value edited (a dataset element, a JSON attribute, a root attribute) with every
  checksum recomputed, as the public spec allows anyone to. The answer may then differ, but it
  must be an answer or a one-line TracerError: never a traceback, a hang or a crash.

A worker process (restarted after a hang or crash) reads each mutated copy the way ``tracer report``
and ``tracer plot`` do (read, summary lines, JSON document, the divergence map); the parent
bounds each case with a timeout.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import Worker, cli_session, write_sweep_v1, zero_heap_free_space

N_RAW = int(os.environ.get("TRACER_SWEEP_FUZZ_CASES", "180"))
N_RESEALED = int(os.environ.get("TRACER_SWEEP_RESEAL_CASES", "100"))
N_V1 = int(os.environ.get("TRACER_SWEEP_V1_CASES", "80"))
SEED = 24
CASE_TIMEOUT_S = 20.0
POINTS = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
KINDS = ["embedding", "layer", "layer", "final_norm", "logits"]


def outcome(path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import tracer
    from tracer.errors import TracerError
    from tracer.report.figures.sweep import sweep_figure
    from tracer.report.sweep_lines import sweep_summary_lines

    try:
        r = tracer.read_sweep(path)
        lines = sweep_summary_lines(r)
        doc = json.dumps({k: v for k, v in r.summary().items() if k != "path"}, default=str, sort_keys=True)
        if r.rows:
            fig = sweep_figure(r)
            drawn = repr(sorted((k, np.asarray(v).tolist()) for k, v in fig.tracer_data.items()
                                if isinstance(v, (list, np.ndarray))))
            plt.close(fig)
        else:
            drawn = ""
        return "ok", repr((lines, doc, drawn))
    except TracerError as e:
        return "error", str(e)
    except Exception as e:  # noqa: BLE001 - the fuzz reports it as a failure
        return "exception", f"{type(e).__name__}: {e}"


def _worker(conn) -> None:
    while True:
        path = conn.recv()
        if path is None:
            return
        conn.send(outcome(path))


def _rows():
    """Consistent rows for lengths 17..21 at block sizes 8 and 16 (some diverging)."""
    from tracer.store.sweepfile import SweepRow

    rows = []
    for b in (8, 16):
        for n in range(17, 22):
            diverges = (n + b) % 3 == 0
            nd = (0, 0, 5 * n, 7 * n, 100) if diverges else (0,) * 5
            nt = (64 * 4, 64 * 4, 64 * 4, 64 * 4, 512 * 4)
            mad = tuple(0.0 if d == 0 else 0.01 * (i + 1) for i, d in enumerate(nd))
            rows.append(SweepRow(length=n, block_size=b, split_at=n - 4, n_positions=4,
                                 first_divergent=2 if diverges else -1, n_diff=nd, n_total=nt, max_abs_diff=mad,
                                 last_layer_fraction=nd[2] / nt[2], logits_max_abs_diff=mad[-1],
                                 argmax_flips=1 if diverges and n % 2 else 0, wall_s=0.5 + n / 100))
    return rows


@pytest.fixture(scope="module")
def sweep_file(tmp_path_factory) -> Path:
    from tracer.store.sweepfile import SweepFile

    path = tmp_path_factory.mktemp("fuzz") / "s.h5"
    params = {"model": "tiny-llama", "scenario": "prefix-cache", "mitigation": None, "granularity": "layers",
              "dtype": "bfloat16", "device": "cpu", "attn": "sdpa", "lengths": list(range(17, 22)),
              "block_sizes": [8, 16], "keep_tensors": False, "prompt_sha256": "ab" * 32}
    sf = SweepFile(path, params, {"tool": "fuzz"})
    for row in _rows():
        sf.append(row, POINTS, KINDS)
    sf.finish(True)
    sf.close()
    return path


def test_a_written_sweep_reads_back_exactly(sweep_file):
    import tracer

    r = tracer.read_sweep(sweep_file)
    assert r.rows == _rows() and r.points == POINTS and r.complete and r.verified


def _mutate(data: bytearray, rng: random.Random) -> tuple[bytearray, str]:
    out = bytearray(data)
    kind = rng.choice(("flip", "byte", "zero", "truncate"))
    at = rng.randrange(len(out))
    if kind == "flip":
        out[at] ^= 1 << rng.randrange(8)
    elif kind == "byte":
        out[at] = rng.randrange(256)
    elif kind == "zero":
        n = rng.randrange(1, 256)
        out[at:at + n] = bytes(len(out[at:at + n]))
    else:
        del out[at:]
    return out, f"{kind}@{at}"


def _run(worker: Worker, cases, original: str, tmp_path: Path, same_or_error: bool) -> dict:
    bad, counts = [], {"ok": 0, "error": 0, "other answer": 0}
    for i, (path, what) in enumerate(cases):
        status, detail = worker.ask(str(path), CASE_TIMEOUT_S)
        if status == "ok" and detail == original:
            counts["ok"] += 1
        elif status == "error" and detail and "\n" not in detail:
            counts["error"] += 1
        elif status == "ok" and not same_or_error:
            counts["other answer"] += 1
        else:
            bad.append((i, what, status, detail[:300] if status != "ok" else "a different answer"))
            shutil.copy(path, tmp_path / f"bad-{i}.h5")
    assert not bad, f"{len(bad)} mutation(s) gave a wrong answer, traceback, hang or crash: {bad[:5]}"
    print(json.dumps(counts))
    return counts


def test_raw_mutations_give_the_original_result_or_one_line_error(sweep_file, tmp_path):
    worker = Worker(_worker)
    try:
        status, original = worker.ask(str(sweep_file), 120)
        assert status == "ok", original
        data = bytearray(sweep_file.read_bytes())
        rng = random.Random(SEED)

        def cases():
            case = tmp_path / "case.h5"
            for _ in range(N_RAW):
                mutated, what = _mutate(data, rng)
                case.write_bytes(mutated)
                yield case, what

        counts = _run(worker, cases(), original, tmp_path, same_or_error=True)
        assert counts["error"] > N_RAW // 4, counts  # most mutations hit data or metadata and are caught
    finally:
        worker.close()


# ---------------------------------------------------------------- re-sealed tampering

_WILD = [0, -1, 1, 2**62, -(2**62), 2**31, 17, 1e308, float("inf"), float("-inf"), float("nan"), 0.5, -0.5]
_JSON = ["x", 5, None, True, [], {}, [1, 2], {"a": 1}, -1, 2**70, 1.5, [[[[]]]], "é", ["x"] * 3]


def _reseal(path: Path, rng: random.Random) -> str:
    """Edit one value in place and recompute every checksum that covers it."""
    import h5py

    from tracer.store.crc import crc32_bytes
    from tracer.store.integrity import seal, set_text

    with h5py.File(path, "r+") as f:
        g = f["sweep"]
        index = json.loads(g.attrs["index"])
        target = rng.choice(("dataset", "dataset", "dataset", "json", "json", "index", "root"))
        if target == "dataset":
            name = rng.choice(sorted(index["crc32"]))
            ds = g[name]
            flat = ds[:].reshape(-1)
            i = rng.randrange(len(flat))
            v = rng.choice(_WILD if ds.dtype.kind == "f" else [x for x in _WILD if isinstance(x, int)])
            flat[i] = v
            ds[...] = flat.reshape(ds.shape)
            n = index["n_done"]
            index["crc32"][name] = crc32_bytes(np.ascontiguousarray(ds[:n]).astype(ds.dtype.newbyteorder("<")))
            set_text(g, "index", json.dumps(index))
            what = f"{name}[{i}] = {v}"
        elif target == "json":
            key = rng.choice(("params", "points", "kinds"))
            doc = json.loads(g.attrs[key])
            v = rng.choice(_JSON)
            if isinstance(doc, dict) and doc:
                k = rng.choice(sorted(doc))
                doc[k] = v
                what = f"{key}.{k} = {v!r}"
            elif isinstance(doc, list) and doc:
                j = rng.randrange(len(doc))
                doc[j] = v
                what = f"{key}[{j}] = {v!r}"
            else:
                doc, what = v, f"{key} = {v!r}"
            set_text(g, key, json.dumps(doc))
        elif target == "index":
            k = rng.choice(("n_done", "columns", "crc32"))
            v = rng.choice(_JSON + [index["n_done"] + 1, index["n_done"] - 1, 10**9])
            index[k] = v
            set_text(g, "index", json.dumps(index))
            what = f"index.{k} = {v!r}"
        else:
            k = rng.choice(("format_version", "created", "tool_version"))
            if k == "format_version":
                f.attrs[k] = np.int64(rng.choice([0, 1, 3, -1, 2**40]))
            else:
                set_text(f, k, rng.choice(["", "x" * 300, "\x1b[31mred"]))
            seal(f)
            what = f"root {k}"
        seal(g)
    return what


def test_resealed_tampering_gives_an_answer_or_one_line_error(sweep_file, tmp_path):
    worker = Worker(_worker)
    try:
        status, original = worker.ask(str(sweep_file), 120)
        assert status == "ok", original
        rng = random.Random(SEED + 1)

        def cases():
            case = tmp_path / "case.h5"
            for _ in range(N_RESEALED):
                shutil.copy(sweep_file, case)
                yield case, _reseal(case, rng)

        counts = _run(worker, cases(), original, tmp_path, same_or_error=False)
        assert counts["error"] > N_RESEALED // 3, counts  # the validation refuses most edits by their values
    finally:
        worker.close()


# ---------------------------------------------------------------- the reproducers of issue 24, by name


def _chunk_offset(path: Path, name: str) -> int:
    import h5py

    with h5py.File(path, "r") as f:
        return f["sweep"][name].id.get_chunk_info(0).byte_offset


def _read_error(path: Path) -> str:
    import tracer
    from tracer.errors import TracerError

    with pytest.raises(TracerError) as e:
        tracer.read_sweep(path)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_flipped_bit_in_length_is_a_checksum_error(sweep_file, tmp_path):
    """One flipped bit in /sweep/length showed N = 21 for a sweep that ran N = 17."""
    data = bytearray(sweep_file.read_bytes())
    data[_chunk_offset(sweep_file, "length")] ^= 1 << 2  # 17 -> 21
    (tmp_path / "c.h5").write_bytes(data)
    assert "/sweep/length fails its checksum" in _read_error(tmp_path / "c.h5")


def test_a_moved_first_divergent_is_caught_raw_and_resealed(sweep_file, tmp_path):
    """One bit in /sweep/first_divergent moved the origin to model.embed_tokens."""
    import h5py

    from tracer.store.crc import crc32_bytes
    from tracer.store.integrity import seal, set_text

    data = bytearray(sweep_file.read_bytes())
    at = _chunk_offset(sweep_file, "first_divergent") + 8 * next(i for i, r in enumerate(_rows()) if r.diverged)
    data[at] ^= 0b10  # 2 -> 0
    (tmp_path / "c.h5").write_bytes(data)
    assert "/sweep/first_divergent fails its checksum" in _read_error(tmp_path / "c.h5")
    shutil.copy(sweep_file, tmp_path / "r.h5")
    with h5py.File(tmp_path / "r.h5", "r+") as f:  # the same edit with every checksum recomputed
        g = f["sweep"]
        fd = g["first_divergent"][:]
        fd[fd >= 0] = 0
        g["first_divergent"][...] = fd
        index = json.loads(g.attrs["index"])
        index["crc32"]["first_divergent"] = crc32_bytes(fd.astype("<i8"))
        set_text(g, "index", json.dumps(index))
        seal(g)
    assert "first_divergent is the first column whose n_diff is not 0" in _read_error(tmp_path / "r.h5")


def test_zeroed_max_abs_diff_is_caught(sweep_file, tmp_path):
    """Zeroed bytes in max_abs_diff showed rows with max |Δ| 0 and thousands of differing elements."""
    data = bytearray(sweep_file.read_bytes())
    at = _chunk_offset(sweep_file, "max_abs_diff")
    data[at:at + 8 * 5 * 10] = bytes(8 * 5 * 10)
    (tmp_path / "c.h5").write_bytes(data)
    assert "/sweep/max_abs_diff fails its checksum" in _read_error(tmp_path / "c.h5")


def test_a_variable_length_string_is_refused_before_it_is_read(sweep_file, tmp_path):
    """A zeroed global-heap header made report and plot hang forever: a version-2 sweep holds no
    variable-length string, and one put there (re-sealed) is refused by its type, unread."""
    import h5py

    from tracer.store.integrity import seal

    shutil.copy(sweep_file, tmp_path / "v.h5")
    with h5py.File(tmp_path / "v.h5", "r+") as f:
        g = f["sweep"]
        text = g.attrs["points"].decode()
        del g.attrs["points"]
        g.attrs["points"] = text  # h5py writes a str as a variable-length string
        seal(g)
    assert "variable-length string" in _read_error(tmp_path / "v.h5")
    with h5py.File(sweep_file, "r") as f:
        def walk(name, obj):
            for k in obj.attrs:
                t = obj.attrs.get_id(k).get_type()
                assert not (isinstance(t, h5py.h5t.TypeStringID) and t.is_variable_str()), (name, k)
        f.visititems(walk)
        walk("/", f)


def test_format_1_sweep_is_read_unverified_and_not_resumed(tmp_path):
    """A sweep written before checksums still reads (values range-checked, verified=False) and is not
    resumed (--overwrite starts a checksummed one)."""
    import tracer
    from tracer.errors import TracerError
    from tracer.store.sweepfile import SweepFile

    rows = _rows()
    params = {"model": "m", "scenario": "prefix-cache", "mitigation": None, "granularity": "layers", "dtype": "bfloat16",
              "device": "cpu", "attn": "sdpa", "lengths": list(range(17, 22)), "block_sizes": [8, 16],
              "keep_tensors": False, "prompt_sha256": "cd" * 32}
    path = write_sweep_v1(tmp_path / "v1.h5", rows, params, POINTS, KINDS)  # the layout before issue 24
    r = tracer.read_sweep(path)
    assert r.rows == rows and not r.verified
    with pytest.raises(TracerError, match="does not resume"):
        SweepFile(path, params, {})


# ---------------------------------------------------------------- format 1: the global heap (issue 37 item 1)

_V1_PARAMS = {"model": "m", "scenario": "prefix-cache", "mitigation": None, "granularity": "layers", "dtype": "bfloat16",
              "device": "cpu", "attn": "sdpa", "lengths": list(range(17, 22)), "block_sizes": [8, 16],
              "keep_tensors": False, "prompt_sha256": "cd" * 32}


def test_a_zeroed_heap_header_is_refused_in_one_line_by_report_and_plot(tmp_path):
    """A format-1 sweep whose global heap's free-space header is zeroed: 'tracer report' and 'tracer plot'
    printed a progress line, then never returned, and ignored SIGTERM (HDF5 loops holding the GIL). The
    collection is checked before HDF5 loads it: one line, exit 2, no output file."""
    import os

    path = write_sweep_v1(tmp_path / "v1.h5", _rows(), _V1_PARAMS, POINTS, KINDS)
    at = zero_heap_free_space(path)
    assert "zeroed header" in _read_error(path) and str(at) in _read_error(path)
    env = {**os.environ, "TRACER_PROGRESS": "off", "COLUMNS": "200"}
    done = cli_session([["report", str(path), "-o", str(tmp_path / "r.html")],
                        ["plot", str(path), "-o", str(tmp_path / "p.png")]], env, tmp_path, timeout=300)
    for proc in done:
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and "global heap collection" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1.h5"]


def test_a_heap_that_hangs_hdf5_is_refused_by_the_probe(tmp_path, monkeypatch):
    """Whatever makes HDF5 loop on the heap, this process never reads it before a forked child did within
    PROBE_S seconds: here the structural check is switched off, and the child that hangs is killed."""
    import time

    from tracer.store import heap

    path = write_sweep_v1(tmp_path / "v1.h5", _rows(), _V1_PARAMS, POINTS, KINDS)
    zero_heap_free_space(path)
    monkeypatch.setattr(heap, "collection_problem", lambda p: None)
    monkeypatch.setattr(heap, "PROBE_S", 2.0)
    t0 = time.monotonic()
    assert "did not finish reading its variable-length texts in 2 s" in _read_error(path)
    assert time.monotonic() - t0 < 30


def test_mutations_of_a_format_1_sweep_give_an_answer_or_one_line_error(tmp_path):
    """Format 1 has no checksums, so an edited value may give another answer; but never a traceback, a
    hang or a crash. Half the mutations land in the global heap collection that holds its texts
    (where a zeroed header hung HDF5), half anywhere."""
    import struct

    path = write_sweep_v1(tmp_path / "v1.h5", _rows(), _V1_PARAMS, POINTS, KINDS)
    data = bytearray(path.read_bytes())
    at = data.find(b"GCOL\x01\x00\x00\x00")
    (size,) = struct.unpack_from("<Q", data, at + 8)
    worker = Worker(_worker)
    try:
        status, original = worker.ask(str(path), 120)
        assert status == "ok", original
        rng = random.Random(SEED + 2)

        def cases():
            case = tmp_path / "case.h5"
            for i in range(N_V1):
                if i % 2:
                    mutated, what = _mutate(data, rng)
                else:  # inside the heap collection: its header, an object header, a text
                    mutated, what = _mutate(data[at:at + size], rng)
                    mutated, what = data[:at] + mutated.ljust(size, b"\0")[:size] + data[at + size:], "heap " + what
                case.write_bytes(mutated)
                yield case, what

        counts = _run(worker, cases(), original, tmp_path, same_or_error=False)
        assert counts["error"] > N_V1 // 5, counts
    finally:
        worker.close()
