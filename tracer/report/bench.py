"""``tracer bench``'s table: medians, min–max, the target ratios and the peers (:mod:`tracer.loops.bench`)."""

from __future__ import annotations

import statistics
from typing import Any


def table(result: Any):
    """A rich Table of medians, min–max, the target ratios and the peers (checked or skipped, and why)."""
    from rich.markup import escape
    from rich.table import Table

    c = result.config
    kv = "" if c.get("kv_cache", True) else ", no KV cache"
    scen = f" · {c['scenario']}" if c.get("scenario", "prefix-cache") != "prefix-cache" else ""
    t = Table(title=f"tracer bench · {c['model']} · {c['dtype']} · {c['device']} · N={c['length']}{scen} · "
                    f"{c['granularity']} ({c['n_points']} points{kv}) · {c['reps']} reps",
              title_justify="left")
    t.add_column("mode")
    t.add_column("median s", justify="right")
    t.add_column("min–max s", justify="right")
    names = {"a": "(a) floor: the model's own forward calls", "b": "(b) tracer, online compare (no file)",
             "c": "(c) tracer + HDF5 trace (--store tensors)", "c_auto": "(c) tracer, --store auto (default)",
             "d": "(d) compare from trace",
             "e_write": "(e) raw write, same bytes", "e_read": "(e) raw read, same bytes",
             "plain": "plain loop of the same calls (cross-check of (a))",
             **{k: f"peer: {v.get('label', k)}" for k, v in result.peers.items()}}
    for m, v in result.times.items():
        t.add_row(names.get(m, m), f"{statistics.median(v):.4f}", f"{min(v):.4f}–{max(v):.4f}")
    for m, info in result.peers.items():
        if info["status"] == "skipped":
            t.add_row(names.get(m, m), "skipped", escape(info["reason"]))
    r = result.ratios()
    t.add_section()

    def mark(ok: bool) -> str:
        return "✓" if ok else "✗"

    peer_rule = ", and ≤ the fastest peer's ratio + 0.02" if "b_over_fastest_peer" in r else ""
    t.add_row("(b)/(a)", f"{r['b_over_a']:.3f}", f"{mark(r['b_over_a'] <= 1.05)} target ≤ 1.05{peer_rule}")
    for m, info in result.peers.items():
        if f"{m}_over_a" in r:
            t.add_row(f"({m})/(a)", f"{r[f'{m}_over_a']:.3f}",
                      escape(f"per-layer differing counts = tracer's ✓ ({info['points']} points: {info['covers']})"))
    for k, v in r.items():
        if k.startswith("a_over_"):
            t.add_row(f"(a) ÷ {k[len('a_over_'):]}", f"{v:.3f}", "the floor against an independent loop of the same "
                      "calls: target within 5 %")
    if "b_over_fastest_peer" in r:
        fastest = min(r[f"{m}_over_a"] for m in result.peers if f"{m}_over_a" in r)
        t.add_row("(b) ÷ fastest peer", f"{r['b_over_fastest_peer']:.3f}",
                  f"{mark(r['b_over_a'] <= fastest + 0.02)} target: (b)/(a) ≤ {fastest:.3f} + 0.02")
    for key, label in (("c_over_a", "(c)/(a)"), ("c_auto_over_a", "(c auto)/(a)")):
        if key not in r:
            continue
        if c.get("kv_cache", True):  # the target is not this run's: no mark
            t.add_row(label, f"{r[key]:.3f}", "target ≤ 1.15 for runs without KV-cache points (--no-kv-cache); "
                                              "this run captures them")
        else:
            t.add_row(label, f"{r[key]:.3f}", f"{mark(r[key] <= 1.15)} target ≤ 1.15")
    small = result.trace_bytes < 64 << 20  # fixed costs, not bandwidth, below this
    why = " (not I/O-bound: the trace is under 64 MiB)" if small else ""
    t.add_row("(c) write bytes/s ÷ (e) write", f"{r['c_write_bw_over_raw']:.3f}",
              ("" if small else f"{mark(r['c_write_bw_over_raw'] >= 0.7)} ") + "target ≥ 0.7 (bytes over all of (c), "
              "forward included: a lower bound)" + why)
    t.add_row("(d) read bytes/s ÷ (e) read", f"{r['d_read_bw_over_raw']:.3f}",
              ("" if small else f"{mark(r['d_read_bw_over_raw'] >= 0.7)} ") + "target ≥ 0.7 ((e) reads the file just "
              "written)" + why)
    t.add_row("trace size", f"{result.trace_bytes / 2**20:.2f} MiB", "")
    if "differing_fraction" in c:
        t.add_row("captured elements that differ", f"{c['differing_fraction']:.1%}", "float64 work scales with it")
    t.add_row("peak host memory", f"{result.peak_host_mb:.0f} MiB", "")
    if result.peak_device_mb is not None:
        t.add_row("peak device memory", f"{result.peak_device_mb:.0f} MiB", "")
    caption = [f"(a) runs, under torch.inference_mode: {escape(c['floor'])}"] if c.get("floor") else []
    if c.get("reps", 3) < 3 or c.get("warmup", 1) < 1:
        caption.append("fewer than 3 repetitions or no warm-up: the ratios are not reliable (first-call costs land "
                       "in one mode)")
    floor = result.times.get("a") or []
    if floor and min(floor) > 0 and max(floor) / min(floor) > 1.25:
        caption.append(f"the floor's repetitions spread {max(floor) / min(floor):.2f} × (slowest ÷ fastest; a busy "
                       "machine?): ratios within that spread say little; re-run on a quiet machine or with more --reps")
    t.caption = "\n".join(caption) or None
    t.caption_justify = "left"
    return t


def engine_labels(engine: str) -> dict[str, str]:
    """The modes of ``tracer bench --engine E`` (:data:`tracer.loops.bench_engine.MODES`), in words."""
    from tracer.engines.table import row

    return {"bare": f"{row(engine).product}'s own run, no hooks (floor)",
            "capture": f"tracer's {engine} executor: hooks + mapping",
            "tracer": f"tracer run --engine {engine} --store none (capture + compare)"}


def engine_table(result: Any):
    """``tracer bench --engine E``: each mode's median and min–max, and the ratios to the bare floor."""
    from rich.table import Table

    from tracer.engines.table import row

    c = result.config
    labels = engine_labels(c["engine"])
    t = Table(title=f"tracer bench --engine {c['engine']} · {c['model']} · {c['dtype']} · {row(c['engine']).product} "
                    f"{c['version']} on {c['device']} "
                    f"({c['attention_backend']}) · N={c['length']} · {c['scenario']} · {c['granularity']} "
                    f"({c['n_points']} points{'' if c['kv_cache'] else ', no KV cache'}) · {c['reps']} reps",
              title_justify="left")
    t.add_column("mode")
    t.add_column("median s", justify="right")
    t.add_column("min–max s", justify="right")
    for m, v in result.times.items():
        t.add_row(labels.get(m, m), f"{statistics.median(v):.4f}", f"{min(v):.4f}–{max(v):.4f}")
    t.add_section()
    for k, v in result.ratios().items():
        t.add_row(f"{k.replace('_over_', ' ÷ ')}", f"{v:.3f}", "medians, measured interleaved in this process")
    t.caption = (f"plans: A {c['plans'][0]}; B {c['plans'][1]} · verdict of the checked run: {c['verdict']}"
                 + (" · fewer than 3 repetitions or no warm-up: the ratios are not reliable"
                    if c["reps"] < 3 or c["warmup"] < 1 else ""))
    return t
