"""Which rows of a vLLM forward pass belong to which request, read from the pass itself.

vLLM flattens the tokens of every request scheduled in a step into one ``[tokens, features]``
batch. Its model runners order the requests differently (the V1 runner keeps its persistent batch
order; the V2 runner, vLLM 0.26's default on CUDA, sorts a step's requests by their number of
tokens), and their internals change between releases, so tracer never reads them. What every
runner hands the model is enough (:class:`StepInputs`): the step's ``input_ids`` and
``positions``, the request boundaries (``query_start_loc`` of the forward context's attention
metadata) and each token's KV-cache slot (``slot_mapping``).

:class:`Tracker` follows the requests tracer cares about through the steps:

- a request is found the first time by its **content at its positions**: a run of rows whose
  positions are consecutive and whose token ids equal the request's prompt at those positions
  (a prefix-cache hit starts at its first uncached position; a chunked prefill continues);
- after that, by **continuity**: the request's next run starts at the position after its last
  one (a chunk of the prompt, still checked against the prompt's ids, or one decode token), and
  when several runs could be it (several requests decoding at the same position), the one whose
  first KV slot follows the request's last slot (inside a KV block), or whose block-table row
  holds the block of the request's last slot (at a block boundary).

Pure numpy; the reading of one forward pass is :func:`tracer.engines.vllm.forward.read_step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tracer.errors import TracerError


@dataclass(frozen=True)
class StepInputs:
    """One forward pass as the model receives it (host copies).

    Attributes:
        ids: ``(T,)`` int64 token ids of the flattened batch.
        positions: ``(T,)`` int64 absolute positions.
        starts: ``(R + 1,)`` int64 request boundaries (``query_start_loc``); rows beyond
            ``starts[-1]`` are padding.
        slots: ``(T,)`` int64 KV-cache slot of each token (``slot_mapping``), or None.
        block_table: returns the step's ``(R, max_blocks)`` block table (read only when two runs
            could be one request at a KV block boundary), or None when the metadata has none.
        boundaries: where ``starts`` came from: ``query_start_loc``, or ``positions`` (derived
            from breaks in the positions and slots, for attention metadata without boundaries).
    """

    ids: np.ndarray
    positions: np.ndarray
    starts: np.ndarray
    slots: np.ndarray | None = None
    block_table: Callable[[], np.ndarray] | None = None
    boundaries: str = "query_start_loc"

    @property
    def n_requests(self) -> int:
        """Requests (runs of rows) in the step."""
        return len(self.starts) - 1


def boundaries_from_positions(positions: np.ndarray, slots: np.ndarray | None) -> np.ndarray:
    """``query_start_loc`` derived from a step's positions (and slots): a new request starts
    wherever the position is not the previous one's + 1 (or the slot not the previous slot + 1).
    Exact unless two requests of one step are adjacent in positions and in KV slots."""
    t = len(positions)
    if t == 0:
        return np.zeros(1, dtype=np.int64)
    brk = positions[1:] != positions[:-1] + 1
    if slots is not None:
        brk |= slots[1:] != slots[:-1] + 1
    return np.concatenate([[0], np.nonzero(brk)[0] + 1, [t]]).astype(np.int64)


@dataclass
class Followed:
    """One request the tracker follows.

    Attributes:
        label: tracer's name for it (vLLM's external request id, or ``first``).
        prompt: its prompt's token ids (identify it by content), or None (the first run of the
            first step it sees: ``tracer.capture(llm)``).
        traced: its activations are captured (else only its logits rows are kept).
        last_pos, last_slot: its last computed position and that token's KV slot (-1: not seen).
        open: still running (closed: finished, never matched again).
        close_when_absent: close it in the first step it is not part of (a request runs in every
            step until it finishes; used when nobody tells the tracker it finished).
    """

    label: str
    prompt: np.ndarray | None
    traced: bool = True
    last_pos: int = -1
    last_slot: int = -1
    open: bool = True
    close_when_absent: bool = False


@dataclass
class Tracker:
    """Follows requests through a run's forward passes (module docstring).

    Args:
        block_size: the KV cache's block size in tokens (slots of one block are consecutive).
    """

    block_size: int
    followed: dict[str, Followed] = field(default_factory=dict)

    def follow(self, label: str, prompt: list[int] | np.ndarray | None, *, traced: bool = True,
               close_when_absent: bool = False) -> None:
        """Start following a request (before the step that computes it first)."""
        arr = None if prompt is None else np.asarray(prompt, dtype=np.int64)
        self.followed[label] = Followed(label, arr, traced, close_when_absent=close_when_absent)

    def close(self, label: str) -> None:
        """The request finished: it is never matched again."""
        if label in self.followed:
            self.followed[label].open = False

    def assign(self, step: StepInputs) -> tuple[dict[str, int], list[str]]:
        """Which run of ``step`` each followed request is, and notes on what was ambiguous.

        Returns:
            ``({label: request index j}, notes)``; rows ``starts[j]..starts[j+1]-1`` are the
            request's, at positions ``positions[starts[j]]`` onwards.

        Raises:
            TracerError: a run whose positions are not consecutive (not a flattened batch).
        """
        starts, pos = step.starts, step.positions
        runs = []
        for j in range(step.n_requests):
            a, b = int(starts[j]), int(starts[j + 1])
            if b > a and not np.array_equal(pos[a:b], np.arange(pos[a], pos[a] + (b - a))):
                raise TracerError(f"request {j} of a vLLM step has positions that are not consecutive "
                                  f"({pos[a:min(b, a + 4)].tolist()}...); tracer reads flattened batches only")
            runs.append((a, b))
        free = {j for j, (a, b) in enumerate(runs) if b > a}
        out: dict[str, int] = {}
        notes: list[str] = []
        # continuations first: a request's next run starts where its last one ended
        for f in [f for f in self.followed.values() if f.open and f.last_pos >= 0]:
            cands = [j for j in sorted(free) if pos[runs[j][0]] == f.last_pos + 1 and self._fits(f, step, *runs[j])]
            if len(cands) > 1:
                cands = self._continuity(f, step, cands, runs) or cands
                if len(cands) > 1:
                    notes.append(f"{len(cands)} requests of one step could continue {f.label} at position "
                                 f"{f.last_pos + 1}; the first in the step's order is taken")
            if cands:
                out[f.label] = cands[0]
                free.discard(cands[0])
            elif f.close_when_absent:
                f.open = False
        for f in [f for f in self.followed.values() if f.open and f.last_pos < 0]:
            if f.prompt is None:
                cands = sorted(free)[:1]
            else:
                cands = [j for j in sorted(free) if pos[runs[j][0]] < len(f.prompt) and self._fits(f, step, *runs[j])]
            if len(cands) > 1:
                notes.append(f"{len(cands)} requests of one step hold {f.label}'s token ids at the same positions "
                             "(identical requests); the first in the step's order is taken")
            if cands:
                out[f.label] = cands[0]
                free.discard(cands[0])
        for label, j in out.items():
            f, (a, b) = self.followed[label], runs[j]
            f.last_pos = int(pos[b - 1])
            f.last_slot = int(step.slots[b - 1]) if step.slots is not None else -1
        return out, notes

    def _fits(self, f: Followed, step: StepInputs, a: int, b: int) -> bool:
        """Whether rows a..b can be ``f``'s: its prompt's ids where the rows lie in the prompt; one
        token (a decode step) where they lie beyond it."""
        p0 = int(step.positions[a])
        if f.prompt is None:
            return True
        n = len(f.prompt)
        k = max(0, min(b - a, n - p0))
        if k == 0:
            return b - a == 1 and f.last_pos >= n - 1
        return bool(np.array_equal(step.ids[a:a + k], f.prompt[p0:p0 + k]))

    def _continuity(self, f: Followed, step: StepInputs, cands: list[int], runs: list[tuple[int, int]]) -> list[int]:
        """Of several runs that could continue ``f``, those whose KV slots continue its last slot."""
        if step.slots is None or f.last_slot < 0:
            return []
        nxt = f.last_pos + 1
        if nxt % self.block_size:  # inside a block: the next slot of the same block
            return [j for j in cands if int(step.slots[runs[j][0]]) == f.last_slot + 1]
        if step.block_table is None:
            return []
        table = step.block_table()
        col = f.last_pos // self.block_size
        block = f.last_slot // self.block_size
        return [j for j in cands if j < table.shape[0] and col < table.shape[1] and int(table[j, col]) == block]


__all__ = ["StepInputs", "Tracker", "Followed", "boundaries_from_positions"]
