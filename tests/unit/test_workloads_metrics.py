"""Metrics and time series against small hand-computed examples."""

from __future__ import annotations

import dataclasses

import pytest

from workloads.measure.metrics import (
    compare,
    percentile,
    render_comparison,
    render_markdown,
    summarize,
)
from workloads.measure.records import RequestRecord, load_records, save_records
from workloads.reports.timeseries import concurrency_series, mode_series, ttft_p90_series

pytestmark = pytest.mark.unit


def _ok(index, phase, priority, send, ttft, itl, queue=None, mode=None):
    """A successful record whose e2e/TPOT follow from send, TTFT and ITLs."""
    e2e = ttft + sum(itl)
    n = len(itl) + 1
    return RequestRecord(
        index=index,
        arrival_s=send,
        prompt_len=10 * (index + 1),
        output_len=n,
        priority=priority,
        phase=phase,
        send_s=send,
        ttft_s=ttft,
        itl_s=list(itl),
        tpot_s=(e2e - ttft) / (n - 1) if n > 1 else None,
        e2e_s=e2e,
        output_tokens=n,
        success=True,
        http_status=200,
        queue_time_s=queue,
        flying={"mode": mode} if mode else None,
    )


def _records():
    # Token times: r0 0.01 0.11 0.21 | r1 0.52 0.72 | r2 0.93 0.98 1.03 1.08 | r3 1.24
    return [
        _ok(0, "low", "normal", 0.0, 0.010, [0.1, 0.1], queue=0.002, mode="dp"),
        _ok(1, "burst", "high", 0.5, 0.020, [0.2], queue=0.004, mode="tp2"),
        _ok(2, "burst", "normal", 0.9, 0.030, [0.05, 0.05, 0.05], mode="tp2"),
        _ok(3, "low", "normal", 1.2, 0.040, []),
        RequestRecord(
            index=4,
            arrival_s=1.0,
            prompt_len=50,
            output_len=8,
            priority="high",
            phase="burst",
            send_s=1.0,
            e2e_s=1.0,
            error="Input length exceeds",
            http_status=400,
        ),
    ]


def test_percentile_linear_interpolation():
    assert percentile([10, 20, 30, 40], 50) == pytest.approx(25.0)
    assert percentile([10, 20, 30, 40], 90) == pytest.approx(37.0)  # rank 2.7 -> 30 + 0.7*10
    assert percentile([], 90) is None


def test_overall_latencies():
    s = summarize(_records())["overall"]
    assert (s["count"], s["completed"], s["failed"]) == (5, 4, 1)
    ttft = s["ttft_ms"]  # [10, 20, 30, 40]
    assert ttft["mean"] == pytest.approx(25.0)
    assert ttft["p50"] == pytest.approx(25.0)
    assert ttft["p90"] == pytest.approx(37.0)
    assert ttft["p99"] == pytest.approx(39.7)
    tpot = s["tpot_ms"]  # (210-10)/2=100, (220-20)/1=200, (180-30)/3=50; r3 has one token
    assert tpot["p50"] == pytest.approx(100.0)
    assert tpot["p90"] == pytest.approx(180.0)  # rank 1.8 of [50, 100, 200]
    assert tpot["mean"] == pytest.approx(350.0 / 3)
    e2e = s["e2e_ms"]  # [210, 220, 180, 40] -> sorted [40, 180, 210, 220]
    assert e2e["p50"] == pytest.approx(195.0)
    assert e2e["p90"] == pytest.approx(217.0)
    assert s["itl_ms"]["p50"] == pytest.approx(75.0)  # [50, 50, 50, 100, 100, 200]
    queue = s["queue_ms"]  # [2, 4]
    assert queue["count"] == 2
    assert queue["mean"] == pytest.approx(3.0)
    assert queue["p90"] == pytest.approx(3.8)


def test_groups_modes_and_errors():
    summary = summarize(_records())
    low, burst = summary["by_phase"]["low"], summary["by_phase"]["burst"]
    assert (low["count"], low["completed"], low["ttft_ms"]["p50"]) == (2, 2, pytest.approx(25.0))
    assert (burst["count"], burst["completed"], burst["failed"]) == (3, 2, 1)
    assert burst["ttft_ms"]["p90"] == pytest.approx(29.0)  # [20, 30]
    high = summary["by_priority"]["high"]
    assert (high["count"], high["completed"], high["ttft_ms"]["p50"]) == (2, 1, 20.0)
    assert summary["by_priority"]["normal"]["count"] == 3
    assert summary["modes"] == {"dp": 1, "tp2": 2}
    assert summary["by_mode"]["tp2"]["ttft_ms"]["mean"] == pytest.approx(25.0)
    assert summary["errors"] == {"Input length exceeds": 1}


def test_throughput():
    tp = summarize(_records())["throughput"]
    assert tp["makespan_s"] == pytest.approx(2.0)  # first send 0.0, last end 1.0 + 1.0
    assert tp["request_throughput"] == pytest.approx(4 / 2.0)
    assert tp["total_output_tokens"] == 10
    assert tp["output_throughput"] == pytest.approx(10 / 2.0)
    assert tp["total_input_tokens"] == 10 + 20 + 30 + 40
    assert tp["max_send_lag_ms"] == pytest.approx(0.0)  # sends equal arrivals here
    # 1 s buckets: [0,1) holds 3 + 2 + 2 tokens, [1,2) holds 2 + 1.
    assert tp["peak_output_throughput"] == pytest.approx(7.0)
    # 0.5 s buckets: 3, 4, 3 tokens -> peak 4 / 0.5.
    half = summarize(_records(), bucket_s=0.5)["throughput"]
    assert half["peak_output_throughput"] == pytest.approx(8.0)


def test_empty_and_all_failed():
    assert summarize([])["overall"]["ttft_ms"]["p50"] is None
    failed = summarize([_records()[-1]])
    assert failed["throughput"]["output_throughput"] == 0.0
    assert failed["throughput"]["peak_output_throughput"] is None
    assert "-" in render_markdown(failed)


def test_render_markdown_row():
    text = render_markdown(summarize(_records()), title="dp")
    assert text.startswith("### dp")
    row = "| all | 5 | 4 | 25.0 | 37.0 | 39.7 | 100.0 | 180.0 | 195.0 | 217.0 | 3.0 | 3.8 |"
    assert row in text
    for name in ("phase=low", "phase=burst", "priority=high", "mode=tp2"):
        assert f"| {name} |" in text
    assert "peak output 7.0 tok/s" in text


def _slowed(rec: RequestRecord, k: float) -> RequestRecord:
    def mul(x):
        return None if x is None else x * k

    return dataclasses.replace(
        rec,
        send_s=mul(rec.send_s),
        ttft_s=mul(rec.ttft_s),
        itl_s=[x * k for x in rec.itl_s],
        tpot_s=mul(rec.tpot_s),
        e2e_s=mul(rec.e2e_s),
        queue_time_s=mul(rec.queue_time_s),
    )


def test_compare_ratios():
    fast = summarize(_records())
    slow = summarize([_slowed(r, 2.0) for r in _records()])
    ratios = compare(fast, slow)
    assert ratios["overall.ttft_ms.p90"] == pytest.approx(0.5)
    assert ratios["overall.tpot_ms.p50"] == pytest.approx(0.5)
    assert ratios["throughput.output_throughput"] == pytest.approx(2.0)
    assert ratios["overall.count"] == 1.0
    table = render_comparison(fast, slow, labels=("flying", "dp"))
    assert "| overall.ttft_ms.p90 | 37.0 | 74.0 | 0.500 |" in table


def test_timeseries():
    records = _records()
    # 0.25 s buckets up to the last end (2.0): spans r0 [0,.21) r1 [.5,.72) r2 [.9,1.08)
    # r3 [1.2,1.24) r4 [1.0,2.0)
    conc = concurrency_series(records, bucket_s=0.25)
    assert [t for t, _ in conc] == pytest.approx([0.25 * k for k in range(9)])
    assert [c for _, c in conc] == [1, 0, 1, 0, 2, 1, 1, 1, 0]
    # Sent in [0,1): TTFT 10, 20, 30 -> P90 28; in [1,2): 40 (r4 failed); [2,3): nothing.
    p90 = ttft_p90_series(records, bucket_s=1.0)
    assert [t for t, _ in p90] == [0.0, 1.0, 2.0]
    assert p90[0][1] == pytest.approx(28.0) and p90[1][1] == pytest.approx(40.0)
    assert p90[2][1] is None
    assert mode_series(records, bucket_s=1.0) == [(0.0, {"dp": 1}), (1.0, {"tp2": 1}), (2.0, {})]


def test_records_round_trip(tmp_path):
    path = tmp_path / "r.jsonl"
    save_records(_records(), path)
    assert load_records(path) == _records()
