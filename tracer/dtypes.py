"""The one dtype table: every floating-point dtype tracer computes, stores and compares in.

Each entry says how the dtype is named, how its bits are read (the signed integer of the same
width), how it lies on disk (bf16/fp16 as raw uint16 bit patterns, lossless) and its float
layout (explicit mantissa bits, exponent of the smallest normal number) for ULP arithmetic.
Loading, the trace store, the metrics and the plots all read this table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tracer.errors import TracerError


@dataclass(frozen=True)
class FloatType:
    """One floating-point dtype.

    Attributes:
        name: canonical name (``bfloat16``), as in traces and on the command line.
        torch: the ``torch.dtype``.
        int_view: signed integer dtype of the same width (bit patterns, ULP distances).
        stored: numpy dtype of the on-disk dataset (``uint16`` for the 16-bit floats).
        mantissa_bits: explicit mantissa bits p (bf16: 7).
        emin: exponent of the smallest normal number (bf16: -126).
    """

    name: str
    torch: torch.dtype
    int_view: torch.dtype
    stored: type
    mantissa_bits: int
    emin: int

    @property
    def raw16(self) -> bool:
        """Stored as 16-bit patterns (numpy has no bfloat16)."""
        return self.stored is np.uint16


FLOATS: dict[str, FloatType] = {f.name: f for f in (
    FloatType("bfloat16", torch.bfloat16, torch.int16, np.uint16, 7, -126),
    FloatType("float16", torch.float16, torch.int16, np.uint16, 10, -14),
    FloatType("float32", torch.float32, torch.int32, np.float32, 23, -126),
    FloatType("float64", torch.float64, torch.int64, np.float64, 52, -1022),
)}
#: ``torch.dtype`` → its entry
BY_TORCH: dict[torch.dtype, FloatType] = {f.torch: f for f in FLOATS.values()}
#: canonical name → ``torch.dtype``
DTYPES: dict[str, torch.dtype] = {n: f.torch for n, f in FLOATS.items()}
#: ``torch.dtype`` → signed integer dtype of the same width
INT_VIEW: dict[torch.dtype, torch.dtype] = {f.torch: f.int_view for f in FLOATS.values()}
ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
           "float": "float32", "fp64": "float64", "double": "float64"}
SUPPORTED = "bfloat16, float16, float32 or float64"


def resolve(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/... (or a ``torch.dtype`` of the table) → ``torch.dtype``.

    Raises:
        TracerError: unknown name, listing the valid ones.
    """
    if isinstance(name, torch.dtype):
        if name in BY_TORCH:
            return name
        name = str(name)
    key = str(name).strip().lower().removeprefix("torch.")
    key = ALIASES.get(key, key)
    if key not in FLOATS:
        raise TracerError(f"unknown dtype {name!r}; valid: {', '.join([*FLOATS, *ALIASES])}")
    return FLOATS[key].torch


def name_of(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (any torch dtype: its name without ``torch.``)."""
    return str(dtype).removeprefix("torch.")
