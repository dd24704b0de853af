"""Flying's Prometheus series, served on ``/metrics`` next to SGLang's own.

Engine-side numbers (mode, binds, releases, preemptions, switch latencies) come from the
status documents the engines publish in the launcher's TCPStore (``flying.session.status``), so a
scrape never waits on a busy engine. Requests by mode and priority are counted in the
HTTP process as they finish (``count_finished``). With ``--enable-metrics`` SGLang's
multi-process series are included in the same response.
"""

from __future__ import annotations

import os
import re
from collections import Counter

from flying.session.status import SWITCH_BUCKETS_MS, bucket_index  # noqa: F401 (re-exported)

_FINISHED: Counter[tuple[str, str]] = Counter()  # (mode, priority) -> requests


def count_finished(mode: str, priority: int | None) -> None:
    _FINISHED[(mode, str(priority or 0))] += 1


class FlyingCollector:
    """A prometheus_client collector over the engines' published status."""

    def __init__(self, read_status):
        self.read_status = read_status  # () -> status.read_all(...) document

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        doc = self.read_status()
        degree = GaugeMetricFamily(
            "flying_engine_tp_degree", "TP degree an engine runs at (1 = DP mode)", labels=["engine"]
        )
        counters = {
            key: CounterMetricFamily(f"flying_{key}", help_, labels=["engine"])
            for key, help_ in (
                ("binds", "TP group binds an engine joined"),
                ("releases", "TP group releases"),
                ("aborted_binds", "binds aborted by the bounded handshake"),
                ("preempted_dp_requests", "DP requests paused (KV kept) by a TP session"),
                ("tp_requests", "requests served in TP sessions"),
            )
        }
        buckets = [0] * (len(SWITCH_BUCKETS_MS) + 1)
        total_ms = 0.0
        for e in doc.get("engines", []):
            rank = str(e.get("rank"))
            degree.add_metric([rank], int(e.get("degree", 1)))
            for key, fam in counters.items():
                fam.add_metric([rank], e.get(key, 0))
            for i, n in enumerate(e.get("switch_hist", [])):
                buckets[i] += n
            total_ms += e.get("switch_ms_sum", 0.0)
        yield degree
        yield from counters.values()
        cumulative, bounds = 0, []
        for bound, n in zip([*map(str, (b / 1e3 for b in SWITCH_BUCKETS_MS)), "+Inf"], buckets,
                            strict=True):
            cumulative += n
            bounds.append((bound, cumulative))
        hist = HistogramMetricFamily(
            "flying_switch_latency_seconds", "bind received -> first TP group step"
        )
        hist.add_metric([], bounds, total_ms / 1e3)
        yield hist
        requests = CounterMetricFamily(
            "flying_requests", "finished requests by where they ran and priority",
            labels=["mode", "priority"],
        )
        for (mode, prio), n in sorted(_FINISHED.items()):
            requests.add_metric([mode, prio], n)
        yield requests


class MetricsApp:
    """ASGI app for ``/metrics``: SGLang's multi-process series (if enabled) + Flying's.

    Built on first scrape: SGLang sets ``PROMETHEUS_MULTIPROC_DIR`` during launch, after
    Flying's routes are added, and the multi-process collector reads it at construction.
    """

    def __init__(self, read_status):
        self.read_status = read_status
        self._app = None

    async def __call__(self, scope, receive, send):
        if self._app is None:
            from prometheus_client import CollectorRegistry, make_asgi_app, multiprocess

            registry = CollectorRegistry()
            if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                multiprocess.MultiProcessCollector(registry)
            registry.register(FlyingCollector(self.read_status))
            self._app = make_asgi_app(registry=registry)
        await self._app(scope, receive, send)


def mount(app, read_status) -> None:
    """Serve ``/metrics`` ahead of SGLang's own mount (first match wins in Starlette)."""
    from starlette.routing import Mount

    route = Mount("/metrics", MetricsApp(read_status))
    route.path_regex = re.compile("^/metrics(?P<path>.*)$")  # as SGLang does: no 307
    app.router.routes.insert(0, route)
