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
         "switch_hist": hist, "switch_ms_sum": 60.4},
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
    assert 'flying_binds_total{engine="1"} 3.0' in text
    assert 'flying_tp_requests_total{engine="0"} 5.0' in text
    assert 'flying_switch_latency_seconds_bucket{le="0.001"} 1.0' in text
    assert 'flying_switch_latency_seconds_bucket{le="0.05"} 3.0' in text
    assert 'flying_switch_latency_seconds_count 3.0' in text
    assert 'flying_requests_total{mode="tp",priority="1"} 2.0' in text
    assert 'flying_requests_total{mode="dp",priority="0"} 1.0' in text
    assert metrics.bucket_index(1e9) == len(metrics.SWITCH_BUCKETS_MS)
