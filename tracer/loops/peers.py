"""The bench's peers: tracer's online comparison (bench mode b) done the ways people do it without tracer.

Each peer runs the scenario's two plans exactly as the bench's floor does
(:func:`tracer.engines.door.run_bare`: the same chunks, the same KV-cache reuse, the same plan
context), keeps every decoder layer's output its own way, and counts, per layer, the elements
whose bits differ between run A and run B on the compared window (batch row 0), with plain
torch: the number tracer reports as ``n_diff`` for its ``layer`` points.

- ``peer_hf``: Hugging Face's own ``output_hidden_states=True``. ``hidden_states[i + 1]`` is the
  output of decoder layer ``i``, except the last entry, which transformers replaces by the
  final norm's output (``last_hidden_state``): the last decoder layer's own output is not
  available this way, so this peer's last count is the final norm's (tracer's ``final_norm``
  point) and it covers layers ``0 .. L-2`` plus the final norm.
- ``peer_hooks``: a plain ``register_forward_hook`` on every decoder layer that copies the whole
  output to the host (``output.detach().to("cpu", copy=True)``: ``.cpu()`` on a GPU, a copy on
  the CPU, where ``.cpu()`` would return the tensor itself); covers all L layers.
- ``peer_nnsight``: nnsight's ``.save()`` of every decoder layer's output, one ``trace`` per
  forward call; covers all L layers. Needs nnsight (``pip install 'tracer[peers]'``); skipped
  with the reason otherwise.

The bench checks every peer's counts against tracer's (:func:`check_counts`) and refuses to
report timings of peers that did different work.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from tracer.errors import TracerError
from tracer.execute.kinds import PointKind
from tracer.engines.door import run_bare

if TYPE_CHECKING:
    from tracer.execute.points import CapturePoint
    from tracer.load.models import LoadedModel
    from tracer.plan.scenarios import Scenario

#: the peers, in the order the bench runs and reports them
PEERS = ("peer_hf", "peer_hooks", "peer_nnsight")

LABELS = {"peer_hf": "HF output_hidden_states + compare", "peer_hooks": "forward hooks + .cpu() + compare",
          "peer_nnsight": "nnsight .save() + compare"}

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class Peer:
    """One peer of the bench.

    Attributes:
        name: its mode name (``peer_hf``, ``peer_hooks``, ``peer_nnsight``).
        label: one line for the table.
        covers: which capture points its counts cover.
        run: executes both plans and returns capture name → differing elements (None when skipped).
        skipped: why it does not run here (None when it runs).
    """

    name: str
    label: str
    covers: str
    run: Callable[[], dict[str, int]] | None = None
    skipped: str | None = None


def count_differing(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """For each ``(a, b)`` pair of same-shape, same-dtype tensors: the elements whose bit patterns
    differ (tracer's ``n_diff``), compared as integers of the same width; one host sync in all.

    Raises:
        TracerError: a pair of different shapes or dtypes.
    """
    out = []
    for a, b in pairs:
        if a.shape != b.shape or a.dtype != b.dtype:
            raise TracerError(f"runs A and B kept different tensors: {tuple(a.shape)} {a.dtype} vs "
                              f"{tuple(b.shape)} {b.dtype}")
        iv = _INT[a.element_size()]
        out.append(torch.count_nonzero(a.contiguous().view(iv) != b.to(a.device).contiguous().view(iv)))
    return [int(x) for x in torch.stack(out).tolist()] if out else []


class _Window:
    """Per run, per point: the compared window's positions of batch row 0, pieced together from
    the tensors ``(batch, chunk positions, *feature)`` each forward call produced."""

    def __init__(self, names: list[str], window: tuple[int, int]) -> None:
        self.names = names
        self.window = (int(window[0]), int(window[1]))
        self.pieces: tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]] = ([], [])

    def add(self, run: int, start: int, stop: int, tensors: list[Any]) -> None:
        """Keep the window's part of one forward call's tensors (one per point, in ``names`` order)."""
        if len(tensors) != len(self.names):
            raise TracerError(f"a forward call gave {len(tensors)} layer outputs, expected {len(self.names)}")
        lo, hi = max(start, self.window[0]), min(stop, self.window[1])
        if lo < hi:
            self.pieces[run].append([_tensor(t)[0, lo - start:hi - start] for t in tensors])

    def counts(self) -> dict[str, int]:
        """Capture name → elements that differ between the runs; the pieces are dropped."""
        runs = [[torch.cat(p, 0) if len(p) > 1 else p[0] for p in zip(*pieces)] for pieces in self.pieces]
        self.pieces = ([], [])
        if any(len(r) != len(self.names) for r in runs):
            raise TracerError("a run computed none of the compared positions")
        return dict(zip(self.names, count_differing(list(zip(*runs)))))


def _tensor(x: Any) -> torch.Tensor:
    """A decoder layer's output tensor (older transformers return a tuple whose first item it is)."""
    return x[0] if isinstance(x, (tuple, list)) else x


def _simple(scen: Scenario, who: str) -> None:
    for plan in (scen.plan_a, scen.plan_b):
        if plan.batch is not None or plan.generate or plan.devices is not None:
            raise TracerError(f"{who} runs plans of batch 1 without generation or device moves; "
                              f"plan {plan.name} of scenario {scen.name} has them")


def _points(points: list[Any]) -> tuple[list[Any], Any]:
    layers = [p for p in points if p.kind == PointKind.LAYER]
    norm = next((p for p in points if p.kind == PointKind.FINAL_NORM), None)
    if not layers or norm is None:
        raise TracerError("the capture points have no decoder layers or no final norm")
    return layers, norm


def peer_hf(loaded: LoadedModel, token_ids: list[int], scen: Scenario, points: list[CapturePoint]) -> Peer:
    """The ``output_hidden_states=True`` peer (see the module docstring)."""
    layers, norm = _points(points)
    names = [p.name for p in layers[:-1]] + [norm.name]
    win = _Window(names, scen.window)

    def on_output(run: int, start: int, stop: int, out: Any) -> None:
        hs = out.hidden_states
        if hs is None or len(hs) != len(layers) + 1:
            raise TracerError(f"output_hidden_states gave {0 if hs is None else len(hs)} entries for "
                              f"{len(layers)} decoder layers (expected {len(layers) + 1})")
        win.add(run, start, stop, list(hs[1:]))

    def run() -> dict[str, int]:
        _simple(scen, "peer_hf")
        run_bare(loaded, token_ids, scen, extra={"output_hidden_states": True}, on_output=on_output)
        return win.counts()

    return Peer("peer_hf", LABELS["peer_hf"], f"layers 0..{len(layers) - 2} and {norm.name} (HF's last hidden "
                "state is the final norm's output)", run)


def peer_hooks(loaded: LoadedModel, token_ids: list[int], scen: Scenario, points: list[CapturePoint]) -> Peer:
    """The naive forward-hook peer (see the module docstring)."""
    layers, _ = _points(points)
    win = _Window([p.name for p in layers], scen.window)
    kept: list[torch.Tensor] = []

    def hook(module: Any, args: Any, output: Any) -> None:
        kept.append(_tensor(output).detach().to("cpu", copy=True))

    def on_output(run: int, start: int, stop: int, out: Any) -> None:
        win.add(run, start, stop, list(kept))
        kept.clear()

    def run() -> dict[str, int]:
        _simple(scen, "peer_hooks")
        handles = [loaded.model.get_submodule(p.module).register_forward_hook(hook) for p in layers]
        try:
            run_bare(loaded, token_ids, scen, on_output=on_output)
        finally:
            for h in handles:
                h.remove()
            kept.clear()
        return win.counts()

    return Peer("peer_hooks", LABELS["peer_hooks"], f"all {len(layers)} decoder layers", run)


def nnsight_missing() -> str | None:
    """Why the nnsight peer cannot run here, or None."""
    if importlib.util.find_spec("nnsight") is None:
        return "nnsight is not installed (pip install 'tracer[peers]')"
    return None


def peer_nnsight(loaded: LoadedModel, token_ids: list[int], scen: Scenario, points: list[CapturePoint]) -> Peer:
    """The nnsight ``.save()`` peer (see the module docstring); skipped when nnsight is missing or
    cannot wrap the model."""
    layers, _ = _points(points)
    covers = f"all {len(layers)} decoder layers"
    why = nnsight_missing()
    if why is not None:
        return Peer("peer_nnsight", LABELS["peer_nnsight"], covers, skipped=why)
    try:
        from nnsight import NNsight

        wrapped = NNsight(loaded.model)
        envoys = [_envoy(wrapped, p.module) for p in layers]
    except Exception as e:  # noqa: BLE001 - any failure of the optional peer is a reason to skip it
        return Peer("peer_nnsight", LABELS["peer_nnsight"], covers,
                    skipped=f"nnsight cannot wrap the model ({type(e).__name__}: {str(e)[:120]})")
    win = _Window([p.name for p in layers], scen.window)
    kept: list[Any] = []

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(**kwargs: Any) -> Any:
            saved = []
            with wrapped.trace(**kwargs):
                for e in envoys:
                    saved.append(e.output.save())
                out = wrapped.output.save()
            kept[:] = saved
            return out

        return call

    def on_output(run: int, start: int, stop: int, out: Any) -> None:
        win.add(run, start, stop, list(kept))
        kept.clear()

    def run() -> dict[str, int]:
        _simple(scen, "peer_nnsight")
        if scen.plan_a.compile or scen.plan_b.compile:
            raise TracerError("peer_nnsight does not run torch.compile-d plans")
        run_bare(loaded, token_ids, scen, wrap=wrap, on_output=on_output)
        return win.counts()

    return Peer("peer_nnsight", LABELS["peer_nnsight"], covers, run)


def _envoy(root: Any, path: str) -> Any:
    """nnsight's proxy of the module at ``path`` (``model.layers.3``)."""
    e = root
    for part in path.split("."):
        e = e[int(part)] if part.isdigit() else getattr(e, part)
    return e


def make_peers(loaded: LoadedModel, token_ids: list[int], scen: Scenario, points: list[CapturePoint]) -> list[Peer]:
    """Every peer of :data:`PEERS` for this model and scenario (``points``: the run's capture points)."""
    return [peer_hf(loaded, token_ids, scen, points), peer_hooks(loaded, token_ids, scen, points),
            peer_nnsight(loaded, token_ids, scen, points)]


def check_counts(peer: str, got: dict[str, int], tracer_counts: dict[str, int]) -> None:
    """Refuse a peer that did different work: its differing count must equal tracer's at every point.

    Args:
        peer: the peer's name (for the message).
        got: the peer's capture name → differing elements.
        tracer_counts: tracer's capture name → ``n_diff`` of the same runs.

    Raises:
        TracerError: a point tracer did not compare, or any count that differs (all are named).
    """
    bad = [f"{n}: {peer} {c:,} vs tracer {tracer_counts[n]:,}" if n in tracer_counts else f"{n}: not compared by tracer"
           for n, c in got.items() if tracer_counts.get(n) != c]
    if not got or bad:
        raise TracerError(f"{peer} did not do tracer's work (differing elements per layer do not match: "
                          f"{'; '.join(bad[:6]) or 'no counts'}{' ...' if len(bad) > 6 else ''}); "
                          "the bench refuses to compare the timings of different work")
