"""Issue 24 item 3: every file input through one gate (regular files only, bounded), and no bomb in a
dump allocates before its declared size is checked.

Bomb cases run in a subprocess under ``RLIMIT_AS`` (2.5 GB of address space), so a regression
fails the test (MemoryError, exit 3) instead of taking the shared machine to its last page. Every
case also runs under a timeout, so a regression that blocks on a FIFO fails instead of hanging.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CAP = 2_500_000_000  # bytes of address space for the bomb cases (tracer + torch need ~0.7 GB)


def capped_cases(cases: dict[str, str], cap: int = CAP, timeout: float = 240) -> dict[str, str]:
    """Run every ``case -> expression`` in ONE fresh interpreter under RLIMIT_AS; return each case's
    TracerError message (or ``"EXC <type>: ..."`` / ``"NO ERROR"``). A MemoryError or any other
    exception of one case is recorded, not fatal; a hang fails every case (the timeout)."""
    import json

    prog = ("import resource, sys, json\n"
            f"resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))\n"
            f"sys.path.insert(0, {str(ROOT)!r})\n"
            "from tracer.errors import TracerError\n"
            "from tracer.engines.dumps.read import read_dump\n"
            "from tracer.engines.dumps.rules import load_engine_map\n"
            "from tracer.engines.dumps.namemap import RefLayout, map_dump\n"
            "REF = RefLayout(names={'model.embed_tokens': ('embedding', 'Embedding', (64,), 'bfloat16')},\n"
            "                layer_prefix='model.layers', n_layers=0, token_ids=[0] * 100, window=(0, 100), family='llama')\n"
            f"cases = {json.dumps(cases)}\n"
            "out = {}\n"
            "for name, expr in cases.items():\n"
            "    try:\n"
            "        eval(expr)\n"
            "        out[name] = 'NO ERROR'\n"
            "    except TracerError as e:\n"
            "        out[name] = str(e)\n"
            "    except BaseException as e:\n"
            "        out[name] = f'EXC {type(e).__name__}: {e}'[:300]\n"
            "print(json.dumps(out))\n")
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _one_line(msg: str) -> str:
    assert "\n" not in msg and msg != "NO ERROR" and not msg.startswith("EXC "), msg
    return msg


# ---------------------------------------------------------------- bombs (under a memory cap)


def _zip_member(path: Path, name: str, payload_head: bytes, zero_blocks: int, block: int = 16 << 20) -> int:
    """Write a zip whose one deflated member is ``payload_head`` followed by ``zero_blocks`` × ``block``
    zero bytes, built from one compressed block repeated (a few MB on disk); returns the member's
    declared (uncompressed) size. The CRC is left 0: a reader that inflated it would fail only at
    the end, after allocating everything."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = c.compress(payload_head) + c.flush(zlib.Z_FULL_FLUSH)
    zeros = bytes(block)
    blk = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    tail = c.flush()
    data = head + blk * zero_blocks + tail
    usize = len(payload_head) + zero_blocks * block
    fname = name.encode()
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0, 0, len(data), usize, len(fname), 0) + fname
    central = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0, 0, len(data), usize, len(fname),
                          0, 0, 0, 0, 0, 0) + fname
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 1, 1, len(central), len(local) + len(data), 0)
    path.write_bytes(local + data + central + end)
    return usize


def _npy_header(shape: tuple[int, ...], descr: str = "<f2") -> bytes:
    from numpy.lib import format as npf
    import io

    buf = io.BytesIO()
    npf.write_array_header_1_0(buf, {"descr": descr, "fortran_order": False, "shape": shape})
    return buf.getvalue()


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> dict[str, tuple[Path | str, str]]:
    """Every hostile input of this file, read in one capped interpreter: case -> (path, message)."""
    import zipfile

    d = tmp_path_factory.mktemp("hostile")
    paths: dict[str, Path | str] = {}
    blocks = 178  # ~1.5e9 float16 zeros (3 GB) declared by a few-MB .npz
    paths["npz_bomb"] = d / "bomb.npz"
    _zip_member(paths["npz_bomb"], "x.npy", _npy_header((blocks * (16 << 20) // 2,)), blocks)
    paths["npy_trillion"] = d / "huge.npz"
    with zipfile.ZipFile(paths["npy_trillion"], "w") as z:
        z.writestr("input_ids.npy", _npy_header((3,), "<i8") + np.arange(3, dtype="<i8").tobytes())
        z.writestr("x.npy", _npy_header((10**12,)) + bytes(64))
    paths["stride_0"] = d / "stride0"
    paths["stride_0"].mkdir()
    torch.save({"model.forward_batch_info.input_ids": torch.arange(3),
                "model.embed_tokens": torch.zeros(1).expand(3_000_000_000)}, paths["stride_0"] / "Pass00000.pt")
    paths["fifo_member"] = d / "dumper"
    paths["fifo_member"].mkdir()
    torch.save({"value": torch.arange(3), "meta": {"name": "input_ids", "step": 0}},
               paths["fifo_member"] / "step=0___rank=0___dump_index=1___name=input_ids.pt")
    os.mkfifo(paths["fifo_member"] / "step=0___rank=0___dump_index=2___name=non_intrusive__model.embed_tokens.output.pt")
    paths["fifo_pass"] = d / "passes"
    paths["fifo_pass"].mkdir()
    os.mkfifo(paths["fifo_pass"] / "Pass00000.pt")
    paths["fifo_dump"] = d / "x.npz"
    os.mkfifo(paths["fifo_dump"])
    paths["dev_dump"] = "/dev/zero"
    maps = {"map_dev": "/dev/zero", "map_fifo": d / "m.toml", "map_latin1": d / "latin1.toml", "map_deep": d / "deep.toml"}
    os.mkfifo(maps["map_fifo"])
    maps["map_latin1"].write_bytes('[layer]\n"caf\xe9" = { hf = "mlp" }\n'.encode("latin-1"))
    maps["map_deep"].write_text("x = " + "[" * 100000 + "]" * 100000 + "\n")
    _engine_dump_cases(d, paths)
    cases = {k: f"read_dump({str(p)!r})" for k, p in paths.items()}
    cases["requests_30m"] = f"map_dump(read_dump({str(paths['requests_30m'])!r}), REF, load_engine_map('llama', None))"
    cases.update({k: f"load_engine_map('llama', {str(p)!r})" for k, p in maps.items()})
    got = capped_cases(cases)
    return {k: ({**paths, **maps}[k], got[k]) for k in cases}


def _dumper(folder: Path, files: list[tuple[str, object, dict]]) -> Path:
    """An SGLang dumper folder of one step on TP rank 0: ``(name, value, meta overrides)`` per file."""
    folder.mkdir()
    for i, (name, value, extra) in enumerate(files):
        tags = {"step": 0, "rank": 0, "dump_index": i + 1, "name": name}
        meta = {**tags, "world_rank": 0, "world_size": 1,
                "sglang_parallel_info": {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1}, **extra}
        torch.save({"value": value, "meta": meta}, folder / ("___".join(f"{k}={v}" for k, v in tags.items()) + ".pt"))
    return folder


def _engine_dump_cases(d: Path, paths: dict) -> None:
    """The engine dumps of issue 37's adversarial trial (items 2, 3, 8), built small on disk."""
    from safetensors.torch import save_file

    n = 30_000_000  # one-token requests: every row at position 0 is its own request
    save_file({"input_ids": torch.zeros(n, dtype=torch.int32), "positions": torch.zeros(n, dtype=torch.int32),
               "model.embed_tokens": torch.zeros(1, 64, dtype=torch.bfloat16)}, str(d / "requests.safetensors"))
    paths["requests_30m"] = d / "requests.safetensors"
    ids, pos, emb = torch.arange(4), torch.arange(4), torch.zeros(4, 64)
    # an int32 input_ids of stride 0: 400 MB as read (within the capped budget), 800 MB more as int64
    paths["int64_copy"] = _dumper(d / "int64", [("input_ids", torch.zeros(1, dtype=torch.int32).expand(100_000_000), {}),
                                                ("positions", pos, {})])
    paths["tp_size_huge"] = _dumper(d / "tp", [
        ("input_ids", ids, {}), ("positions", pos, {}),
        ("non_intrusive__model.embed_tokens.output", emb,
         {"sglang_parallel_info": {"tp_rank": 0, "tp_size": 10**12, "pp_rank": 0, "pp_size": 1}})])
    paths["tp_size_unfilled"] = _dumper(d / "tp3", [
        ("input_ids", ids, {"sglang_parallel_info": {"tp_rank": 0, "tp_size": 3, "pp_rank": 0, "pp_size": 1}}),
        ("non_intrusive__model.embed_tokens.output", emb,
         {"sglang_parallel_info": {"tp_rank": 0, "tp_size": 3, "pp_rank": 0, "pp_size": 1}})])
    paths["sparse"] = _dumper(d / "sparse", [("input_ids", ids, {}), ("positions", pos, {}),
                                             ("non_intrusive__model.embed_tokens.output", emb.to_sparse(), {})])


def test_thirty_million_one_token_requests_are_refused_in_vectorised_time(hostile):
    """A 240 MB dump of 3·10⁷ one-token requests (positions all 0) ran unbounded (per-row Python
    loops; a MemoryError after 118 s before that): the requests are counted with one vectorised op
    and refused before any per-request work."""
    _, msg = hostile["requests_30m"]
    assert "requests.safetensors" in _one_line(msg) and "30,000,000 requests" in msg and "65,536" in msg, msg


def test_the_int64_copy_of_token_ids_counts_against_the_budget(hostile):
    """A stride-0 int32 input_ids (a few hundred bytes on disk) passed the budget by its int32 size, then
    its int64 copy failed to allocate (exit 3): the copy is charged before it is made."""
    path, msg = hostile["int64_copy"]
    assert sum(f.stat().st_size for f in Path(path).iterdir()) < 8192
    assert "name=input_ids.pt" in _one_line(msg) and "the int64 copy of input_ids" in msg and "input budget" in msg, msg


@pytest.mark.parametrize("case, needle", [("tp_size_huge", "disagree on tp_size (1, 1000000000000)"),
                                          ("tp_size_unfilled", "tp_size 3 but the dump holds TP rank(s) 0")])
def test_tp_size_is_checked_against_the_ranks_present(hostile, case, needle):
    """``tp_size = 10**12`` on one member ended in a MemoryError (a list of every rank): the meta is input,
    checked against the files before anything is sized by it."""
    _, msg = hostile[case]
    assert needle in _one_line(msg), msg


def test_a_sparse_tensor_is_refused_by_its_layout(hostile):
    """An activation saved as a sparse COO tensor: 'unsupported memory format option Contiguous' (exit 3)."""
    _, msg = hostile["sparse"]
    assert "sparse_coo (not dense) tensor of shape (4, 64)" in _one_line(msg) and "to_dense()" in msg, msg


def test_npz_decompression_bomb_is_refused_before_inflating(hostile):
    """A few-MB .npz declaring ~1.5e9 float16 zeros (3 GB): it used to inflate them all, then fail
    with "holds pickled objects"."""
    path, msg = hostile["npz_bomb"]
    assert Path(path).stat().st_size < 8 << 20
    assert "bomb.npz" in _one_line(msg) and ("decompression bomb" in msg or "input budget" in msg), msg


def test_npy_header_of_a_trillion_elements_is_refused(hostile):
    """An npy header of (10**12,) over a few bytes of data: it used to die with a MemoryError (exit 3)."""
    _, msg = hostile["npy_trillion"]
    assert "huge.npz" in _one_line(msg) and "'x.npy'" in msg, msg


def test_stride_0_tensor_in_a_pt_is_refused_before_materialising(hostile):
    """A few-hundred-byte .pt of ``torch.zeros(1).expand(3_000_000_000)``: it used to allocate 12 GB."""
    path, msg = hostile["stride_0"]
    assert (Path(path) / "Pass00000.pt").stat().st_size < 4096
    assert "Pass00000.pt" in _one_line(msg) and "stride 0" in msg and "input budget" in msg, msg


def test_small_stride_0_tensor_is_materialised_within_the_budget(tmp_path):
    from tracer.engines.dumps.files import load_pt

    torch.save({"x": torch.arange(4.0).reshape(4, 1).expand(4, 3)}, tmp_path / "a.pt")
    x = load_pt(tmp_path / "a.pt")["x"]
    assert x.is_contiguous() and torch.equal(x, torch.arange(4.0).reshape(4, 1).repeat(1, 3))


def test_budget_env_bounds_every_decoded_tensor(tmp_path, monkeypatch):
    from tracer.errors import TracerError
    from tracer.engines.dumps.files import load_npz

    np.savez_compressed(tmp_path / "x.npz", a=np.zeros(1000, dtype=np.float32))  # ~300 bytes on disk, 4000 decoded
    assert (tmp_path / "x.npz").stat().st_size < 1000
    monkeypatch.setenv("TRACER_INPUT_BUDGET", "1000")
    with pytest.raises(TracerError, match="over the input budget of 1,000 bytes"):
        load_npz(tmp_path / "x.npz")
    monkeypatch.setenv("TRACER_INPUT_BUDGET", "100000")
    assert load_npz(tmp_path / "x.npz")["a"].shape == (1000,)


def test_npz_round_trip_and_byte_order(tmp_path):
    from tracer.engines.dumps.files import load_npz

    a = np.arange(12, dtype=">f4").reshape(3, 4)
    np.savez_compressed(tmp_path / "x.npz", a=a, b=np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3)))
    got = load_npz(tmp_path / "x.npz")
    assert torch.equal(got["a"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(got["b"], torch.arange(6).reshape(2, 3))


# ---------------------------------------------------------------- files that block or are not files


def test_fifo_named_like_a_dumper_file_is_refused_without_blocking(hostile):
    _, msg = hostile["fifo_member"]
    assert "FIFO" in _one_line(msg) and "name=non_intrusive__model.embed_tokens.output.pt" in msg


def test_fifo_pass_file_is_refused_without_blocking(hostile):
    _, msg = hostile["fifo_pass"]
    assert "Pass00000.pt" in _one_line(msg) and "FIFO" in msg


@pytest.mark.parametrize("case", ["fifo_dump", "dev_dump"])
def test_engine_dump_that_is_a_fifo_or_device_is_refused(hostile, case):
    """`tracer import FIFO` or `tracer import /dev/zero` gave exit 3."""
    _, msg = hostile[case]
    assert ("FIFO" in _one_line(msg) or "character device" in msg) and "regular file" in msg


@pytest.mark.parametrize("case, expect", [("map_dev", "character device"), ("map_fifo", "FIFO"),
                                          ("map_latin1", "not UTF-8"), ("map_deep", "deep.toml")])
def test_engine_map_is_read_through_the_gate(hostile, case, expect):
    """--map /dev/zero grew to 24 GB; a FIFO hung; a non-UTF-8 map gave exit 3."""
    _, msg = hostile[case]
    assert expect in _one_line(msg), msg


def test_procfs_prompt_file_is_refused():
    """``--prompt-file /proc/kmsg`` blocked forever: kernel pseudo-files are refused by their filesystem."""
    from tracer.errors import TracerError
    from tracer.files import read_text_file

    for path in ("/proc/kmsg", "/proc/self/status"):
        if not os.path.exists(path):
            continue
        with pytest.raises(TracerError, match="kernel pseudo-file"):
            read_text_file(path, "--prompt-file")


def test_gguf_header_declaring_2_62_tensors_is_one_line(tmp_path):
    from tracer.errors import TracerError
    from tracer.files import check_gguf_file

    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**62, 1) + bytes(64))
    with pytest.raises(TracerError, match=r"4,611,686,018,427,387,904 tensors .* truncated or damaged"):
        check_gguf_file(path)


def test_empty_path_is_one_line():
    from tracer.errors import TracerError
    from tracer.files import check_input_file

    with pytest.raises(TracerError, match="is empty; give a file path"):
        check_input_file("", "trace file")


def test_a_lying_safetensors_header_is_one_line(tmp_path):
    """What held before issue 24, kept: a safetensors header whose offsets exceed the file."""
    import json as _json

    from safetensors.torch import save_file

    from tracer.errors import TracerError
    from tracer.engines.dumps.read import read_dump

    save_file({"input_ids": torch.arange(4), "model.embed_tokens": torch.zeros(4, 8)}, tmp_path / "t.safetensors")
    raw = (tmp_path / "t.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = _json.loads(raw[8:8 + n])
    header["model.embed_tokens"]["data_offsets"][1] += 10**9
    text = _json.dumps(header).encode().ljust(n)[:n] if len(_json.dumps(header)) <= n else _json.dumps(header).encode()
    (tmp_path / "t.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    with pytest.raises(TracerError) as e:
        read_dump(tmp_path / "t.safetensors")
    assert "t.safetensors" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["bad\nname.h5", "a\rb.h5:A", "esc\x1b[2J.h5"])
def test_a_missing_input_named_with_control_characters_is_one_line(tmp_path, name):
    """check_exists/check_input_file put the path in the message as given: a newline in it raised
    ValueError('TracerError messages are one line') and `tracer compare` exited 3 'internal error'."""
    from tracer.errors import TracerError
    from tracer.files import check_exists, check_input_file

    for check in (check_exists, lambda p, w: check_input_file(p, w)):
        with pytest.raises(TracerError) as e:
            check(str(tmp_path / name), "input")
        message = str(e.value)
        assert "\n" not in message and "\r" not in message and "\x1b" not in message
        assert message.endswith("not found; check the path")


def test_file_run_where_a_command_takes_the_file_alone_says_so(tmp_path):
    """A newcomer's trial: ``tracer show T.h5:A`` (the form ``compare`` takes) said the file was not found."""
    import pytest

    from tracer.errors import TracerError
    from tracer.files import check_input_file

    (tmp_path / "t.h5").write_bytes(b"x")
    with pytest.raises(TracerError, match=r"t\.h5:A not found, but .*t\.h5 is a file: this command takes the file alone"):
        check_input_file(tmp_path / "t.h5:A", "trace file")
    with pytest.raises(TracerError, match=r"u\.h5:A not found; check the path"):
        check_input_file(tmp_path / "u.h5:A", "trace file")
