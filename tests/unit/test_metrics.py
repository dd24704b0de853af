"""Flying's Prometheus series rendered from engine status documents (no server)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from flying.node import metrics

pytestmark = pytest.mark.unit


def test_collector_renders_modes_counters_histogram_and_requests():
    hist = [0] * (len(metrics.SWITCH_BUCKETS_MS) + 1)
    hist[metrics.bucket_index(0.4)] += 1  # <= 1 ms
    hist[metrics.bucket_index(30.0)] += 2  # <= 50 ms
    doc = {"engines": [
        {"rank": 0, "mode": "tp2", "degree": 2, "binds": 3, "releases": 2, "tp_requests": 5,
         "switch_hist": hist, "switch_ms_sum": 60.4, "stretch": {"2": 1.4},
         "live_ms": {"1": 38.5, "2": 52.0}},
        {"rank": 1, "mode": "dp", "binds": 3, "releases": 3},
    ]}
    metrics.count_finished("tp", 1)
    metrics.count_finished("tp", 1)
    metrics.count_finished("dp", None)
    registry = CollectorRegistry()
    registry.register(metrics.FlyingCollector(lambda: doc))
    text = generate_latest(registry).decode()
    assert 'flying_engine_tp_degree{engine="0"} 2.0' in text
    assert 'flying_engine_tp_degree{engine="1"} 1.0' in text
    assert 'flying_engine_step_stretch{degree="2",engine="0"} 1.4' in text
    assert 'flying_engine_step_stretch{degree="1",engine="1"}' not in text  # not run lately
    assert 'flying_engine_live_decode_ms{degree="2",engine="0"} 52.0' in text
    assert 'flying_binds_total{engine="1"} 3.0' in text
    assert 'flying_tp_requests_total{engine="0"} 5.0' in text
    assert 'flying_switch_latency_seconds_bucket{le="0.001"} 1.0' in text
    assert 'flying_switch_latency_seconds_bucket{le="0.05"} 3.0' in text
    assert 'flying_switch_latency_seconds_count 3.0' in text
    assert 'flying_requests_total{mode="tp",priority="1"} 2.0' in text
    assert 'flying_requests_total{mode="dp",priority="0"} 1.0' in text
    assert metrics.bucket_index(1e9) == len(metrics.SWITCH_BUCKETS_MS)


def _render(doc: dict) -> str:
    registry = CollectorRegistry()
    registry.register(metrics.FlyingCollector(lambda: doc))
    return generate_latest(registry).decode()


def test_session_histogram_per_engine_from_status_counters():
    """``session_hist`` / ``session_s_sum`` of each engine's status document become
    ``flying_session_seconds`` with cumulative buckets per engine."""
    hist = [0] * (len(metrics.SESSION_BUCKETS_S) + 1)
    hist[metrics.bucket_index(0.2, metrics.SESSION_BUCKETS_S)] += 2  # <= 0.25 s
    hist[metrics.bucket_index(3.0, metrics.SESSION_BUCKETS_S)] += 1  # <= 5 s
    hist[metrics.bucket_index(99.0, metrics.SESSION_BUCKETS_S)] += 1  # +Inf
    doc = {"engines": [
        {"rank": 0, "degree": 2, "session_hist": hist, "session_s_sum": 102.4},
        {"rank": 1, "mode": "unknown"},  # not published yet: no session series for it
    ]}
    text = _render(doc)
    assert 'flying_session_seconds_bucket{engine="0",le="0.1"} 0.0' in text
    assert 'flying_session_seconds_bucket{engine="0",le="0.25"} 2.0' in text
    assert 'flying_session_seconds_bucket{engine="0",le="5.0"} 3.0' in text
    assert 'flying_session_seconds_bucket{engine="0",le="+Inf"} 4.0' in text
    assert 'flying_session_seconds_count{engine="0"} 4.0' in text
    assert 'flying_session_seconds_sum{engine="0"} 102.4' in text
    assert 'flying_session_seconds_count{engine="1"}' not in text


def test_ttft_and_tpot_by_mode_from_sglang_time_stats():
    """TTFT and TPOT are taken from SGLang's own per-request time stats, labelled with the
    engine-status mode name (dp, tp2...); aborted requests are left out, as in SGLang."""
    from sglang.srt.observability.req_time_stats import APIServerReqTimeStats

    metrics._TTFT.clear()
    metrics._TPOT.clear()

    def stats(created: float, first: float, finished: float) -> APIServerReqTimeStats:
        s = APIServerReqTimeStats()
        s.set_created_time(created)
        s.set_first_token_time(first)
        s.set_finished_time(finished)
        return s

    length = {"type": "length", "length": 11}
    # TP-2: first token after 0.3 s, then 10 more tokens in 0.14 s -> TPOT 14 ms
    metrics.observe_finished(2, stats(100.0, 100.3, 100.44),
                             {"finish_reason": length, "completion_tokens": 11})
    # DP: first token after 0.03 s, one token only -> no TPOT
    metrics.observe_finished(1, stats(200.0, 200.03, 200.03),
                             {"finish_reason": {"type": "stop"}, "completion_tokens": 1})
    # aborted: neither
    metrics.observe_finished(1, stats(300.0, 300.5, 301.0),
                             {"finish_reason": {"type": "abort"}, "completion_tokens": 5})
    text = _render({"engines": []})
    assert 'flying_ttft_seconds_bucket{le="0.2",mode="tp2"} 0.0' in text
    assert 'flying_ttft_seconds_bucket{le="0.4",mode="tp2"} 1.0' in text
    assert 'flying_ttft_seconds_bucket{le="0.025",mode="dp"} 0.0' in text
    assert 'flying_ttft_seconds_bucket{le="0.05",mode="dp"} 1.0' in text
    assert 'flying_ttft_seconds_count{mode="dp"} 1.0' in text  # the abort is not counted
    assert 'flying_tpot_seconds_bucket{le="0.01",mode="tp2"} 0.0' in text
    assert 'flying_tpot_seconds_bucket{le="0.015",mode="tp2"} 1.0' in text
    assert 'flying_tpot_seconds_count{mode="tp2"} 1.0' in text
    assert 'flying_tpot_seconds_count{mode="dp"}' not in text
    assert metrics.mode_label(1) == "dp" and metrics.mode_label(4) == "tp4"
