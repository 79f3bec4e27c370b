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


def capped(code: str, cap: int = CAP, timeout: float = 120) -> str:
    """Run ``code`` (which prints a TracerError's message) in a fresh interpreter under RLIMIT_AS;
    return what it printed. A MemoryError, any other exception or a hang fails."""
    prog = ("import resource, sys\n"
            f"resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))\n"
            f"sys.path.insert(0, {str(ROOT)!r})\n"
            "from tracer.errors import TracerError\n"
            "try:\n" + "".join(f"    {line}\n" for line in code.strip().splitlines()) +
            "    print('NO ERROR')\n"
            "except TracerError as e:\n"
            "    print(e)\n")
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.strip()
    assert "\n" not in out and out != "NO ERROR", out
    return out


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


def test_npz_decompression_bomb_is_refused_before_inflating(tmp_path):
    """A few-MB .npz declaring ~1.5e9 float16 zeros (3 GB): it used to inflate them all, then fail
    with "holds pickled objects"."""
    blocks = 178
    n = blocks * (16 << 20) // 2
    path = tmp_path / "bomb.npz"
    _zip_member(path, "x.npy", _npy_header((n,)), blocks)
    assert path.stat().st_size < 8 << 20
    msg = capped(f"from tracer.store.enginedump import read_dump\nread_dump({str(path)!r})")
    assert "bomb.npz" in msg and ("decompression bomb" in msg or "input budget" in msg), msg


def test_npy_header_of_a_trillion_elements_is_refused(tmp_path):
    """An npy header of (10**12,) over a few bytes of data: it used to die with a MemoryError (exit 3)."""
    import zipfile

    path = tmp_path / "huge.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("input_ids.npy", _npy_header((3,), "<i8") + np.arange(3, dtype="<i8").tobytes())
        z.writestr("x.npy", _npy_header((10**12,)) + bytes(64))
    msg = capped(f"from tracer.store.enginedump import read_dump\nread_dump({str(path)!r})")
    assert "huge.npz" in msg and "'x.npy'" in msg, msg


def test_stride_0_tensor_in_a_pt_is_refused_before_materialising(tmp_path):
    """A few-hundred-byte .pt of ``torch.zeros(1).expand(3_000_000_000)``: it used to allocate 12 GB."""
    dump = tmp_path / "d"
    dump.mkdir()
    torch.save({"model.forward_batch_info.input_ids": torch.arange(3), "model.embed_tokens": torch.zeros(1).expand(3_000_000_000)},
               dump / "Pass00000.pt")
    assert (dump / "Pass00000.pt").stat().st_size < 4096
    msg = capped(f"from tracer.store.enginedump import read_dump\nread_dump({str(dump)!r})")
    assert "Pass00000.pt" in msg and "stride 0" in msg and "input budget" in msg, msg


def test_small_stride_0_tensor_is_materialised_within_the_budget(tmp_path):
    from tracer.store.dumpfiles import load_pt

    torch.save({"x": torch.arange(4.0).reshape(4, 1).expand(4, 3)}, tmp_path / "a.pt")
    x = load_pt(tmp_path / "a.pt")["x"]
    assert x.is_contiguous() and torch.equal(x, torch.arange(4.0).reshape(4, 1).repeat(1, 3))


def test_budget_env_bounds_every_decoded_tensor(tmp_path, monkeypatch):
    from tracer.errors import TracerError
    from tracer.store.dumpfiles import load_npz

    np.savez_compressed(tmp_path / "x.npz", a=np.zeros(1000, dtype=np.float32))  # ~300 bytes on disk, 4000 decoded
    assert (tmp_path / "x.npz").stat().st_size < 1000
    monkeypatch.setenv("TRACER_INPUT_BUDGET", "1000")
    with pytest.raises(TracerError, match="over the input budget of 1,000 bytes"):
        load_npz(tmp_path / "x.npz")
    monkeypatch.setenv("TRACER_INPUT_BUDGET", "100000")
    assert load_npz(tmp_path / "x.npz")["a"].shape == (1000,)


def test_npz_round_trip_and_byte_order(tmp_path):
    from tracer.store.dumpfiles import load_npz

    a = np.arange(12, dtype=">f4").reshape(3, 4)
    np.savez_compressed(tmp_path / "x.npz", a=a, b=np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3)))
    got = load_npz(tmp_path / "x.npz")
    assert torch.equal(got["a"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(got["b"], torch.arange(6).reshape(2, 3))


# ---------------------------------------------------------------- files that block or are not files


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def test_fifo_named_like_a_dumper_file_is_refused_without_blocking(tmp_path):
    dump = tmp_path / "dump"
    dump.mkdir()
    torch.save({"value": torch.arange(3), "meta": {"name": "input_ids", "step": 0}},
               dump / "step=0___rank=0___dump_index=1___name=input_ids.pt")
    _fifo(dump / "step=0___rank=0___dump_index=2___name=non_intrusive__model.embed_tokens.output.pt")
    msg = capped(f"from tracer.store.enginedump import read_dump\nread_dump({str(dump)!r})", timeout=60)
    assert "FIFO" in msg and "name=non_intrusive__model.embed_tokens.output.pt" in msg


def test_fifo_pass_file_is_refused_without_blocking(tmp_path):
    dump = tmp_path / "dump"
    dump.mkdir()
    _fifo(dump / "Pass00000.pt")
    msg = capped(f"from tracer.store.enginedump import read_dump\nread_dump({str(dump)!r})", timeout=60)
    assert "Pass00000.pt" in msg and "FIFO" in msg


@pytest.mark.parametrize("target", ["fifo", "/dev/zero"])
def test_engine_dump_that_is_a_fifo_or_device_is_refused(tmp_path, target):
    path = str(_fifo(tmp_path / "x.npz")) if target == "fifo" else target
    msg = capped(f"from tracer.store.enginedump import read_dump\nread_dump({path!r})", timeout=60)
    assert ("FIFO" in msg or "character device" in msg) and "regular file" in msg


@pytest.mark.parametrize("what", ["dev", "fifo", "latin1", "deep"])
def test_engine_map_is_read_through_the_gate(tmp_path, what):
    """--map /dev/zero grew to 24 GB; a FIFO hung; a non-UTF-8 map gave exit 3."""
    if what == "dev":
        path = "/dev/zero"
    elif what == "fifo":
        path = str(_fifo(tmp_path / "m.toml"))
    elif what == "latin1":
        path = str(tmp_path / "m.toml")
        Path(path).write_bytes('[layer]\n"caf\xe9" = { hf = "mlp" }\n'.encode("latin-1"))
    else:
        path = str(tmp_path / "m.toml")
        Path(path).write_text("x = " + "[" * 100000 + "]" * 100000 + "\n")
    msg = capped(f"from tracer.execute.enginemap import load_engine_map\nload_engine_map('llama', {path!r})", timeout=60)
    expect = {"dev": "character device", "fifo": "FIFO", "latin1": "not UTF-8", "deep": "m.toml"}[what]
    assert expect in msg, msg


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
    from tracer.store.enginedump import read_dump

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
