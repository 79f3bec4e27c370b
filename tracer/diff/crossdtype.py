"""Two runs that hold a capture point in different dtypes: compared honestly, never refused.

An engine's LogitsProcessor returns float32 logits while the HF reference's are bfloat16; an RL
trainer may compute its LM head in float32; a ``tp:partial`` sum is kept in float64. Such a pair is
compared like this (SGLang's comparator does the same: its ``diff`` in the wider dtype, its
``diff_downcast`` in the smaller one):

- **values** in the narrowest dtype that holds both exactly (:func:`torch.promote_types`: bf16 and
  float32 → float32; bf16 and fp16 → float32): ``n_diff`` counts elements whose *values* differ,
  the abs/rel errors, cosine and SQNR are those of the exact values (casting up is exact);
- **ULPs** in the coarser dtype (the one with fewer mantissa bits): ``max_ulp_mag`` is
  ``|a - b| / ulp(max(|a|, |b|))`` of that dtype over the exact values (0.5: B is within half an ULP
  of A, i.e. B rounds to A), ``max_ulp`` and ``ulp_hist`` the integer ULP distances after both
  sides are rounded to it (round to nearest even; ``ulp_hist[0]`` then counts the elements equal
  *after rounding*, which may exceed ``n_total - n_diff``);
- how many elements of the finer side are **not exactly representable** in the coarser dtype
  (0: the finer side holds only values of the coarser one, e.g. a plain up-cast), and how many
  differ after rounding (SGLang's ``diff_downcast``).

Nothing is cast silently: every such point carries a :class:`CrossDtype` record, and the report
says "values compared in float32; A is bfloat16" in its header, verdict and table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tracer import schema
from tracer.diff.metrics import TensorDiff, ulp_of

#: elements per chunk of the float64 work of :meth:`CrossAccumulator.add`
_CHUNK = 1 << 20


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def pair_dtypes(da: torch.dtype, db: torch.dtype) -> tuple[torch.dtype, torch.dtype] | None:
    """``(compared in, ULPs in)`` for two different floating dtypes; None when they are equal or one
    is not a floating dtype (such a pair is not comparable)."""
    if da == db or not (da.is_floating_point and db.is_floating_point):
        return None
    wide = torch.promote_types(da, db)
    narrow = da if torch.finfo(da).eps > torch.finfo(db).eps else db
    return wide, narrow


@dataclass(frozen=True)
class CrossDtype(schema.Record):
    """How a capture point whose two runs hold different dtypes was compared.

    Attributes:
        dtype_a, dtype_b: the storage dtypes of run A and run B (``bfloat16``, ``float32``, ...).
        compared_in: the dtype the values were compared in (holds both exactly).
        ulps_in: the dtype the ULP fields of the point's :class:`TensorDiff` are measured in (the
            coarser of the two).
        n_inexact: elements of the run(s) not in ``ulps_in`` whose value is not exactly
            representable in ``ulps_in`` (rounding changes it); 0 when that side holds only
            ``ulps_in`` values.
        n_diff_rounded: elements that still differ after both sides are rounded to ``ulps_in``
            (SGLang's ``diff_downcast``).
        max_abs_diff_rounded: max |A − B| after that rounding.
    """

    dtype_a: str
    dtype_b: str
    compared_in: str
    ulps_in: str
    n_inexact: int = 0
    n_diff_rounded: int = 0
    max_abs_diff_rounded: float = 0.0

    def finer_runs(self, run_a: str = "A", run_b: str = "B") -> str:
        """The run(s) whose dtype is not ``ulps_in``."""
        runs = [r for r, d in ((run_a, self.dtype_a), (run_b, self.dtype_b)) if d != self.ulps_in]
        return " and ".join(runs)

    def text(self, run_a: str = "A", run_b: str = "B") -> str:
        """``values compared in float32 (A is bfloat16, B is float32); ULPs in bfloat16; B exactly
        representable in bfloat16`` (or ``... B not exactly representable in bfloat16 at 12 elements,
        3 differ after rounding``)."""
        finer = self.finer_runs(run_a, run_b)
        if self.n_inexact == 0:
            rep = f"{finer} exactly representable in {self.ulps_in}"
        else:
            rep = (f"{finer} not exactly representable in {self.ulps_in} at {self.n_inexact:,} element"
                   f"{'s' if self.n_inexact != 1 else ''}")
        return (f"values compared in {self.compared_in} ({run_a} is {self.dtype_a}, {run_b} is {self.dtype_b}); "
                f"ULPs in {self.ulps_in}; {rep}; {self.n_diff_rounded:,} differ after rounding both to {self.ulps_in}")


class CrossAccumulator:
    """Accumulates, over one pair given whole or in row blocks, what :class:`CrossDtype` and the
    merged :class:`TensorDiff` need beyond the two batched comparisons (values in ``wide``,
    rounded to ``narrow``): the inexact count and the max difference in ``narrow`` ULPs."""

    def __init__(self, da: torch.dtype, db: torch.dtype) -> None:
        dtypes = pair_dtypes(da, db)
        if dtypes is None:
            raise ValueError(f"not a cross-dtype pair: {da} and {db}")
        self.da, self.db = da, db
        self.wide, self.narrow = dtypes
        self.n_inexact = 0
        self.max_ulp_mag = 0.0

    def views(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Account for one block and return ``(a wide, b wide, a rounded, b rounded)``."""
        self.add(a, b)
        return a.to(self.wide), b.to(self.wide), a.to(self.narrow), b.to(self.narrow)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        fa, fb = a.reshape(-1), b.reshape(-1)
        for i in range(0, fa.numel(), _CHUNK):
            xa, xb = fa[i:i + _CHUNK], fb[i:i + _CHUNK]
            for x in (xa, xb):
                if x.dtype != self.narrow:
                    back = x.to(self.narrow).to(x.dtype)
                    same = (back == x) | (torch.isnan(back) & torch.isnan(x))
                    self.n_inexact += int((~same).sum())
            a64, b64 = xa.to(torch.float64), xb.to(torch.float64)
            d = (a64 - b64).abs()
            mag = d / ulp_of(torch.maximum(a64.abs(), b64.abs()), self.narrow)
            fin = torch.isfinite(a64) & torch.isfinite(b64)
            both_nan = torch.isnan(a64) & torch.isnan(b64)
            mag = torch.where(fin, mag, torch.where(both_nan | (a64 == b64), torch.zeros_like(mag),
                                                    torch.full_like(mag, float("inf"))))
            if mag.numel():
                self.max_ulp_mag = max(self.max_ulp_mag, float(mag.max()))

    def merge(self, values: TensorDiff, rounded: TensorDiff) -> tuple[TensorDiff, CrossDtype]:
        """The point's :class:`TensorDiff` (``values``: the comparison in ``wide``; its ULP fields
        replaced by those in ``narrow``) and its :class:`CrossDtype` record."""
        diff = replace(values, max_ulp=rounded.max_ulp, ulp_hist=rounded.ulp_hist,
                       max_ulp_mag=self.max_ulp_mag if values.n_diff else 0.0)
        info = CrossDtype(dtype_a=dtype_name(self.da), dtype_b=dtype_name(self.db), compared_in=dtype_name(self.wide),
                          ulps_in=dtype_name(self.narrow), n_inexact=self.n_inexact,
                          n_diff_rounded=rounded.n_diff, max_abs_diff_rounded=rounded.max_abs_diff)
        return diff, info


def summary_line(infos: dict[str, CrossDtype], run_a: str, run_b: str) -> str | None:
    """One header line for every cross-dtype point of a comparison (None when there is none)."""
    if not infos:
        return None
    first_name, first = next(iter(infos.items()))
    names = list(infos)
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    inexact = sum(i.n_inexact for i in infos.values())
    rep = ("exactly representable in " + first.ulps_in) if inexact == 0 else \
        f"not exactly representable in {first.ulps_in} at {inexact:,} element(s)"
    return (f"dtypes differ at {len(names)} capture point(s) ({', '.join(names[:3])}{more}): values compared in "
            f"{first.compared_in} ({run_a} is {first.dtype_a}, {run_b} is {first.dtype_b}), ULPs in {first.ulps_in} "
            f"(the {first.finer_runs(run_a, run_b)} side {rep}; {sum(i.n_diff_rounded for i in infos.values()):,} "
            f"element(s) differ after rounding both to {first.ulps_in})")
