"""What one scenario run returns: :class:`RunResult` (:func:`tracer.pipeline.run`, ``tracer.run``).

The comparison as data, the scenario, the trace path, the prompt's token ids, both runs and the
model's facts, with the calls a notebook makes on them (``check``, ``verdict``, ``plot``,
``to_pandas``, Jupyter's markdown); the rendering itself lives in :mod:`tracer.report`, imported
when first asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tracer.diff.result import Comparison
    from tracer.execute.records import RunRecord
    from tracer.load.models import ModelInfo
    from tracer.plan.scenarios import Scenario


@dataclass
class RunResult:
    """What :func:`tracer.pipeline.run` (and ``tracer.run``) returns.

    Attributes:
        comparison: the :class:`~tracer.diff.result.Comparison` (the amplification table as data).
        scenario: the :class:`~tracer.plan.scenarios.Scenario` that was run.
        trace: path of the HDF5 trace, or None when nothing was stored.
        token_ids: the prompt's N token ids.
        runs: the two :class:`~tracer.execute.records.RunRecord` objects (captured tensors in memory).
        model_info: the :class:`~tracer.load.models.ModelInfo` of the model that ran.
        fail_on: the rule :meth:`check` judges by.
        partials: ``--tp-mode distributed --tp-partials``: run ``B.partials``, every rank's
            row-parallel partials. Under ``torchrun``, ranks other than 0 get ``comparison=None``.
    """

    comparison: Comparison | None
    scenario: Scenario
    trace: str | None
    token_ids: list[int]
    runs: tuple[RunRecord | None, RunRecord | None] = field(repr=False, default=(None, None))
    model_info: ModelInfo | None = None
    fail_on: str | None = None
    partials: RunRecord | None = field(repr=False, default=None)

    def check(self) -> tuple[bool, str]:
        """``(failed, reason)`` under the ``fail_on`` rule (see :meth:`Comparison.check`)."""
        return self.comparison.check(self.fail_on)

    def to_dict(self) -> dict[str, Any]:
        """The same document as ``tracer run --format json``."""
        return self.comparison.to_dict()

    def verdict(self) -> str:
        """One line: bit-identical, or where the runs diverge and how many argmax flips."""
        return self.comparison.verdict()

    def plot(self, kind: str = "amplification", **kwargs: Any):
        """A matplotlib Figure (see :func:`tracer.report.plot.figure_for`): ``amplification``,
        ``heatmap`` or ``ulp``.

        Raises:
            TracerError: unknown kind, matplotlib missing.
        """
        from tracer.report.plot import figure_for

        return figure_for(kind, comparison=self.comparison, runs=self.runs, trace=self.trace, **kwargs)

    def to_pandas(self):
        """The comparison as a DataFrame, one row per capture point (:func:`tracer.report.frames.comparison_frame`)."""
        from tracer.report.frames import comparison_frame

        return comparison_frame(self.comparison)

    def _repr_markdown_(self) -> str:  # Jupyter
        from tracer.report.tables import to_markdown

        return to_markdown(self.comparison)

    def __repr__(self) -> str:
        return f"RunResult({self.comparison.verdict()!r}, trace={self.trace!r})"


__all__ = ["RunResult"]
