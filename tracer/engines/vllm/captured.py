"""``tracer.capture(llm)``: the notebook capture on a user's own ``vllm.LLM`` (eager).

    llm = vllm.LLM(model=folder, enforce_eager=True, ...)     # engine core here or in its own process
    with tracer.capture(llm, "layers") as cap:
        llm.generate(...)
    cap["model.layers.3"].tensor                               # (T, hidden), HF name, vLLM's dtype

The first request of the first forward pass inside the block is traced (in the order the model
runner puts a step's requests: vLLM's V2 runner sorts them by their number of tokens): every
position it computes (its prompt's uncached positions, then one per decode step, followed by its
KV slots), hooks on vLLM's modules mapped onto the HF capture points of the same model (in this
process, or, with vLLM's engine core in its own process, in its workers:
:class:`~tracer.engines.vllm.remote.RemoteCapture`, which needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``
in the environment the LLM was built in)
(:class:`~tracer.engines.vllm.capture.VllmCapture`: fused q/k/v and gate/up split, ``(hidden,
residual)`` summed, rows placed at their positions), kept on vLLM's device while it runs and copied
to the host once when the block ends (``keep_on_device=True``: left there).
The HF layout comes from ``reference`` (a :class:`~tracer.load.models.LoadedModel` of the same
weights), else from the HF model loaded once from the LLM's own folder on the CPU.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tracer.errors import TracerError
from tracer.execute.points import discover_points
from tracer.execute.records import CaptureRecord, RecordsView, RunRecord
from tracer.engines.vllm.capture import VllmCapture
from tracer.engines.vllm.remote import RemoteCapture
from tracer.engines.vllm.llm import vllm
from tracer.engines.vllm.running import VllmEngine
from tracer.engines.vllm.layout import engine_map, ref_layout
from tracer.engines.vllm.plan import VllmSettings


class VllmCaptured(RecordsView):
    """A read-only mapping of HF capture name → :class:`~tracer.execute.records.CaptureRecord`
    (``(T, *feature)`` over the traced request's computed positions), filled when the block ends.

    Args:
        llm: an eager ``vllm.LLM`` (its engine core in this process or in its own).
        points: ``layers`` or ``sublayers`` (no KV-cache points), or a list of HF capture names.
        reference: a loaded HF model of the same weights (None: loaded from the LLM's folder).
        keep_on_device: leave the captures on vLLM's device (a GPU); default: copied to the host
            once, when the block ends.

    Attributes (after the block): ``token_ids`` (the traced request's ids at positions 0..),
    ``positions`` (``(first, stop)`` it computed), ``logits`` (HF logits name → ``(positions,
    (k, vocab) tensor)``: vLLM computes logits only where it samples), ``not_captured`` (name → why).

    Raises:
        TracerError: compilation or CUDA graphs are on, a worker that cannot install the hooks, an
            unknown point, no weights folder, a reference of another dtype than the LLM's (each one line).
    """

    def __init__(self, llm: Any, points: str | list[str] = "layers", *, reference: Any = None,
                 keep_on_device: bool = False) -> None:
        self.keep_on_device = keep_on_device
        cfg = llm.llm_engine.vllm_config
        dtype = str(cfg.model_config.dtype).replace("torch.", "")
        self.engine = VllmEngine(llm, VllmSettings(), {"dtype": dtype}, Path(cfg.model_config.model), (0, 0))
        if reference is None:
            from tracer.load.models import load_model

            folder = Path(cfg.model_config.model)
            if not (folder / "config.json").is_file():
                raise TracerError(f"the LLM's model {folder} is not a local HF folder; pass reference= (a loaded HF "
                                  "model of the same weights: tracer.load_model(...))")
            reference = load_model(str(folder), dtype=dtype, device="cpu", tokenizer=False)
        ref_dtype = str(reference.model.dtype).replace("torch.", "")
        if ref_dtype != dtype:  # the map sums (hidden, residual) in the reference's dtype: a silent rounding
            raise TracerError(f"the reference model is {ref_dtype} but this LLM runs {dtype}; load the reference in "
                              f"the LLM's dtype (tracer.load_model(..., dtype={dtype!r}))")
        self.reference = reference
        known = discover_points(reference.model, points if isinstance(points, str) else "sublayers", kv_cache=False)
        if not isinstance(points, str):
            names = {p.name: p for p in known}
            missing = [n for n in points if n not in names]
            if missing:
                raise TracerError(f"capture point {missing[0]!r} is not an HF capture point of this model; give names "
                                  "such as model.layers.0 or model.layers.0.mlp (--granularity sublayers lists them)")
            known = [names[n] for n in points]
        self.points = known
        self.token_ids: list[int] = []
        self.positions: tuple[int, int] = (0, 0)
        self.logits: dict[str, tuple[list[int], torch.Tensor]] = {}
        self.not_captured: dict[str, str] = {}
        self._records: dict[str, CaptureRecord] | None = None
        self._cap: VllmCapture | None = None

    def __enter__(self) -> "VllmCaptured":
        eng, ref = self.engine, self.reference
        n = int(eng.llm.llm_engine.vllm_config.model_config.max_model_len)
        layout = ref_layout(ref, self.points, [0], (0, 1))
        self._cap = eng.new_capture(engine_map(ref.info.family), layout, [0] * n, (0, n), {})
        self._records = None
        self._cap.__enter__()
        try:
            self._cap.follow("first", None)  # the first request of the first forward pass in the block
        except BaseException:
            self._cap.__exit__(TracerError, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        cap = self._cap
        cap.__exit__(*exc)
        if exc and exc[0] is not None:
            return
        if isinstance(cap, RemoteCapture):  # the hooks ran in vLLM's workers: their rows, read back here
            cap = cap.local
        seen: dict[int, int] = {}
        for tok in cap.tokens.values():
            seen.update(zip(tok["positions"].tolist(), tok["input_ids"].tolist()))
        if not seen:
            raise TracerError("the hooks inside vLLM saw no forward pass in the block; call llm.generate(...) inside it")
        lo, hi = min(seen), max(seen) + 1
        self.token_ids = [seen.get(p, -1) for p in range(hi)]  # -1: a position served from the prefix cache
        self.positions = (lo, hi)
        cap.n, cap.window, cap.token_ids = hi, (lo, hi), self.token_ids
        cap.ref = replace(cap.ref, token_ids=self.token_ids, window=(lo, hi))
        self._records, info = cap.records(self.points, f"vLLM {vllm.__version__}")
        if not self.keep_on_device:
            self._records = {k: replace(r, tensor=r.tensor.cpu()) for k, r in self._records.items()}
            info["partial_logits"] = {k: (ps, t.cpu()) for k, (ps, t) in info["partial_logits"].items()}
        self.logits, self.not_captured = info["partial_logits"], info["not_captured"]

    def records(self) -> dict[str, CaptureRecord]:
        """Capture name → record, in HF execution order.

        Raises:
            TracerError: read before the block ended.
        """
        if self._records is None:
            raise TracerError("the vLLM capture is filled when the with-block ends; read it after the block")
        return self._records

    def run_record(self, name: str = "vllm") -> RunRecord:
        """The capture as a :class:`~tracer.execute.records.RunRecord` (window: the computed positions)."""
        return RunRecord(name=name, token_ids=self.token_ids, plan={"description": "tracer.capture(vllm.LLM)"},
                         window=self.positions, captures=self.records(),
                         meta={"engine": self.engine.facts(), "not_captured": self.not_captured},
                         extras={"partial_logits": self.logits})


__all__ = ["VllmCaptured"]
