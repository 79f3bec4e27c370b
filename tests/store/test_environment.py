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
    # oneDNN's own word, from a separate process where oneDNN prints it on its own (ONEDNN_VERBOSE), after
    # a bf16 matmul (oneDNN's only on AVX-512 machines) and a layout reorder (oneDNN's on every CPU)
    code = ("import torch; a = torch.ones(256, 256, dtype=torch.bfloat16); a @ a; "
            "torch.ones(8, 8).to_mkldnn().to_dense()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "ONEDNN_VERBOSE": "1"}).stdout
    isa = [line.split(",isa:", 1)[1].strip() for line in out.splitlines() if ",isa:" in line]
    assert env["onednn_isa"] == (isa[0] if isa else None)
    assert isa or not torch.backends.mkldnn.is_available()  # an AVX2 CPU has an answer too
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


def test_a_cpu_and_a_gpu_differ_in_device_not_instruction_set():
    """A CPU's trace and an H200's: the device is the likely cause (named with both sides), not
    ``device_capability None (A) vs 9.0 (B)``; two CPUs leave it to the instruction sets."""
    from tracer.store.environment import device_difference, isa_differences

    cpu = {"device": "cpu", "device_name": "AMD EPYC 7B13", "cpu": "AMD EPYC 7B13", "cpu_capability": "AVX2",
           "device_capability": None}
    h200 = {"device": "cuda:0", "device_name": "NVIDIA H200", "cpu": "Intel Xeon", "cpu_capability": "AVX512",
            "device_capability": "9.0"}
    a100 = {**h200, "device_name": "NVIDIA A100-SXM4-80GB", "device_capability": "8.0"}
    assert device_difference(cpu, h200) == "cpu (AMD EPYC 7B13, AVX2) (A) vs NVIDIA H200 (sm 9.0) (B)"
    assert isa_differences(cpu, h200) == []
    assert device_difference(a100, h200) == "NVIDIA A100-SXM4-80GB (sm 8.0) (A) vs NVIDIA H200 (sm 9.0) (B)"
    assert "device_capability 8.0 (A) vs 9.0 (B)" in isa_differences(a100, h200)  # two GPUs: both said
    assert device_difference(cpu, {**cpu, "cpu_capability": "AVX512"}) is None
    assert device_difference(h200, dict(h200)) is None
    assert device_difference({"cpu": "x"}, h200) is None  # no device recorded: not compared


@pytest.fixture(scope="module")
def two_machines(tmp_path_factory):
    """Two traces of one prompt, the second as if made on a CPU of another instruction set: without
    AVX-512 (AVX2), or, when this machine is an AVX2 one, with it."""
    import h5py
    import torch

    import tracer
    from tracer.store.integrity import seal, set_text

    d = tmp_path_factory.mktemp("isa")
    lm = tracer.load_model("tiny-llama", device="cpu")
    for name in ("a.h5", "b.h5"):
        tracer.run(lm, length=24, progress=False, output=d / name)
    with h5py.File(d / "b.h5", "r+") as f:
        header = json.loads(f["header"].attrs["json"])
        if torch.backends.cpu.get_cpu_capability() == "AVX2":
            header.update(cpu_capability="AVX512", onednn_isa="Intel AVX-512 with Intel DL Boost and bfloat16 support",
                          cpu_isa_flags=[*header["cpu_isa_flags"], "avx512f", "avx512_bf16"])
        else:
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

    here = torch.backends.cpu.get_cpu_capability()
    assert c.facts["isa_differs"][0] == f"cpu_capability {here} (A) vs {'AVX512' if here == 'AVX2' else 'AVX2'} (B)"
    assert any(n.startswith("likely cause: the instruction sets differ") for n in c.facts["notes"])
    assert dict(headline(c, "compare"))["isa"] == "; ".join(c.facts["isa_differs"])
    # the likely cause first: the instruction sets before the versions, in the headline and the notes
    labels = [k for k, _ in headline(c, "compare")]
    assert labels.index("isa") < labels.index("versions")
    notes = c.facts["notes"]
    assert notes.index(next(n for n in notes if n.startswith("likely cause"))) < \
        notes.index(next(n for n in notes if n.startswith("versions that differ")))


def test_the_title_line_names_the_instruction_set(two_machines):
    """A run's title names the ISA the kernels dispatched to, from the trace's header (B: as if made on a
    CPU without AVX-512, with a cap in the environment), so a first run can be matched to a README sample."""
    import h5py
    import torch

    from tracer.diff.compare import compare_runs
    from tracer.report.tables import _title
    from tracer.store.environment import isa_summary

    c = compare_runs((str(two_machines / "a.h5"), "A"), (str(two_machines / "a.h5"), "B"))
    assert f"({c.facts['device_name']}, {torch.backends.cpu.get_cpu_capability()}" in _title(c)
    assert isa_summary({"device": "cpu", "cpu_capability": "DEFAULT", "onednn_isa": "Intel SSE4.1",
                        "cpu_isa_env": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}}) == (
        "DEFAULT, oneDNN SSE4.1; capped: ATEN_CPU_CAPABILITY=default, ONEDNN_MAX_CPU_ISA=SSE41")
    assert isa_summary({"device": "cpu", "cpu_capability": "AVX2", "onednn_isa": "Intel AVX2"}) == "AVX2"
    assert isa_summary({"device": "cuda:0", "device_capability": "9.0", "driver": "580.159.04"}) == (
        "sm 9.0, driver 580.159.04")
    assert isa_summary({"device": "cpu"}) is None  # a trace written before the ISA was recorded
    with h5py.File(two_machines / "b.h5", "r") as f:
        header = json.loads(f["header"].attrs["json"])
    assert isa_summary(header).startswith(header["cpu_capability"])


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
        lines = out.splitlines()
        i = next(k for k, x in enumerate(lines) if x.strip().startswith(key + " "))
        indent = len(lines[i]) - len(lines[i].lstrip()) + len(key)
        shown = [lines[i].rstrip()]  # a value wider than the terminal folds onto indented lines below its key
        for x in lines[i + 1:]:
            if x[:indent + 1].strip() or not x.strip():
                break
            shown.append(x.strip())
        assert "…" not in "".join(shown), (key, shown)  # never cut
        assert " ".join(shown).endswith(value) or "".join(shown).endswith(value), (key, shown)  # whole


def test_compare_a_cpu_trace_with_a_gpu_trace_names_the_devices_first(two_machines, tmp_path):
    """B as if run on an H200: the likely cause is the devices, first in the headline and the notes."""
    import shutil

    import h5py

    from tracer.diff.compare import compare_runs
    from tracer.report.summary import headline
    from tracer.store.integrity import seal, set_text

    b = shutil.copy(two_machines / "a.h5", tmp_path / "gpu.h5")
    with h5py.File(b, "r+") as f:
        header = json.loads(f["header"].attrs["json"])
        header.update(device="cuda:0", device_name="NVIDIA H200", device_capability="9.0")
        set_text(f["header"], "json", json.dumps(header))
        seal(f["header"])
    c = compare_runs((str(two_machines / "a.h5"), "A"), (str(b), "A"))
    likely = [n for n in c.facts["notes"] if n.startswith("likely cause")]
    assert len(likely) == 1 and likely[0].startswith("likely cause: the devices differ: cpu (")
    assert "NVIDIA H200 (sm 9.0) (B)" in likely[0] and "instruction sets" not in likely[0]
    labels = [k for k, _ in headline(c, "compare")]
    assert "devices" in labels and "isa" not in labels
