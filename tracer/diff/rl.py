"""RL metrics of ``rollout-vs-train``: the rollout/trainer logprob mismatch as RL stacks log it.

Over the K × T response tokens y of one RL step (K sequences of T tokens), with ``logp_A`` the
rollout's logprob of y (run A, recorded while sampling) and ``logp_B`` the trainer's (run B,
teacher-forced), both ``log_softmax(float32(logits) / τ)[y]``:

- ``Δlogp = logp_B − logp_A`` per token (float64 difference of the two float32 values); mean,
  max and 99th percentile (linear interpolation) of ``|Δlogp|``, and a histogram by decade
  (:data:`HIST_LABELS`). slime/Miles log ``train_rollout_logprob_abs_diff`` (the mean), TRL
  ``sampling_logp_difference``.
- ``k1 = mean(logp_A − logp_B)`` and ``k3 = mean(r − 1 − log r)`` with ``r = exp(Δlogp)``:
  Schulman's estimators of ``KL(π_rollout ‖ π_train)`` from the sampled tokens (verl
  ``mismatch_kl`` / ``mismatch_k3_kl``; k3 ≥ 0 for every token).
- full-vocabulary ``KL(A ‖ B) = Σ_v p_A(v) (log p_A(v) − log p_B(v))`` per position, in float64
  from both runs' logits at τ; mean and max (SkyRL #2201 asks for it instead of sampled-token means).
- importance ratios: per token ``r_t = exp(Δlogp_t)``, per sequence ``R = exp(Σ_t Δlogp_t)``; min and max.
- the share a correction would touch: TIS truncates ratios above the cap C (``--is-cap``;
  share of tokens, and of sequences, with r > C); MIS / IcePop masks ratios outside
  ``[1/β, β]`` (``--mask-threshold`` β; share of tokens and of sequences outside).
- ``rollout_ppl = mean_seq exp(−mean_t logp_A)``, ``train_ppl`` the same of ``logp_B``, and their
  ratio ``train_ppl / rollout_ppl`` (verl ``rollout_corr`` PPL metrics).
- argmax flips: positions (of all K × T) whose argmax differs between the two runs' logits.

Plus the per-token picture of the traced sequence (:class:`TokenStep`: which response position
first differs, and how the gap grows along the response) and, with ``--mitigations``, one
:class:`KnobResult` per knob. The results are frozen dataclasses deriving from
:class:`tracer.schema.Record`: their documents (``to_dict``, ``from_dict``) come from their fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from numpy.typing import ArrayLike

from tracer import schema
from tracer.diff.positions import one_device
from tracer.dtypes import INT_VIEW
from tracer.errors import TracerError
from tracer.execute.kinds import PointKind
from tracer.execute.records import RunRecord

if TYPE_CHECKING:
    from tracer.plan.scenarios import Scenario

#: upper edges of the |Δlogp| histogram bins after the first (exactly 0): ≤1e-8, (1e-8, 1e-7], ..., (0.1, 1], > 1
HIST_EDGES = tuple(10.0 ** e for e in range(-8, 1))
HIST_LABELS = ("0", "≤1e-8", *(f"≤1e{e}" for e in range(-7, 0)), "≤1", ">1")


@dataclass(frozen=True)
class TokenStep(schema.Record):
    """One response token of the traced sequence.

    Attributes:
        step: i, 0-based among the T response tokens.
        position: its logits' position in the sequence (N - 1 + i).
        token: the sampled token y_i.
        logp_a, logp_b: the rollout's and the trainer's logprob of y_i.
        dlogp: ``logp_b − logp_a``.
        kl: full-vocabulary ``KL(A ‖ B)`` at this position (None without the logits).
        logits_differ: logits elements that differ (bits; values when the dtypes differ).
        logits_max_abs: max |Δ| of the logits at this position.
        flip: the two runs' argmax differ here.
        first_point: the first capture point, in execution order, that differs at this position
            (None: none differs, or the per-position statistics are binned).
        last_layer_max_abs: max |Δ| of the last decoder layer's output at this position.
    """

    step: int
    position: int
    token: int
    logp_a: float
    logp_b: float
    dlogp: float
    kl: float | None = None
    logits_differ: int | None = None
    logits_max_abs: float | None = None
    flip: bool | None = None
    first_point: str | None = None
    last_layer_max_abs: float | None = None


@dataclass(frozen=True)
class KnobResult(schema.Record):
    """One row of the ``--mitigations`` table.

    Attributes:
        knob: a name of :data:`tracer.plan.rollout.KNOBS`.
        what: what it changes.
        ran: False when the knob changes nothing here (the numbers are the base run's).
        mean_abs_dlogp, max_abs_dlogp, k3_kl: as in :class:`RLComparison`.
        identical: both runs bit-identical at every compared capture point and logprob.
        first_divergent: the first capture point that differs (None when identical).
    """

    knob: str
    what: str
    ran: bool
    mean_abs_dlogp: float
    max_abs_dlogp: float
    k3_kl: float
    identical: bool
    first_divergent: str | None = None


@dataclass(frozen=True)
class RLComparison(schema.Record):
    """The RL metrics of one ``rollout-vs-train`` run (formulas in the module docstring).

    Attributes:
        rollouts, new_tokens, row: K, T and the traced sequence's index.
        tau, sample: the temperature of the logprobs, and whether the rollout sampled (else greedy).
        is_cap, mask_threshold: TIS cap C and MIS/IcePop threshold β.
        n_tokens: K × T.
        mean_abs_dlogp, max_abs_dlogp, p99_abs_dlogp, mean_dlogp: of ``Δlogp`` over the tokens.
        n_equal: tokens whose two logprobs are bit-identical.
        hist: token counts per :data:`HIST_LABELS` bin of ``|Δlogp|``.
        k1_kl, k3_kl: the sampled-token KL estimators.
        vocab_kl_mean, vocab_kl_max: full-vocabulary KL(A ‖ B) over the positions (None without logits).
        token_ratio_min, token_ratio_max, seq_ratio_min, seq_ratio_max: importance ratios.
        tis_clipped, seq_tis_clipped: share of tokens / sequences with ratio > C.
        mis_masked, seq_mis_masked: share of tokens / sequences with ratio outside [1/β, β].
        rollout_ppl, train_ppl, ppl_ratio: perplexities of the response and train/rollout.
        argmax_flips: positions (of K × T) whose argmax differs (None without logits).
        first_divergent_step: the traced sequence's first response step whose logits differ (None: none).
        steps: the traced sequence's :class:`TokenStep` per response token.
        tokens, logp_a, logp_b, dlogp: K × T, per sequence and step.
        vocab_kl: K × T full-vocabulary KL (None without logits).
        mitigations: one :class:`KnobResult` per knob (``--mitigations``), else empty.
        notes: one line each (cross-dtype comparison, ...).
        tokens_from: where the tokens come from when not from this run's rollout (two engine
            dumps: the sequence's own tokens; None: greedy or sampled by the rollout, per ``sample``).
    """

    rollouts: int
    new_tokens: int
    row: int
    tau: float
    sample: bool
    is_cap: float
    mask_threshold: float
    n_tokens: int
    mean_abs_dlogp: float
    max_abs_dlogp: float
    p99_abs_dlogp: float
    mean_dlogp: float
    n_equal: int
    hist: tuple[int, ...]
    k1_kl: float
    k3_kl: float
    vocab_kl_mean: float | None
    vocab_kl_max: float | None
    token_ratio_min: float
    token_ratio_max: float
    seq_ratio_min: float
    seq_ratio_max: float
    tis_clipped: float
    seq_tis_clipped: float
    mis_masked: float
    seq_mis_masked: float
    rollout_ppl: float
    train_ppl: float
    ppl_ratio: float
    argmax_flips: int | None
    first_divergent_step: int | None
    steps: tuple[TokenStep, ...]
    tokens: tuple[tuple[int, ...], ...]
    logp_a: tuple[tuple[float, ...], ...]
    logp_b: tuple[tuple[float, ...], ...]
    dlogp: tuple[tuple[float, ...], ...]
    vocab_kl: tuple[tuple[float, ...], ...] | None = None
    mitigations: tuple[KnobResult, ...] = ()
    notes: tuple[str, ...] = ()
    tokens_from: str | None = None

    @property
    def identical(self) -> bool:
        """Every token's two logprobs are bit-identical."""
        return self.n_equal == self.n_tokens


def _histogram(absd: np.ndarray) -> tuple[int, ...]:
    """Counts per :data:`HIST_LABELS` bin: exactly 0, then (0, 1e-8], (1e-8, 1e-7], ..., (0.1, 1], > 1."""
    rest = absd[absd > 0]
    idx = np.searchsorted(np.asarray(HIST_EDGES), rest, side="left")  # edges[i-1] < x <= edges[i]
    counts = np.bincount(idx, minlength=len(HIST_EDGES) + 1)
    return (int((absd == 0).sum()), *(int(c) for c in counts))


def _share(mask: np.ndarray) -> float:
    return float(mask.mean()) if mask.size else 0.0


def _exp(x: float) -> float:
    return math.exp(x) if x < 709.0 else math.inf


def vocab_kl(logits_a: torch.Tensor, logits_b: torch.Tensor, tau: float) -> torch.Tensor:
    """``KL(softmax(a/τ) ‖ softmax(b/τ))`` per position, in float64.

    Args:
        logits_a, logits_b: ``(K, T, vocab)`` of any float dtypes.

    Returns:
        ``(K, T)`` float64 (NaN where a logit is NaN).
    """
    out = torch.empty(logits_a.shape[:-1], dtype=torch.float64)
    for j in range(logits_a.shape[0]):  # one sequence at a time: bounded float64 memory
        la = torch.log_softmax(logits_a[j].to("cpu", torch.float64) / tau, dim=-1)
        lb = torch.log_softmax(logits_b[j].to("cpu", torch.float64) / tau, dim=-1)
        out[j] = (la.exp() * (la - lb)).sum(-1)
    return out


def _differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise: bits differ (same dtype), or values differ (different dtypes, compared in float64)."""
    if a.dtype == b.dtype:
        return a.view(INT_VIEW[a.dtype]) != b.view(INT_VIEW[a.dtype])
    return a.to(torch.float64) != b.to(torch.float64)


def rl_metrics(tokens: ArrayLike, logp_a: ArrayLike, logp_b: ArrayLike, *, tau: float, sample: bool, row: int, is_cap: float,
               mask_threshold: float, logits_a: torch.Tensor | None = None,
               logits_b: torch.Tensor | None = None, window_start: int = 0) -> RLComparison:
    """The RL metrics of one step from the two runs' logprobs (and logits) of the sampled tokens.

    Args:
        tokens: K × T sampled token ids.
        logp_a, logp_b: K × T logprobs of the rollout and of the trainer (float32 values).
        tau: the temperature they were taken at; sample: whether the rollout sampled.
        row: the traced sequence; window_start: its first response position (N - 1).
        is_cap, mask_threshold: TIS cap C and MIS/IcePop β.
        logits_a, logits_b: ``(K, T, vocab)`` logits at the response positions (None: the
            full-vocabulary KL, flips and per-step logits columns are left out).

    Returns:
        an :class:`RLComparison` without per-point columns or mitigations (see :func:`rl_comparison`).

    Raises:
        TracerError: the inputs' shapes disagree.
    """
    tok = np.asarray(tokens, dtype=np.int64)
    la, lb = np.asarray(logp_a, dtype=np.float32), np.asarray(logp_b, dtype=np.float32)
    if tok.ndim != 2 or la.shape != tok.shape or lb.shape != tok.shape:
        raise TracerError(f"RL metrics need K x T tokens and logprobs; got {tok.shape}, {la.shape}, {lb.shape}")
    k, t = tok.shape
    d = lb.astype(np.float64) - la.astype(np.float64)  # (K, T)
    absd = np.abs(d)
    r = np.exp(np.minimum(d, 709.0))
    seq = d.sum(axis=1)  # (K,)
    seq_r = np.array([_exp(float(s)) for s in seq])
    lo, hi = 1.0 / mask_threshold, mask_threshold
    ppl_a = float(np.mean(np.exp(-la.astype(np.float64).mean(axis=1))))
    ppl_b = float(np.mean(np.exp(-lb.astype(np.float64).mean(axis=1))))
    kl = flips = first = None
    if logits_a is not None and logits_b is not None:
        logits_a, logits_b = one_device(logits_a, logits_b)  # a GPU rollout against a CPU trainer
        kl = vocab_kl(logits_a, logits_b, tau).numpy()
        flip = (logits_a.to(torch.float64).argmax(-1) != logits_b.to(torch.float64).argmax(-1)).cpu()
        flips = int(flip.sum())
        differ = _differ(logits_a[row], logits_b[row]).sum(-1).cpu()  # (T,)
        first = next((i for i in range(t) if int(differ[i])), None)
    steps = tuple(TokenStep(step=i, position=window_start + i, token=int(tok[row, i]), logp_a=float(la[row, i]),
                            logp_b=float(lb[row, i]), dlogp=float(d[row, i]),
                            kl=None if kl is None else float(kl[row, i])) for i in range(t))
    if logits_a is not None and logits_b is not None:
        diff = (logits_a[row].to(torch.float64) - logits_b[row].to(torch.float64)).abs().amax(-1).cpu()
        steps = tuple(replace(s, logits_differ=int(differ[s.step]), logits_max_abs=float(diff[s.step]),
                              flip=bool(flip[row, s.step])) for s in steps)
    return RLComparison(
        rollouts=k, new_tokens=t, row=row, tau=float(tau), sample=bool(sample), is_cap=float(is_cap),
        mask_threshold=float(mask_threshold), n_tokens=k * t, mean_abs_dlogp=float(absd.mean()),
        max_abs_dlogp=float(absd.max()), p99_abs_dlogp=float(np.quantile(absd, 0.99)), mean_dlogp=float(d.mean()),
        n_equal=int((la.view(np.int32) == lb.view(np.int32)).sum()), hist=_histogram(absd.ravel()),
        k1_kl=float((-d).mean()), k3_kl=float((r - 1.0 - d).mean()),
        vocab_kl_mean=None if kl is None else float(kl.mean()), vocab_kl_max=None if kl is None else float(kl.max()),
        token_ratio_min=float(r.min()), token_ratio_max=float(r.max()), seq_ratio_min=float(seq_r.min()),
        seq_ratio_max=float(seq_r.max()), tis_clipped=_share(r > is_cap), seq_tis_clipped=_share(seq_r > is_cap),
        mis_masked=_share((r < lo) | (r > hi)), seq_mis_masked=_share((seq_r < lo) | (seq_r > hi)),
        rollout_ppl=ppl_a, train_ppl=ppl_b, ppl_ratio=ppl_b / ppl_a, argmax_flips=flips, first_divergent_step=first,
        steps=steps, tokens=tuple(tuple(int(x) for x in rw) for rw in tok),
        logp_a=tuple(tuple(float(x) for x in rw) for rw in la), logp_b=tuple(tuple(float(x) for x in rw) for rw in lb),
        dlogp=tuple(tuple(float(x) for x in rw) for rw in d),
        vocab_kl=None if kl is None else tuple(tuple(float(x) for x in rw) for rw in kl))


def rl_from_logits(positions: list[int], tokens: list[int], logits_a: torch.Tensor, logits_b: torch.Tensor, *,
                   tau: float = 1.0, is_cap: float = 2.0, mask_threshold: float = 2.0,
                   per_position: dict[str, Any] | None = None, notes: tuple[str, ...] = ()) -> RLComparison:
    """The RL metrics of one sequence from two runs' logits at its response positions (two engine
    dumps: a rollout engine's and a trainer's): each side's logprob of the next token
    ``log_softmax(float32(logits) / τ)[y]`` (:func:`tracer.execute.sampling.token_logprobs`), then
    :func:`rl_metrics` with K = 1, and the per-token columns from the layer comparison.

    Args:
        positions: T consecutive positions p (the logits that predict token p + 1).
        tokens: the T tokens y_p at p + 1 (the sequence's own: sampled by the rollout, teacher-forced
            in the trainer).
        logits_a, logits_b: ``(T, vocab)`` logits of the rollout (A) and the trainer (B), any float dtypes.
        tau, is_cap, mask_threshold: τ of the logprobs, TIS cap C and MIS/IcePop β.
        per_position: the comparison's per-position statistics (first differing point per position).
        notes: lines carried into the result.

    Raises:
        TracerError: positions that are not consecutive, shapes that disagree.
    """
    from tracer.execute.sampling import token_logprobs

    if not positions or list(positions) != list(range(positions[0], positions[0] + len(positions))):
        raise TracerError(f"RL metrics need consecutive response positions; got {positions[:6]}")
    if logits_a.shape != logits_b.shape or logits_a.shape[0] != len(tokens) or len(tokens) != len(positions):
        raise TracerError(f"RL metrics need (T, vocab) logits of both runs for T tokens; got {tuple(logits_a.shape)}, "
                          f"{tuple(logits_b.shape)} for {len(tokens)} tokens")
    y = torch.tensor(tokens, dtype=torch.long)
    la, lb = token_logprobs(logits_a, y, tau), token_logprobs(logits_b, y, tau)
    m = rl_metrics([tokens], [la.tolist()], [lb.tolist()], tau=tau, sample=False, row=0, is_cap=is_cap,
                   mask_threshold=mask_threshold, logits_a=logits_a[None], logits_b=logits_b[None],
                   window_start=positions[0])
    return replace(m, steps=_per_position_columns(m.steps, per_position), notes=tuple(notes),
                   tokens_from=f"dumped tokens, τ={tau:g}")


def _per_position_columns(steps: tuple[TokenStep, ...], per_position: dict[str, Any] | None) -> tuple[TokenStep, ...]:
    """Fill ``first_point`` and ``last_layer_max_abs`` of each step from the comparison's per-position data."""
    if not per_position or per_position.get("bin", 1) != 1:
        return steps
    names, kinds = per_position["names"], per_position["kinds"]
    nd, mx = per_position["n_diff"], per_position["max_abs_diff"]
    start = per_position["start"]
    layers = [i for i, kd in enumerate(kinds) if kd == PointKind.LAYER]
    out = []
    for s in steps:
        col = s.position - start
        if not 0 <= col < len(nd[0] if nd else []):
            out.append(s)
            continue
        first = next((names[c] for c in range(len(names)) if nd[c][col]), None)
        last = float(mx[layers[-1]][col]) if layers else None
        out.append(replace(s, first_point=first, last_layer_max_abs=last))
    return tuple(out)


def is_rl(scen: Scenario) -> bool:
    """Whether ``scen`` is an RL step (its run B is a trainer plan: ``plan_b.rl``)."""
    rl = getattr(scen.plan_b, "rl", None)
    return rl is not None and rl.role == "train"


def comparable(a: RunRecord, b: RunRecord) -> tuple[RunRecord, RunRecord, tuple[str, ...]]:
    """The records to hand to :func:`tracer.diff.compare.compare_records` and extra notes: the records
    as they are (an fp32 LM head or another trainer dtype is compared by
    :func:`tracer.diff.compare.compare_pairs` itself: values in the wider dtype, ULPs in the coarser,
    :mod:`tracer.diff.crossdtype`, and its header note says so), no notes."""
    return a, b, ()


def rl_comparison(a: RunRecord, b: RunRecord, params: dict[str, Any], comparison: Any = None,
                  notes: tuple[str, ...] = ()) -> RLComparison:
    """The :class:`RLComparison` of a rollout record ``a`` and a trainer record ``b``.

    Args:
        a, b: the records of :func:`tracer.engines.hf.rollout.execute_rollout` / ``execute_train``
            (``meta["rollout"]``/``meta["train"]``; ``extras["rl_logits"]`` when in memory).
        params: the scenario's parameters (``is_cap``, ``mask_threshold``, ``sample``).
        comparison: the layer comparison, for the per-token columns (first differing point, last
            layer's max |Δ| per position).
        notes: lines carried into the result.

    Raises:
        TracerError: the records are not a rollout and a trainer run of one step.
    """
    ro, tr = a.meta.get("rollout"), b.meta.get("train")
    if not isinstance(ro, dict) or not isinstance(tr, dict):
        raise TracerError(f"runs {a.name} and {b.name} are not a rollout and a trainer run; "
                          "RL metrics need the rollout-vs-train scenario")
    la, lb = a.extras.get("rl_logits"), b.extras.get("rl_logits")
    row, tokens = int(ro["row"]), ro["tokens"]
    m = rl_metrics(tokens, ro["logprobs"], tr["logprobs"], tau=float(ro["tau"]),
                   sample=bool(params.get("sample", False)), row=row,
                   is_cap=float(params.get("is_cap", 2.0)), mask_threshold=float(params.get("mask_threshold", 2.0)),
                   logits_a=la, logits_b=lb, window_start=len(ro["sequences"][row]) - len(tokens[row]) - 1)  # N - 1
    steps = m.steps if comparison is None else _per_position_columns(m.steps, comparison.per_position)
    return replace(m, steps=steps, notes=tuple(notes))


def knob_result(knob: str, what: str, comparison: Any) -> KnobResult:
    """A ``--mitigations`` row from the comparison of the scenario with the knob changed (its ``rl`` set)."""
    rl = comparison.rl
    return KnobResult(knob=knob, what=what, ran=True, mean_abs_dlogp=rl.mean_abs_dlogp,
                      max_abs_dlogp=rl.max_abs_dlogp, k3_kl=rl.k3_kl,
                      identical=bool(comparison.identical and rl.identical),
                      first_divergent=comparison.first_divergent)


def mitigation_table(variants: list[tuple[str, str, Scenario | None]], base: Any, run: Callable[[Scenario], Any],
                     say: Callable[[str], None] | None = None) -> tuple[KnobResult, ...]:
    """One :class:`KnobResult` per knob: ``run(scenario)`` (→ a comparison with ``rl``) for each
    changed scenario of ``variants`` (:func:`tracer.plan.rollout.mitigation_variants`); a knob
    that changes nothing gets the ``base`` comparison's numbers with ``ran`` False. ``say`` gets
    one line per knob run."""
    rows = []
    for knob, what, scen in variants:
        if scen is None:
            rows.append(replace(knob_result(knob, what, base), ran=False, what=what + " (already so: the base run)"))
            continue
        if say is not None:
            say(f"mitigation {knob}: {what}")
        rows.append(knob_result(knob, what, run(scen)))
    return tuple(rows)


__all__ = ["RLComparison", "TokenStep", "KnobResult", "HIST_LABELS", "rl_metrics", "rl_comparison", "rl_from_logits", "vocab_kl",
           "comparable", "is_rl", "knob_result", "mitigation_table"]
