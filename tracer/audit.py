"""``tracer audit``: every level of the determinism hierarchy on this machine, in one trace.

Each *check* is a catalogue scenario with fixed options (a level can have several: batch of
equal lengths and padded; prefix-cache, decode step and generation). :func:`audit` loads the
model once, runs every selected check whose requirements this machine meets (the others are
skipped with the reason), stores all runs in one HDF5 trace (runs ``L2-prefix-cache.A`` ...),
and re-runs each check that diverged under each applicable mitigation to show which levels it
restores. The result renders as the hierarchy table, beside the seed's own status per level.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .errors import TracerError

#: the seed's status of each level ("The Illusion of Determinism", hierarchy table)
SEED_STATUS = {
    0: "largely solved (fixed kernel, fixed shape, no atomics)",
    1: "attempted; 11 of 28 items unresolved (SGLang #10278)",
    2: "addressed via scheduling constraints (vLLM #34046, open)",
    3: "inherently follows from level 2",
    4: "partially solved (deterministic all-reduce; edge cases remain)",
    5: "unsolved",
    6: "unattempted",
    7: "currently inexpressible",
}
STATUSES = ("passed", "failed", "skipped")


@dataclass(frozen=True)
class Check:
    """One row of the audit: a scenario with the options that make this variant.

    Attributes:
        key: run-name prefix in the trace (``L1-batch-padded``).
        level, scenario, label: hierarchy level, catalogue name, one line for the table.
        options: scenario options fixed by this check (they win over the user's).
        needs: ``"cuda"``, ``"cuda2"`` (two GPUs), ``"flash"`` or None.
        mitigations: mitigations that apply when the check diverges.
    """

    key: str
    level: int
    scenario: str
    label: str
    options: dict[str, Any] = field(default_factory=dict)
    needs: str | None = None
    mitigations: tuple[str, ...] = ("deterministic",)


def checks(n_tokens: int | None = None) -> list[Check]:
    """The audit's checks in level order (``n_tokens`` fixes the decode-step split at N-1)."""
    decode = {"split_at": n_tokens - 1} if n_tokens else {}
    return [
        Check("L0-repeat", 0, "repeat", "the same call twice"),
        Check("L1-batch", 1, "batch", "alone vs one row of an equal-length batch", {"padding": "none"}),
        Check("L1-batch-padded", 1, "batch", "alone vs one row of a left-padded batch", {"padding": "left"}),
        Check("L2-prefix-cache", 2, "prefix-cache", "cache miss vs hit (last block boundary)", {},
              mitigations=("aligned", "deterministic")),
        Check("L2-decode-step", 2, "prefix-cache", "cache miss vs hit at N-1 (a decode step)", decode,
              mitigations=("aligned", "deterministic")),
        Check("L2-generate-cache", 2, "generate-cache", "greedy generation with vs without KV cache"),
        Check("L3-block-size", 3, "block-size", "cache hit at block size 16 vs 64"),
        Check("L3-chunked-prefill", 3, "chunked-prefill", "full prefill vs chunks"),
        Check("L4-tp-sim-ring", 4, "tensor-parallel", "unsharded vs simulated TP-2, ring all-reduce",
              {"reduce": "ring"}),
        # at k = 2 every order and dtype gives the same sum (one rounding of p0 + p1); k = 4 differs
        Check("L4-tp-sim-tree-fp32", 4, "tensor-parallel", "unsharded vs simulated TP-4, tree all-reduce in fp32",
              {"tp": 4, "reduce": "tree", "reduce_dtype": "float32"}),
        Check("L4-tp-real", 4, "tensor-parallel", "single GPU vs torch.distributed TP-2", needs="cuda2"),
        Check("L5-kv-fp8", 5, "kv-quant", "KV cache model dtype vs FP8 E4M3", {"kv_format": "fp8-e4m3"}),
        Check("L5-kv-mxfp8", 5, "kv-quant", "KV cache model dtype vs MXFP8 (32, E8M0)", {"kv_format": "mxfp8"}),
        Check("L5-kv-nvfp4", 5, "kv-quant", "KV cache model dtype vs NVFP4 (16, E4M3)", {"kv_format": "nvfp4"}),
        Check("L6-attention", 6, "attention", "attention eager vs sdpa"),
        Check("L6-attention-flash", 6, "attention", "attention sdpa vs flash_attention_2",
              {"attn_a": "sdpa", "attn_b": "flash_attention_2"}, needs="flash"),
        Check("L6-compile", 6, "compile", "eager vs torch.compile"),
        Check("L7-device", 7, "device", "CPU vs GPU", {"devices": "cpu,cuda"}, needs="cuda"),
        Check("L7-disaggregated", 7, "disaggregated", "prefix on CPU, moved to GPU, vs all on GPU",
              {"devices": "cpu,cuda"}, needs="cuda"),
    ]


def skip_reason(check: Check) -> str | None:
    """Why this machine cannot run ``check`` (None if it can)."""
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if check.needs == "cuda" and n_gpu == 0:
        return "no CUDA GPU on this machine"
    if check.needs == "cuda2":
        if n_gpu < 2:
            return f"real tensor parallelism needs 2 or more GPUs; this machine has {n_gpu}"
        return "real multi-GPU TP (torch.distributed) is not implemented yet; the simulation rows cover level 4"
    if check.needs == "flash" and importlib.util.find_spec("flash_attn") is None:
        return "flash-attention is not installed (pip install flash-attn)"
    return None


def parse_levels(levels: str | None) -> list[int]:
    """``"0,1,2"`` → ``[0, 1, 2]``; None → all levels 0-7.

    Raises:
        TracerError: not a comma-separated list of integers 0-7.
    """
    if levels is None:
        return list(range(8))
    if not levels.replace(",", "").strip():  # "" is a mistake, not "all levels"
        raise TracerError("--levels is empty; give e.g. --levels 0,1,2, or leave it out for all levels")
    try:
        out = sorted({int(x) for x in levels.split(",") if x.strip()})
    except ValueError:
        raise TracerError(f"--levels {levels!r} must be comma-separated levels 0-7, e.g. 0,1,2") from None
    bad = [x for x in out if not 0 <= x <= 7]
    if bad or not out:
        raise TracerError(f"--levels {levels!r}: levels are 0-7; e.g. --levels 0,1,2")
    return out


@dataclass(frozen=True)
class AuditRow:
    """The outcome of one check.

    Attributes:
        status: ``passed`` (bit-identical), ``failed`` (diverged) or ``skipped`` (``reason`` says why).
        last_layer: ``(differing, total)`` elements of the last decoder layer's output, or None.
        max_logit_diff, argmax_flips, first_divergent: from the comparison (None when skipped).
        mitigations: mitigation name → True if it makes the check bit-identical (or the reason
            it could not run, as a string).
    """

    check: Check
    status: str
    reason: str | None = None
    last_layer: tuple[int, int] | None = None
    max_logit_diff: float | None = None
    argmax_flips: int | None = None
    first_divergent: str | None = None
    mitigations: dict[str, bool | str] = field(default_factory=dict)

    @property
    def holds(self) -> bool | None:
        return None if self.status == "skipped" else self.status == "passed"

    def to_dict(self) -> dict[str, Any]:
        c = self.check
        return {"key": c.key, "level": c.level, "scenario": c.scenario, "check": c.label,
                "invariant": _invariant(c), "status": self.status, "holds_bitwise": self.holds,
                "reason": self.reason, "last_layer_differing": None if self.last_layer is None else self.last_layer[0],
                "last_layer_total": None if self.last_layer is None else self.last_layer[1],
                "max_abs_logit_diff": self.max_logit_diff, "argmax_flips": self.argmax_flips,
                "first_divergent": self.first_divergent, "mitigations": dict(self.mitigations),
                "seed_status": SEED_STATUS[c.level]}


_INVARIANTS = {0: "repeating the call", 1: "batch size", 2: "cache hit vs miss", 3: "KV block size / chunking",
               4: "parallelism degree", 5: "quantization scheme", 6: "engine choice", 7: "hardware"}


def _invariant(c: Check) -> str:
    return _INVARIANTS[c.level]


@dataclass(frozen=True)
class Audit:
    """The hierarchy table as data: one row per check; ``total == passed + failed + skipped``."""

    model: str
    facts: dict[str, Any]
    rows: tuple[AuditRow, ...]
    trace: str | None = None

    def counts(self) -> dict[str, int]:
        out = {s: sum(r.status == s for r in self.rows) for s in STATUSES}
        out["total"] = len(self.rows)
        assert out["total"] == out["passed"] + out["failed"] + out["skipped"]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "facts": self.facts, "rows": [r.to_dict() for r in self.rows],
                "summary": self.counts(), "trace": self.trace}


def _row(check: Check, comparison: Any) -> AuditRow:
    layers = [p for p in comparison.points if p.kind == "layer"]
    last = (layers[-1].diff.n_diff, layers[-1].diff.n_total) if layers else None
    lg = comparison.logits
    return AuditRow(check=check, status="passed" if comparison.identical else "failed",
                    last_layer=last, max_logit_diff=None if lg is None else lg.tensor.max_abs_diff,
                    argmax_flips=None if lg is None else len(lg.argmax_flips),
                    first_divergent=comparison.first_divergent)


def audit(model: str = "smollm2-135m", *, levels: str | list[int] | None = None, prompt: str | None = None,
          prompt_file: str | None = None, token_ids_file: str | None = None, chat: bool = False,
          length: int | None = None, dtype: str = "bfloat16", device: str | None = None, attn: str = "sdpa",
          gguf: str | None = None, granularity: str = "layers", output: str | Path | None = None,
          store: bool = True, overwrite: bool = False, mitigations: bool = True, loaded: Any = None,
          progress: bool = True, on_check: Callable[[str, int, int], None] | None = None,
          **options: Any) -> Audit:
    """Run every selected level of the hierarchy on this machine and return the table.

    Args:
        model, prompt..., dtype, device, attn, gguf, granularity: as :func:`tracer.api.run`.
        levels: ``"0,1,2"`` or a list of levels (default: all).
        output / store / overwrite: one trace for all runs (default
            ``traces/<model>-audit-<timestamp>.h5``), runs named ``<check key>.A``/``.B`` and
            ``<check key>+<mitigation>.A``/``.B``; comparisons under ``/comparisons/<key>``.
        mitigations: re-run diverging checks under each applicable mitigation.
        on_check: called as ``on_check(label, done, total)`` before each check (progress bars).
        options: scenario options applied to every check that uses them (a check's own
            options win), e.g. ``batch_size=8``, ``tp=4``.

    Raises:
        TracerError: bad input (checked before the model loads where possible).
    """
    from . import models as _models
    from .api import check_options, check_output, default_output, read_prompt, tokenize
    from .capture import GRANULARITIES, discover_points
    from .compare import compare_records
    from .report import _clean
    from .runner import execute_scenario
    from .scenarios import build
    from .store import TraceWriter, collect_environment

    selected = parse_levels(levels) if not isinstance(levels, list) else parse_levels(",".join(map(str, levels)))
    if granularity not in GRANULARITIES:
        raise TracerError(f"unknown granularity '{granularity}'; use one of: {', '.join(GRANULARITIES)}")
    check_options(options)
    text, ids = read_prompt(prompt, prompt_file, token_ids_file)
    if loaded is None:
        _models.resolve_dtype(dtype)
        _models.resolve_device(device)
        _models.check_attn(attn)
    check_output(output if store else None, overwrite)
    if loaded is None:
        loaded = _models.load_model(model, dtype=dtype, device=device, attn=attn, gguf=gguf, progress=progress)
    info = loaded.info
    ids = tokenize(loaded.tokenizer, text, ids, chat=chat, vocab_size=info.vocab_size, length=length)
    n = len(ids)
    todo = [c for c in checks(n) if c.level in selected]
    # plan everything first (metadata only): scenarios go into the header, bad options fail early
    plans: dict[str, Any] = {}
    reasons: dict[str, str] = {}
    for c in todo:
        reason = skip_reason(c)
        if reason is None:
            try:
                plans[c.key] = build(c.scenario, n, **{**options, **c.options})
            except TracerError as e:
                reason = str(e)
        if reason is not None:
            reasons[c.key] = reason
    header = collect_environment(info.device, extra={
        "model": info.to_dict(), "scenario": {"name": "audit", "levels": selected}, "granularity": granularity,
        "dtype": info.dtype, "attn_implementation": info.attn_implementation, "n_tokens": n,
        "audit": {k: s.to_dict() for k, s in plans.items()},
    })
    points = discover_points(loaded.model, granularity)
    out_path = Path(output) if output is not None else default_output(info.name, "audit")
    writer = TraceWriter(out_path, header=header, overwrite=overwrite) if store else None
    rows: list[AuditRow] = []
    try:
        for i, c in enumerate(todo):
            if on_check is not None:
                on_check(c.label, i, len(todo))
            if c.key in reasons:
                rows.append(AuditRow(check=c, status="skipped", reason=reasons[c.key]))
                continue
            scen = plans[c.key]
            try:
                rec_a, rec_b = execute_scenario(loaded.model, ids, scen, points, names=(f"{c.key}.A", f"{c.key}.B"))
            except TracerError as e:
                rows.append(AuditRow(check=c, status="skipped", reason=str(e)))
                continue
            comp = compare_records(rec_a, rec_b, scenario=scen.name, model=info.name)
            if writer is not None:
                writer.add_run(rec_a)
                writer.add_run(rec_b)
                writer.add_comparison(c.key, _clean(comp.to_dict()))
            del rec_a, rec_b
            row = _row(c, comp)
            if mitigations and row.status == "failed":
                fixed: dict[str, bool | str] = {}
                for m in c.mitigations:
                    key = f"{c.key}+{m}"
                    try:
                        ms = build(c.scenario, n, **{**options, **c.options, "mitigation": m})
                        ra, rb = execute_scenario(loaded.model, ids, ms, points, names=(f"{key}.A", f"{key}.B"))
                    except TracerError as e:
                        fixed[m] = str(e)
                        continue
                    mc = compare_records(ra, rb, scenario=ms.name, model=info.name)
                    fixed[m] = mc.identical
                    if writer is not None:
                        writer.add_run(ra)
                        writer.add_run(rb)
                        writer.add_comparison(key, _clean(mc.to_dict()))
                row = AuditRow(**{**row.__dict__, "mitigations": fixed})
            rows.append(row)
        if on_check is not None:
            on_check("done", len(todo), len(todo))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if writer is not None:
        writer.close()
    facts = {"dtype": info.dtype, "device": info.device, "device_name": header.get("device_name"),
             "attn": info.attn_implementation, "n_tokens": n, "torch": header.get("torch"),
             "levels": selected}
    return Audit(model=info.name, facts=facts, rows=tuple(rows), trace=str(out_path) if store else None)


# ---------------------------------------------------------------- rendering


def _fmt_row(r: AuditRow) -> dict[str, str]:
    def num(x: float | None) -> str:
        from .report import _num

        return _num(x)

    mit = "; ".join(f"{k}: {'restores' if v is True else 'no' if v is False else 'n/a'}" for k, v in r.mitigations.items())
    holds = {"passed": "yes", "failed": "no", "skipped": "skipped"}[r.status]
    return {
        "level": str(r.check.level), "check": r.check.label, "invariant": _invariant(r.check), "holds": holds,
        "last": "-" if r.last_layer is None else f"{r.last_layer[0]:,} / {r.last_layer[1]:,}",
        "logit": num(r.max_logit_diff) if r.max_logit_diff is not None else "-",
        "flips": "-" if r.argmax_flips is None else str(r.argmax_flips),
        "first": r.first_divergent or ("-" if r.status != "skipped" else (r.reason or "")),
        "mitigations": mit or "-", "seed": SEED_STATUS[r.check.level],
    }


_COLUMNS = (("level", "level"), ("check", "check"), ("invariant", "invariant"), ("holds", "holds bitwise?"),
            ("last", "last layer differing"), ("logit", "max abs logit diff"), ("flips", "argmax flips"),
            ("first", "first divergent (or why skipped)"), ("mitigations", "mitigations"), ("seed", "seed's status"))


def _title(a: Audit) -> str:
    f = a.facts
    dev = f"{f.get('device')} ({f.get('device_name')})" if f.get("device_name") else str(f.get("device"))
    return f"determinism audit · model {a.model} · {f.get('dtype')} · {dev} · {f.get('n_tokens')} tokens · torch {f.get('torch')}"


def _summary(a: Audit) -> str:
    c = a.counts()
    return f"{c['total']} checks: {c['passed']} hold bitwise, {c['failed']} diverge, {c['skipped']} skipped"


def print_audit(a: Audit, console: Any = None) -> None:
    """The hierarchy table as a rich table, the summary line and the trace path."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title=_title(a), title_justify="left", header_style="bold", show_lines=False)
    for key, head in _COLUMNS:
        t.add_column(head, overflow="fold", no_wrap=key in ("level", "holds", "flips"))
    for r in a.rows:
        cells = _fmt_row(r)
        style = {"passed": "green", "failed": "red", "skipped": "dim"}[r.status]
        t.add_row(*(cells[k] for k, _ in _COLUMNS), style=style)
    console.print(t)
    console.print(_summary(a), highlight=False)
    if a.trace:
        console.print(f"trace: {a.trace}", style="dim", highlight=False)


def render_audit(a: Audit, fmt: str = "table", console: Any = None) -> str | None:
    """Render an audit as ``table`` (printed; returns None), ``json``, ``csv`` or ``markdown``.

    Raises:
        TracerError: unknown format.
    """
    import csv
    import io
    import json

    from .report import _clean, check_format

    match check_format(fmt):
        case "table":
            print_audit(a, console)
            return None
        case "json":
            return json.dumps(_clean(a.to_dict()), indent=2, default=str)
        case "csv":
            buf = io.StringIO()
            rows = [r.to_dict() for r in a.rows]
            w = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else ["key"], lineterminator="\n")
            w.writeheader()
            for r in rows:
                w.writerow({k: json.dumps(v) if isinstance(v, dict) else ("" if v is None else v) for k, v in r.items()})
            return buf.getvalue()
        case "markdown":
            lines = [f"**{_title(a)}**", "", "| " + " | ".join(h for _, h in _COLUMNS) + " |",
                     "|" + "---|" * len(_COLUMNS)]
            for r in a.rows:
                cells = _fmt_row(r)
                lines.append("| " + " | ".join(cells[k].replace("|", "\\|") for k, _ in _COLUMNS) + " |")
            lines += ["", _summary(a)]
            return "\n".join(lines) + "\n"
    raise AssertionError(fmt)
