"""The decode replay (``--decode T``): both runs' greedy continuations, compared token by token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tracer import schema
from tracer.errors import TracerError


@dataclass(frozen=True)
class Replay(schema.Record):
    """Greedy continuations of both runs from their own KV caches (``--decode T``).

    Attributes:
        tokens_a, tokens_b: the T generated token ids of each run.
        first_diff: index (0-based, among the generated tokens) of the first position whose ids
            differ, or None when the continuations are identical.
        text_a, text_b: the continuations decoded to text (None if no tokenizer was at hand).
    """

    tokens_a: tuple[int, ...]
    tokens_b: tuple[int, ...]
    first_diff: int | None
    text_a: str | None = None
    text_b: str | None = None

    def line(self) -> str:
        """One line for people, without a label (the report puts ``decode:`` before it); the first
        differing generated token counted from 1 (``first_diff`` + 1)."""
        n = len(self.tokens_a)
        if self.first_diff is None:
            return f"the {n} greedy tokens after the prompt are identical in both runs"
        return f"the greedy continuations differ from generated token {self.first_diff + 1} of {n}"  # 1-based

    def schema_extras(self, doc: dict[str, Any]) -> None:
        doc["steps"] = len(self.tokens_a)


def replay_diff(tokens_a: list[int], tokens_b: list[int], text_a: str | None = None,
                text_b: str | None = None) -> Replay:
    """Compare two greedy continuations token by token (see :class:`Replay`).

    Raises:
        TracerError: the continuations have different lengths.
    """
    if len(tokens_a) != len(tokens_b):
        raise TracerError(f"the runs decoded {len(tokens_a)} and {len(tokens_b)} tokens; replay both with the same --decode")
    first = next((i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y), None)
    return Replay(tuple(int(t) for t in tokens_a), tuple(int(t) for t in tokens_b), first, text_a, text_b)
