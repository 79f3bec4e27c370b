"""CRC-32 of large buffers: the checksum every trace and sweep file carries, computed fast.

Store-layer module. :func:`crc32_bytes` gives ``zlib.crc32``'s value of a bytes-like object or
numpy array, with ISA-L when it is installed, a large buffer cut into pieces checksummed on
several threads (:func:`crc_threads`) and their values joined by :func:`crc32_combine` (zlib's,
which Python's zlib does not expose). What is checksummed, and how the sums are stored and
verified: :mod:`tracer.store.integrity`. Nothing here imports torch.
"""

from __future__ import annotations

import functools
import os
import zlib
from typing import Any

try:  # ISA-L's CRC-32: the same checksum as zlib.crc32 (same polynomial and values), ~7x faster
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the fallback
    _crc32 = zlib.crc32


def crc32_bytes(buf: Any, crc: int = 0) -> int:
    """CRC-32 (``zlib.crc32``'s checksum) of a bytes-like object or numpy array (its raw bytes in C
    order), as an unsigned int; ``crc``: the running value of the bytes before ``buf`` (so the CRC
    of a stream is carried block by block: ``crc32_bytes(b2, crc32_bytes(b1)) == crc32_bytes(b1 + b2)``).

    Computed with ISA-L (``isal``, ~11 GiB/s on the development machine's CPU) when it is
    installed, else with zlib (~1.6 GiB/s there); both give the same values. A buffer of
    :data:`PARALLEL_CRC_BYTES` or more is cut into pieces checksummed on :func:`crc_threads`
    threads at once (both libraries release the GIL) and the pieces' values combined
    (:func:`crc32_combine`): the same value, several times faster on a machine with spare cores.
    """
    import numpy as np  # imported here: importing this module loads no numpy

    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            buf = np.ascontiguousarray(buf)
        buf = memoryview(buf.reshape(-1).view(np.uint8)) if buf.size else b""
    n = len(buf) if not isinstance(buf, memoryview) else buf.nbytes
    if n >= PARALLEL_CRC_BYTES and crc_threads() > 1:
        view = buf if isinstance(buf, memoryview) else memoryview(buf)
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        pieces = [view[i:i + _CRC_PIECE] for i in range(0, n, _CRC_PIECE)]
        sums = list(_crc_pool().map(lambda piece: _crc32(piece) & 0xFFFFFFFF, pieces))
        for piece, value in zip(pieces, sums):
            crc = crc32_combine(crc, value, piece.nbytes)
        return crc
    return _crc32(buf, crc) & 0xFFFFFFFF


#: buffers at least this large are checksummed in pieces on several threads (:func:`crc32_bytes`)
PARALLEL_CRC_BYTES = 8 << 20
_CRC_PIECE = 2 << 20
_CRC_POLY = 0xEDB88320  # CRC-32's polynomial, bit-reflected (zlib's)


def crc_threads() -> int:
    """Threads :func:`crc32_bytes` uses for a large buffer: half the CPUs, at most 8 (1 on a
    machine of 2 or 3 cores, where the comparison needs the other one)."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


_POOL: list = []


def _crc_pool():
    if not _POOL:
        from concurrent.futures import ThreadPoolExecutor

        _POOL.append(ThreadPoolExecutor(max_workers=crc_threads(), thread_name_prefix="tracer-crc"))
    return _POOL[0]


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo CRC-32's polynomial (both bit-reflected), as zlib's ``multmodp``."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31 (zlib's x2n_table)
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


@functools.lru_cache(maxsize=64)
def _x8n(nbytes: int) -> int:
    """``x^(8 * nbytes)`` modulo the polynomial (zlib's ``x2nmodp(nbytes, 3)``)."""
    p, k, n = 1 << 31, 3, nbytes
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1`` (of ``A``), ``crc2`` (of ``B``) and ``len2`` (``B``'s
    length in bytes): zlib's ``crc32_combine``, which Python's zlib does not expose."""
    return (_multmodp(_x8n(len2), crc1) ^ crc2) & 0xFFFFFFFF
