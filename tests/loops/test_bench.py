"""The benchmark runs every mode and reports the target ratios (no timing assertions)."""

from __future__ import annotations

from tracer.loops.bench import MODES, bench


def test_bench_reports_every_mode_and_ratio(tmp_path):
    r = bench("tiny-llama", length=64, device="cpu", reps=2, warmup=0, outdir=str(tmp_path))
    peers = {m for m, p in r.peers.items() if p["status"] == "checked"}
    assert {"peer_hf", "peer_hooks"} <= peers  # the nnsight peer runs where nnsight is installed
    assert set(r.times) == set(MODES) | peers and all(len(v) == 2 for v in r.times.values())
    assert r.trace_bytes > 0
    d = r.to_dict()
    assert set(d["ratios"]) == {"b_over_a", "c_over_a", "c_auto_over_a", "c_write_bw_over_raw", "d_read_bw_over_raw"} | {
        f"{m}_over_a" for m in peers} | {"b_over_fastest_peer"}
    assert d["ratios"]["b_over_a"] == r.median("b") / r.median("a")
    assert not list(tmp_path.iterdir())  # the trace and raw files are cleaned up


def test_bench_never_touches_the_users_files(tmp_path):
    import pytest

    from tracer.errors import TracerError

    mine = tmp_path / "bench-trace.h5"
    mine.write_bytes(b"my own file")
    bench("tiny-llama", length=32, device="cpu", reps=1, warmup=0, outdir=str(tmp_path))
    assert mine.read_bytes() == b"my own file" and list(tmp_path.iterdir()) == [mine]
    with pytest.raises(TracerError, match="is a file"):
        bench("tiny-llama", length=32, device="cpu", reps=1, warmup=0, outdir=str(mine))


def test_bench_block_size_is_checked_not_dropped(tmp_path):
    """--block-size 0 is refused as in ``tracer run`` (it used to fall back to 16), a block size on a
    scenario without a KV block (repeat) is refused rather than ignored, and a given size is used."""
    import pytest

    import tracer
    from tracer.errors import TracerError

    with pytest.raises(TracerError, match="--block-size 0 is outside 1"):
        tracer.bench("tiny-llama", length=32, device="cpu", reps=1, warmup=0, block_size=0, peers=False)
    with pytest.raises(TracerError, match="--block-size does not apply to scenario repeat"):
        tracer.bench("tiny-llama", length=32, device="cpu", reps=1, warmup=0, scenario="repeat", block_size=32,
                     peers=False)
    r = bench("tiny-llama", length=32, device="cpu", reps=1, warmup=0, block_size=8, peers=False, outdir=str(tmp_path))
    assert r.config["block_size"] == 8


def test_bench_takes_format_like_every_command(tmp_path):
    """`tracer bench` had --json but no --format: it takes --format (csv, markdown, json, table) as every
    command does, --json still means --format json, and a contradiction or an unknown format is one
    line, exit 2, before the bench runs."""
    import csv
    import io

    from tests.helpers import cli_batch, tracer_warm

    args = ["bench", "tiny-llama", "--device", "cpu", "--length", "32", "--reps", "1", "--warmup", "0", "--no-peers",
            "--outdir", str(tmp_path / "b")]
    out = tracer_warm([*args, "--format", "csv"], cwd=tmp_path).stdout
    rows = list(csv.reader(io.StringIO(out)))
    assert rows[0] == ["mode", "median_s", "min_s", "max_s"] and {"a", "b"} <= {r[0] for r in rows[1:]}, out
    (c1, e1), (c2, e2) = cli_batch([[*args, "--json", "--format", "csv"], [*args, "--format", "nope"]], tmp_path)
    assert c1 == 2 and e1.strip() == ("error: --json and --format csv contradict each other; give one of them "
                                      "(--json is --format json)"), e1
    assert c2 == 2 and "unknown format 'nope'" in e2 and len(e2.strip().splitlines()) == 1, e2


def test_bench_progress_counts_warm_up_and_repetitions_apart(tmp_path):
    """--reps 2 --warmup 1: one warm-up of 1, then repetitions 1/2 and 2/2 (never 3/3)."""
    said: list[str] = []
    bench("tiny-llama", length=32, device="cpu", reps=2, warmup=1, outdir=str(tmp_path), progress=said.append)
    counted = [m for m in said if m.startswith(("warm-up", "repetition"))]
    assert counted == ["warm-up 1/1", "repetition 1/2", "repetition 2/2"], said


def test_engine_bench_progress_counts_warm_up_and_repetitions_apart():
    """The engine bench (vLLM / SGLang modes) read 'repetition 3/3 (warm-up)'-style counts too; it
    now words each round with the HF bench's label: warm-ups counted apart from the --reps."""
    from tracer.loops.bench_engine import repetition_label
    assert [repetition_label(i, 1, 2) for i in range(3)] == ["warm-up 1/1", "repetition 1/2", "repetition 2/2"]
    assert [repetition_label(i, 0, 2) for i in range(2)] == ["repetition 1/2", "repetition 2/2"]


def test_paired_ratios_pair_each_repetitions_modes():
    from tracer.loops.bench import BenchResult

    # planted: the second round is slow for every mode; paired, each round's own ratio counts
    r = BenchResult(config={}, trace_bytes=100, times={"a": [1.0, 2.0, 4.0], "b": [1.1, 2.4, 4.0], "c": [1.5, 3.0, 4.4],
                                      "peer_hooks": [0.9, 2.0, 4.0], "plain": [1.0, 2.0, 4.4],
                                      "d": [9.0, 9.0, 9.0], "e_write": [1.0] * 3, "e_read": [1.0] * 3})
    p = r.paired_ratios()
    assert p == {"b_over_a": 1.1, "c_over_a": 1.5, "peer_hooks_over_a": 1.0, "a_over_plain": 1.0}
    assert r.ratios()["b_over_a"] == 2.4 / 2.0  # the ratio of medians differs: 1.2
    assert r.to_dict()["paired_ratios"] == p


def test_the_bench_table_marks_only_the_targets_that_apply_to_the_run():
    """A newcomer's trial: the default run captures KV-cache points, and its (c) rows were marked ✗
    against the target for runs without them; with --no-peers the (b) target still named the
    fastest peer; a floor that moved 2× between repetitions went unremarked."""
    import io

    from rich.console import Console

    from tracer.loops.bench import MODES, BenchResult
    from tracer.report.bench import table

    def text(kv_cache: bool, floor: list[float]) -> str:
        times = {m: [1.5, 1.5] for m in MODES}
        times.update(a=floor, d=[0.1, 0.1], e_write=[0.1, 0.1], e_read=[0.1, 0.1])
        config = {"model": "m", "dtype": "bfloat16", "device": "cpu", "length": 32, "granularity": "layers",
                  "n_points": 6, "reps": 3, "warmup": 1, "kv_cache": kv_cache}
        out = io.StringIO()
        Console(file=out, width=200).print(table(BenchResult(config=config, times=times, trace_bytes=1 << 20)))
        return out.getvalue()

    with_kv, without = text(True, [1.0, 1.0]), text(False, [1.0, 1.0])
    c_rows = [line for line in with_kv.splitlines() if "(c)/(a)" in line or "(c auto)/(a)" in line]
    assert len(c_rows) == 2 and not any("✗" in line or "✓" in line for line in c_rows), c_rows
    assert sum("✗ target ≤ 1.15" in line for line in without.splitlines()) == 2  # 1.5 × the floor: missed
    assert "fastest peer" not in with_kv  # no peer was measured
    assert "spread" not in with_kv and "spread 2.00 ×" in text(True, [1.0, 2.0])
