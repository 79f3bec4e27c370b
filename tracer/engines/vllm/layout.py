"""The HF reference layout a vLLM capture is mapped onto, and vLLM's engine map per model family
(read once per process each)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from tracer.engines.dumps.namemap import RefLayout
from tracer.engines.dumps.rules import load_engine_map
from tracer.execute.capture import Capture
from tracer.execute.kinds import PointKind
from tracer.execute.points import CapturePoint


_LAYOUTS: dict[tuple, RefLayout] = {}
_MAPS: dict[str, dict[str, Any]] = {}


def engine_map(family: str) -> dict[str, Any]:
    """The vLLM engine map of a model family (:func:`tracer.engines.dumps.rules.load_engine_map`),
    read once per process (a run's capture compiles its rules once per map object)."""
    if family not in _MAPS:
        _MAPS[family] = load_engine_map(family, engine="vllm")
    return _MAPS[family]


def ref_layout(loaded: Any, points: list[CapturePoint], token_ids: list[int], window: tuple[int, int]) -> RefLayout:
    """The HF layout the vLLM tensors are mapped onto: every capture point's kind, op, feature
    shape and dtype, in HF execution order, from one forward pass of the HF model on the prompt's
    first token (cached per model and point list).

    Raises:
        TracerError: the HF model cannot run that pass.
    """
    from tracer.dtypes import name_of
    from tracer.load.devices import model_device

    key = (id(loaded.model), tuple(p.name for p in points))
    if key not in _LAYOUTS:
        model = loaded.model
        with torch.inference_mode(), Capture(model, points, (0, 1)) as cap:
            with cap.forward_call(0, 1):
                model(input_ids=torch.tensor([token_ids[:1]], device=model_device(model)), use_cache=False)
        names = {}
        for n, r in cap.records().items():
            if r.kind == PointKind.KV_CACHE:
                names[n] = (r.kind, r.op, (), name_of(model.dtype))
            elif r.tensor.numel():
                names[n] = (r.kind, r.op, tuple(r.tensor.shape[1:]), name_of(r.tensor.dtype))
        layers = [n for n, v in names.items() if v[0] == PointKind.LAYER]
        _LAYOUTS[key] = RefLayout(names=names, layer_prefix=layers[0].rsplit(".", 1)[0] if layers else "model.layers",
                                  n_layers=len(layers), token_ids=[], window=(0, 1), family=loaded.info.family)
    return replace(_LAYOUTS[key], token_ids=list(token_ids), window=(int(window[0]), int(window[1])))


__all__ = ["engine_map", "ref_layout"]
