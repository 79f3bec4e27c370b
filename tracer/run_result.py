"""What one scenario run returns: :class:`RunResult` (:func:`tracer.pipeline.run`, ``tracer.run``).

The comparison as data, the scenario, the trace path, the prompt's token ids, both runs and the
model's facts, with what the result says of itself (``check``, ``verdict``, ``to_dict``). It is
rendered by :mod:`tracer.report` (``tracer.render(result, "markdown")``, ``tracer.plot(result)``,
``tracer.to_pandas(result)``), which this module does not import: the orchestration that returns
it knows nothing of the renderer.
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
        comparison: the :class:`~tracer.diff.result.Comparison` (the amplification table as data;
            its ``fail_on`` is the rule :meth:`check` judges by).
        scenario: the :class:`~tracer.plan.scenarios.Scenario` that was run.
        trace: path of the HDF5 trace, or None when nothing was stored.
        token_ids: the prompt's N token ids.
        runs: the two :class:`~tracer.execute.records.RunRecord` objects (captured tensors in memory).
        model_info: the :class:`~tracer.load.models.ModelInfo` of the model that ran.
        partials: ``--tp-mode distributed --tp-partials``: run ``B.partials``, every rank's
            row-parallel partials. Under ``torchrun``, ranks other than 0 get ``comparison=None``.
    """

    comparison: Comparison | None
    scenario: Scenario
    trace: str | None
    token_ids: list[int]
    runs: tuple[RunRecord | None, RunRecord | None] = field(repr=False, default=(None, None))
    model_info: ModelInfo | None = None
    partials: RunRecord | None = field(repr=False, default=None)

    @property
    def fail_on(self) -> str | None:
        """The ``--fail-on`` rule of the comparison (held there, :attr:`Comparison.fail_on`)."""
        return self.comparison.fail_on if self.comparison is not None else None

    def check(self) -> tuple[bool, str]:
        """``(failed, reason)`` under the comparison's ``fail_on`` rule (see :meth:`Comparison.check`)."""
        return self.comparison.check()

    def to_dict(self) -> dict[str, Any]:
        """The comparison's document (``tracer run --format json`` renders it with its sentences)."""
        return self.comparison.to_dict()

    def verdict(self) -> str:
        """One line: bit-identical, or where the runs diverge and how many argmax flips."""
        return self.comparison.verdict()

    def __repr__(self) -> str:
        return f"RunResult({self.comparison.verdict()!r}, trace={self.trace!r})"


__all__ = ["RunResult"]
