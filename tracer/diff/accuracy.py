"""Op-level accuracy replay: how far each run's result is from the exact answer.

For an origin op (its inputs bit-identical in both runs, its output not), the op is replayed on
the CPU in float64 on the captured inputs, which is the exact reference to within float64
rounding (2^-53 relative, far below a bf16/fp16/fp32 ULP). Each run's output is then measured
against it in ULPs of the storage dtype: ``|y - exact| / ulp(exact)``, where ``ulp(x)`` is the
dtype's spacing at ``|x|`` (``2^(floor(log2|x|) - mantissa bits)``, the subnormal spacing below
the smallest normal). An element is *correctly rounded* when its error is at most 0.5 ULP.

Which ops replay, and from which captured points (:mod:`tracer.diff.dataflow` names the inputs):

- ``Linear`` (``nn.Linear`` with or without bias): ``x @ W.T + b`` on the consumed point.
  A reduction over K in the accumulator dtype may legitimately err by up to
  ``gamma * sum_k |x_k W_k| + |b|`` with ``gamma = K * u`` (``u`` = 2^-24 for bf16/fp16/fp32
  accumulated in fp32, 2^-53 for float64): that bound is subtracted before a run is judged.
- RMSNorm (Llama/Qwen/Mistral style ``w * x / sqrt(mean(x^2) + eps)``; Gemma's ``(1 + w)``) and
  ``nn.LayerNorm``; the input is the consumed point, or the sum of the two consumed points for
  a norm after a residual add (``X + attention``, added in the model dtype as the model does).
- activation functions (``act_fn``): the module itself applied to the float64 input.
- the attention core (SDPA): softmax(q k^T * scale + mask) v from the queries, mask rows and scale
  SDPA was given (recorded for the compared window, :mod:`tracer.execute.sdpa_inputs`) and the keys and
  values of the layer's ``kv_cache`` point; its legitimate bound is in :func:`exact_attention`.
- everything else is "not replayable", with the reason.

Verdict per origin (:class:`OpReplay`): a run whose error exceeds the legitimate bound by more
than :data:`DEFECT_ULP` ULP on some element is "defect suspected"; otherwise both runs are
rounding noise around the exact result, and the text says whether one is closer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tracer import schema
from tracer.execute.kinds import PointKind
from tracer.execute.records import RunRecord

#: mantissa bits and minimum normal exponent per storage dtype
_FORMAT = {torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float32: (23, -126), torch.float64: (52, -1022)}
#: unit roundoff of the accumulator a GEMM of this storage dtype uses
_ACC_U = {torch.bfloat16: 2.0 ** -24, torch.float16: 2.0 ** -24, torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}
#: ULPs beyond the legitimate error bound that make a run "defect suspected" (an output rounding
#: and one intermediate rounding, as in HF's RMSNorm, stay below it)
DEFECT_ULP = 2.0
#: largest weight (elements) replayed in float64 (8 bytes each): 64 Mi elements = 512 MiB
MAX_WEIGHT = 64 * 2 ** 20


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at ``|x|`` (float64 tensor ``x`` of any shape; returns float64, same shape).

    Raises:
        KeyError: a dtype other than bfloat16, float16, float32, float64.
    """
    mant, emin = _FORMAT[dtype]
    _, e = torch.frexp(x.abs())  # |x| = m * 2^e, m in [0.5, 1): floor(log2|x|) = e - 1
    exp = torch.where(x == 0, torch.full_like(x, float(emin)), torch.clamp(e.to(torch.float64) - 1, min=emin))
    return torch.exp2(exp - mant)


@dataclass(frozen=True)
class RunError(schema.Record):
    """One run's error against the exact result.

    Attributes:
        max_ulp, mean_ulp: max and mean of ``|y - exact| / ulp(exact)`` over the finite elements.
        correctly_rounded: share of elements within 0.5 ULP (0..1).
        max_excess_ulp: max of ``(|y - exact| - bound) / ulp(exact)``, bound = the op's
            legitimate accumulation error (0 for elementwise ops); > :data:`DEFECT_ULP` = defect.
        worst: flat index of the element furthest beyond the bound (of the largest error when
            none exceeds it).
        n: finite elements measured.
    """

    max_ulp: float
    mean_ulp: float
    correctly_rounded: float
    max_excess_ulp: float
    worst: int
    n: int

    @property
    def defect(self) -> bool:
        return self.max_excess_ulp > DEFECT_ULP

    def schema_extras(self, doc: dict[str, Any]) -> None:
        doc["defect"] = self.defect


def run_error(y: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor | None = None) -> RunError:
    """Error of ``y`` (storage dtype, any shape) against ``exact`` (float64, same shape).

    ``bound``: float64 tensor of the legitimate absolute error per element (None = 0).

    Raises:
        ValueError: different shapes.
    """
    if y.shape != exact.shape:
        raise ValueError(f"output {tuple(y.shape)} and exact result {tuple(exact.shape)} differ in shape")
    yy = y.detach().to("cpu", torch.float64).reshape(-1)
    ee = exact.reshape(-1)
    ok = torch.isfinite(yy) & torch.isfinite(ee)
    u = ulp(ee, y.dtype)
    err = torch.where(ok, (yy - ee).abs() / u, torch.zeros_like(ee))
    excess = err if bound is None else torch.where(ok, ((yy - ee).abs() - bound.reshape(-1)).clamp(min=0) / u, err)
    n = int(ok.sum())
    if n == 0:
        return RunError(0.0, 0.0, 1.0, 0.0, 0, 0)
    return RunError(max_ulp=float(err.max()), mean_ulp=float(err[ok].mean()),
                    correctly_rounded=float((err[ok] <= 0.5).double().mean()),
                    max_excess_ulp=float(excess.max()),
                    worst=int(excess.argmax()) if float(excess.max()) > 0 else int(err.argmax()), n=n)


@dataclass(frozen=True)
class OpReplay(schema.Record):
    """The float64 replay of one op.

    Attributes:
        name, op: capture point and op kind replayed (``Linear``, ``RMSNorm``, ...), or
            ``op = None`` with ``reason`` when it is not replayable.
        errors: run name → :class:`RunError`.
        text: the verdict sentence.
    """

    name: str
    op: str | None
    errors: dict[str, RunError] = field(default_factory=dict)
    reason: str | None = None
    text: str = ""


def _f(x: float) -> str:
    return f"{x:.3g}"


def verdict_text(errors: dict[str, RunError], op: str) -> str:
    """The sentence for two runs' errors (run names in order, as given)."""
    (ra, ea), (rb, eb) = list(errors.items())
    bad = [(r, e) for r, e in ((ra, ea), (rb, eb)) if e.defect]
    if len(bad) == 2:
        return (f"both runs are far from the exact {op} result (max {_f(ea.max_ulp)} and {_f(eb.max_ulp)} ULP, "
                f"beyond what the reduction order explains): defect suspected")
    if bad:
        (r, e), (ro, eo) = bad[0], next((x, y) for x, y in ((ra, ea), (rb, eb)) if x != bad[0][0])
        return (f"run {r} is {_f(e.max_ulp)} ULP from the exact {op} result (run {ro} {_f(eo.max_ulp)} ULP): "
                f"defect suspected in run {r}")
    pa, pb = 100 * ea.correctly_rounded, 100 * eb.correctly_rounded
    head = (f"both runs are within 0.5 ULP of the exact {op} result on {_pct(pa)} % of elements" if pa == pb
            else f"run {ra} is within 0.5 ULP of the exact {op} result on {_pct(pa)} % of elements, run {rb} on {_pct(pb)} %")
    head += f" (max {_f(ea.max_ulp)} vs {_f(eb.max_ulp)} ULP, mean {_f(ea.mean_ulp)} vs {_f(eb.mean_ulp)})"
    if abs(ea.mean_ulp - eb.mean_ulp) <= 0.1 * max(ea.mean_ulp, eb.mean_ulp, 1e-12) or ea.mean_ulp == eb.mean_ulp:
        return f"{head}; neither is more accurate: reduction-order noise, not a defect"
    better = ra if ea.mean_ulp < eb.mean_ulp else rb
    return f"{head}; run {better} is closer on average, both within the rounding bound: reduction-order noise, not a defect"


def _pct(x: float) -> str:
    """A percentage that never rounds a share below 100 up to 100."""
    if x == 100.0:
        return "100"
    text = f"{x:.4g}"
    return text if float(text) < 100 else f"{x:.6f}".rstrip("0")


def _eps(m: nn.Module) -> float:
    for key in ("variance_epsilon", "eps", "epsilon"):
        v = getattr(m, key, None)
        if isinstance(v, (int, float)):
            return float(v)
    raise ValueError(f"{type(m).__name__} has no eps attribute")


def exact_op(module: nn.Module, kind: str, x: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """``(op name, exact float64 output, legitimate error bound or None)`` of ``module`` on ``x``.

    Args:
        module: the op's module (``nn.Linear``, an RMSNorm/LayerNorm, an activation).
        kind: the capture kind (``linear``, ``norm``, ``activation``).
        x: its input, ``(T, *feature)``, storage dtype; the output keeps ``T``.

    Raises:
        ValueError: an op this module cannot replay (the message is the reason).
    """
    x64 = x.detach().to("cpu", torch.float64)
    cls = type(module).__name__
    if kind == PointKind.LINEAR and isinstance(module, nn.Linear):
        if module.weight.numel() > MAX_WEIGHT:
            raise ValueError(f"weight of {module.weight.numel():,} elements is over {MAX_WEIGHT:,} (float64 copy too large)")
        w = module.weight.detach().to("cpu", torch.float64)
        y = x64 @ w.T
        s = x64.abs() @ w.abs().T
        if module.bias is not None:
            b = module.bias.detach().to("cpu", torch.float64)
            y, s = y + b, s + b.abs()
        gamma = module.in_features * _ACC_U.get(module.weight.dtype, 2.0 ** -24)
        return "Linear", y, gamma * s
    if kind == PointKind.NORM and isinstance(module, nn.LayerNorm):
        mu = x64.mean(-1, keepdim=True)
        y = (x64 - mu) / torch.sqrt(((x64 - mu) ** 2).mean(-1, keepdim=True) + module.eps)
        if module.weight is not None:
            y = y * module.weight.detach().to("cpu", torch.float64)
        if module.bias is not None:
            y = y + module.bias.detach().to("cpu", torch.float64)
        return "LayerNorm", y, None
    if kind == PointKind.NORM and "rmsnorm" in cls.lower():
        w = getattr(module, "weight", None)
        width = w.numel() if w is not None else x64.shape[-1]
        xs = x64.reshape(*x64.shape[:-1], -1, width) if x64.shape[-1] != width else x64
        y = xs / torch.sqrt((xs * xs).mean(-1, keepdim=True) + _eps(module))
        if w is not None:
            w64 = w.detach().to("cpu", torch.float64)
            y = y * ((1.0 + w64) if cls.lower().startswith("gemma") else w64)
        return "RMSNorm", y.reshape(x64.shape), None
    if kind == PointKind.ACTIVATION:
        with torch.no_grad():
            y = module(x64)
        if y.dtype != torch.float64:
            raise ValueError(f"{cls} did not compute in float64")
        return cls, y, None
    raise ValueError(f"{cls} ({kind}) is not an op the replay knows (Linear, RMSNorm/LayerNorm, activations)")


def exact_attention(calls: list[dict[str, Any]], kv: torch.Tensor, width: int, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exact, bound)`` of an attention core, float64 ``(T, heads * head_dim_v)``, from the
    recorded SDPA inputs (:mod:`tracer.execute.sdpa_inputs`) and the layer's ``kv_cache`` capture.

    Args:
        calls: the recorded calls, in order (their kept query rows concatenate to the core's T).
        kv: the ``kv_cache`` tensor ``(S_cache, kv_heads * (head_dim_k + head_dim_v))``, keys then
            values, positions ``N - S_cache .. N-1``.
        width: the core's feature width ``heads * head_dim_v``.
        dtype: the storage dtype (the kernels round P to it before the P·V product).

    The bound per element is ``(u + S * u_acc + 2 * ds) * (P @ |V|)``: the rounding of P to the
    storage dtype (``u``), the fp32 accumulation over S keys, and the score error ``ds = D *
    u_acc * scale * max_j |q|·|k_j|`` that becomes a relative error of P.

    Raises:
        ValueError: the recorded calls cannot be replayed (dropout, left padding, the cache does
            not start at position 0, shapes that do not fit).
    """
    u, acc = 2.0 ** -(_FORMAT[dtype][0] + 1), _ACC_U.get(dtype, 2.0 ** -24)
    outs, bounds = [], []
    kv64 = kv.detach().to("cpu", torch.float64)
    for c in calls:
        if c["dropout"]:
            raise ValueError("the attention ran with dropout")
        if c["col"]:
            raise ValueError("the prompt sat at a padded column of a batch")
        q = c["q"].to(torch.float64)  # (H, T, D)
        heads, _, d = q.shape
        dv = width // heads
        if dv * heads != width or kv64.shape[1] % (d + dv):
            raise ValueError(f"head sizes do not fit (heads {heads}, head_dim {d}, core width {width}, cache width {kv64.shape[1]})")
        kvh = kv64.shape[1] // (d + dv)
        s = c["S"]
        if kv64.shape[0] < s or heads % kvh:
            raise ValueError(f"the kv_cache holds {kv64.shape[0]} positions but the call attended {s}")
        k = kv64[:s, :kvh * d].reshape(s, kvh, d).permute(1, 0, 2).repeat_interleave(heads // kvh, 0)  # (H, S, D)
        v = kv64[:s, kvh * d:].reshape(s, kvh, dv).permute(1, 0, 2).repeat_interleave(heads // kvh, 0)
        scale = c["scale"] if c["scale"] is not None else d ** -0.5
        scores = (q @ k.transpose(1, 2)) * scale  # (H, T, S)
        if c["mask"] is not None:
            m = c["mask"]
            scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.to(torch.float64)
        if c["is_causal"]:
            rows = torch.arange(scores.shape[1]).unsqueeze(1) + c["q_offset"]
            scores = scores.masked_fill(torch.arange(s).unsqueeze(0) > rows, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        ds = d * acc * scale * (q.abs() @ k.abs().transpose(1, 2)).amax(-1, keepdim=True)  # (H, T, 1)
        outs.append((p @ v).permute(1, 0, 2).reshape(-1, width))
        bounds.append(((u + s * acc + 2 * ds) * (p @ v.abs())).permute(1, 0, 2).reshape(-1, width))
    if not outs:
        raise ValueError("no SDPA call was recorded for it (eager attention, or packed GQA decode)")
    return torch.cat(outs), torch.cat(bounds)


def _input(point: Any, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The op's input from the captured points it consumes (one point, or X + attention for a
    norm after the residual add)."""
    deps = [d for d in point.consumes.points if not d.endswith(".kv_cache")]
    if len(deps) == 1 and deps[0] in tensors:
        return tensors[deps[0]]
    if len(deps) == 2 and point.kind == PointKind.NORM and all(d in tensors for d in deps):
        return tensors[deps[0]] + tensors[deps[1]]  # the residual add, in the model dtype, as the model does
    raise ValueError(f"its input is not a captured point (consumes {', '.join(deps) or 'nothing'})")


def _replay_core(point: Any, runs: dict[str, dict[str, torch.Tensor]], extras: dict[str, Any]) -> OpReplay:
    kv_name = next((d for d in point.consumes.points if d.endswith(".kv_cache")), None)
    errors: dict[str, RunError] = {}
    try:
        for run, tensors in runs.items():
            calls = (extras.get(run) or {}).get("sdpa", {}).get(point.name)
            if calls is None:
                raise ValueError("its SDPA inputs were not recorded (tracer.run(op_replay=True) records them)")
            if kv_name is None or kv_name not in tensors:
                raise ValueError(f"the layer's kv_cache point was not captured in run {run} (drop --no-kv-cache; "
                                 "a run that keeps no KV cache, as a trainer's forward, has none)")
            y = tensors[point.name]
            exact, bound = exact_attention(calls, tensors[kv_name], int(y.shape[-1]), y.dtype)
            errors[run] = run_error(y, exact.reshape(y.shape), bound.reshape(y.shape))
    except ValueError as e:
        return OpReplay(point.name, None, reason=f"not replayable: {e}", text=f"not replayable ({e})")
    return OpReplay(point.name, "attention", errors=errors, text=verdict_text(errors, "attention"))


def replay_point(model: nn.Module, point: Any, runs: dict[str, dict[str, torch.Tensor]],
                 extras: dict[str, Any] | None = None) -> OpReplay:
    """Replay one compared point (:class:`tracer.diff.result.PointResult`) in float64 for both runs.

    Args:
        model: the model the runs used (its module ``point.name`` is the op).
        point: the compared point (``name``, ``kind``, ``consumes``).
        runs: run name → {capture name → tensor ``(T, *feature)``} (two runs, in order A, B).
        extras: run name → the run's ``RunRecord.extras`` (the attention core needs its recorded
            SDPA inputs, ``extras["sdpa"]``).

    Returns:
        an :class:`OpReplay`; ``op`` None and ``reason`` set when the op is not replayable.
    """
    if point.kind == PointKind.ATTENTION_CORE:
        return _replay_core(point, runs, extras or {})
    try:
        module = model.get_submodule(point.name)
    except AttributeError:
        return OpReplay(point.name, None, reason="not replayable: it is not a module (a virtual capture point)",
                        text="not replayable (not a module)")
    errors: dict[str, RunError] = {}
    op = None
    try:
        for run, tensors in runs.items():
            x = _input(point, tensors)
            op, exact, bound = exact_op(module, point.kind, x)
            y = tensors[point.name]
            errors[run] = run_error(y, exact.reshape(y.shape), None if bound is None else bound.reshape(y.shape))
    except ValueError as e:
        return OpReplay(point.name, None, reason=f"not replayable: {e}", text=f"not replayable ({e})")
    return OpReplay(point.name, op, errors=errors, text=verdict_text(errors, op or "op"))


def replay_origins(model: nn.Module, comparison: Any, run_a: RunRecord, run_b: RunRecord, *, every: bool = False) -> dict[str, OpReplay]:
    """Float64 replay of every origin op (``every``: of every differing op) of ``comparison``.

    Args:
        model: the model both runs used.
        comparison: a :class:`tracer.diff.result.Comparison` of ``run_a`` and ``run_b``.
        run_a, run_b: the two :class:`tracer.execute.records.RunRecord` with their captured tensors (any
            device; copied to the CPU point by point).

    Returns:
        capture name → :class:`OpReplay`, in execution order.
    """
    out: dict[str, OpReplay] = {}
    for p in comparison.points:
        if not (p.origin or (every and p.diverged)) or p.kind == PointKind.KV_CACHE:
            continue
        names = [p.name, *p.consumes.points]
        runs = {}
        for rec in (run_a, run_b):
            got = {n: rec.captures[n].tensor.detach().cpu() for n in names
                   if n in rec.captures and rec.captures[n].tensor.numel()}
            runs[rec.name] = got
        if any(p.name not in r for r in runs.values()):
            out[p.name] = OpReplay(p.name, None, reason="not replayable: tensors not in memory",
                                   text="not replayable (tensors not in memory)")
            continue
        out[p.name] = replay_point(model, p, runs, {run_a.name: run_a.extras, run_b.name: run_b.extras})
    return out
