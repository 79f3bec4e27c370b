"""The HF engine's deterministic mode leaves the process as it found it."""

from __future__ import annotations


def test_deterministic_mode_restores_the_numeric_contract():
    """A deterministic mitigation used to leave torch's fp32 precisions at "ieee" (from "none"): a
    later audit in the same process read another numeric contract in its header and refused to
    resume its own trace ("matmul_fp32_precision differ")."""
    from tracer.engines.hf.context import deterministic_mode
    from tracer.store.environment import collect_environment

    before = collect_environment("cpu")
    with deterministic_mode():
        inside = collect_environment("cpu")
    after = collect_environment("cpu")
    assert inside["deterministic_algorithms"] is True  # it did change something
    assert {k: (v, after[k]) for k, v in before.items() if after[k] != v} == {}


def test_a_kv_cache_moved_to_another_device_carries_its_contract_into_the_trace(tmp_path):
    """--scenario disaggregated (here cpu to cpu): the producer's and the consumer's KV contracts are
    checked when the cache moves and stored beside the run (meta.kv_transfer.contract, as prefill-decode);
    read back, the producer's contract refuses a mismatched consumer in one line naming both sides."""
    import pytest
    from dataclasses import replace

    import tracer
    from tracer.errors import TracerError
    from tracer.load.kv_contract import KVContract, check_kv_contract, require_kv
    from tracer.schema import decode
    from tracer.store.trace import TraceReader

    out = tmp_path / "d.h5"
    tracer.run("tiny-llama", scenario="disaggregated", devices="cpu,cpu", length=40, output=str(out), store="stats",
               progress=False)
    with TraceReader(out) as r:
        meta = r.run("B", load_tensors=False).meta
    check = meta["kv_transfer"]["contract"]
    assert meta["kv_transfer"]["role"] == "moved" and not check["fatal"] and check["differences"] == []
    producer = decode(KVContract, check["producer"], "producer")
    assert (producer.engine, producer.layout, producer.transfer_unit, producer.positions) == ("hf", "HND", "token", (0, 32))
    assert producer.storage_dtype == "bfloat16" and producer.device == "cpu"
    for consumer, words in ((replace(producer, storage_dtype="float32"), "KV storage dtype: producer bfloat16, "
                                                                         "consumer float32"),
                            (replace(producer, layout="NHD"), "KV layout: producer HND, consumer NHD")):
        with pytest.raises(TracerError) as e:
            require_kv(check_kv_contract(producer, consumer, "test"))
        assert words in str(e.value) and "\n" not in str(e.value)


def test_a_fatal_kv_contract_difference_at_the_move_refuses_the_run(monkeypatch):
    """The consumer's contract is checked when the cache moves, before the consumer computes: a planted
    consumer that expects another layout stops the run in one line naming both layouts."""
    import pytest
    from dataclasses import replace

    import tracer
    import tracer.load.hf_cache as hf_cache
    from tracer.errors import TracerError

    real = hf_cache.cache_contract

    def planted(model, cache, device, positions, tokens_sha256):
        c = real(model, cache, device, positions, tokens_sha256)
        return c if cache is not None else replace(c, layout="NHD")  # the consumer reads token-major

    monkeypatch.setattr(hf_cache, "cache_contract", planted)
    with pytest.raises(TracerError, match=r"KV layout: producer HND, consumer NHD"):
        tracer.run("tiny-llama", scenario="disaggregated", devices="cpu,cpu", length=40, store="none", progress=False)


def test_torch_compile_warnings_go_to_the_report_not_stderr(monkeypatch, capfd):
    """A compiler that warns (as Dynamo does on an untraceable builtin) while it runs: the warning's
    first line is a note of the report, naming the run, and nothing of it reaches stderr."""
    import warnings

    import torch

    import tracer

    lm = tracer.load_model("tiny-llama", device="cpu", progress=False)

    def fake_compile(model):
        def fn(**kwargs):
            warnings.warn("Dynamo does not know how to trace the builtin X.\nsecond line", UserWarning)
            return model(**kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    capfd.readouterr()
    res = tracer.run(lm, scenario="compile", length=12, progress=False)
    err = capfd.readouterr().err
    assert "Dynamo" not in err and "UserWarning" not in err, err
    notes = res.comparison.facts.get("notes", [])
    run_b = res.comparison.run_b
    assert f"{run_b}: torch.compile warned: UserWarning: Dynamo does not know how to trace the builtin X." in notes
    assert not any(n.startswith(f"{res.comparison.run_a}: torch.compile") for n in notes)  # run A: eager
