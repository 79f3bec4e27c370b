"""The one dtype table: every floating-point dtype tracer computes, stores and compares in.

Each entry says how the dtype is named, how its bits are read (the signed integer of the same
width), how it lies on disk (bf16/fp16 as raw uint16 bit patterns, lossless) and its float
layout (explicit mantissa bits, exponent of the smallest normal number) for ULP arithmetic.
Loading, the trace store, the metrics and the plots all read this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from tracer.errors import TracerError, did_you_mean

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class FloatType:
    """One floating-point dtype. The table is read without importing torch or numpy (a command-line
    dtype is checked before either loads); the torch and numpy dtypes resolve on first use.

    Attributes:
        name: canonical name (``bfloat16``), as in traces and on the command line.
        bits: width in bits.
        mantissa_bits: explicit mantissa bits p (bf16: 7).
        emin: exponent of the smallest normal number (bf16: -126).
        torch: the ``torch.dtype``.
        int_view: signed integer dtype of the same width (bit patterns, ULP distances).
        stored: numpy dtype of the on-disk dataset (``uint16`` for the 16-bit floats).
    """

    name: str
    bits: int
    mantissa_bits: int
    emin: int

    @cached_property
    def torch(self) -> torch.dtype:
        import torch

        return getattr(torch, self.name)

    @cached_property
    def int_view(self) -> torch.dtype:
        import torch

        return getattr(torch, f"int{self.bits}")

    @cached_property
    def stored(self) -> type:
        import numpy as np

        return np.uint16 if self.raw16 else getattr(np, self.name)

    @property
    def raw16(self) -> bool:
        """Stored as 16-bit patterns (numpy has no bfloat16)."""
        return self.bits == 16


FLOATS: dict[str, FloatType] = {f.name: f for f in (
    FloatType("bfloat16", 16, 7, -126),
    FloatType("float16", 16, 10, -14),
    FloatType("float32", 32, 23, -126),
    FloatType("float64", 64, 52, -1022),
)}
ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
           "float": "float32", "fp64": "float64", "double": "float64"}
SUPPORTED = "bfloat16, float16, float32 or float64"


def __getattr__(name: str) -> Any:
    """The torch-keyed views of the table, built on first use: ``BY_TORCH`` (``torch.dtype`` → its
    entry), ``DTYPES`` (canonical name → ``torch.dtype``), ``INT_VIEW`` (``torch.dtype`` → signed
    integer dtype of the same width)."""
    views = {"BY_TORCH": lambda: {f.torch: f for f in FLOATS.values()},
             "DTYPES": lambda: {n: f.torch for n, f in FLOATS.items()},
             "INT_VIEW": lambda: {f.torch: f.int_view for f in FLOATS.values()}}
    if name not in views:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = views[name]()
    globals()[name] = value
    return value


def canonical(name: str) -> str:
    """``"bf16"``/``"BFloat16"``/``"torch.bfloat16"`` → ``"bfloat16"`` (no torch import).

    Raises:
        TracerError: unknown name, listing the valid ones.
    """
    key = str(name).strip().lower().removeprefix("torch.")
    key = ALIASES.get(key, key)
    if key not in FLOATS:
        close = did_you_mean(key, [*FLOATS, *ALIASES])  # as read: lower case, no torch.
        raise TracerError(f"unknown dtype {name!r}; valid: {', '.join([*FLOATS, *ALIASES])}"
                          + (f" (did you mean {close}?)" if close else ""))
    return key


def resolve(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/... (or a ``torch.dtype`` of the table) → ``torch.dtype``.

    Raises:
        TracerError: unknown name, listing the valid ones.
    """
    import torch

    if isinstance(name, torch.dtype):
        if any(name == f.torch for f in FLOATS.values()):
            return name
        name = str(name)
    return FLOATS[canonical(name)].torch


def name_of(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (any torch dtype: its name without ``torch.``)."""
    return str(dtype).removeprefix("torch.")
