"""Cost of the trace checksums: CRC-32 of a large tensor vs writing and reading it.

Run from the repo root: ``PYTHONPATH=$PWD python3 scripts/checksum_cost.py [MiB] [folder]``
(default 512 MiB in $OUT or /tmp). Prints one JSON line: seconds and GB/s of zlib.crc32 over the
tensor's bytes, of TraceWriter.add_run+close (CRC included) and of TraceReader.tensor (verify
included), and the CRC's share of each.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from tracer.store.crc import crc32_bytes
from tracer.execute.records import CaptureRecord, RunRecord
from tracer.api_files import read_trace
from tracer.store.trace import TraceWriter, tensor_to_numpy


def main() -> None:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    folder = Path(sys.argv[2] if len(sys.argv) > 2 else os.environ.get("OUT", tempfile.gettempdir()))
    rows = mib * (1 << 20) // (4096 * 2)
    x = torch.randn(rows, 4096).to(torch.bfloat16)  # (rows, 4096) bf16
    arr, _ = tensor_to_numpy(x)
    t = time.perf_counter()
    crc32_bytes(arr)
    crc_s = time.perf_counter() - t
    path = folder / "checksum_cost.h5"
    run = RunRecord("A", list(range(rows)), {}, (0, rows), {"x": CaptureRecord("x", "layer", x)})
    t = time.perf_counter()
    with TraceWriter(path, header={}, overwrite=True) as w:
        w.add_run(run)
    write_s = time.perf_counter() - t
    t = time.perf_counter()
    with read_trace(path) as r:
        r.tensor("A", "x")
    read_s = time.perf_counter() - t
    path.unlink()
    gb = arr.nbytes / 1e9
    print(json.dumps({"bytes": arr.nbytes, "crc32_s": round(crc_s, 3), "crc32_GBps": round(gb / crc_s, 2),
                      "write_s": round(write_s, 3), "read_verified_s": round(read_s, 3),
                      "crc_share_of_write": round(crc_s / write_s, 3), "crc_share_of_read": round(crc_s / read_s, 3)}))


if __name__ == "__main__":
    main()
