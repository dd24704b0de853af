"""The Grafana dashboard: valid JSON generated from ``workloads.reports.panels.PANELS``, reading
only series that Flying's collector or SGLang 0.5.23 export, every panel on a datasource;
and the rendering's PromQL-equivalent computations on series from the real collector."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from flying.node import metrics
from workloads.reports import dashboard, panels
from workloads.reports import scrapes as prom

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "flying-dashboard.json"

#: SGLang's own series the dashboard reads (histograms by their family name). Each must be
#: declared by the installed SGLang's metrics collector (checked below).
SGLANG_SERIES = {
    "sglang:time_to_first_token_seconds",
    "sglang:e2e_request_latency_seconds",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:gen_throughput",
    "sglang:token_usage",
}

SERIES_RE = re.compile(r"\b(flying_[a-z0-9_]+|sglang:[a-z0-9_:]+)")


def _collector_text(doc: dict) -> str:
    registry = CollectorRegistry()
    registry.register(metrics.FlyingCollector(lambda: doc))
    return generate_latest(registry).decode()


def _full_doc(binds: int = 0, session_le_1s: int = 0) -> dict:
    """A status document with every counter an engine publishes."""
    session = [0] * (len(metrics.SESSION_BUCKETS_S) + 1)
    session[metrics.bucket_index(0.8, metrics.SESSION_BUCKETS_S)] = session_le_1s
    switch = [0] * (len(metrics.SWITCH_BUCKETS_MS) + 1)
    return {"engines": [
        {"rank": r, "degree": 2, "binds": binds, "releases": binds, "aborted_binds": 0,
         "preempted_dp_requests": 0, "tp_requests": binds, "switch_hist": switch,
         "switch_ms_sum": 0.0, "session_hist": session, "session_s_sum": 0.8 * session_le_1s}
        for r in (0, 1)
    ]}


def _flying_sample_names() -> set[str]:
    from sglang.srt.observability.req_time_stats import APIServerReqTimeStats

    s = APIServerReqTimeStats()
    s.set_created_time(1.0)
    s.set_first_token_time(1.1)
    s.set_finished_time(1.5)
    metrics.observe_finished(2, s, {"finish_reason": {"type": "length"}, "completion_tokens": 5})
    metrics.count_finished("tp", 0)
    return {name for name, _labels, _v in prom.parse_metrics(_collector_text(_full_doc(1, 1)))}


def test_committed_json_is_the_generated_dashboard():
    """docs/grafana/flying-dashboard.json is written by ``workloads.dashboard --write-json``,
    so the image's computations and Grafana's PromQL cannot drift apart."""
    assert json.loads(DASHBOARD.read_text()) == dashboard.dashboard_json()


def test_dashboard_json_is_valid_with_a_datasource_on_every_panel_and_target():
    doc = json.loads(DASHBOARD.read_text())
    names = [v["name"] for v in doc["templating"]["list"]]
    assert names == ["datasource", "instance", "model_name"]  # SGLang's filters + datasource
    assert doc["uid"] and doc["title"] and doc["schemaVersion"] >= 36
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)) == len(panels.PANELS)
    for panel in doc["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["type"] == "timeseries" and panel["targets"], panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"])
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert 'instance=~"$instance"' in target["expr"]
            if "sglang:" in target["expr"]:
                assert 'model_name=~"$model_name"' in target["expr"]


def test_dashboard_reads_only_exported_series():
    doc = json.loads(DASHBOARD.read_text())
    used = {m for p in doc["panels"] for t in p["targets"] for m in SERIES_RE.findall(t["expr"])}
    flying = _flying_sample_names()
    sglang = {f"{s}{suffix}" for s in SGLANG_SERIES for suffix in ("", "_bucket")}
    unknown = used - flying - sglang
    assert not unknown, f"series neither Flying's collector nor SGLang exports: {unknown}"
    # the panels the issue asks for are there
    for needed in ("flying_engine_tp_degree", "flying_binds_total", "flying_releases_total",
                   "flying_preempted_dp_requests_total", "flying_session_seconds_bucket",
                   "flying_ttft_seconds_bucket", "flying_tpot_seconds_bucket"):
        assert needed in used


def test_listed_sglang_series_are_declared_by_installed_sglang():
    import sglang.srt.observability.metrics_collector as collector

    source = Path(collector.__file__).read_text()
    for name in SGLANG_SERIES:
        assert f'name="{name}"' in source, name


def test_histogram_quantile_matches_prometheus():
    inf = math.inf
    # 10 observations: 4 <= 1, 8 <= 2, 10 <= +Inf
    buckets = [(1.0, 4.0), (2.0, 8.0), (inf, 10.0)]
    assert prom.histogram_quantile(0.2, buckets) == pytest.approx(0.5)  # from 0 to 1
    assert prom.histogram_quantile(0.6, buckets) == pytest.approx(1.5)
    assert prom.histogram_quantile(0.99, buckets) == 2.0  # in +Inf: highest finite bound
    assert math.isnan(prom.histogram_quantile(0.5, [(1.0, 0.0), (inf, 0.0)]))


def test_panels_evaluate_on_the_real_collectors_series():
    """Rates and quantiles over two scrapes of the collector, 1 s apart: 2 engines bind 3
    times each (6 binds/s summed), 4 sessions each <= 1 s (p50 inside (0.5, 1])."""
    scrapes = [
        (0.0, prom.parse_metrics(_collector_text(_full_doc(0, 0)))),
        (1.0, prom.parse_metrics(_collector_text(_full_doc(3, 2)))),
    ]
    by_title = {p.title: p for p in panels.PANELS}
    binds = by_title["Binds and releases"].targets[0].evaluate(scrapes, window_s=5.0)
    assert binds == {"binds": ([1.0], [pytest.approx(6.0)])}
    p50 = by_title["Group session length"].targets[0].evaluate(scrapes, window_s=5.0)
    assert 0.5 < p50["p50"][1][0] <= 1.0
    degree = by_title["Engine TP degree"].targets[0].evaluate(scrapes, window_s=5.0)
    assert degree["engine 0"] == ([0.0, 1.0], [2.0, 2.0])
    dp, tp = (t.evaluate(scrapes, window_s=5.0) for t in by_title["Engines by mode"].targets)
    assert dp == {"DP engines": ([0.0, 1.0], [0.0, 0.0])}  # 0, not absent: no broken line
    assert tp == {"engines in TP groups": ([0.0, 1.0], [2.0, 2.0])}
    # a series absent from a scrape is a gap (NaN), as in Grafana
    first_only = [scrapes[0], (1.0, [s for s in scrapes[1][1] if s[1].get("engine") != "1"])]
    degree = by_title["Engine TP degree"].targets[0].evaluate(first_only, window_s=5.0)
    assert degree["engine 1"][1][0] == 2.0 and math.isnan(degree["engine 1"][1][1])
