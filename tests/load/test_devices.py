"""--device-map: a model dispatched by accelerate (issue 6, models larger than one GPU).

On the CPU the split is CPU + disk: half of the decoder layers keep their weights on disk
(accelerate's offload: the weights sit on ``meta`` and are loaded at each forward, through
accelerate's own module hooks). Expected values come from the same model loaded whole: the
dispatched model must compute the same bits, and tracer's hooks must capture them.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("accelerate")

import tracer  # noqa: E402
from tracer.cli import app  # noqa: E402
from tracer.errors import TracerError  # noqa: E402
from tracer.load.models import load_model  # noqa: E402
from tracer.store.trace import TraceReader  # noqa: E402

PROMPT = "x" * 70 + " a model split over devices"


def _split_map(model) -> dict[str, str]:
    dm = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    for i in range(len(model.model.layers)):
        dm[f"model.layers.{i}"] = "cpu" if i % 2 == 0 else "disk"
    return dm


def test_dispatched_model_captures_the_same_tensors(tmp_path):
    whole = load_model("tiny-llama", dtype="bfloat16", device="cpu", progress=False)
    split = load_model("tiny-llama", dtype="bfloat16", device_map=json.dumps(_split_map(whole.model)), progress=False)
    assert split.model.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # really offloaded
    assert split.info.device == "cpu" and split.info.device_map["model.layers.1"] == "disk"
    a = tracer.run(loaded=whole, prompt=PROMPT, output=tmp_path / "whole.h5", progress=False)
    b = tracer.run(loaded=split, prompt=PROMPT, output=tmp_path / "split.h5", progress=False)
    with TraceReader(tmp_path / "whole.h5") as ra, TraceReader(tmp_path / "split.h5") as rb:
        assert rb.header["model"]["device_map"]["model.layers.1"] == "disk"
        for run in ("A", "B"):
            names = ra.capture_names(run)
            assert names == rb.capture_names(run) and len(names) > 5
            for name in names:
                assert torch.equal(ra.tensor(run, name).view(torch.int16), rb.tensor(run, name).view(torch.int16)), name
    assert [p.diff for p in a.comparison.points] == [p.diff for p in b.comparison.points]
    # and the dispatched model's own outputs equal HF's on the whole model (independent of tracer)
    ids = torch.tensor([a.token_ids])
    with torch.inference_mode():
        hw = whole.model(ids, output_hidden_states=True).hidden_states
        hs = split.model(ids, output_hidden_states=True).hidden_states
    assert all(torch.equal(x, y) for x, y in zip(hw, hs))


def test_auto_map_on_this_machine_and_bad_maps(capsys):
    lm = load_model("tiny-llama", dtype="bfloat16", device_map="auto", progress=False)
    assert lm.info.device_map and set(lm.info.device_map.values()) <= {"cpu", "cuda:0", "disk"}
    with pytest.raises(TracerError, match="either --device or --device-map"):
        load_model("tiny-llama", device="cpu", device_map="auto", progress=False)
    with pytest.raises(TracerError, match="JSON object"):
        load_model("tiny-llama", device_map="everywhere", progress=False)
    with pytest.raises(TracerError, match="could not be applied"):
        load_model("tiny-llama", device_map='{"model.embed_tokens": "cpu"}', progress=False)
    with pytest.raises(TracerError, match="DEVICE=SIZE"):
        load_model("tiny-llama", device_map="auto", max_memory="lots", progress=False)
    with pytest.raises(TracerError, match="verdict"):
        tracer.run(loaded=lm, verdict=True, progress=False, store="none")
    with pytest.raises(SystemExit) as e:
        app(["run", "tiny-llama", "--device-map", "everywhere", "--no-store"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--device-map" in err and "Traceback" not in err


def test_bad_memory_budgets_and_all_on_disk_are_one_line_errors():
    with pytest.raises(TracerError, match="not a size"):
        load_model("tiny-llama", device_map="auto", max_memory="cpu=-5GiB", progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(TracerError, match="names GPU 0"):
            load_model("tiny-llama", device_map="auto", max_memory="0=1GiB", progress=False)
    with pytest.raises(TracerError, match="whole model on disk"):
        load_model("tiny-llama", device_map='{"": "disk"}', progress=False)
