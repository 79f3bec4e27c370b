"""The audit's plan: which of the hierarchy's checks this machine can run, and how.

Before anything runs, :func:`plan_checks` gives every runnable check its scenario (metadata only,
so bad options fail at once) and every other check its skip reason: the machine lacks what the
check needs (:func:`skip_reason`: a CUDA GPU, an engine's package or processes, flash-attention),
the model does not shard to the check's TP degree (:func:`fit_check`), or the scenario refuses the
options (its advice rewritten to name only ``tracer audit``'s flags, :func:`skip_hint`).
:func:`check_options` refuses scenario options that no selected check uses, and
:func:`check_scenario` builds a check's scenario (also under a mitigation) on the engine the
options name. :mod:`tracer.loops.audit` runs the plan.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
from dataclasses import replace as _replace
from typing import Any

from tracer.config import COMMAND_OPTIONS, OPTIONS, applicable_options
from tracer.engines import door
from tracer.engines.table import rows
from tracer.errors import TracerError
from tracer.plan.build import build
from tracer.plan.hierarchy import Check, checks

#: the run options' flags of ``tracer audit`` (:data:`tracer.config.COMMAND_OPTIONS`): a skip reason's
#: advice may name only these
AUDIT_FLAGS = tuple(f for k in COMMAND_OPTIONS["audit"] if k != "model" for flag in OPTIONS[k].flags
                    for f in flag.split("/"))


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
    import torch

    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if check.needs == "cuda" and n_gpu == 0:
        return "no CUDA GPU on this machine"
    if check.needs in rows():  # an engine: its package, its processes
        return door.engine(check.needs).unavailable(check.options, device)
    if check.needs == "flash" and importlib.util.find_spec("flash_attn") is None:
        return "flash-attention is not installed (pip install flash-attn)"
    return None


def check_options(options: dict[str, Any], selected: list[int]) -> None:
    """Refuse scenario options that no selected check uses (e.g. ``tp`` without level 4)."""
    used = {o for c in checks() if c.level in selected for o in applicable_options(c.scenario)}
    extra = sorted(k for k in options if k not in used)
    if extra:
        raise TracerError(f"{', '.join('--' + k.replace('_', '-') for k in extra)} is used by no check of levels "
                          f"{','.join(map(str, selected))}; drop it or add the level that uses it")


def plan_checks(todo: list[Check], n: int, options: dict[str, Any], device: str,
                model: Any = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Every runnable check's scenario (metadata only: bad options fail before anything runs) and the
    skip reason of every other check; a real-TP check runs at a degree the model shards to
    (its engine's :meth:`~tracer.engines.base.Engine.fit`) and its label names the degree and the backend (in place in ``todo``)."""
    plans: dict[str, Any] = {}
    reasons: dict[str, str] = {}
    for j, c in enumerate(todo):
        shard_reason = None
        if c.needs in rows():  # the row says how its engine ran (real TP: the degree the model shards to, the backend)
            c, shard_reason = fit_check(c, model)
            with contextlib.suppress(TracerError):
                detail = door.engine(c.needs).detail(device)
                if detail:
                    c = _replace(c, label=f"{c.label} ({detail})")
            todo[j] = c
        reason = skip_reason(c, device) or shard_reason
        if reason is None:
            try:
                plans[c.key] = check_scenario(c, n, options)
            except TracerError as e:
                reason = skip_hint(str(e))
        if reason is not None:
            reasons[c.key] = reason
    return plans, reasons


def fit_check(c: Check, model: Any) -> tuple[Check, str | None]:
    """Check ``c`` as its engine can run it on ``model`` (:meth:`~tracer.engines.base.Engine.fit`: real
    TP at the smallest degree the model shards to, its label saying it), and why it cannot (else None).
    ``model`` None (not loaded yet) or a check on no engine: ``c`` as it is."""
    if model is None or c.needs not in rows():
        return c, None
    fitted, why = door.engine(c.needs).fit(dict(c.options), model)
    if fitted == dict(c.options):
        return c, why
    k0, k = c.options.get("tp"), fitted.get("tp")
    return _replace(c, options=fitted, label=c.label.replace(f"TP-{k0}", f"TP-{k}") if k0 != k else c.label), why


def _options_for(c: Check, options: dict[str, Any]) -> dict[str, Any]:
    uses = applicable_options(c.scenario) + (("engine",) if c.scenario != "engine" else ())
    return {**{k: v for k, v in options.items() if k in uses}, **c.options}


def check_scenario(c: Check, n: int, options: dict[str, Any], **extra: Any) -> Any:
    """The check's scenario for N = ``n``, realised on the engine the options name."""
    opts = _options_for(c, options)
    return door.realise(build(c.scenario, n, **opts, **extra), opts.get("engine"))


__all__ = ["AUDIT_FLAGS", "skip_hint", "skip_reason", "check_options", "plan_checks", "fit_check", "check_scenario"]
