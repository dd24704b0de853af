"""Trace generation, replay and presets: bounds, determinism, phase shape, scaling."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path

import pytest

from workloads.load.presets import CPU_SMALL, PAPER, PRESETS, build_preset
from workloads.load.replay import SAMPLE, ReplayOptions, replay_trace, trace_path
from workloads.load.trace import (
    BurstyConfig,
    attach_input_ids,
    generate_bursty,
    generate_long_context,
    generate_mixed_priority,
    load_trace,
    save_trace,
    token_ids_for,
)

pytestmark = pytest.mark.unit

# Short phases and high rates keep generation instant while giving many phase windows.
SHAPE = BurstyConfig(
    num_requests=3000,
    prompt_range=(20, 60),
    output_range=(5, 9),
    low_rate_range=(1.0, 2.0),
    burst_rate_range=(10.0, 20.0),
    low_duration_s=20.0,
    burst_duration_s=20.0,
    with_input_ids=False,  # ids are checked where needed; building them is the slow part
)


def test_lengths_and_ids_within_bounds():
    trace = generate_bursty(dataclasses.replace(SHAPE, with_input_ids=True), seed=1)
    assert len(trace) == SHAPE.num_requests
    assert [r.index for r in trace] == list(range(len(trace)))
    prompts = [r.prompt_len for r in trace]
    outputs = [r.output_len for r in trace]
    assert min(prompts) == 20 and max(prompts) == 60  # 3000 draws hit both ends of 41 values
    assert min(outputs) == 5 and max(outputs) == 9
    assert abs(sum(prompts) / len(prompts) - 40) < 1.5  # uniform mean, sd of mean ~0.2
    for r in trace:
        assert r.input_ids is not None and len(r.input_ids) == r.prompt_len
        assert all(3 <= t < 500 for t in r.input_ids)
        assert r.priority == "normal"
    arrivals = [r.arrival_s for r in trace]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0


def test_same_seed_same_trace_different_seed_different():
    assert generate_bursty(SHAPE, seed=5) == generate_bursty(SHAPE, seed=5)
    a, b = generate_bursty(SHAPE, seed=5), generate_bursty(SHAPE, seed=6)
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]
    assert [r.prompt_len for r in a] != [r.prompt_len for r in b]
    small = dataclasses.replace(SHAPE, num_requests=20, with_input_ids=True)
    assert generate_bursty(small, seed=5) == generate_bursty(small, seed=5)
    assert (
        generate_bursty(small, seed=5)[0].input_ids != generate_bursty(small, seed=6)[0].input_ids
    )


def test_phases_alternate_and_bursts_are_faster():
    trace = generate_bursty(SHAPE, seed=2)
    period = SHAPE.low_duration_s + SHAPE.burst_duration_s
    # Phase label follows from the clock alone: low in [0, 20), burst in [20, 40), ...
    for r in trace:
        expected = "low" if (r.arrival_s % period) < SHAPE.low_duration_s else "burst"
        assert r.phase == expected
    # Arrival rate per full phase window, measured from the arrivals.
    windows = int(trace[-1].arrival_s // SHAPE.low_duration_s)  # last window may be partial
    counts = [0] * windows
    for r in trace:
        w = int(r.arrival_s // SHAPE.low_duration_s)
        if w < windows:
            counts[w] += 1
    low = [c / SHAPE.low_duration_s for c in counts[0::2]]
    burst = [c / SHAPE.burst_duration_s for c in counts[1::2]]
    assert len(low) >= 5 and len(burst) >= 5
    low_mean, burst_mean = sum(low) / len(low), sum(burst) / len(burst)
    assert 1.0 * 0.7 <= low_mean <= 2.0 * 1.3
    assert 10.0 * 0.9 <= burst_mean <= 20.0 * 1.1
    assert min(burst) > max(low)


def test_start_in_burst_phase():
    trace = generate_bursty(dataclasses.replace(SHAPE, start_phase="burst"), seed=3)
    assert trace[0].phase == "burst"
    assert {r.phase for r in trace} == {"low", "burst"}


def test_mixed_priority_fraction_and_same_arrivals():
    base = generate_bursty(SHAPE, seed=4)
    mixed = generate_mixed_priority(SHAPE, high_fraction=0.2, seed=4)
    high = sum(r.priority == "high" for r in mixed)
    assert abs(high / len(mixed) - 0.2) <= 0.01
    assert {r.priority for r in mixed} == {"high", "normal"}
    # Priority labels use their own random stream: arrivals and lengths do not move.
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in mixed] == [
        (r.arrival_s, r.prompt_len, r.output_len) for r in base
    ]
    # High-priority requests are spread over the trace, not bunched at the start.
    first_half = sum(r.priority == "high" for r in mixed[: len(mixed) // 2])
    assert 0.35 * high <= first_half <= 0.65 * high


def test_long_context_fraction():
    trace = generate_long_context(SHAPE, long_fraction=0.1, long_prompt_range=(5000, 8000), seed=7)
    long = [r for r in trace if r.prompt_len >= 5000]
    assert abs(len(long) / len(trace) - 0.1) <= 0.01
    assert all(r.prompt_len <= 8000 for r in long)
    assert all(20 <= r.prompt_len <= 60 for r in trace if r.prompt_len < 5000)


def test_token_ids_deterministic_and_attach_keeps_existing():
    assert token_ids_for(3, 50, seed=9) == token_ids_for(3, 50, seed=9)
    assert token_ids_for(3, 50, seed=9) != token_ids_for(4, 50, seed=9)
    ids = token_ids_for(0, 2000, seed=1, id_range=(10, 12))
    assert set(ids) == {10, 11}
    trace = generate_bursty(dataclasses.replace(SHAPE, num_requests=5, with_input_ids=False), 1)
    assert all(r.input_ids is None for r in trace)
    trace[0].input_ids = [7] * trace[0].prompt_len
    attach_input_ids(trace, seed=1)
    assert trace[0].input_ids == [7] * trace[0].prompt_len
    assert trace[1].input_ids == token_ids_for(1, trace[1].prompt_len, seed=1)


def _write_csv(path: Path, rows: list[tuple[float, int, int]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arrived_at", "num_prefill_tokens", "num_decode_tokens"])
        writer.writerows(rows)


CSV_ROWS = [(10.0, 100, 40), (11.0, 5000, 3), (13.0, 3, 700), (16.0, 800, 100), (20.0, 1200, 9)]


def test_replay_csv_time_scale_and_clamping(tmp_path):
    path = tmp_path / "t.csv"
    _write_csv(path, CSV_ROWS)
    opts = ReplayOptions(
        time_scale=0.5,
        prompt_scale=0.1,
        output_scale=0.5,
        prompt_clamp=(16, 192),
        output_clamp=(8, 48),
    )
    trace = replay_trace(path, opts, seed=0)
    assert [r.arrival_s for r in trace] == pytest.approx([0.0, 0.5, 1.5, 3.0, 5.0])
    # 100*0.1=10->16, 5000*0.1=500->192, 3*0.1=0.3->1->16, 800*0.1=80, 1200*0.1=120
    assert [r.prompt_len for r in trace] == [16, 192, 16, 80, 120]
    # 40*0.5=20, 3*0.5=1.5->2->8, 700*0.5=350->48, 100*0.5=50->48, 9*0.5=4.5->4 (even)->8
    assert [r.output_len for r in trace] == [20, 8, 48, 48, 8]
    assert all(r.phase == "replay" and r.priority == "normal" for r in trace)
    assert all(len(r.input_ids or []) == r.prompt_len for r in trace)


def test_replay_target_rate_and_windows(tmp_path):
    path = tmp_path / "t.csv"
    _write_csv(path, CSV_ROWS)
    # 4 gaps over 10 s = 0.4 req/s; a target of 2 req/s shrinks gaps by 0.2.
    trace = replay_trace(path, ReplayOptions(target_rate=2.0))
    assert [r.arrival_s for r in trace] == pytest.approx([0.0, 0.2, 0.6, 1.2, 2.0])
    assert [r.prompt_len for r in trace] == [100, 5000, 3, 800, 1200]
    window = replay_trace(path, ReplayOptions(offset=1, limit=2))
    assert [(r.arrival_s, r.prompt_len) for r in window] == [(0.0, 5000), (2.0, 3)]
    by_time = replay_trace(path, ReplayOptions(start_s=12.5))
    assert [r.prompt_len for r in by_time] == [3, 800, 1200]
    with pytest.raises(ValueError):
        replay_trace(path, ReplayOptions(time_scale=1.0, target_rate=1.0))


def test_replay_jsonl_keeps_priority(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"arrival_s": 0.0, "prompt_len": 10, "output_len": 4},
        {"arrival_s": 3.0, "prompt_len": 20, "output_len": 5, "priority": "high"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = replay_trace(path, ReplayOptions(time_scale=2.0))
    assert [(r.arrival_s, r.prompt_len, r.output_len, r.priority) for r in trace] == [
        (0.0, 10, 4, "normal"),
        (6.0, 20, 5, "high"),
    ]


def test_replay_bundled_sample():
    with open(trace_path(SAMPLE), newline="") as f:
        raw = [row for _, row in zip(range(200), csv.DictReader(f), strict=False)]
    opts = ReplayOptions(target_rate=2.0, limit=200)
    trace = replay_trace(SAMPLE, opts, with_input_ids=False)
    assert len(trace) == 200
    assert [r.prompt_len for r in trace] == [int(row["num_prefill_tokens"]) for row in raw]
    assert [r.output_len for r in trace] == [int(row["num_decode_tokens"]) for row in raw]
    span = trace[-1].arrival_s - trace[0].arrival_s
    assert trace[0].arrival_s == 0.0 and 199 / span == pytest.approx(2.0)
    # Gaps keep their proportions: one factor, (observed rate / target rate), for all of them.
    raw_times = [float(row["arrived_at"]) for row in raw]
    factor = (199 / (raw_times[-1] - raw_times[0])) / 2.0
    expected = [(t - raw_times[0]) * factor for t in raw_times]
    assert [r.arrival_s for r in trace] == pytest.approx(expected)


def test_jsonl_round_trip(tmp_path):
    config = dataclasses.replace(SHAPE, num_requests=50, with_input_ids=True)
    trace = generate_mixed_priority(config, 0.2, seed=3)
    path = tmp_path / "trace.jsonl"
    save_trace(trace, path)
    assert load_trace(path) == trace
    save_trace(trace, path, include_ids=False)
    loaded = load_trace(path)
    assert all(r.input_ids is None for r in loaded)
    assert [dataclasses.replace(r, input_ids=None) for r in trace] == loaded


def test_presets_construct():
    for name in PRESETS:
        if name.startswith("azure"):
            continue  # public traces are not in the repository
        trace = build_preset(name, seed=0)
        assert trace, name
        assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace), name
    paper = build_preset("paper")
    assert len(paper) == 4000 == PAPER.num_requests
    assert all(128 <= r.prompt_len <= 4000 and 64 <= r.output_len <= 512 for r in paper)
    assert paper == build_preset("paper", seed=0) and paper != build_preset("paper", seed=1)
    priority = build_preset("paper-priority")
    assert sum(r.priority == "high" for r in priority) == 800
    small = build_preset("cpu-small")
    assert len(small) == CPU_SMALL.num_requests == 80
    assert all(16 <= r.prompt_len <= 192 and 8 <= r.output_len <= 48 for r in small)
    assert 25.0 <= small[-1].arrival_s <= 120.0  # arrivals fit a 2-3 minute run
    long = [r.prompt_len for r in build_preset("cpu-small-long") if r.prompt_len > 192]
    assert len(long) == 8 and all(2560 <= n <= 3840 for n in long)
    with pytest.raises(KeyError):
        build_preset("nope")


def test_sample_cpu_preset_matches_cpu_small_budget():
    # The azure-*-cpu presets scale their traces the same way (AZURE_CPU).
    trace = build_preset("sample-cpu")
    assert len(trace) == 80
    assert all(16 <= r.prompt_len <= 192 and 8 <= r.output_len <= 48 for r in trace)
    assert all(len(r.input_ids or []) == r.prompt_len for r in trace)
    assert 79 / trace[-1].arrival_s == pytest.approx(1.5)
    assert not math.isnan(trace[-1].arrival_s)


def test_a_rate_without_an_arrival_process_is_refused_not_ignored():
    """``--preset cpu-poisson --rate 0.5`` once replayed the preset's own 1.5 req/s."""
    import argparse

    from workloads.load.cli import add_trace_args, trace_from_args

    parser = argparse.ArgumentParser()
    add_trace_args(parser)
    with pytest.raises(SystemExit, match="--rate needs --arrival"):
        trace_from_args(parser.parse_args(["--preset", "cpu-poisson", "--rate", "0.5"]))
    args = parser.parse_args(["--preset", "cpu-poisson", "--arrival", "poisson", "--rate", "0.5",
                              "--limit", "40"])
    trace, _ = trace_from_args(args)
    span = trace[-1].arrival_s - trace[0].arrival_s
    assert 40 <= span <= 160  # 40 requests at 0.5 req/s: ~80 s


@pytest.mark.parametrize("argv, says", [
    (["--arrival", "poisson", "--rate", "-5"], "rate must be > 0"),
    (["--arrival", "poisson", "--rate", "nan"], "rate must be > 0"),
    (["--arrival", "gamma", "--rate", "2", "--burstiness", "0"], "burstiness must be > 0"),
    (["--arrival", "ramp", "--rate", "2"], "a ramp needs end_rate > 0"),
    (["--trace", "no-such-trace.jsonl"], "--trace no-such-trace.jsonl: no such file"),
])
def test_bad_trace_options_are_one_line_errors(argv, says):
    """Every workloads tool reads these options here: a value out of range or a missing
    file ends the command with its reason (they were tracebacks)."""
    import argparse

    from workloads.load.cli import add_trace_args, trace_from_args

    parser = argparse.ArgumentParser()
    add_trace_args(parser)
    with pytest.raises(SystemExit) as done:
        trace_from_args(parser.parse_args(argv))
    assert isinstance(done.value.code, str) and says in done.value.code


@pytest.mark.parametrize("limit", ["0", "-3", "x"])
def test_a_limit_below_one_is_a_usage_error(limit, capsys):
    import argparse

    from workloads.load.cli import add_trace_args

    parser = argparse.ArgumentParser()
    add_trace_args(parser)
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["--limit", limit])
    assert done.value.code == 2 and "--limit" in capsys.readouterr().err
