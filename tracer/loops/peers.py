"""The bench's peers: tracer's online comparison (bench mode b) done the ways its best users do it without tracer.

Every peer makes the floor's forward calls (:func:`tracer.loops.floor.forward_inputs`: the same
chunks, the same KV-cache reuse, ``torch.inference_mode``), keeps the compared window's rows of
every decoder layer's output (batch row 0) its own way, and counts per layer the elements whose
bits differ between run A and run B, all layers in one batched comparison with plain torch: the
number tracer reports as ``n_diff`` for its ``layer`` points.

- ``peer_hf``: Hugging Face's own ``output_hidden_states=True``; the window rows of each hidden
  state are views, stacked per call and compared on the model's device, one host synchronisation.
  ``hidden_states[i + 1]`` is the output of decoder layer ``i``, except the last entry, which
  transformers replaces by the final norm's output (``last_hidden_state``): this peer's last count
  is the final norm's (tracer's ``final_norm`` point), so it covers layers ``0 .. L-2`` and the norm.
- ``peer_hooks``: a ``register_forward_hook`` on every decoder layer (registered for the run,
  removed after it) copies the window rows of the layer's output into a host buffer allocated
  once, in pinned memory with a non-blocking copy on a GPU; one synchronisation after both runs,
  counted on the host; covers all L layers.
- ``peer_nnsight``: nnsight's ``layer.output[0, lo:hi].save()`` of every decoder layer inside one
  ``trace`` per forward call that computes window rows (the other calls run the model directly);
  compared as ``peer_hf``; covers all L layers. Needs nnsight (``pip install 'tracer[peers]'``);
  skipped with the reason otherwise.

What a peer's library leaves on the model is taken off between that peer's runs
(:class:`Leftovers`): transformers installs its output recorders (forward hooks on every decoder
layer and attention module) for good at the first ``output_hidden_states=True``, and wrapping a
model in ``NNsight`` replaces every module's ``forward``; both slow down every later forward of
the model. So every other mode, the floor and tracer included, runs the model as a user who
never used that library has it.

The bench checks every peer's counts against tracer's (:func:`check_counts`) and refuses to
report timings of peers that did different work.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from tracer.errors import TracerError
from tracer.execute.kinds import PointKind
from tracer.load.devices import model_device
from tracer.load.hf_cache import cache_kwarg
from tracer.loops.floor import Calls, forward_inputs

if TYPE_CHECKING:
    from tracer.execute.points import CapturePoint
    from tracer.load.models import LoadedModel
    from tracer.plan.scenarios import Scenario

#: the peers, in the order the bench runs and reports them
PEERS = ("peer_hf", "peer_hooks", "peer_nnsight")

LABELS = {"peer_hf": "HF output_hidden_states (window rows) + compare",
          "peer_hooks": "forward hooks, window rows copied to pinned host memory + compare",
          "peer_nnsight": "nnsight .save() of the window rows + compare"}

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
        leftovers: what its library added to the model, off between its runs (:class:`Leftovers`).
    """

    name: str
    label: str
    covers: str
    run: Callable[[], dict[str, int]] | None = None
    skipped: str | None = None
    leftovers: Leftovers | None = None


class Leftovers:
    """What a library adds to a model's modules inside :meth:`active`: forward hooks, forward
    pre-hooks and instance attributes (an instance ``forward``; transformers' flag that its output
    recorders are installed), taken off when the block ends and put back when the next
    :meth:`active` block begins. :meth:`restore` leaves the model as the library left it."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._kept: list[tuple[Any, str, Any, Any]] = []

    def _state(self) -> dict[int, tuple[set[Any], set[Any], set[str], Any]]:
        return {id(m): (set(m._forward_hooks), set(m._forward_pre_hooks), set(m.__dict__), m.__dict__.get("forward"))
                for m in self.model.modules()}

    def _take(self, before: dict[int, tuple[set[Any], set[Any], set[str], Any]]) -> None:
        for m in self.model.modules():
            hooks, pre, attrs, forward = before.get(id(m), (set(), set(), set(), None))
            for key in [k for k in m._forward_hooks if k not in hooks]:
                self._kept.append((m, "_forward_hooks", key, m._forward_hooks.pop(key)))
            for key in [k for k in m._forward_pre_hooks if k not in pre]:
                self._kept.append((m, "_forward_pre_hooks", key, m._forward_pre_hooks.pop(key)))
            for key in [k for k in m.__dict__ if k not in attrs]:  # set by the library: taken off
                self._kept.append((m, "attr", key, m.__dict__.pop(key)))
            if "forward" in attrs and m.__dict__.get("forward") is not forward:  # replaced by the library
                self._kept.append((m, "attr", "forward", m.__dict__["forward"]))
                m.__dict__["forward"] = forward

    def restore(self) -> None:
        """Put back what the last :meth:`active` block took off."""
        for m, where, key, value in self._kept:
            if where == "attr":
                m.__dict__[key] = value
            else:
                getattr(m, where)[key] = value
        self._kept = []

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The block runs with what the library added before (put back); whatever is added by the
        end of the block, before's included, is taken off again."""
        before = self._state()
        self.restore()
        try:
            yield
        finally:
            self._take(before)


def count_layers(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Per index of the first axis: the elements whose bit patterns differ (tracer's ``n_diff``).

    Args:
        a, b: ``(L, T, *feature)`` tensors of one shape and float dtype, on one device (``b`` is
            moved to ``a``'s); compared as integers of the same width, one host transfer.

    Raises:
        TracerError: different shapes or dtypes.
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        raise TracerError(f"runs A and B kept different tensors: {tuple(a.shape)} {a.dtype} vs "
                          f"{tuple(b.shape)} {b.dtype}")
    iv = _INT[a.element_size()]
    return (a.view(iv) != b.to(a.device).view(iv)).flatten(1).sum(1).tolist()


def _rows(window: tuple[int, int], start: int, stop: int) -> tuple[int, int, int] | None:
    """The window's rows in a call over ``[start, stop)``: ``(first, last + 1)`` in the call's
    output and the first one's row in the window; None when the call computes none of them."""
    lo, hi = max(start, window[0]), min(stop, window[1])
    return (lo - start, hi - start, lo - window[0]) if lo < hi else None


def _each_call(model: torch.nn.Module, plans: tuple[Calls, Calls],
               call: Callable[[int, torch.Tensor, dict[str, Any], tuple[int, int, int] | None], Any],
               window: tuple[int, int]) -> None:
    """The floor's loop: ``call(run, ids, cache kwargs, window rows)`` for every chunk of both plans,
    each call's KV cache given to the next; ``call`` returns the model output."""
    kw = cache_kwarg(model)
    with torch.inference_mode():
        for run, calls in enumerate(plans):
            cache = None
            for s, e, x in calls:
                out = call(run, x, {} if cache is None else {kw: cache}, _rows(window, s, e))
                cache = getattr(out, kw)


def _stacked(pieces: list[list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run A's and run B's ``(L, rows, *feature)`` pieces, in call order → two ``(L, T, *feature)`` tensors."""
    if any(not p for p in pieces):
        raise TracerError("a run computed none of the compared positions")
    a, b = (torch.cat(p, 1) if len(p) > 1 else p[0] for p in pieces)
    return a, b


def _points(points: list[Any]) -> tuple[list[Any], Any]:
    layers = [p for p in points if p.kind == PointKind.LAYER]
    norm = next((p for p in points if p.kind == PointKind.FINAL_NORM), None)
    if not layers or norm is None:
        raise TracerError("the capture points have no decoder layers or no final norm")
    return layers, norm


def _tensor(x: Any) -> torch.Tensor:
    """A decoder layer's output tensor (older transformers return a tuple whose first item it is)."""
    return x[0] if isinstance(x, (tuple, list)) else x


def peer_hf(loaded: LoadedModel, token_ids: list[int], scen: Scenario, points: list[CapturePoint]) -> Peer:
    """The ``output_hidden_states=True`` peer (see the module docstring)."""
    layers, norm = _points(points)
    names = [p.name for p in layers[:-1]] + [norm.name]
    model = loaded.model
    plans = _plans(loaded, token_ids, scen)
    left = Leftovers(model)

    def run() -> dict[str, int]:
        pieces: list[list[torch.Tensor]] = [[], []]

        def call(run: int, x: torch.Tensor, cache: dict[str, Any], rows: tuple[int, int, int] | None) -> Any:
            out = model(input_ids=x, use_cache=True, output_hidden_states=True, **cache)
            if rows is not None:
                hs = out.hidden_states
                if hs is None or len(hs) != len(layers) + 1:
                    raise TracerError(f"output_hidden_states gave {0 if hs is None else len(hs)} entries for "
                                      f"{len(layers)} decoder layers (expected {len(layers) + 1})")
                pieces[run].append(torch.stack([h[0, rows[0]:rows[1]] for h in hs[1:]]))
            return out

        with left.active():
            _each_call(model, plans, call, scen.window)
        return dict(zip(names, count_layers(*_stacked(pieces))))

    return Peer("peer_hf", LABELS["peer_hf"], f"layers 0..{len(layers) - 2} and {norm.name} (HF's last hidden "
                "state is the final norm's output)", run, leftovers=left)


def peer_hooks(loaded: LoadedModel, token_ids: list[int], scen: Scenario, points: list[CapturePoint]) -> Peer:
    """The forward-hook peer (see the module docstring)."""
    layers, _ = _points(points)
    model = loaded.model
    plans = _plans(loaded, token_ids, scen)
    modules = [model.get_submodule(p.module) for p in layers]
    device = model_device(model)
    t_rows = scen.window[1] - scen.window[0]
    held: dict[str, Any] = {"buf": None, "at": None}  # the host buffer (2, L, T, *feature); the call in flight

    def hook(i: int) -> Callable[..., None]:
        def copy(module: Any, args: Any, output: Any) -> None:
            at = held["at"]
            if at is None:
                return
            run, (lo, hi, r0) = at
            t = _tensor(output)
            if held["buf"] is None:  # once: the first run allocates it (the bench's check, before any timing)
                held["buf"] = torch.empty((2, len(modules), t_rows, *t.shape[2:]), dtype=t.dtype,
                                          pin_memory=t.device.type == "cuda")
            held["buf"][run, i, r0:r0 + hi - lo].copy_(t[0, lo:hi], non_blocking=True)

        return copy

    def call(run: int, x: torch.Tensor, cache: dict[str, Any], rows: tuple[int, int, int] | None) -> Any:
        held["at"] = None if rows is None else (run, rows)
        return model(input_ids=x, use_cache=True, **cache)

    def run() -> dict[str, int]:
        handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(modules)]
        try:
            _each_call(model, plans, call, scen.window)
        finally:
            held["at"] = None
            for h in handles:
                h.remove()
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the copies have landed
        buf = held["buf"]
        if buf is None:
            raise TracerError("a run computed none of the compared positions")
        return dict(zip([p.name for p in layers], count_layers(buf[0], buf[1])))

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
    model = loaded.model
    plans = _plans(loaded, token_ids, scen)
    left = Leftovers(model)
    try:
        from nnsight import NNsight

        with left.active():  # NNsight(model) replaces every module's forward: only this peer's runs keep that
            wrapped = NNsight(model)
            envoys = [_envoy(wrapped, p.module) for p in layers]
    except Exception as e:  # noqa: BLE001 - any failure of the optional peer is a reason to skip it
        return Peer("peer_nnsight", LABELS["peer_nnsight"], covers,
                    skipped=f"nnsight cannot wrap the model ({type(e).__name__}: {str(e)[:120]})")

    def run() -> dict[str, int]:
        pieces: list[list[torch.Tensor]] = [[], []]

        def call(run: int, x: torch.Tensor, cache: dict[str, Any], rows: tuple[int, int, int] | None) -> Any:
            if rows is None:
                return model(input_ids=x, use_cache=True, **cache)
            lo, hi = rows[0], rows[1]
            saved: list[Any] = []
            with wrapped.trace(input_ids=x, use_cache=True, **cache):
                for e in envoys:
                    o = e.output
                    saved.append((o[0] if isinstance(o, tuple) else o)[0, lo:hi].save())
                out = wrapped.output.save()
            pieces[run].append(torch.stack(saved))
            return out

        with left.active():
            _each_call(model, plans, call, scen.window)
        return dict(zip([p.name for p in layers], count_layers(*_stacked(pieces))))

    return Peer("peer_nnsight", LABELS["peer_nnsight"], covers, run, leftovers=left)


def _envoy(root: Any, path: str) -> Any:
    """nnsight's proxy of the module at ``path`` (``model.layers.3``)."""
    e = root
    for part in path.split("."):
        e = e[int(part)] if part.isdigit() else getattr(e, part)
    return e


def _plans(loaded: LoadedModel, token_ids: list[int], scen: Scenario) -> tuple[Calls, Calls]:
    """The floor's forward calls of both plans, the ids on the model's device (made once, before any timing).

    Raises:
        TracerError: a scenario whose plans are not plain forward calls (:func:`tracer.loops.floor.check_plain`).
    """
    ids = torch.tensor([token_ids], dtype=torch.long, device=model_device(loaded.model))  # (1, N)
    return forward_inputs(ids, scen)


def make_peers(loaded: LoadedModel, token_ids: list[int], scen: Scenario, points: list[CapturePoint]) -> list[Peer]:
    """Every peer of :data:`PEERS` for this model and scenario (``points``: the run's capture points).

    Raises:
        TracerError: a scenario whose plans are not plain forward calls (:func:`tracer.loops.floor.check_plain`).
    """
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
