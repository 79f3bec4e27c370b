"""The notebook API (:mod:`tracer.api`): what it refuses before anything loads."""

from __future__ import annotations

import pytest

import tracer
from tracer.errors import TracerError


@pytest.mark.parametrize("ids, message", [([1.9] * 8, "1.9"), ("1" * 8, "got str"), ({1: 1}, "got dict"),
                                          ([True] * 8, "True"), ([None] * 8, "None")])
def test_api_token_ids_must_be_ints(ids, message):
    with pytest.raises(TracerError, match=message):
        tracer.run("tiny-llama", token_ids=ids, store="none", progress=False)


def test_compare_device_and_capture_flags_are_validated(tmp_path):
    """`tracer.compare(a, b, device="tpu")` compared in-memory captures anyway (the device was never
    looked at) and `tracer.capture(m, keep_on_device="yes")` took the string for on: each is one
    TracerError line naming the bad value, before any work."""
    import torch

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4))
    with tracer.capture(model, ["1"]) as a:
        model(torch.tensor([[1, 2, 3]]))
    with pytest.raises(TracerError, match=r"^unknown device 'tpu'; valid: cpu, cuda, cuda:N, mps"):
        tracer.compare(a, a, device="tpu")
    with pytest.raises(TracerError, match=r"^unknown device 'tpu'"):
        tracer.compare_trace(str(tmp_path / "missing.h5"), device="tpu")  # before the file is looked for
    for kw in ({"keep_on_device": "yes"}, {"cuda_graphs": 1}):
        with pytest.raises(TracerError, match=rf"^{next(iter(kw))}=.* must be True or False$"):
            tracer.capture(model, ["1"], **kw)
    assert tracer.compare(a, a, device="cpu").identical


def test_a_missing_accelerator_is_named_in_the_callers_own_words(monkeypatch, tmp_path):
    """From Python, `tracer.run(..., device="cuda")` on a machine without CUDA said "use --device cpu"
    (the command's flag): the API's message says `device="cpu"`, the command's still `--device cpu`."""
    from tests.helpers import cli_batch
    from tracer.errors import cli_wording, option
    from tracer.load import preflight

    monkeypatch.setattr(preflight, "no_cuda_reason", lambda: "no GPU here")
    with pytest.raises(TracerError, match=r'use device="cpu"$'):
        tracer.run("tiny-llama", device="cuda", store="none", progress=False)
    with pytest.raises(TracerError, match=r'use device="cpu"$'):
        tracer.compare(str(tmp_path / "missing.h5") + ":A", str(tmp_path / "missing.h5") + ":B", device="cuda")
    assert (option("device", "cpu"), option("tp", 2), option("tp_mode")) == ('device="cpu"', "tp=2", "tp_mode=")
    with cli_wording():
        assert (option("device", "cpu"), option("tp", 2), option("tp_mode")) == ("--device cpu", "--tp 2", "--tp-mode")
    assert option("device", "cpu") == 'device="cpu"'  # the block ended: Python's words again
    import torch

    if not torch.cuda.is_available():  # the command, in its own process: the flag
        [(code, err)] = cli_batch([["run", "tiny-llama", "--device", "cuda"]], tmp_path)
        assert code == 2 and err.strip().endswith("use --device cpu") and 'device="' not in err, err


def test_show_of_an_engine_dump_says_it_shows_traces_and_names_the_calls(tmp_path):
    """`tracer show X.safetensors` said "not a readable HDF5 file (truncated or corrupt?)": it is one
    line saying that show reads traces and naming `tracer compare REF.h5:RUN X` / `tracer import`."""
    from safetensors.torch import save_file
    import torch

    from tests.helpers import cli_batch

    dump = tmp_path / "x.safetensors"
    save_file({"input_ids": torch.arange(4)}, dump)
    with pytest.raises(TracerError, match=r"is an engine dump; trace_info shows traces .*tracer\.compare_trace\("):
        tracer.trace_info(str(dump))
    [(code, err)] = cli_batch([["show", str(dump)]], tmp_path, refuse_reads=True)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "tracer show shows traces" in err and f"tracer compare REF.h5:RUN {dump}" in err and "tracer import" in err
