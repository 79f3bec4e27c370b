"""The trace header records the instruction sets the kernels dispatch on, `tracer show` prints them,
and `tracer compare` across machines names a difference as a likely cause (issue 25, item 3)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_header_records_the_cpu_instruction_sets():
    import torch

    from tracer.store.environment import SIMD_FLAGS, collect_environment

    env = collect_environment("cpu")
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    # oneDNN's own word, from a separate process where oneDNN prints it on its own (ONEDNN_VERBOSE)
    code = "import torch; a = torch.ones(256, 256, dtype=torch.bfloat16); a @ a"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "ONEDNN_VERBOSE": "1"}).stdout
    isa = [line.split(",isa:", 1)[1].strip() for line in out.splitlines() if ",isa:" in line]
    assert env["onednn_isa"] == (isa[0] if isa else None)
    with open("/proc/cpuinfo") as f:
        flags = next(set(line.split(":", 1)[1].split()) for line in f if line.startswith(("flags", "Features")))
    assert env["cpu_isa_flags"] == [x for x in SIMD_FLAGS if x in flags]
    assert json.dumps(env)  # JSON data, as the header stores it


def test_isa_differences_name_each_key_that_differs():
    from tracer.store.environment import isa_differences

    a = {"cpu_capability": "AVX512", "onednn_isa": "Intel AVX-512", "cpu_isa_flags": ["avx2", "avx512f"],
         "device_capability": None}
    b = {"cpu_capability": "AVX2", "onednn_isa": "Intel AVX2", "cpu_isa_flags": ["avx2", "avx_vnni"],
         "device_capability": None}
    assert isa_differences(a, b) == ["cpu_capability AVX512 (A) vs AVX2 (B)", "onednn_isa Intel AVX-512 (A) vs Intel AVX2 (B)",
                                     "cpu_isa_flags: only A has avx512f; only B has avx_vnni"]
    assert isa_differences(a, dict(a)) == []
    assert isa_differences({"cpu": "x"}, b) == []  # a trace written before the keys existed: not compared


@pytest.fixture(scope="module")
def two_machines(tmp_path_factory):
    """Two traces of one prompt, the second as if made on a CPU without AVX-512."""
    import h5py

    import tracer
    from tracer.store.integrity import seal, set_text

    d = tmp_path_factory.mktemp("isa")
    lm = tracer.load_model("tiny-llama", device="cpu")
    for name in ("a.h5", "b.h5"):
        tracer.run(lm, length=24, progress=False, output=d / name)
    with h5py.File(d / "b.h5", "r+") as f:
        header = json.loads(f["header"].attrs["json"])
        header.update(cpu_capability="AVX2", onednn_isa="Intel AVX2",
                      cpu_isa_flags=[x for x in header["cpu_isa_flags"] if not x.startswith(("avx512", "amx"))])
        set_text(f["header"], "json", json.dumps(header))
        seal(f["header"])  # a deliberate edit: re-sealed
    return d


def test_compare_across_machines_names_the_instruction_sets(two_machines):
    from tracer.diff.compare import compare_runs
    from tracer.report.summary import headline

    c = compare_runs((str(two_machines / "a.h5"), "A"), (str(two_machines / "b.h5"), "A"))
    import torch

    assert c.facts["isa_differs"][0] == f"cpu_capability {torch.backends.cpu.get_cpu_capability()} (A) vs AVX2 (B)"
    assert any(n.startswith("likely cause: the instruction sets differ") for n in c.facts["notes"])
    assert dict(headline(c, "compare"))["isa"] == "; ".join(c.facts["isa_differs"])


def test_show_prints_the_instruction_sets_whole(two_machines, cli_env):
    out = subprocess.run([sys.executable, "-m", "tracer", "show", str(two_machines / "a.h5")], capture_output=True,
                         text=True, env={**cli_env, "COLUMNS": "80"}, check=True).stdout
    from tracer.store.trace import TraceReader

    with TraceReader(two_machines / "a.h5") as r:
        header = r.header
    for key in ("cpu_capability", "onednn_isa", "cpu_isa_flags", "platform", "weights_hash"):
        if key not in header:
            continue
        value = header[key] if isinstance(header[key], str) else json.dumps(header[key])
        line = next(x for x in out.splitlines() if x.strip().startswith(key + " "))
        assert line.rstrip().endswith(value), (key, line)  # whole on one line, never cut with "…"
