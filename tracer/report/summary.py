"""The summary that every report starts with: a headline block and the rows that matter.

Pure functions of a :class:`~tracer.diff.result.Comparison` (no I/O, no recomputation); the terminal
table (:mod:`tracer.report.tables`) and the HTML report (:mod:`tracer.report.html`) render the same data.

- :func:`headline`: ``[(label, text)]``: verdict, origin (op, shapes, kernels when recorded),
  first divergent point, growth to the last layer, logits (differing share, flips, KL) and
  what to try next (options of ``tracer run`` that exist).
- :func:`rows_that_matter`: indices of the table rows worth printing: the first point, the
  origins, the first divergent point, every row where the differing count or max |Δ| changes
  notably (count ×2, max |Δ| ×4, or from/to zero) against the last kept row of the same kind, the last layer
  and the logits; and every row where NaN/Inf appear or their counts change (:func:`nonfinite_text` names them).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from tracer.engines.table import is_reference, name_of
from tracer.execute.kinds import LAYER_KINDS, PointKind
from tracer.plan.hierarchy import ALIGNED_SOURCE
from tracer.plan.scenarios import SCENARIOS
from tracer.report.origins import origin_lines

if TYPE_CHECKING:
    from tracer.diff.result import Comparison, PointResult

#: a row is kept when its differing count moves by this factor from the previous row of its kind ...
NOTABLE_COUNT = 2.0
#: ... or its max |Δ| by this one (bf16 max |Δ| moves in powers of two: ×2 is one step of rounding)
NOTABLE_MAX = 4.0


def _g(x: float | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    return f"{x:.3g}"


def _share(n: int, total: int) -> str:
    return "-" if not total else f"{100 * n / total:.3g}%"


def positions_text(positions: tuple[int, int] | list[int], n_tokens: int | None) -> str:
    """The compared positions ``[start, stop)`` of a prompt of ``n_tokens``: ``positions 304..313 of 314``,
    or, for a window past the prompt, what was computed past it: ``positions 128..132 (prompt 0..129,
    4 generated, 3 decode steps)`` -- the prefill's last position gives the first generated token and
    each decode step (positions 130..132, each fed the token before) one more; the last generated token
    is never fed back, so T generated tokens take T - 1 decode steps."""
    a, b = int(positions[0]), int(positions[1])
    text = f"positions {a}..{b - 1}"
    if not n_tokens:
        return text
    if b <= n_tokens:
        return f"{text} of {n_tokens}"
    steps = b - n_tokens
    return f"{text} (prompt 0..{n_tokens - 1}, {steps + 1} generated, {steps} decode step{'s' * (steps != 1)})"


def gemm_text(gemm_m: Any) -> str:
    """GEMM M of each forward pass of a run (``facts["gemm_m_a"]``), runs of one value folded:
    ``[272, 4, 4, 4]`` → ``272, 4 ×3``; ``""`` when not known."""
    if not isinstance(gemm_m, (list, tuple)):
        return "" if gemm_m is None else str(gemm_m)
    parts: list[str] = []
    i = 0
    while i < len(gemm_m):
        j = i
        while j + 1 < len(gemm_m) and gemm_m[j + 1] == gemm_m[i]:
            j += 1
        n = j - i + 1
        parts.append(f"{gemm_m[i]} ×{n}" if n >= 3 else ", ".join([str(gemm_m[i])] * n))
        i = j + 1
    return ", ".join(parts)


def plan_line(c: Comparison, side: str) -> str:
    """What run ``side`` (``a`` or ``b``) computed and the GEMM M of each of its forward passes:
    ``cache hit: 304 cached tokens, then the 10-token suffix (GEMM M per step: 304, 10)``."""
    plan = str(c.facts.get(f"plan_{side}", ""))
    gemm = gemm_text(c.facts.get(f"gemm_m_{side}"))
    return plan + (f" (GEMM M per step: {gemm})" if gemm else "")


def last_layer(c: Comparison) -> PointResult | None:
    """The last decoder-layer point (kind ``layer``) in execution order, or None."""
    layers = [p for p in c.points if p.kind == PointKind.LAYER]
    return layers[-1] if layers else None


def _first_point(c: Comparison) -> PointResult | None:
    return next((p for p in c.points if p.diverged), None)


def _kernels(p: PointResult) -> str:
    """Kernel names recorded for a point's calls (``calls[*]['kernels']``), when a capture recorded them."""
    ka = sorted({k for cl in p.calls_a for k in cl.get("kernels", ()) or ()})
    kb = sorted({k for cl in p.calls_b for k in cl.get("kernels", ()) or ()})
    if not ka and not kb:
        return ""
    return f"kernels A: {', '.join(ka) or '-'}; B: {', '.join(kb) or '-'}"


def growth_text(c: Comparison) -> str:
    """``×256 from model.layers.3 (max |Δ| 0.0312) to model.layers.29 (8)``; a difference that gets
    smaller says so (``shrinks to ×0.625 from ... to ...``), one that is not a finite number
    (NaN, inf) gives no ratio (``no ratio (max |Δ| inf → 0) from ... to ...``); or a why-not."""
    first, last = _first_point(c), last_layer(c)
    if first is None:
        return ("none: every capture point is bit-identical" if c.identical
                else "none before the logits: every other capture point is bit-identical")
    if last is None:
        return "no decoder layer captured"
    a, b = first.diff.max_abs_diff, last.diff.max_abs_diff
    if first.name == last.name:
        return f"first divergent point is the last layer ({last.name}, max |Δ| {_g(b)})"
    idx = [p.name for p in c.points]
    if idx.index(first.name) > idx.index(last.name):
        return f"the last layer {last.name} is bit-identical; the divergence starts after it"
    if not (math.isfinite(a) and math.isfinite(b)):
        factor = f"no ratio (max |Δ| {_g(a)} → {_g(b)})"
    elif a and b < a:
        factor = f"shrinks to ×{_g(b / a)}"
    else:
        factor = f"×{_g(b / a)}" if a else "from 0"
    return (f"{factor} from {first.name} (max |Δ| {_g(a)}, {_share(first.diff.n_diff, first.diff.n_total)} differ) "
            f"to {last.name} (max |Δ| {_g(b)}, {_share(last.diff.n_diff, last.diff.n_total)} differ)")


def logits_text(c: Comparison) -> str:
    """``81.7% of 491,520 differ · 0 argmax flips in 10 positions · KL mean 0.00184, max 0.00222 nats``."""
    if c.logits is None:
        skip = next((s for s in c.skipped if s.kind == PointKind.LOGITS), None)  # missing in a run, or not stored
        part = next((n for n in c.facts.get("notes", []) if " (logits) at position(s) " in n), None)
        if skip is None and part is not None:  # an engine dump's next-token logits: a few positions only
            return "at a few positions only (" + part.split(" (logits) at position(s) ")[1].split(" only")[0] + "): see the notes"
        return "not captured" if skip is None else f"not compared: {skip.reason}"
    lg, d = c.logits, c.logits.tensor
    flips = len(lg.argmax_flips)
    text = (f"{_share(d.n_diff, d.n_total)} of {d.n_total:,} differ (max |Δ| {_g(d.max_abs_diff)}) · "
            f"{flips_text(c)} · KL(A‖B) mean {_g(lg.kl_mean)}, max {_g(lg.kl_max)} nats")
    if flips:
        f = lg.argmax_flips[0]
        text += f" · first flip at position {c.positions[0] + f.position} ({flip_tokens(f)})"
    return text


def flip_tokens(f: Any) -> str:
    """An :class:`~tracer.diff.metrics.ArgmaxFlip`'s two tokens: ``token 1234 ' the' in A, 567 ' a' in B``
    (the decoded text where the run had a tokenizer, escaped and shortened)."""
    from tracer.report.textsafe import token_text

    def one(token: int, text: str | None) -> str:
        return f"{token} {token_text(text)}" if text is not None else str(token)

    return f"token {one(f.token_a, f.text_a)} in A, {one(f.token_b, f.text_b)} in B"


def flip_tie(f: Any) -> str:
    """Where a run's top two logits tie or lie 1 ULP apart (the flip is a coin toss of rounding):
    ``; a tie in B (the lower token id wins)``, ``; 1 ULP apart in A``; ``""`` otherwise or unknown."""
    parts = [("a tie" if u == 0 else "1 ULP apart") + f" in {side}"
             for side, u in (("A", f.ulps_a), ("B", f.ulps_b)) if u is not None and u <= 1]
    if not parts:
        return ""
    return "; top two " + " and ".join(parts) + (" (the lower token id wins a tie)" if "a tie" in parts[0] + parts[-1] else "")


def flips_text(c: Comparison) -> str:
    """What the logits' argmax flips count: ``2 argmax flips in 16 positions``, with the rows they lie in
    when that is not the one prompt: `` of the traced sequence (row 2)`` for an RL step (whose summary's
    ``flips`` counts every sequence's response tokens); ``""`` without logits."""
    if c.logits is None:
        return ""
    flips, n = len(c.logits.argmax_flips), c.logits.n_positions
    rows = f" of the traced sequence (row {c.rl.row})" if c.rl is not None else ""
    return f"{flips} argmax flip{'s' if flips != 1 else ''} in {n} position{'s' if n != 1 else ''}{rows}"


def noise_text(noise: Any) -> str:
    """``--verdict``'s answer with its evidence, in one line: ``rounding noise (the error shrinks with
    ε: logits max|Δ| bfloat16 0.25 → float32 1.2e-06)``."""
    trend = {"rounding noise": "the error shrinks with ε", "defect suspected": "the error does not shrink with ε"}
    chain = " → ".join(f"{lv.dtype} {_g(lv.logits_max_abs)}" for lv in noise.levels)
    return f"{noise.verdict} ({trend.get(noise.verdict, 'between the thresholds')}: logits max|Δ| {chain})"


def verdict_line(c: Comparison) -> str:
    """The answer first: with ``--verdict``, whether the divergence is rounding noise, then
    :meth:`~tracer.diff.result.Comparison.verdict` (where it diverges); the headline's first line
    and the report's last."""
    return c.verdict() if c.noise is None else f"{noise_text(c.noise)}; {c.verdict()}"


def _engine_flag(c: Any) -> str | None:
    """``"--engine E"`` when this comparison's runs ran on an engine other than the reference (the
    runs' contracts in ``facts["engine_a"/"engine_b"]``), ``""`` for ``--scenario engine`` (its runs
    name their engines), None for the reference's runs."""
    names = {name_of((c.facts.get(k) or {}).get("engine")) for k in ("engine_a", "engine_b")
             if isinstance(c.facts.get(k), dict)}
    other = sorted(n for n in names if not is_reference(n))
    if not other:
        return None
    return "" if c.scenario == "engine" else f"--engine {other[0]}"


def _model_argument(c: Any) -> str:
    """The model as a suggested command names it: ``facts["model_argument"]`` (a GGUF file or folder by
    its path, :func:`tracer.load.models.model_argument`), else the comparison's model name, else ``MODEL``."""
    arg = c.facts.get("model_argument")
    if isinstance(arg, str) and arg and arg.isprintable():
        return arg
    return c.model if c.model and c.model != "model" else "MODEL"


def _rerun(c: Any, command: str) -> str:
    """How a suggestion names ``tracer run``'s options: the bare option from ``tracer run`` itself,
    else the whole command line that re-runs this comparison's model and scenario (on its engine)."""
    if command == "run":
        return ""
    model = _model_argument(c)
    scen = f" --scenario {c.scenario}" if c.scenario in SCENARIOS and c.scenario != "prefix-cache" else ""
    engine = _engine_flag(c)
    return f"tracer run {model}{scen}{' ' + engine if engine else ''} "


def _sublayers_cost(c: Comparison) -> str:
    """What a suggested ``--granularity sublayers`` run writes at most: ``; its trace takes up to about
    257 MiB`` (:attr:`~tracer.diff.result.ComparisonFacts.sublayers_bytes`: every position's tensors,
    within ``--store auto``'s default budget), ``""`` where unknown."""
    n = c.facts.get("sublayers_bytes")
    if not n:
        return ""
    size = f"{n / (1 << 30):.3g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.3g} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
    return f"; its trace takes up to about {size}"


#: the prompt lengths a suggested sweep maps: 15 lengths, minutes on a CPU (17:512 takes hours)
QUICK_LENGTHS = "17:129:8"


def next_steps(c: Comparison, command: str = "run") -> list[str]:
    """What to try next. Each suggestion names options of the command that prints it (``command``:
    ``run``), or a whole command line (``tracer run MODEL --positions all`` from ``tracer compare``,
    ``tracer sweep``/``audit`` for identical runs: the sweep of the run's scenario over
    :data:`QUICK_LENGTHS`)."""
    steps: list[str] = []
    model = _model_argument(c)
    engine = _engine_flag(c)  # runs on an engine: suggestions run it again; --verdict re-runs HF only (refused)
    if c.identical and (c.facts.get("engine") or engine == ""):  # engine dumps, two engines: a sweep or an
        return steps  # audit runs one engine, not the two that were compared
    if c.identical:
        on = f" {engine}" if engine else ""
        scen = f" --scenario {c.scenario}" if c.scenario in SCENARIOS and c.scenario != "prefix-cache" else ""
        steps.append("other prompt lengths can diverge where this one does not: "
                     f"`tracer sweep {model}{scen}{on} --lengths {QUICK_LENGTHS}` maps 15 of them in minutes "
                     "(--lengths 17:512: every length, hours on a CPU)")
        steps.append(f"the other levels of the hierarchy (batching, chunking, TP, KV quantization): `tracer audit {model}{on}`")
        return steps
    if c.facts.get("engine"):  # an engine dump: the options of `tracer run` do not re-run an engine
        subs = any(p.kind not in LAYER_KINDS for p in c.points)
        return [] if subs else ["dump with the dumper's non-intrusive mode `all` (DUMPER_NON_INTRUSIVE_MODE=all): "
                                "every module's output, so the op inside the layer is named"]
    run = _rerun(c, command)
    origins = list(c.origins)
    whole_prompt = c.positions[0] == 0
    subs = any(p.kind not in LAYER_KINDS for p in c.points)
    prefix_born = any(p.kind == PointKind.KV_CACHE and p.n_diff_prefix for p in origins) and not whole_prompt
    if prefix_born:  # one command that names the op: the cached-prefix pass, traced op by op
        both = "--positions all" if subs or c.facts.get("family_inferred") else "--positions all --granularity sublayers"
        steps.append(f"`{run}{both}`: the divergence is born in the cached-prefix pass, which this run compares at "
                     "the KV cache only; this traces that pass op by op and names the op (norm, q/k/v, attention core, "
                     f"MLP, every Linear) with its GEMM shapes{'' if subs else _sublayers_cost(c)}")
    elif any(p.kind == PointKind.STATE for p in origins) and not whole_prompt:
        prefix_born = True
        steps.append(f"`{run}--positions all`: a recurrent state carries the cached-prefix pass; this traces that pass "
                     "op by op too")
    if not subs and c.facts.get("family_inferred"):
        steps.append("write a family descriptor for this model (one TOML file, hooks/README.md): then "
                     "--granularity sublayers names the op inside the layer")
    elif not subs and not prefix_born:
        steps.append(f"`{run}--granularity sublayers`: names the op inside the layer (norm, q/k/v, attention core, "
                     f"MLP, every Linear) with its GEMM shapes{_sublayers_cost(c)}")
    # two traces of one plan on two machines: aligning the split changes nothing between them
    same_plan = "versions_differ" in c.facts and c.facts.get("plan_a") == c.facts.get("plan_b")
    aligned = any("aligned" in str(c.facts.get(k, "")) for k in ("plan_a", "plan_b"))  # either side ran it already
    if c.scenario.startswith("prefix-cache") and not aligned and not same_plan:
        steps.append(f"`{run}--mitigation aligned`: the cache-miss run also splits at P ({ALIGNED_SOURCE}); "
                     "checks whether aligning the split restores bitwise equality")
    if c.noise is None and engine is None:
        steps.append(f"`{run}--verdict`: re-runs at float32 (and float64 on the CPU) and says whether this is "
                     "rounding noise or a defect")
    if c.replay is None and c.logits is not None and c.rl is None and c.scenario != "rollout-vs-train":
        # an RL run compares its own response (the scenario refuses --decode)
        steps.append(f"`{run}--decode 16`: greedy-decodes from both runs and shows where the generated text first "
                     "differs")
    if c.rl is not None and not c.rl.mitigations and engine is None:
        steps.append(f"`{run}--mitigations`: re-runs with each knob changed (same attention, fp32 LM head, no "
                     "padding, batch of one, deterministic) and reports the |Δlogp| each leaves")
    return steps


def unverified_text(c: Comparison) -> str | None:
    """The line said beside the verdict when a trace the comparison was read from carries no
    checksums (:attr:`~tracer.diff.result.Comparison.unverified`), else None."""
    if not c.unverified:
        return None
    files = ", ".join(c.unverified)
    return (f"{files} {'carries' if len(c.unverified) == 1 else 'carry'} no checksums (written before tracer stored "
            "them, or stripped): the values compared were not verified, so this verdict holds only if the file is intact")


def _nonfinite_counts(c: Comparison) -> list[tuple[str, tuple[int, int, int, int]]]:
    """``(row name, (NaN in A, Inf in A, NaN in B, Inf in B))`` per table row (points in execution
    order, the logits last)."""
    diffs = [(p.name, p.diff) for p in c.points]
    if c.logits is not None:
        diffs.append((f"{c.logits_name} (logits)", c.logits.tensor))
    return [(n, (d.n_nan_a, d.n_inf_a, d.n_nan_b, d.n_inf_b)) for n, d in diffs]


def nonfinite_text(c: Comparison) -> str | None:
    """The line naming the NaN/±Inf values of each run, or None when every compared value is finite:
    per run with any, ``"B: 3 NaN, 1 Inf in 2 points, first model.layers.1"`` (counts summed over the
    compared points and the logits; the first point in execution order), runs joined by ``"; "``."""
    rows = _nonfinite_counts(c)
    parts = []
    for run, i in ((c.run_a, 0), (c.run_b, 2)):
        hit = [(n, k[i], k[i + 1]) for n, k in rows if k[i] or k[i + 1]]
        if hit:
            nan, inf = sum(h[1] for h in hit), sum(h[2] for h in hit)
            parts.append(f"{run}: {nan:,} NaN, {inf:,} Inf in {len(hit)} point{'s' if len(hit) > 1 else ''}, "
                         f"first {hit[0][0]}")
    return "; ".join(parts) or None


def headline(c: Comparison, command: str = "run") -> list[tuple[str, str]]:
    """The headline block as ``(label, text)`` pairs, in print order.

    Labels: ``verdict`` (:func:`verdict_line`: the noise verdict first when there is one),
    ``unverified`` (a trace read without checksums: :func:`unverified_text`), ``non-finite`` (NaN/Inf
    in either run: :func:`nonfinite_text`), ``origin`` (one pair per origin; shapes, and kernels when recorded), ``first divergent``,
    ``growth``, ``logits``, ``devices`` (two traces of a CPU and a GPU, or of two GPU models: the
    likely cause, so first), ``isa`` (two traces of CPUs or GPUs whose instruction sets differ: the
    likely cause, so before the versions), ``versions`` (two traces: every version that differs),
    ``decode`` when present, ``next`` (one
    pair per suggestion, valid for ``command``: :func:`next_steps`).
    """
    out: list[tuple[str, str]] = [("verdict", verdict_line(c))]
    if (bare := unverified_text(c)) is not None:
        out.append(("unverified", bare))
    if (bad := nonfinite_text(c)) is not None:
        out.append(("non-finite", bad))
    for p, line in zip(list(c.origins) + ([None] if c.logits_origin and c.logits is not None else []), origin_lines(c)):
        out.append(("origin", line))
        k = _kernels(p) if p is not None else ""
        if k:
            out.append(("kernels", k))
    if not c.identical and c.first_divergent is not None:
        first = _first_point(c)
        out.append(("first divergent", c.first_divergent + (
            f" ({first.kind}, {first.diff.n_diff:,} of {first.diff.n_total:,} elements, max |Δ| "
            f"{_g(first.diff.max_abs_diff)})" if first is not None else " (the logits)")))
        out.append(("growth", growth_text(c)))
    out.append(("logits", logits_text(c)))
    if c.facts.get("device_differs"):  # a CPU's trace and a GPU's, or two GPU models: the likely cause, first
        out.append(("devices", c.facts["device_differs"]))
    if c.facts.get("isa_differs"):  # two traces of CPUs or GPUs of other instruction sets: the likely cause, first
        out.append(("isa", "; ".join(c.facts["isa_differs"])))
    if "versions_differ" in c.facts:  # runs from two traces
        out.append(("versions", "; ".join(c.facts["versions_differ"]) or "the same in both traces"))
    if c.replay is not None:
        shown = c.replay.first_diff is not None or c.replay.text_a is not None  # replay_lines prints them
        out.append(("decode", c.replay.line() + (" (both continuations below)" if shown else "")))
    out.extend(("next", s) for s in next_steps(c, command))
    return out


def _notable(prev: Any, cur: Any) -> bool:
    """The differing count moves by :data:`NOTABLE_COUNT` or max |Δ| by :data:`NOTABLE_MAX` or more,
    or either goes between 0 and non-zero."""
    for a, b, f in ((prev.n_diff, cur.n_diff, NOTABLE_COUNT), (prev.max_abs_diff, cur.max_abs_diff, NOTABLE_MAX)):
        if (a == 0) != (b == 0):
            return True
        if a and b and (b / a >= f or a / b >= f):
            return True
    return False


def rows_that_matter(c: Comparison, limit: int | None = None) -> list[int]:
    """Indices into :func:`tracer.report.tables.rows` (points in execution order, logits last) worth printing.

    Always: the first point, the origins, the first divergent point, the last layer, the final
    norm (kind ``final_norm``), the logits, and every row where NaN/Inf values appear in either run
    or their counts change from the row before (a run that stays NaN from one point on keeps the
    rows where it starts and spreads, not each row after). Then every point whose differing count or max |Δ| changed notably from the
    last kept point of the same kind (:func:`_notable`). With ``limit``, the notable rows are thinned
    (the largest changes kept) so that at most ``max(limit, number of always-rows)`` rows remain.
    """
    pts = list(c.points)
    n = len(pts) + (c.logits is not None)
    if n == 0:
        return []
    must = {0}
    first = c.first_divergent
    last = last_layer(c)
    for i, p in enumerate(pts):
        if p.origin or p.name == first or (last is not None and p.name == last.name) or p.kind == PointKind.FINAL_NORM:
            must.add(i)
    if c.logits is not None:
        must.add(n - 1)
    before = (0, 0, 0, 0)
    for i, (_, counts) in enumerate(_nonfinite_counts(c)):
        if any(counts) and counts != before:
            must.add(i)
        before = counts
    scored: list[tuple[float, int]] = []
    last_kept: dict[str, Any] = {}  # per kind: the last row kept, the reference for "changed notably"
    for i, p in enumerate(pts):
        ref = last_kept.get(p.kind)
        if i in must or ref is None:
            last_kept[p.kind] = p
            continue
        if _notable(ref.diff, p.diff):
            a, b = ref.diff.max_abs_diff, p.diff.max_abs_diff
            na, nb = ref.diff.n_diff, p.diff.n_diff
            finite = a and b and math.isfinite(a) and math.isfinite(b)  # inf/NaN max |Δ| (an overflow): a big jump
            jump = (abs(math.log2(b / a)) if finite else 64.0) + (abs(math.log2(nb / na)) if na and nb else 0.0)
            scored.append((jump, i))
            last_kept[p.kind] = p
    keep = set(must)
    scored.sort(key=lambda t: (-t[0], t[1]))
    room = None if limit is None else max(0, limit - len(must))
    for _, i in scored if room is None else scored[:room]:
        keep.add(i)
    return sorted(keep)
