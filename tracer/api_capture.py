"""The notebook API's calls on forward passes the user runs: capture them, compare two captures.

    >>> with tracer.capture(lm, points="layers") as cap:   # any forward inside is captured
    ...     lm.model(ids)
    >>> cap["model.layers.3"].tensor                      # (T, hidden), model dtype
    >>> tracer.compare(cap_a, cap_b)                      # captures, runs or "file.h5:RUN"

:func:`capture` hooks an HF model (or another engine's own object, through the door) for the forward
passes inside a ``with`` block; :func:`compare` compares two captures, two runs or two stored runs
(an engine dump against an HF reference run included), layer by layer. Re-exported by
:mod:`tracer.api` (``tracer.capture``, ``tracer.compare``). Importing this module loads neither
torch nor transformers.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Union

from tracer.diff.refs import as_record, is_ref, stored_ref
from tracer.engines.table import is_reference
from tracer.errors import TracerError

if TYPE_CHECKING:  # the result types, for the signatures only: importing tracer stays light
    from torch import nn

    from tracer.diff.result import Comparison
    from tracer.execute.captured import Captured
    from tracer.execute.records import RunRecord
    from tracer.load.models import LoadedModel

#: a stored run: ``"file.h5:RUN"``, ``"file.h5"`` (a run picked by position), ``("file.h5", "RUN")`` or a path
RunRef = Union[str, "tuple[str, str | None]", os.PathLike]


def is_loaded(obj: object) -> bool:
    """Whether ``obj`` is a loaded model (:class:`~tracer.load.models.LoadedModel`: model, info, tokenizer)."""
    return hasattr(obj, "model") and hasattr(obj, "info") and hasattr(obj, "tokenizer")


def capture(model: nn.Module | LoadedModel | Any, points: str | list[str] = "layers", *, keep_on_device: bool = False,
            reference: str | None = None, cuda_graphs: bool = False) -> Captured | Any:
    """A context manager that captures every forward pass of ``model`` run inside it.

    ``model`` may also be another engine's own object (a row's ``objects`` in
    :mod:`tracer.engines.table`, e.g. an in-process, eager LLM of a serving engine): the first request
    it schedules inside the block is traced at every position it computes, under HF capture names
    (:meth:`tracer.engines.base.Engine.capture`, filled when the block ends; ``reference``: a loaded
    HF model of the same weights, else loaded from the engine's folder).

    ``model`` is an HF causal LM or a loaded model; ``points`` is ``"layers"`` (embedding, every
    decoder layer's output, final norm, logits), ``"sublayers"`` or a list of module paths
    (``["model.layers.3", "model.layers.3.mlp"]``). Each forward is a call of its own: positions
    continue from the KV cache it is given, else start at 0; every position of batch row 0 is kept,
    in call order. After (or during) the block, ``cap["model.layers.3"]`` is a
    :class:`~tracer.execute.records.CaptureRecord` whose ``.tensor`` is ``(T, *feature)`` in the
    model's dtype (on the CPU unless ``keep_on_device``)::

        with tracer.capture(lm) as cap:
            lm.model(ids)

    ``cuda_graphs=True``: the model runs as CUDA-graph replays recorded inside the block; the
    capture copies are recorded into the graph, so every replay refreshes the captures (on the
    GPU, the latest replay's values)::

        with tracer.capture(lm, cuda_graphs=True) as cap:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = lm.model(static_ids)
        g.replay()  # cap["model.layers.3"].tensor now holds this replay's output

    Raises:
        TracerError: ``keep_on_device`` or ``cuda_graphs`` not a bool; unknown granularity or module
            path; ``cuda_graphs`` off a CUDA GPU, or with no
            capture point fired in the block; for another engine's object: the options its capture does
            not take, a ``reference`` of another dtype.
    """
    from tracer.engines.door import capture_object

    for name, value in (("keep_on_device", keep_on_device), ("cuda_graphs", cuda_graphs)):
        if not isinstance(value, bool):  # "yes" or "no" would both read as on
            raise TracerError(f"{name}={value!r} must be True or False")
    engine_cap = capture_object(model, points, reference=reference, cuda_graphs=cuda_graphs, keep_on_device=keep_on_device)
    if engine_cap is not None:  # another engine's object (tracer.engines.table: objects)
        return engine_cap
    if reference is not None:
        raise TracerError("reference= applies to another engine's object (the HF model its captures are named after)")
    from tracer.execute.captured import Captured

    cap = Captured(model.model if is_loaded(model) else model, points, keep_on_device=keep_on_device,
                   cuda_graphs=cuda_graphs)
    cap.model_name = model.info.name if is_loaded(model) else getattr(getattr(model, "config", None), "name_or_path", None)
    return cap


def compare(a: Captured | RunRecord | RunRef, b: Captured | RunRecord | RunRef, *, atol: float | None = None,
            rtol: float | None = None, device: str | None = None) -> Comparison:
    """Compare two captures, two runs, or two stored runs, layer by layer.

    Args:
        a, b: each a :func:`capture` result (of an HF model or another engine's object: logits compared
            where that engine sampled, HF points it does not compute named), a :class:`~tracer.execute.records.RunRecord`, or a
            reference ``"file.h5:RUN"`` / ``("file.h5", "RUN")`` (files from different machines
            included; ``"file.h5"`` alone: its first run for ``a``, its second for ``b``); ``b``
            may be an engine dump (SGLang dumper folder, ``PassN.pt`` folder, ``.safetensors``/
            ``.npz``) compared against the HF reference run ``a``.
        atol, rtol: tolerances counted per capture point.
        device: where the metrics of stored runs are computed (default: cuda if available).

    Returns:
        the :class:`~tracer.diff.result.Comparison` the CLI renders.

    Raises:
        TracerError: runs of different prompts or windows, unknown files or runs; an unknown
            ``device``, or CUDA where there is none.
    """
    from tracer.diff.compare_dump import compare_dump, dump_side
    from tracer.diff.compare import compare_records, compare_runs
    from tracer.load.preflight import check_device

    check_device(device)

    if is_ref(a) and is_ref(b):
        dump = dump_side([str(a), str(b)]) if isinstance(a, str) and isinstance(b, str) else None
        if dump is not None:  # an HF reference run against an engine dump
            return compare_dump(dump[0], dump[1], atol=atol, rtol=rtol, device=device)
        return compare_runs(stored_ref(a, 0), stored_ref(b, 1), atol=atol, rtol=rtol, device=device)
    rec_a, rec_b = as_record(a, "A", 0), as_record(b, "B", 1)
    model = getattr(a, "model_name", None) or getattr(b, "model_name", None) or "model"
    facts = {"n_tokens": max(len(rec_a.token_ids), len(rec_b.token_ids)), "plan_a": rec_a.plan.get("description"),
             "plan_b": rec_b.plan.get("description")}
    c = compare_records(rec_a, rec_b, scenario="capture", model=model, atol=atol, rtol=rtol, facts=facts)
    if any(not is_reference((r.meta.get("engine") or {}).get("engine")) for r in (rec_a, rec_b)):  # another engine's capture
        from tracer.diff.engine import engine_skips, sampled_logits

        c = engine_skips(sampled_logits(c, rec_a, rec_b), rec_a, rec_b)
    return c


__all__ = ["RunRef", "capture", "compare", "is_loaded"]
