"""What reading vLLM's hidden-states output costs, phase by phase, without vLLM: a request's
``[T, L + 1, hidden]`` rows gathered from a KV-cache-shaped tensor as vLLM's connector gathers them,
copied to the host (``host_rows``), written with safetensors to the folder tracer's compiled
engine uses (``outputs_folder``: ``/dev/shm`` when it has room), read back (``read_dump``), mapped
onto HF names (``map_dump``) and made the captures (``contiguous``, as ``execute_compiled`` does).
Then the compiled capture's two ways of reading the file for a window of the last ``--window``
rows, alternating within each repetition: the whole file (``read_dump`` and ``check_slots``, then
``map_dump``) and the window's rows alone (``read_window``, then ``map_window``).

    PYTHONPATH=$PWD python scripts/hidden-states-phases.py [--tokens 1024] [--layers 28] [--hidden 1024]
        [--reps 5] [--window 16]

Prints the median milliseconds of each phase (the H200 run's shape is the default: qwen3-0.6b's
28 layers and hidden size 1024, 1024 tokens, bf16) and checks that the captures equal the rows and
that the two reads map the window alike.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
import shutil
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--window", type=int, default=16, help="the compared window: the last W rows")
    args = ap.parse_args()
    t, layers, hidden = args.tokens, args.layers, args.hidden

    import torch
    from safetensors.torch import save_file

    from tracer.engines.dumps.hidden_states import ENGINE, check_slots, read_window
    from tracer.engines.dumps.namemap import RefLayout, map_dump, map_window
    from tracer.engines.dumps.read import read_dump
    from tracer.engines.vllm.hidden_states import host_rows, outputs_folder
    from tracer.engines.vllm.layout import engine_map
    from tracer.execute.kinds import PointKind

    block = 32
    cache = torch.randn(t // block + 1, layers + 1, block, hidden, generator=torch.Generator().manual_seed(0))
    cache = cache.to(torch.bfloat16)  # the cache-only layer's [blocks, slots, block, hidden]
    ids, slots = torch.randint(0, 1000, (t,)), torch.arange(t)
    names = {"model.embed_tokens": (PointKind.EMBEDDING, "embedding", (hidden,), "bfloat16")}
    names.update({f"model.layers.{i}": (PointKind.LAYER, "layer", (hidden,), "bfloat16") for i in range(layers)})
    ref = RefLayout(names=names, layer_prefix="model.layers", n_layers=layers, token_ids=ids.tolist(), window=(0, t),
                    family="qwen3")
    emap = engine_map("qwen3")
    folder = outputs_folder(t * (layers + 1) * hidden * 2)
    path = os.path.join(folder, "req.safetensors")

    def phase(fn):
        times, out = [], None
        for _ in range(args.reps):
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3, out

    rows = cache[slots // block, :, slots % block][:t]
    ms = {}
    ms["host copy"], host = phase(lambda: host_rows(rows))
    ms["write"], _ = phase(lambda: save_file({"hidden_states": host, "token_ids": ids}, path))
    ms["read"], raw = phase(lambda: read_dump(path))
    ms["map"], mapped = phase(lambda: map_dump(raw, ref, emap))
    ms["contiguous"], caps = phase(lambda: {n: x.contiguous() for n, x in mapped.tensors.items()})
    assert all(torch.equal(caps[n], rows[:, j]) for j, n in enumerate(names)), "the captures differ from the rows"
    size = os.path.getsize(path) / 2**20
    print(f"{t} tokens x {layers + 1} x {hidden} bf16 ({size:.0f} MiB) in {folder.rsplit('/', 1)[0]}: "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()) + f"; total {sum(ms.values()):.1f} ms")

    ref = replace(ref, window=(t - args.window, t))
    ways = {"whole file": (lambda: check_slots(r := read_dump(path), layers) or r, lambda r: map_dump(r, ref, emap)),
            "window rows": (lambda: read_window(path, ref.window, layers),
                            lambda r: map_window(path, ENGINE, r[0], r[1], ref, emap, r[2]))}
    times = {(w, k): [] for w in ways for k in ("read", "map")}
    out = {}
    for _ in range(args.reps):  # alternating: the two see the same load of the shared machine
        for way, (read, mapping) in ways.items():
            out.pop(way, None)  # the last repetition's tensors are freed outside the timed calls
            t0 = time.perf_counter()
            got = read()
            t1 = time.perf_counter()
            mapped = mapping(got)
            t2 = time.perf_counter()
            times[way, "read"].append(t1 - t0)
            times[way, "map"].append(t2 - t1)
            out[way] = mapped
            del got, mapped
    a, b = out.values()
    assert (a.mapping, a.notes, list(a.tensors)) == (b.mapping, b.notes, list(b.tensors)), "the two reads map otherwise"
    assert all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors), "the two reads give other rows"
    shutil.rmtree(folder, ignore_errors=True)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"the last {args.window} rows, medians of {args.reps} alternating: " + "; ".join(
        f"{w}: read {med[w, 'read']:.2f} ms + map {med[w, 'map']:.2f} ms = {med[w, 'read'] + med[w, 'map']:.2f} ms"
        for w in ways))


if __name__ == "__main__":
    main()
