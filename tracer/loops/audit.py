"""``tracer audit``: every level of the determinism hierarchy on this machine, in one trace.

Each *check* is a catalogue scenario with fixed options (a level can have several: batch of
equal lengths and padded; prefix-cache, decode step and generation). :func:`audit` loads the
model once, runs every selected check whose requirements this machine meets (the others are
skipped with the reason), stores all runs in one HDF5 trace (runs ``L2-prefix-cache.A`` ...),
and re-runs each check that diverged under each applicable mitigation to show which levels it
restores. The result renders as the hierarchy table, beside the seed's own status per level.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from dataclasses import replace as _replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from tracer import pipeline, schema
from tracer.config import RunConfig
from tracer.diff.metrics import flips_phrase
from tracer.errors import TracerError, option
from tracer.execute.kinds import PointKind
from tracer.engines import door
from tracer.engines.table import is_reference, name_of
from tracer.loops.audit_plan import check_options, check_scenario, plan_checks, skip_hint
from tracer.loops.audit_store import AuditStore, FolderClaim
from tracer.plan.cost import Cost, scenario_cost
from tracer.plan.hierarchy import SEED_STATUS, STATUSES, Check, checks, invariant, parse_levels
from tracer.progress import DELAY_S, ItemProgress, StatusProgress
from tracer.prompt_checks import prompt_ids
from tracer.store.integrity import check_name_length, check_output_path
from tracer.store.trace import json_safe

if TYPE_CHECKING:
    from tracer.diff.result import Comparison
    from tracer.load.models import LoadedModel, ModelInfo


@dataclass(frozen=True)
class AuditRow(schema.Record):
    """The outcome of one check.

    Its document holds the check's keys beside its own (the label under ``check``, its
    mitigations under ``applicable_mitigations``), ``max_logit_diff`` under ``max_abs_logit_diff``,
    and the derived ``invariant``, ``holds_bitwise``, ``last_layer_differing``/``_total`` and
    ``seed_status``.

    Attributes:
        status: ``passed`` (bit-identical), ``failed`` (diverged) or ``skipped`` (``reason`` says why).
        last_layer: ``(differing, total)`` elements of the last decoder layer's output, or None.
        max_logit_diff, argmax_flips, first_divergent: from the comparison (None when skipped).
        mitigations: mitigation name → True if it makes the check bit-identical (or the reason
            it could not run, as a string).
    """

    check: Check = schema.field(flatten=True, rename={"label": "check", "mitigations": "applicable_mitigations"})
    status: str
    reason: str | None = None
    last_layer: tuple[int, int] | None = None
    max_logit_diff: float | None = schema.field(key="max_abs_logit_diff", default=None)
    argmax_flips: int | None = None
    first_divergent: str | None = None
    mitigations: dict[str, bool | str] = schema.field(default_factory=dict)

    @property
    def holds(self) -> bool | None:
        return None if self.status == "skipped" else self.status == "passed"

    def schema_extras(self, doc: dict[str, Any]) -> None:
        last = self.last_layer or (None, None)
        doc.update(invariant=invariant(self.check), holds_bitwise=self.holds, last_layer_differing=last[0],
                   last_layer_total=last[1], seed_status=SEED_STATUS[self.check.level])

    @classmethod
    def schema_prepare(cls, doc: dict[str, Any]) -> dict[str, Any]:
        """A document written before ``last_layer`` was stored has it as its two derived keys."""
        if "last_layer" in doc or doc.get("last_layer_total") is None:
            return doc
        return {**doc, "last_layer": [doc.get("last_layer_differing"), doc["last_layer_total"]]}


@dataclass(frozen=True)
class Audit(schema.Record):
    """The hierarchy table as data: one row per check; ``total == passed + failed + skipped``
    (the document's derived ``summary``, :meth:`counts`)."""

    model: str
    facts: dict[str, Any]
    rows: tuple[AuditRow, ...]
    trace: str | None = None

    def counts(self) -> dict[str, int]:
        out = {s: sum(r.status == s for r in self.rows) for s in STATUSES}
        out["total"] = len(self.rows)
        assert out["total"] == out["passed"] + out["failed"] + out["skipped"]
        return out

    def schema_extras(self, doc: dict[str, Any]) -> None:
        doc["summary"] = self.counts()


def _row(check: Check, comparison: Comparison) -> AuditRow:
    layers = [p for p in comparison.points if p.kind == PointKind.LAYER]
    last = (layers[-1].diff.n_diff, layers[-1].diff.n_total) if layers else None
    lg = comparison.logits
    return AuditRow(check=check, status="passed" if comparison.identical else "failed",
                    last_layer=last, max_logit_diff=None if lg is None else lg.tensor.max_abs_diff,
                    argmax_flips=None if lg is None else len(lg.argmax_flips),
                    first_divergent=comparison.first_divergent)


#: the prompt length of an audit when none is given (the built-in prompt cut to it): long enough for
#: every check (level 3 caches 64-token blocks, so N > 64), short enough that the default audit ends
#: in a few minutes on a 2-core CPU; ``--length N`` costs each forward pass about N tokens more
DEFAULT_LENGTH = 96


def audit_length(cfg: RunConfig) -> int | None:
    """The prompt length of the audit: ``--length``, else the whole prompt given, else :data:`DEFAULT_LENGTH`
    tokens of the built-in prompt."""
    p = cfg.prompt
    given = p.prompt is not None or p.prompt_file is not None or p.token_ids is not None or p.token_ids_file is not None
    return p.length if p.length is not None or given else DEFAULT_LENGTH


#: ``--store auto``'s byte budget of full tensors per check (both runs; each mitigation re-run has its own)
#: when ``--max-trace-size`` is not given: the origin and the points beside it (SmolLM2 at N = 96: a
#: layer's output is 110 KB per run), the logits' 9.4 MB per run only on request. Every point's
#: statistics are stored whatever the budget (the stored comparison)
CHECK_BUDGET = 1 << 20


def check_budget(cfg: RunConfig) -> int | None:
    """The per-check budget of full tensors: ``--max-trace-size``, else :data:`CHECK_BUDGET`; None
    unless ``--store auto`` (``tensors`` keeps every tensor, ``stats`` none)."""
    if cfg.store.mode != "auto":
        return None
    return cfg.store.budget() if cfg.store.max_trace_size is not None else CHECK_BUDGET


def default_output(model: str, root: str = "traces") -> Any:
    """``traces/<model>-audit.h5``: a fixed name, so re-running an interrupted audit resumes it."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("_") or "model"
    return Path(root) / f"{safe}-audit.h5"


def row_record(row: AuditRow) -> dict[str, Any]:
    """A row as it is kept on disk: its schema document (:meth:`AuditRow.to_dict`), JSON-safe
    (read back bit for bit by :meth:`AuditRow.from_dict`)."""
    return json_safe(row.to_dict())


def result_line(row: AuditRow) -> str:
    """One line per finished check: ``L2-prefix-cache: diverges from model.layers.3, 0 argmax flips; aligned: restores``."""
    c = row.check
    if row.status == "skipped":
        return f"{c.key}: skipped: {row.reason}"
    if row.status == "passed":
        return f"{c.key}: holds bitwise ({c.label})"
    mit = "; ".join(f"{m}: {'restores' if v is True else 'no' if v is False else 'n/a'}" for m, v in row.mitigations.items())
    return (f"{c.key}: diverges from {row.first_divergent}, {flips_phrase(row.argmax_flips)} ({c.label})"
            + (f"; {mit}" if mit else ""))


def audit(cfg: RunConfig, *, levels: str | list[int] | None = None, mitigations: bool = True, loaded: LoadedModel | None = None,
          progress: bool | str = True, on_check: Callable[[str, int, int], None] | None = None,
          on_row: Callable[[AuditRow], None] | None = None) -> Audit:
    """Run every selected level of the hierarchy on this machine and return the table.

    Every check (and every mitigation re-run) is a :func:`tracer.pipeline.run_scenario` on the model
    loaded once, so the audit gets the same GPU fast path as ``tracer run``. Before the first check
    runs, every check's cost is shown (:mod:`tracer.plan.cost`: forward passes and tokens); each
    result is shown as it comes. With a trace, every finished check is kept at once
    (:mod:`tracer.loops.audit_store`), so an interrupted audit re-run with the same output resumes:
    finished checks are reused (their rows bit-identical), the others run.

    Args:
        cfg: model, prompt, capture and store options (``store`` ``none``: nothing written; else one
            trace for all runs, default ``traces/<model>-audit.h5`` (:func:`default_output`), runs named
            ``<check key>.A``/``.B`` and ``<check key>+<mitigation>.A``/``.B``, comparisons under
            ``/comparisons/<key>``, the rows in the header's ``audit_rows``); its scenario options apply
            to every check that uses them (a check's own options win). Without a prompt or length the
            prompt is :data:`DEFAULT_LENGTH` tokens of the built-in one.
        levels: ``"0,1,2"`` or a list of levels (default: all).
        mitigations: re-run diverging checks under each applicable mitigation.
        loaded: a loaded model to reuse.
        progress: the plan, one line per check and an ETA weighed by each check's cost on stderr
            (:class:`tracer.progress.ItemProgress`): True or ``"auto"``: a bar in a terminal,
            log lines otherwise; ``"lines"``; False: nothing. Loading the model shows a status
            (a spinner, or a ``load:`` line once it takes 2 s).
        on_check: called as ``on_check(label, done, total)`` before each check (progress bars).
        on_row: called with each finished (or reused) :class:`AuditRow`.

    Raises:
        TracerError: bad input (checked before the model loads where possible); an output holding
            another audit without ``overwrite``.
    """
    selected = parse_levels(levels) if not isinstance(levels, list) else parse_levels(",".join(map(str, levels)))
    options = dict(cfg.scenario.options)
    check_options(options, selected)
    if not is_reference(cfg.scenario.engine):  # every check runs on it (the engine check names its own)
        options["engine"] = cfg.scenario.engine
    out = _output_path(cfg) if cfg.store.mode != "none" else None
    claim = FolderClaim(out) if out is not None else None  # one writer per output, refused before the model loads
    try:
        return _audit(cfg, selected, options, out, claim, mitigations, loaded, progress, on_check, on_row)
    finally:
        if claim is not None:
            claim.release(remove=True)  # the folder goes only when this audit made it and left it empty


def _audit(cfg: RunConfig, selected: list[int], options: dict[str, Any], out: Path | None, claim: FolderClaim | None,
           mitigations: bool, loaded: LoadedModel | None, progress: bool | str,
           on_check: Callable[[str, int, int], None] | None, on_row: Callable[[AuditRow], None] | None) -> Audit:
    """:func:`audit` once its output is claimed (``out`` None: nothing written)."""
    if loaded is None:
        with StatusProgress("load", mode=progress, delay_s=DELAY_S) as status:
            status(f"loading {cfg.model.name}")
            loaded = pipeline.load(cfg, progress=status.loader)
    info = loaded.info
    ids = prompt_ids(cfg, loaded, length=audit_length(cfg))
    todo = [c for c in checks(len(ids)) if c.level in selected]
    plans, reasons = plan_checks(todo, len(ids), options, info.device, loaded.model)
    budget = check_budget(cfg) if out is not None else None  # per check (both runs)
    header = pipeline.trace_header(loaded, None, len(ids), cfg.capture, cfg.store.mode,
                                   extra={"scenario": {"name": "audit", "params": {"levels": selected}},
                                          "audit": {k: s.to_dict() for k, s in plans.items()},
                                          "audit_options": {"mitigations": bool(mitigations), "budget": budget,
                                                            "engine": name_of(cfg.scenario.engine),
                                                            "checks": [c.key for c in todo]},
                                          **(door.header(plans["L4-tp-real"], info.device)
                                             if "L4-tp-real" in plans else {})}).to_dict()
    state = AuditStore(out, header, overwrite=cfg.store.overwrite, claim=claim) if out is not None else None
    done, refused = _kept_rows(state, todo, reasons)
    costs = {k: scenario_cost(s) for k, s in plans.items()}
    # the ETA's weights: each check's cost, and its mitigation re-runs at the odds that it diverges (set
    # to what ran once it is done, so the estimate neither waits for nor hides them)
    unit = {c.key: costs[c.key].units(len(ids)) if c.key in costs else 0.0 for c in todo}
    weight = {c.key: unit[c.key] * (1 + (DIVERGE_ODDS * len(c.mitigations) if mitigations else 0)) for c in todo}
    rows: list[AuditRow] = []
    with ItemProgress("audit", len(todo), mode=progress, weight_total=sum(weight.values())) as bar:
        for line in plan_lines(info, len(ids), todo, costs, reasons, done, mitigations, refused):
            bar.note(line)
        bar.note(disk_line(info, len(ids), todo, reasons, done, cfg, budget, mitigations))
        for i, c in enumerate(todo):
            if c.key in done:
                row = AuditRow.from_dict(done[c.key])
                result = f"{result_line(row)} [kept from an earlier run]"
            else:
                if on_check is not None:
                    on_check(c.label, i, len(todo))
                if c.key not in reasons:
                    bar.update(description=f"{c.key} ({costs[c.key].text()})")
                row = _run_check(c, plans, reasons, loaded, ids, cfg, header, options, mitigations, budget, state)
                result = result_line(row)
            rows.append(row)
            if bar.mode == "bar":
                bar.note(result)  # stays above the bar; without a terminal the count line carries it
            ran = unit[c.key] * (1 + sum(isinstance(v, bool) for v in row.mitigations.values()))
            bar.weight_total -= weight[c.key] - ran  # the mitigation re-runs it did not need
            bar.advance(result, weight=ran, timed=c.key not in done)
            if on_row is not None:
                on_row(row)
        if on_check is not None:
            on_check("done", len(todo), len(todo))
        if state is not None and state.reused is None:
            bar.note(f"audit: writing {out}")
            state.merge([c.key for c in todo], [row_record(r) for r in rows])
    facts = {"dtype": info.dtype, "device": info.device, "device_name": header.get("device_name"),
             "attn": info.attn_implementation, "n_tokens": len(ids), "torch": header.get("torch"),
             "levels": selected, "engine": name_of(cfg.scenario.engine)}
    return Audit(model=info.name, facts=facts, rows=tuple(rows), trace=str(out) if out is not None else None)


def disk_line(info: ModelInfo, n: int, todo: list[Check], reasons: dict[str, str], done: dict[str, Any],
              cfg: RunConfig, budget: int | None, mitigations: bool) -> str:
    """The plan's line on disk use: how many run pairs it may store (each check still to run, and a
    re-run per mitigation if it diverges), what each holds, and the bound (:func:`tracer.plan.cost.trace_bytes`)."""
    from tracer.plan.cost import stats_bytes, trace_bytes
    from tracer.store.budget import format_size

    if cfg.store.mode == "none":
        return f"audit: disk: nothing is written ({option('store', 'none')})"
    runs = [c for c in todo if c.key not in reasons and c.key not in done]
    pairs = len(runs) + (sum(len(c.mitigations) for c in runs) if mitigations else 0)
    full = trace_bytes(info, n, cfg.capture.granularity, cfg.capture.kv_cache)
    stats = stats_bytes(info, cfg.capture.granularity, cfg.capture.kv_cache)
    kept = full if cfg.store.mode == "tensors" else 0 if budget is None else min(budget, full)
    what = ("every tensor" if cfg.store.mode == "tensors" else "statistics only" if budget is None else
            f"full tensors around the origin within --max-trace-size {format_size(budget)}")
    return (f"audit: disk: at most {format_size(pairs * (kept + stats))} for {pairs} run pair(s) ({len(runs)} check{'' if len(runs) == 1 else 's'}, "
            f"and a re-run per mitigation of a check that diverges): {what} and every point's statistics per pair"
            + (f"; every tensor (--store tensors) is {format_size(full)} per pair" if cfg.store.mode != "tensors" else ""))


def _kept_rows(state: AuditStore | None, todo: list[Check], reasons: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The rows an earlier run of this audit finished (check key → row record) and why each other
    kept row is not believed: a complete trace's rows as they are; a folder's rows only when sealed
    to their part trace and derived again from its comparison (:func:`believed`). A check the plan
    skips is never read from disk (its row costs nothing)."""
    if state is None:
        return {}, {}
    if state.reused is not None:
        return {r["key"]: r for r in state.reused}, {}
    sealed, refused = state.finished()
    by_key = {c.key: c for c in todo}
    done = {}
    for key, rec in sealed.items():
        if key not in by_key or key in reasons:
            continue
        try:
            why = believed(by_key[key], rec, state.comparisons(key))
        except TracerError as e:
            why = str(e)
        if why is None:
            done[key] = rec
        else:
            refused[key] = why
    return done, {k: v for k, v in refused.items() if k in by_key and k not in reasons}


#: the row fields derived from a check's comparison (checked against its part trace on resume)
DERIVED = ("status", "last_layer", "max_abs_logit_diff", "argmax_flips", "first_divergent")


def believed(c: Check, record: dict[str, Any], comparisons: dict[str, dict[str, Any]]) -> str | None:
    """Why a kept row of check ``c`` is not believed, or None when its part trace bears it out: the
    row is this check's, its part holds the check's comparison, the row's status, counts, max |Δ|,
    flips and first divergent point are what that comparison gives (:func:`_row`), and every
    mitigation it reports is a comparison in the part with that answer."""
    from tracer.diff.stored import comparison_from_dict

    try:
        row = AuditRow.from_dict(record)
    except (TracerError, KeyError, TypeError, ValueError):
        return "its row is not an audit row"
    if (row.check.key, row.check.scenario, row.check.options) != (c.key, c.scenario, c.options):
        return "its row is another check's"
    if c.key not in comparisons:
        return "its part trace holds no comparison of it"
    derived = row_record(_row(row.check, comparison_from_dict(comparisons[c.key])))
    kept = row_record(_replace(row, mitigations={}))
    if any(derived.get(k) != kept.get(k) for k in DERIVED):
        return "its row does not say what its part trace's comparison says"
    for m, answer in row.mitigations.items():
        doc = comparisons.get(f"{c.key}+{m}")
        if isinstance(answer, bool) and (doc is None or doc.get("identical") is not answer):
            return f"its mitigation {m} is not what its part trace holds"
    return None


def _output_path(cfg: RunConfig) -> Any:
    """The audit's trace (checked before the model loads: a name that fits, a writable folder, not a
    folder itself); an existing file is judged later, by its content (:class:`AuditStore`)."""
    out = check_name_length(cfg.store.output if cfg.store.output is not None else default_output(cfg.model.name),
                            "--output")
    check_output_path(out, cfg.store.overwrite, "--output", resume=True)
    if out.is_dir():
        raise TracerError(f"--output {out} is a directory; give a file path ending in .h5")
    return out


def plan_lines(info: ModelInfo, n: int, todo: list[Check], costs: dict[str, Any], reasons: dict[str, str],
               done: dict[str, Any], mitigations: bool, refused: dict[str, str] | None = None) -> list[str]:
    """What the audit will do, before it does it: one line per check with its cost, the skipped
    checks with their reasons, a kept row not believed (``refused``: why; it runs again), and what
    ``--length`` costs."""
    refused = refused or {}
    run = [c for c in todo if c.key not in reasons]
    total = sum((costs[c.key] for c in run if c.key not in done), Cost())
    lines = [f"audit: {len(run)} of {len(todo)} check{'' if len(todo) == 1 else 's'} run on {info.name} ({info.device}, {info.dtype}), "
             f"N = {n} tokens; {len(done)} finished earlier" if done else
             f"audit: {len(run)} of {len(todo)} check{'' if len(todo) == 1 else 's'} run on {info.name} ({info.device}, {info.dtype}), N = {n} tokens"]
    width = max((len(c.key) for c in todo), default=0)
    for c in todo:
        what = ("finished earlier" if c.key in done else
                f"skipped: {reasons[c.key]}" if c.key in reasons else costs[c.key].text()
                + (f"; runs again: an earlier row is not believed ({refused[c.key]})" if c.key in refused else ""))
        lines.append(f"  {c.key:<{width}}  {what}")
    lines.append(f"audit: to run: {total.text()}"
                 + ("; a diverging check is run again under each mitigation (aligned, deterministic)" if mitigations else "")
                 + f"; the tokens grow in proportion to {option('length').rstrip('=')} (N = {n} here), the passes do not")
    return lines


def _run_check(c: Check, plans: dict[str, Any], reasons: dict[str, str], loaded: LoadedModel, ids: list[int], cfg: RunConfig,
               header: dict[str, Any], options: dict[str, Any], mitigations: bool, budget: int | None,
               state: Any) -> AuditRow:
    """One check, its runs written to its own trace part (kept once the row is kept)."""
    writer = None
    if state is not None and c.key not in reasons:
        state.discard(c.key)  # a row not believed, a part of a run that died: this run writes both anew

    def one(key: str, scen: Any) -> Any:
        nonlocal writer
        if state is not None and writer is None:
            writer = pipeline.open_writer(state.part(c.key), header, overwrite=True)
        return pipeline.run_scenario(loaded, ids, scen, cfg.capture, writer=writer, online=state is None,
                                     names=(f"{key}.A", f"{key}.B"), header=header, comparison_key=key,
                                     budget=budget).comparison

    try:
        row = _check(c, plans, reasons, one, len(ids), options, mitigations)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.close()
        state.keep(c.key, row_record(row))  # sealed with its part; a row without a part is the plan's (free again)
    return row


#: the share of an audit's checks that diverge, for the ETA's weight of their mitigation re-runs before
#: it is known (the default audit of SmolLM2 on this CPU: 9 of the 15 checks that ran)
DIVERGE_ODDS = 0.6


def _check(c: Check, plans: dict[str, Any], reasons: dict[str, str], one: Callable[[str, Any], Any], n: int,
           options: dict[str, Any], mitigations: bool) -> AuditRow:
    """One row: run the check (unless skipped), then each applicable mitigation if it diverged."""
    if c.key in reasons:
        return AuditRow(check=c, status="skipped", reason=reasons[c.key])
    try:
        row = _row(c, one(c.key, plans[c.key]))
    except TracerError as e:
        return AuditRow(check=c, status="skipped", reason=skip_hint(str(e)))
    if not mitigations or row.status != "failed":
        return row
    fixed: dict[str, bool | str] = {}
    for m in c.mitigations:
        try:
            fixed[m] = one(f"{c.key}+{m}", check_scenario(c, n, options, mitigation=m)).identical
        except TracerError as e:
            fixed[m] = skip_hint(str(e))
    return _replace(row, mitigations=fixed)


__all__ = ["Audit", "AuditRow", "audit", "checks", "parse_levels", "SEED_STATUS", "STATUSES",
           "DEFAULT_LENGTH", "default_output", "row_record"]
