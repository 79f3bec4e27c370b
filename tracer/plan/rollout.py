"""Rollout vs trainer (RL): the two run plans of ``rollout-vs-train`` and the knobs that may close the gap.

An RL step samples a response with a rollout engine and recomputes the same tokens' logprobs
with the trainer. The two compute the response in different shapes:

- **run A, the rollout** (:class:`RLSpec` role ``rollout``): K prompts (the traced one among
  them) as one left-padded batch, prefilled in one forward pass (GEMM M = K × W, W the longest
  prompt), then the response one token per step from the KV cache (M = K per decode step),
  greedy or sampled with a seed; each sampled token's logprob is recorded from the logits the
  rollout computed (``log_softmax(float32(logits) / τ)``, as an engine reports it).
- **run B, the trainer** (role ``train``): one teacher-forced forward pass over prompt + response
  of the same K sequences, right-padded (M = K × (W + T)) or packed into one row without
  padding, position ids restarting per sequence (M = Σ lengths + K × T), optionally with
  another attention implementation, an fp32 LM head or another dtype.

The compared positions are the traced row's N-1 .. N+T-2 (the positions whose logits give the T
response tokens). This module holds only plain data and pure functions (no torch): the
plans' RL fields (:class:`RLSpec`), their checks, descriptions and GEMM M, and
:func:`mitigation_variants`, the scenario with each knob changed (``--mitigations``). The
scenario builder is :func:`tracer.plan.scenarios.rollout_vs_train`; the executors are in
:mod:`tracer.engines.hf.rollout`; the RL metrics in :mod:`tracer.diff.rl`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from tracer import schema
from tracer.dtypes import FLOATS, canonical
from tracer.errors import TracerError

#: how the trainer lays the K sequences out: right-padded rows, or one packed row
TRAIN_BATCHINGS = ("padded", "packed")
#: the run plan's part of an RL step
ROLES = ("rollout", "train")
#: the largest K (rollouts per step) and T (response tokens) accepted
MAX_ROLLOUTS = 1024
MAX_NEW_TOKENS = 4096
#: ``--mitigations``: the knobs, in the order of the table (``all`` = every knob at once)
KNOBS = ("same-attention", "fp32-lm-head", "no-padding", "batch-of-one", "deterministic", "all")
#: defaults of the clip/mask thresholds (verl ``rollout_is_threshold`` 2.0 and ``rollout_rs`` lower
#: bound 1/upper; TRL ``vllm_importance_sampling_cap`` 2.0, ms-swift
#: ``rollout_importance_sampling_threshold`` 2.0)
DEFAULT_IS_CAP = 2.0
DEFAULT_MASK_THRESHOLD = 2.0


@dataclass(frozen=True)
class RLSpec(schema.Record):
    """The RL part of a run plan (``RunPlan.rl``): which side of an RL step the plan is.

    Attributes:
        role: ``rollout`` (run A: sample token by token from a KV cache) or ``train`` (run B: one
            teacher-forced forward over prompt + response).
        rollouts: K, the sequences of the step (the traced one included).
        row: index of the traced sequence among the K.
        lengths: the K prompt lengths; ``lengths[row]`` is N. The other prompts are the traced one
            rotated by a row-dependent offset, as :func:`tracer.engines.hf.run.batch_inputs` builds them.
        new_tokens: T, response tokens per sequence (no early stop: every sequence gets T).
        sample: sample from ``softmax(logits / temperature)`` with a seeded generator (else greedy).
        temperature: τ; the logprobs of both runs are ``log_softmax(logits / τ)`` (τ = 1 when greedy).
        seed: the sampling generator's seed.
        batching: ``train`` only: ``padded`` or ``packed`` (:data:`TRAIN_BATCHINGS`).
        lm_head_fp32: compute the LM head in float32 (hidden state and weight up-cast).
        dtype: ``train`` only: the dtype the trainer runs in (None = the model's); weights are cast
            for the run and back afterwards.
    """

    role: str
    rollouts: schema.Count
    row: schema.Count
    lengths: tuple[schema.Count, ...]
    new_tokens: schema.Count
    sample: bool = False
    temperature: float = 1.0
    seed: int = 0
    batching: str = "padded"
    lm_head_fp32: bool = False
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise TracerError(f"RL plan role {self.role!r} is not one of {', '.join(ROLES)}")
        if len(self.lengths) != self.rollouts:
            raise TracerError(f"{self.rollouts} rollouts need {self.rollouts} prompt lengths, got {len(self.lengths)}")
        if not 0 <= self.row < self.rollouts:
            raise TracerError(f"--batch-row {self.row} is outside 0..{self.rollouts - 1}; choose a row of the rollouts")
        if self.batching not in TRAIN_BATCHINGS:
            raise TracerError(f"unknown --train-batching {self.batching!r}; use one of: {', '.join(TRAIN_BATCHINGS)}")

    @property
    def width(self) -> int:
        """W, the longest prompt (the rollout's left-padded prefill width)."""
        return max(self.lengths)

    @property
    def tau(self) -> float:
        """The temperature the logprobs are taken at (1 when greedy)."""
        return float(self.temperature) if self.sample else 1.0

    def gemm_m(self, flattened: bool = False) -> list[int]:
        """GEMM M of every forward pass: the rollout's prefill (K × W padded; Σ lengths ``flattened``, as
        vLLM schedules requests) then its T-1 decode steps (K each); the trainer's one pass (K × (W + T)
        padded, Σ lengths + K × T packed)."""
        k, t = self.rollouts, self.new_tokens
        if self.role == "rollout":
            return [sum(self.lengths) if flattened else k * self.width] + [k] * (t - 1)
        if self.batching == "packed":
            return [sum(self.lengths) + k * t]
        return [k * (self.width + t)]

    def describe(self, attn: str | None = None) -> str:
        """One line for people (``rollout: 4 prompts left-padded to 80 prefilled in one pass, then 15 decode
        steps ...``); the GEMM M of each pass is :meth:`gemm_m`'s."""
        k, t, w = self.rollouts, self.new_tokens, self.width
        pad = "left-padded to " if len(set(self.lengths)) > 1 else "all of length "
        head = " (fp32 LM head)" if self.lm_head_fp32 else ""
        if self.role == "rollout":  # GEMM M per step: the plan line's (gemm_m), said once there
            how = f"sampled at τ={self.temperature:g}, seed {self.seed}" if self.sample else "greedy"
            return (f"rollout: {k} prompt{'s' if k != 1 else ''} {pad}{w} prefilled in one pass, then {t - 1} decode "
                    f"steps from the KV cache, {how}{head}")
        layout = (f"packed into one row of {sum(self.lengths) + k * t} tokens, position ids restarting per sequence"
                  if self.batching == "packed" else f"right-padded to {w + t}")
        extra = "".join(f", {x}" for x in (f"attention {attn}" if attn else "", self.dtype or "") if x)
        return (f"trainer: one teacher-forced forward over prompt + response of the {k} sequence"
                f"{'s' if k != 1 else ''}, {layout}{extra}{head}")


def _check_int(value: Any, option: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise TracerError(f"{option} {value!r} must be a whole number in {lo}..{hi}")
    return value


def _check_positive(value: Any, option: str, above: float, example: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= above:
        raise TracerError(f"{option} {value!r} must be a finite number above {above:g}; e.g. {option} {example}")
    return float(value)


#: the smallest temperature accepted: below it ``float32(logits) / τ`` leaves float32's range for
#: ordinary logits (|logit| · 10⁵ already; at τ = 1e-300 every logit is ±inf and softmax NaN), and
#: engines sample greedily there anyway (vLLM: τ < 1e-5 is greedy)
MIN_TEMPERATURE = 1e-5


def check_rl_thresholds(*, temperature: float | None = None, is_cap: float | None = None,
                        mask_threshold: float | None = None) -> None:
    """Validate the temperature of the logprobs and the TIS/MIS thresholds (those given).

    Raises:
        TracerError: a value that is not a finite number above its floor (τ, C > 0; β > 1), or a
            temperature below :data:`MIN_TEMPERATURE` (``logits / τ`` would overflow).
    """
    if temperature is not None:
        _check_positive(temperature, "--temperature", 0.0, "0.7")
        if temperature < MIN_TEMPERATURE:
            raise TracerError(f"--temperature {temperature!r} is below {MIN_TEMPERATURE:g}: float32(logits) / τ leaves "
                              f"float32's range (logits become ±inf, the probabilities NaN), and engines sample greedily there "
                              f"(vLLM: τ < {MIN_TEMPERATURE:g}); drop --sample for greedy decoding, or give τ >= "
                              f"{MIN_TEMPERATURE:g}")
    if is_cap is not None:
        _check_positive(is_cap, "--is-cap", 0.0, "2")
    if mask_threshold is not None:
        _check_positive(mask_threshold, "--mask-threshold", 1.0, "2")


def check_rl_options(*, rollouts: int, new_tokens: int, sample: bool, temperature: float | None, seed: int | None,
                     train_batching: str, train_dtype: str | None, is_cap: float, mask_threshold: float) -> None:
    """Validate the ``rollout-vs-train`` options (before any model loads).

    Raises:
        TracerError: a count out of range, a non-positive temperature or threshold, ``--temperature``
            or ``--seed`` without ``--sample``, an unknown batching or dtype.
    """
    _check_int(rollouts, "--rollouts", 1, MAX_ROLLOUTS)
    _check_int(new_tokens, "--new-tokens", 1, MAX_NEW_TOKENS)
    if not sample and (temperature is not None or seed is not None):
        given = "--temperature" if temperature is not None else "--seed"
        raise TracerError(f"{given} applies to sampled rollouts; add --sample (greedy decoding has no temperature or seed)")
    check_rl_thresholds(temperature=temperature)
    if seed is not None:
        _check_int(seed, "--seed", 0, 2**63 - 1)
    if train_batching not in TRAIN_BATCHINGS:
        raise TracerError(f"unknown --train-batching {train_batching!r}; use one of: {', '.join(TRAIN_BATCHINGS)}")
    if train_dtype is not None:
        canonical(train_dtype)  # the table alone: no torch import before a model loads
    check_rl_thresholds(is_cap=is_cap, mask_threshold=mask_threshold)


#: ``--decode`` on an RL step (its executors refuse it too)
DECODE_REFUSED = ("--decode does not apply to rollout-vs-train: the rollout's own response is compared; "
                  "drop --decode (use --new-tokens for its length)")


def train_dtype_error(train_dtype: str, model_dtype: str) -> str | None:
    """Why the trainer cannot run in ``train_dtype`` on a model in ``model_dtype`` (None: it can): the
    weights are cast for the trainer's pass and back, which is exact only when widening."""
    t, m = canonical(train_dtype), canonical(model_dtype)
    if t == m or FLOATS[t].bits > FLOATS[m].bits:
        return None
    return (f"--train-dtype {train_dtype} is not wider than the model's {m}; the weights could not be cast back bit "
            "for bit: load the model in that dtype, or use float32/float64")


def check_rl_run(scen: Any, model_dtype: str, decode: int) -> None:
    """The checks of a planned RL step (``scen``: a :class:`~tracer.plan.scenarios.Scenario`) that need
    the run's other options, before the model loads: ``--decode`` and ``--train-dtype`` against the
    model's dtype. A scenario that is no RL step passes.

    Raises:
        TracerError: ``decode`` set, or a trainer dtype narrower than (or as wide as, but not) the model's.
    """
    b = getattr(scen.plan_b, "rl", None)
    if b is None:
        return
    if decode:
        raise TracerError(DECODE_REFUSED)
    why = train_dtype_error(b.dtype, model_dtype) if b.dtype is not None else None
    if why is not None:
        raise TracerError(why)


def rl_specs(*, n_tokens: int, lengths: tuple[int, ...], row: int, new_tokens: int, sample: bool,
             temperature: float, seed: int, train_batching: str, lm_head_fp32: bool,
             train_dtype: str | None) -> tuple[RLSpec, RLSpec]:
    """The rollout's and the trainer's :class:`RLSpec` for a prompt of ``n_tokens`` at ``row``.

    Raises:
        TracerError: ``lengths[row]`` is not N, or a bad field (see :class:`RLSpec`).
    """
    if not 0 <= row < len(lengths):
        raise TracerError(f"--batch-row {row} is outside 0..{len(lengths) - 1}; choose a row of the rollouts")
    if lengths[row] != n_tokens:
        raise TracerError(f"the traced row {row} must hold the {n_tokens}-token prompt, not {lengths[row]} tokens")
    common = dict(rollouts=len(lengths), row=row, lengths=tuple(lengths), new_tokens=new_tokens, sample=bool(sample),
                  temperature=float(temperature), seed=int(seed))
    a = RLSpec("rollout", **common)
    b = RLSpec("train", **common, batching=train_batching, lm_head_fp32=bool(lm_head_fp32), dtype=train_dtype)
    return a, b


def _with_specs(scen: Any, a: RLSpec, b: RLSpec, attn_b: Any = "keep", deterministic: bool | None = None) -> Any:
    """``scen`` with new RL specs (and optionally run B's attention / both runs' deterministic flag),
    descriptions and recorded parameters updated."""
    pa, pb = scen.plan_a, scen.plan_b
    attn = pb.attn if attn_b == "keep" else attn_b
    det_a = pa.deterministic if deterministic is None else deterministic
    det_b = pb.deterministic if deterministic is None else deterministic
    tail = " (deterministic)" if deterministic else ""
    pa = replace(pa, rl=a, deterministic=det_a, description=a.describe() + tail)
    pb = replace(pb, rl=b, attn=attn, deterministic=det_b, description=b.describe(attn) + tail)
    params = {**scen.params, "rollouts": a.rollouts, "batch_row": a.row, "lengths": list(a.lengths),
              "train_attn": attn, "lm_head_fp32": b.lm_head_fp32}
    return replace(scen, plan_a=pa, plan_b=pb, params=params)


def mitigation_variants(scen: Any) -> list[tuple[str, str, Any]]:
    """The ``rollout-vs-train`` scenario with each knob of :data:`KNOBS` changed, for ``--mitigations``.

    Knobs: ``same-attention`` (run B uses the rollout's attention implementation), ``fp32-lm-head``
    (both runs compute the LM head in float32), ``no-padding`` (every prompt has the traced one's
    length N, so neither run pads), ``batch-of-one`` (K = 1: the traced sequence alone on both
    sides), ``deterministic`` (both runs under torch's deterministic algorithms), ``all`` (every
    knob at once).

    Returns:
        ``[(knob, what it changes, scenario or None)]``; None when the knob changes nothing here
        (already so in the base run: its numbers are the base run's).
    """
    a, b = scen.plan_a.rl, scen.plan_b.rl
    n = a.lengths[a.row]
    out: list[tuple[str, str, Any]] = []

    def add(knob: str, what: str, changed: bool, new: Any) -> None:
        out.append((knob, what, new if changed else None))

    add("same-attention", "run B uses the rollout's attention implementation", scen.plan_b.attn is not None,
        _with_specs(scen, a, b, attn_b=None))
    add("fp32-lm-head", "both runs compute the LM head in float32", not (a.lm_head_fp32 and b.lm_head_fp32),
        _with_specs(scen, replace(a, lm_head_fp32=True), replace(b, lm_head_fp32=True)))
    equal = (n,) * a.rollouts
    add("no-padding", f"every prompt {n} tokens: no padding in either run", a.lengths != equal,
        _with_specs(scen, replace(a, lengths=equal), replace(b, lengths=equal)))
    one = dict(rollouts=1, row=0, lengths=(n,))
    add("batch-of-one", "K = 1: the traced sequence alone in both runs", a.rollouts != 1,
        _with_specs(scen, replace(a, **one), replace(b, **one)))
    add("deterministic", "torch deterministic algorithms in both runs",
        not (scen.plan_a.deterministic and scen.plan_b.deterministic), _with_specs(scen, a, b, deterministic=True))
    every = dict(lm_head_fp32=True, **one)
    add("all", "every knob above at once", True,
        _with_specs(scen, replace(a, **every), replace(b, **every), attn_b=None, deterministic=True))
    return out


__all__ = ["RLSpec", "TRAIN_BATCHINGS", "KNOBS", "DEFAULT_IS_CAP", "DEFAULT_MASK_THRESHOLD", "check_rl_options",
           "check_rl_run", "check_rl_thresholds", "train_dtype_error", "DECODE_REFUSED",
           "rl_specs", "mitigation_variants"]
