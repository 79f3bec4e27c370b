"""Streaming two stored runs' capture points in row blocks: bounded host memory whatever the trace size.

Every point is read front to back in row blocks of about :data:`BLOCK_BYTES` into a few reused
buffers (:class:`_Ring`), :data:`READ_AHEAD` blocks ahead of the consumer on one background thread
(:class:`_ReadAhead`; a version-2 trace is read with ``preadv``, which releases the GIL), each
point's CRC-32 checked after its last block. :func:`stored_pairs` hands the comparison
(:func:`tracer.diff.compare.compare_pairs`) one :class:`RowBlocks` pair per point.
"""

from __future__ import annotations

import functools
import math
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from tracer.dtypes import DTYPES
from tracer.store import trace as store  # looked up at call time: a test substitutes stored_crc
from tracer.store.crc import crc_threads


@dataclass(frozen=True)
class RowBlocks:
    """A capture point read in row blocks, in place of its two tensors in :func:`~tracer.diff.compare.compare_pairs`'s
    pairs (a point larger than memory, streamed from a trace).

    The pair's ``tensor_a`` is a RowBlocks whose ``blocks`` yields ``(first row, rows of A, rows
    of B)`` front to back (same rows on both sides, on the compute device); ``tensor_b`` is a
    RowBlocks of run B's shape and dtype with ``blocks`` None. The blocks' buffers may be reused
    after the next block is requested: nothing of a block is kept.

    Attributes:
        shape: the whole tensor's shape ``(rows, *feature)``.
        dtype: its torch dtype.
        blocks: the iterator of blocks (side A), or None (side B).
        equal_hint: the runs' stored CRC-32s of the point are equal, so its bits are probably
            equal: each block's bits are compared as integers and, if all agree, the point is
            recorded as equal without float64 work (the numbers a full comparison gives).
        reread: a function giving the blocks again (fresh buffers), for the one case the hint is
            wrong (two different tensors with one CRC-32): the point is then compared in full.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    blocks: Iterator[tuple[int, torch.Tensor, torch.Tensor]] | None = None
    equal_hint: bool = False
    reread: Callable[[], Iterator[tuple[int, torch.Tensor, torch.Tensor]]] | None = None

    def numel(self) -> int:
        return math.prod(self.shape)



#: bytes of one row block of a stored capture point (per run): ``compare`` reads every point in
#: row blocks of about this size into reused buffers, so host memory does not grow with the trace
BLOCK_BYTES = 32 << 20
#: row blocks (per run) read ahead of the comparison, on one background thread (0: in turn)
READ_AHEAD = 2


class _Ring:
    """``count`` reusable byte buffers of ``nbytes`` each (pinned for a GPU), handed out in turn
    (allocated on first use). On a GPU a buffer's host-to-device copy runs asynchronously: the
    copy's CUDA event is recorded against the buffer (:meth:`copied`), and the buffer is handed
    out again only once that copy has finished."""

    def __init__(self, count: int, nbytes: int, pin: bool) -> None:
        self.count, self.nbytes, self.pin = count, nbytes, pin
        self.bufs: list = []
        self.i = 0
        self.events: dict[int, Any] = {}  # buffer address -> the CUDA event of its last copy

    def next(self):
        if len(self.bufs) < self.count:
            self.bufs.append(torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.pin).numpy())
            return self.bufs[-1]
        self.i = (self.i + 1) % self.count
        buf = self.bufs[self.i]
        event = self.events.pop(buf.ctypes.data, None)
        if event is not None:
            event.synchronize()  # the device still reads this buffer: wait for that copy (releases the GIL)
        return buf

    def copied(self, address: int, event: Any) -> bool:
        """Record ``event`` as the copy out of the buffer at ``address``; False when no buffer of
        this ring starts there (a block read into a fresh buffer)."""
        if not any(b.ctypes.data == address for b in self.bufs):
            return False
        self.events[address] = event
        return True


class _Raised:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _ReadAhead:
    """Items of ``gen`` produced on one background thread, at most ``depth`` ahead of the consumer
    (``depth`` 0: produced in turn on the calling thread); an error is raised where its item would
    have come. :meth:`close` stops the thread."""

    def __init__(self, gen: Iterator[Any], depth: int) -> None:
        self.gen, self.depth, self.stop = gen, depth, False
        self.done = False
        if depth > 0:
            self.q: queue.Queue = queue.Queue(maxsize=depth)
            self.thread = threading.Thread(target=self._run, name="tracer-read", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        try:
            for item in self.gen:
                if self.stop:
                    return
                self.q.put(item)
            self.q.put(_END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, in order
            self.q.put(_Raised(e))

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self.done:
            raise StopIteration
        if self.depth <= 0:
            return next(self.gen)
        item = self.q.get()
        if item is _END:
            self.done = True
            raise StopIteration
        if isinstance(item, _Raised):
            self.done = True
            raise item.error
        return item

    def close(self) -> None:
        self.stop = True
        if self.depth > 0 and self.thread.is_alive():
            while self.thread.is_alive():  # let a put() blocked on a full queue finish
                try:
                    self.q.get(timeout=0.05)
                except Exception:  # noqa: BLE001 - queue.Empty: the thread is finishing
                    pass
            self.thread.join()


class StoredPairs:
    """The pairs of :func:`~tracer.diff.compare.compare_pairs` for points of two stored runs: every point as
    :class:`RowBlocks`, read front to back in row blocks of about :data:`BLOCK_BYTES` into reused
    buffers, :data:`READ_AHEAD` blocks ahead on one thread (reads release the GIL), each point's
    CRC-32 checked after its last block (the two runs' blocks may differ in dtype). A point whose
    shape differs between the runs (or that is empty in one) is given by its shapes alone: :func:`~tracer.diff.compare.compare_pairs` reports it unread.
    Host memory: the ring of buffers, whatever the trace size."""

    def __init__(self, names: list[str], caps_a: dict, caps_b: dict, dev: torch.device) -> None:
        self.dev = dev
        self.items = []
        biggest = 1
        for name in names:
            (ia, ha), (ib, hb) = caps_a[name], caps_b[name]
            same = list(ia["shape"]) == list(ib["shape"])  # dtypes may differ: compared in the wider one
            crc_a = store.stored_crc(ha) if same and ia["dtype"] == ib["dtype"] else None
            hint = crc_a is not None and crc_a == store.stored_crc(hb)
            self.items.append((name, ia, ib, ha, hb, same, DTYPES[ia["dtype"]], DTYPES[ib["dtype"]], hint))
            if same:
                biggest = max(biggest, int(ha.nbytes), int(hb.nbytes))
        size = min(BLOCK_BYTES, biggest)
        pin = dev.type == "cuda"
        self.rings = (_Ring(READ_AHEAD + 2, size, pin), _Ring(READ_AHEAD + 2, size, pin))
        self.copy_stream: Any = None
        self.ahead = _ReadAhead(self._produce(), READ_AHEAD)

    def _produce(self) -> Iterator[tuple]:
        for _name, ia, _ib, ha, hb, same, _da, _db, _hint in self.items:
            if not same:
                continue
            yield from self._read(ia, ha, hb, self.rings[0].next, self.rings[1].next)
            yield None, None, None  # the end of this point

    @staticmethod
    def _read(ia: dict, ha: Any, hb: Any, buf_a: Callable | None, buf_b: Callable | None) -> Iterator[tuple]:
        shape = tuple(ia["shape"])
        rows = shape[0] if shape else 1
        row_bytes = max(1, int(max(ha.nbytes, hb.nbytes)) // max(1, rows))
        per_block = max(1, BLOCK_BYTES // row_bytes)
        ga = store.read_row_blocks(ha, per_block, buf_a)
        gb = store.read_row_blocks(hb, per_block, buf_b)
        if crc_threads() > 1:  # spare cores: run B's block is read (and checksummed) beside run A's
            side = _side_reader()
            while True:
                fb = side.submit(next, gb, _END)
                a = next(ga, _END)
                b = fb.result()
                if a is _END or b is _END:
                    break
                yield a[0], a[1], b[1]
        else:
            for (r0, xa), (_, xb) in zip(ga, gb):
                yield r0, xa, xb
        for _ in gb:  # run B's CRC-32 is checked when its blocks are exhausted (A's already was)
            pass

    def _again(self, ia: dict, ha: Any, hb: Any) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        for r0, xa, xb in self._read(ia, ha, hb, None, None):
            yield r0, xa.to(self.dev), xb.to(self.dev)

    def _blocks(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        for r0, xa, xb in self.ahead:
            if r0 is None:
                return
            yield r0, self._to_device(xa, 0), self._to_device(xb, 1)

    def _to_device(self, x: torch.Tensor, side: int) -> torch.Tensor:
        """``x`` (a ring buffer's block) on the compute device. On a GPU the copy runs on a side
        stream without blocking the host, so the next block's read, this copy and the comparison
        of the block before overlap; the comparison's stream waits for the copy, and the ring
        hands the buffer out again only after it (:class:`_Ring`)."""
        if self.dev.type != "cuda" or not x.is_pinned():
            return x.to(self.dev)  # a blocking copy: the buffer may be reused afterwards
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(self.dev)
        compute = torch.cuda.current_stream(self.dev)
        with torch.cuda.stream(self.copy_stream):
            out = torch.empty(x.shape, dtype=x.dtype, device=self.dev)
            out.copy_(x, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        compute.wait_event(event)
        out.record_stream(compute)  # allocated on the copy stream, used on the compute stream
        if not self.rings[side].copied(x.data_ptr(), event):
            event.synchronize()  # not a ring buffer: nothing tracks it, so wait here
        return out

    def __iter__(self) -> Iterator[tuple]:
        for name, ia, ib, ha, hb, same, da, db, hint in self.items:
            sa, sb = tuple(ia["shape"]), tuple(ib["shape"])
            blocks = self._blocks() if same else None
            again = functools.partial(self._again, ia, ha, hb)
            yield name, ia["kind"], ia.get("op", ""), RowBlocks(sa, da, blocks, hint, again), RowBlocks(sb, db), \
                ia.get("calls", []), ib.get("calls", [])
            for _ in blocks or ():  # what the comparison did not take (a point it skipped)
                pass

    def close(self) -> None:
        self.ahead.close()


_SIDE: list = []


def _side_reader():
    """The one thread reading run B's blocks beside run A's (reads and CRC-32s release the GIL)."""
    if not _SIDE:
        from concurrent.futures import ThreadPoolExecutor

        _SIDE.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="tracer-read-b"))
    return _SIDE[0]


def stored_pairs(names: list[str], caps_a: dict, caps_b: dict, dev: torch.device) -> StoredPairs:
    """The :class:`StoredPairs` of points ``names`` of two stored runs (``caps_x``: name → (info, dataset)),
    moved to ``dev`` block by block; close it when done."""
    return StoredPairs(names, caps_a, caps_b, dev)


_END = object()
