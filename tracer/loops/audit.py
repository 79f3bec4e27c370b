"""``tracer audit``: every level of the determinism hierarchy on this machine, in one trace.

Each *check* is a catalogue scenario with fixed options (a level can have several: batch of
equal lengths and padded; prefix-cache, decode step and generation). :func:`audit` loads the
model once, runs every selected check whose requirements this machine meets (the others are
skipped with the reason), stores all runs in one HDF5 trace (runs ``L2-prefix-cache.A`` ...),
and re-runs each check that diverged under each applicable mitigation to show which levels it
restores. The result renders as the hierarchy table, beside the seed's own status per level.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from dataclasses import replace as _replace
from typing import Any, Callable

from tracer import schema
from tracer.config import RunConfig, applicable_options
from tracer.errors import TracerError
from tracer.plan.hierarchy import SEED_STATUS, STATUSES, Check, checks, invariant, parse_levels


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


def _row(check: Check, comparison: Any) -> AuditRow:
    layers = [p for p in comparison.points if p.kind == "layer"]
    last = (layers[-1].diff.n_diff, layers[-1].diff.n_total) if layers else None
    lg = comparison.logits
    return AuditRow(check=check, status="passed" if comparison.identical else "failed",
                    last_layer=last, max_logit_diff=None if lg is None else lg.tensor.max_abs_diff,
                    argmax_flips=None if lg is None else len(lg.argmax_flips),
                    first_divergent=comparison.first_divergent)


def audit(cfg: RunConfig, *, levels: str | list[int] | None = None, mitigations: bool = True, loaded: Any = None,
          progress: bool = True, on_check: Callable[[str, int, int], None] | None = None) -> Audit:
    """Run every selected level of the hierarchy on this machine and return the table.

    Every check (and every mitigation re-run) is a :func:`tracer.pipeline.run_scenario` on the model
    loaded once, so the audit gets the same GPU fast path as ``tracer run``.

    Args:
        cfg: model, prompt, capture and store options (``store`` ``none``: nothing written; else one
            trace for all runs, default ``traces/<model>-audit-<timestamp>.h5``, runs named
            ``<check key>.A``/``.B`` and ``<check key>+<mitigation>.A``/``.B``, comparisons under
            ``/comparisons/<key>``); its scenario options apply to every check that uses them (a
            check's own options win).
        levels: ``"0,1,2"`` or a list of levels (default: all).
        mitigations: re-run diverging checks under each applicable mitigation.
        loaded: a loaded model to reuse.
        on_check: called as ``on_check(label, done, total)`` before each check (progress bars).

    Raises:
        TracerError: bad input (checked before the model loads where possible).
    """
    from tracer import pipeline
    from tracer.execute.tp_dist import distributed_header
    from tracer.store.trace import default_output

    selected = parse_levels(levels) if not isinstance(levels, list) else parse_levels(",".join(map(str, levels)))
    options = dict(cfg.scenario.options)
    _check_options(options, selected)
    if loaded is None:
        loaded = pipeline.load(cfg, progress=progress)
    info = loaded.info
    ids = pipeline.prompt_ids(cfg, loaded)
    todo = [c for c in checks(len(ids)) if c.level in selected]
    plans, reasons = _plan(todo, len(ids), options, info.device)
    header = pipeline.trace_header(loaded, None, len(ids), cfg.capture, cfg.store.mode,
                                   extra={"scenario": {"name": "audit", "levels": selected},
                                          "audit": {k: s.to_dict() for k, s in plans.items()},
                                          **(distributed_header(plans["L4-tp-real"], info.device)
                                             if "L4-tp-real" in plans else {})})
    store = cfg.store.mode != "none"
    out = (cfg.store.output or default_output(info.name, "audit")) if store else None
    writer = pipeline.open_writer(out, header, overwrite=cfg.store.overwrite) if store else None

    budget = cfg.store.budget() if cfg.store.mode == "auto" and store else None  # per check (both runs)

    def one(key: str, scen: Any) -> Any:
        return pipeline.run_scenario(loaded, ids, scen, cfg.capture, writer=writer, online=not store,
                                     names=(f"{key}.A", f"{key}.B"), header=header, comparison_key=key,
                                     budget=budget).comparison

    rows: list[AuditRow] = []
    with writer if writer is not None else contextlib.nullcontext():
        for i, c in enumerate(todo):
            if on_check is not None:
                on_check(c.label, i, len(todo))
            rows.append(_check(c, plans, reasons, one, len(ids), options, mitigations))
        if on_check is not None:
            on_check("done", len(todo), len(todo))
    facts = {"dtype": info.dtype, "device": info.device, "device_name": header.get("device_name"),
             "attn": info.attn_implementation, "n_tokens": len(ids), "torch": header.get("torch"),
             "levels": selected}
    return Audit(model=info.name, facts=facts, rows=tuple(rows), trace=str(out) if store else None)


#: the options of ``tracer audit`` (a skip reason may name only these; tests/test_summary.py checks the CLI)
AUDIT_FLAGS = ("--levels", "-l", "--prompt", "-p", "--prompt-file", "--token-ids-file", "--length", "-n", "--chat",
                 "--dtype", "--device", "--attn", "--gguf", "--granularity", "--kv-cache", "--kernels", "--output", "-o", "--overwrite",
                 "--no-store", "--no-mitigations", "--format", "-f", "--report", "--batch-size", "--batch-row",
                 "--new-tokens", "--block-sizes", "--chunk-size", "--tp")


def skip_hint(message: str) -> str:
    """A scenario's error as an audit skip reason: its advice is kept when every option it names
    is one of :data:`AUDIT_FLAGS`; otherwise the advice is replaced by one the audit can follow
    (``tracer run`` options such as ``--split-at`` or ``--block-size`` do not exist here)."""
    head, sep, advice = message.partition("; ")
    if not sep or all(o in AUDIT_FLAGS for o in re.findall(r"--[a-z][a-z0-9-]*", advice)):
        return message
    if "tokens" in head:
        return f"{head}; use a longer prompt (--length N, --prompt or --prompt-file)"
    return f"{head}; run it alone with 'tracer run' to use the options it names"


def skip_reason(check: Check, device: str = "cpu") -> str | None:
    """Why this machine cannot run ``check`` with the model on ``device`` (None if it can)."""
    import importlib.util

    import torch

    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if check.needs == "cuda" and n_gpu == 0:
        return "no CUDA GPU on this machine"
    if check.needs == "ranks":
        from tracer.execute.tp_shard import check_world

        try:
            check_world(int(check.options.get("tp", 2)), device)
        except TracerError as e:
            return str(e)
    if check.needs == "flash" and importlib.util.find_spec("flash_attn") is None:
        return "flash-attention is not installed (pip install flash-attn)"
    return None


def _check_options(options: dict[str, Any], selected: list[int]) -> None:
    """Refuse scenario options that no selected check uses (e.g. ``tp`` without level 4)."""
    used = {o for c in checks() if c.level in selected for o in applicable_options(c.scenario)}
    extra = sorted(k for k in options if k not in used)
    if extra:
        raise TracerError(f"{', '.join('--' + k.replace('_', '-') for k in extra)} is used by no check of levels "
                          f"{','.join(map(str, selected))}; drop it or add the level that uses it")


def _plan(todo: list[Check], n: int, options: dict[str, Any], device: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Every runnable check's scenario (metadata only: bad options fail before anything runs) and the
    skip reason of every other check; a real-TP check's label names its backend (in place in ``todo``)."""
    from tracer.execute.tp_shard import backend_for
    from tracer.plan.scenarios import build

    plans: dict[str, Any] = {}
    reasons: dict[str, str] = {}
    for j, c in enumerate(todo):
        if c.needs == "ranks":  # the row says which mode and backend produced it
            with contextlib.suppress(TracerError):
                todo[j] = c = _replace(c, label=f"{c.label} ({backend_for(device)})")
        reason = skip_reason(c, device)
        if reason is None:
            try:
                plans[c.key] = build(c.scenario, n, **_options_for(c, options))
            except TracerError as e:
                reason = skip_hint(str(e))
        if reason is not None:
            reasons[c.key] = reason
    return plans, reasons


def _options_for(c: Check, options: dict[str, Any]) -> dict[str, Any]:
    uses = applicable_options(c.scenario)
    return {**{k: v for k, v in options.items() if k in uses}, **c.options}


def _check(c: Check, plans: dict[str, Any], reasons: dict[str, str], one: Callable[[str, Any], Any], n: int,
           options: dict[str, Any], mitigations: bool) -> AuditRow:
    """One row: run the check (unless skipped), then each applicable mitigation if it diverged."""
    from tracer.plan.scenarios import build

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
            fixed[m] = one(f"{c.key}+{m}", build(c.scenario, n, **_options_for(c, options), mitigation=m)).identical
        except TracerError as e:
            fixed[m] = skip_hint(str(e))
    return _replace(row, mitigations=fixed)


__all__ = ["Audit", "AuditRow", "audit", "checks", "parse_levels", "skip_reason", "SEED_STATUS", "STATUSES"]
