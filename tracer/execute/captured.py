"""The notebook capture (:func:`tracer.capture` on an HF model): every forward pass inside a
``with`` block captured by the :class:`~tracer.execute.capture.Capture` hooks, no call declared,
and what was captured read back as a mapping of records or as a :class:`RunRecord`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tracer.errors import TracerError
from tracer.execute.capture import Capture
from tracer.execute.kinds import PointKind
from tracer.execute.points import CapturePoint, discover_points
from tracer.execute.records import CaptureRecord, RecordsView, RunRecord


class Captured(RecordsView):
    """The notebook capture (:func:`tracer.capture`): every forward pass of the model inside the
    ``with`` block is captured, no other call needed.

    Each forward is a call of its own (positions continue from the KV cache it is given, else start
    at 0); every position of batch row 0 is kept, in call order. Behaves as a read-only mapping of
    capture name → :class:`~tracer.execute.records.CaptureRecord` (``.tensor``: ``(T, *feature)``
    in the model's dtype, on the CPU unless ``keep_on_device``), during and after the block.

    Args:
        model: an HF causal LM.
        points: ``layers`` or ``sublayers`` (see :func:`discover_points`, without KV-cache points),
            or a list of module paths of ``model`` (a path that is also a discovered point keeps
            its kind, op and role, any other module is captured at its output; a model no family
            descriptor fits takes paths only).
        cuda_graphs: the model runs as CUDA-graph replays, recorded (``torch.cuda.graph``, or a
            static-cache ``torch.compile(mode="reduce-overhead")`` model's first calls) inside the
            ``with`` block: the hooks fire while the graph is recorded and their copies become
            nodes of the graph, so every replay refreshes the captures (:mod:`tracer.execute.graphs`).
            A point's tensor is the buffer the graph replays into (eager forwards before the
            recording, e.g. warm-ups, are not kept for it), on the GPU, holding the latest replay's
            values (clone it to keep one); ``token_ids`` are the recorded call's. A block in which no
            point fired (a graph recorded before it) or a point recorded twice is an error.

    Raises:
        TracerError: ``model`` not an ``nn.Module``; ``points`` neither a granularity nor a non-empty
            list of paths; unknown granularity, a module path that is not in the model, ``cuda_graphs``
            for a model not on a CUDA GPU, or (at the end of the block) ``cuda_graphs`` and
            nothing captured, or a point recorded in several forwards.
    """

    def __init__(self, model: nn.Module, points: str | list[str] = "layers", *, keep_on_device: bool = False,
                 cuda_graphs: bool = False) -> None:
        if not isinstance(model, nn.Module):
            hint = ": load it first, tracer.load_model(name)" if isinstance(model, str) else ""
            raise TracerError(f"tracer.capture takes an HF causal LM (a torch.nn.Module), a tracer.load_model(...) result "
                              f"or an engine's object, not a {type(model).__name__}{hint}")
        if not isinstance(points, str) and (not isinstance(points, (list, tuple)) or not points
                                            or not all(isinstance(p, str) for p in points)):
            raise TracerError(f"points must be 'layers', 'sublayers' or a non-empty list of module paths such as "
                              f"['model.layers.0.mlp'], not {str(points)[:60]}")
        self.cuda_graphs = cuda_graphs
        if cuda_graphs:
            from tracer.execute.graphs import check_graph_device
            from tracer.load.devices import model_device

            check_graph_device(model_device(model), "cuda_graphs=True", "move the model to a CUDA GPU or drop cuda_graphs")
            keep_on_device = True
        if isinstance(points, str):
            pts = discover_points(model, points, kv_cache=False)
        else:
            try:  # a path that is a discovered point keeps its kind, op and role
                known = {p.name: p for p in discover_points(model, "sublayers", kv_cache=False)}
            except TracerError:  # no family descriptor fits: the named modules are captured as they are
                known = {}
            pts = []
            for name in points:
                if name in known:
                    pts.append(known[name])
                    continue
                try:
                    mod = model.get_submodule(name)
                except AttributeError:
                    raise TracerError(f"module '{name}' is not in the model; give paths of model.named_modules(), "
                                      "e.g. model.layers.0.mlp") from None
                pts.append(CapturePoint(name=name, module=name, kind=PointKind.MODULE, op=type(mod).__name__))
        self._capture = Capture(model, pts, None, keep_on_device=keep_on_device)
        self._records: dict[str, CaptureRecord] | None = None

    def __enter__(self) -> "Captured":
        self._records = None
        self._capture.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._capture.__exit__(*exc)
        self._records = self._capture.records(graphs=self.cuda_graphs)
        if self.cuda_graphs and exc[0] is None and not self._capture._fired:
            raise TracerError("no capture point fired inside the block: with cuda_graphs=True, record the CUDA graph "
                              "(torch.cuda.graph, or a reduce-overhead compiled model's first calls) inside the "
                              "'with' block; replays of a graph recorded before it run no hooks")

    def records(self) -> dict[str, CaptureRecord]:
        """Capture name → record, in execution order."""
        return self._records if self._records is not None else self._capture.records()

    @property
    def token_ids(self) -> list[int]:
        """Batch row 0's input ids of every captured call, in call order."""
        return list(self._capture.token_ids)

    def run_record(self, name: str = "A") -> RunRecord:
        """The capture as a :class:`~tracer.execute.records.RunRecord` (window: every captured position).

        Raises:
            TracerError: nothing was captured (no forward pass of the model ran inside the block).
        """
        if not any(getattr(r, "tensor", None) is not None and r.tensor.numel() for r in self.records().values()):
            raise TracerError(f"capture {name} holds nothing: no forward pass of the model ran inside its "
                              "'with tracer.capture(...)' block; call the model inside the block")
        n = len(self._capture.token_ids) or self._capture._n_tokens
        return RunRecord(name=name, token_ids=self.token_ids, plan={"description": _description(self.records(), n)},
                         window=(0, n), captures=self.records(), meta={})


def _description(records: dict[str, CaptureRecord], n: int) -> str:
    """What a capture ran, for the report's run lines: ``tracer.capture: 314 tokens in 2 forward calls
    (GEMM M per step: 304, 10)``, from the positions of the first point's recorded calls; a batch of
    several rows says so, and its GEMM M counts every row (``17 tokens of row 0 of 4 ... 68``)."""
    calls = next(([c for c in r.calls if c.get("positions")] for r in records.values() if r.calls), [])
    steps, batch = [], 1
    for c in calls:
        k = int(c["positions"][1]) - int(c["positions"][0])
        # the call's rows: the leading dim of an input or output shaped (rows, positions, ...)
        rows = next((int(s[0]) for s in [*c.get("in", []), *c.get("out", [])] if len(s) >= 2 and int(s[1]) == k), 1)
        steps.append(rows * k)
        batch = max(batch, rows)
    text = f" in {len(steps)} forward call{'s' * (len(steps) != 1)} (GEMM M per step: " \
           f"{', '.join(map(str, steps))})" if steps else ""
    of = f" of row 0 of {batch}" if batch > 1 else ""
    return f"tracer.capture: {n} token{'s' * (n != 1)}{of}{text}"
