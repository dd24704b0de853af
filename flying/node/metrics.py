"""Flying's Prometheus series, served on ``/metrics`` next to SGLang's own.

Engine-side numbers (mode, binds, releases, preemptions, switch latencies, group session
lengths) come from the status documents the engines publish in the launcher's TCPStore
(``flying.session.status``), so a scrape never waits on a busy engine. Requests by mode
and priority, and their TTFT / TPOT by mode, are recorded in the HTTP process as they
finish (``count_finished``, ``observe_finished``). With ``--enable-metrics`` SGLang's
multi-process series are included in the same response.

The series and the dashboard that reads them are described in docs/MONITORING.md.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from flying.session.status import (  # noqa: F401 (re-exported)
    SESSION_BUCKETS_S,
    SWITCH_BUCKETS_MS,
    bucket_index,
)

#: TTFT bounds (s): SGLang's ``sglang:time_to_first_token_seconds`` defaults, with three
#: finer bounds below 0.1 s first, so short prompts on small models are not one bucket.
TTFT_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0,
    60.0, 80.0, 100.0, 200.0, 400.0,
)
#: TPOT bounds (s): SGLang's ``sglang:inter_token_latency_seconds`` defaults, so the
#: per-mode TPOT reads on the same scale as SGLang's own.
TPOT_BUCKETS_S = (
    0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08,
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0,
)

_FINISHED: Counter[tuple[str, str]] = Counter()  # (mode, priority) -> requests


class _ModeHistogram:
    """Cumulative-at-render histogram of one latency, one bucket list per mode label.

    Kept as plain lists (not prometheus_client's ``Histogram``) so it is rendered by the
    same collector as the engine series, without SGLang's multi-process value files.
    """

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}

    def observe(self, mode: str, value: float) -> None:
        counts = self.counts.setdefault(mode, [0] * (len(self.bounds) + 1))
        counts[bucket_index(value, self.bounds)] += 1
        self.sums[mode] = self.sums.get(mode, 0.0) + value

    def clear(self) -> None:
        self.counts.clear()
        self.sums.clear()


_TTFT = _ModeHistogram(TTFT_BUCKETS_S)
_TPOT = _ModeHistogram(TPOT_BUCKETS_S)


def count_finished(mode: str, priority: int | None) -> None:
    _FINISHED[(mode, str(priority or 0))] += 1


def mode_label(degree: int) -> str:
    """``dp``, ``tp2``, ``tp4``...: the engine status documents' own mode names."""
    return "dp" if degree <= 1 else f"tp{degree}"


def observe_finished(degree: int, time_stats: Any, meta: dict) -> None:
    """Record a finished request's TTFT and TPOT under the mode it ran in.

    ``time_stats`` is SGLang's ``APIServerReqTimeStats`` of the request (created, first
    token and finished times in the HTTP process, the same clock SGLang's own
    ``sglang:time_to_first_token_seconds`` uses). As in SGLang, aborted requests are left
    out (their decode is cut short), and TPOT needs at least two output tokens.
    """
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind not in ("stop", "length"):
        return
    mode = mode_label(degree)
    if time_stats.first_token_time > 0.0:
        _TTFT.observe(mode, max(0.0, time_stats.get_first_token_latency()))
    tpot = time_stats.get_time_per_output_token(int(meta.get("completion_tokens") or 0))
    if tpot is not None:
        _TPOT.observe(mode, tpot)


def _buckets(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, float]]:
    """Prometheus' cumulative ``(le, count)`` pairs, +Inf last."""
    out, total = [], 0
    for le, n in zip([*map(str, bounds), "+Inf"], counts, strict=True):
        total += n
        out.append((le, total))
    return out


class FlyingCollector:
    """A prometheus_client collector over the engines' published status."""

    def __init__(self, read_status: Callable[[], dict]):
        self.read_status = read_status  # () -> status.read_all(...) document

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        doc = self.read_status()
        degree = GaugeMetricFamily(
            "flying_engine_tp_degree", "TP degree an engine runs at (1 = DP mode)", labels=["engine"]
        )
        stretch = GaugeMetricFamily(
            "flying_engine_step_stretch", "how much slower an engine's steps in a mode ran "
            "over the last 10 s than their best measured cost (1 = as on a quiet machine)",
            labels=["engine", "degree"],
        )
        live = GaugeMetricFamily(
            "flying_engine_live_decode_ms", "an engine's last single-request decode steps "
            "in a mode while serving, mean (ms); the latency rule compares them",
            labels=["engine", "degree"],
        )
        counters = {
            key: CounterMetricFamily(f"flying_{key}", help_, labels=["engine"])
            for key, help_ in (
                ("binds", "TP group binds an engine joined"),
                ("standby_binds", "binds that took a KV reservation and scope made ready "
                 "before an idle sleep"),
                ("releases", "TP group releases"),
                ("aborted_binds", "binds aborted by the bounded handshake"),
                ("preempted_dp_requests", "DP requests paused (KV kept) by a TP session"),
                ("tp_requests", "requests served in TP sessions"),
                ("held_admissions", "arrivals a group's leader held while its running "
                 "requests finished"),
                ("moved_to_dp", "running requests a group handed to DP with their KV"),
                ("handed_back", "waiting requests a group handed to DP to start there "
                 "when it was to end"),
                ("moved_tokens", "tokens of KV moved from groups to DP"),
                ("moved_peer_steps", "steps the senders of a move ran while it was "
                 "in flight (on the member that took it)"),
                ("upgraded", "running DP requests that outgrew their engine into a group"),
                ("regrouped", "group requests that outgrew their group into a larger one"),
            )
        }
        sessions = HistogramMetricFamily(
            "flying_session_seconds",
            "TP group session length (bind -> release) as each member engine saw it",
            labels=["engine"],
        )
        buckets = [0] * (len(SWITCH_BUCKETS_MS) + 1)
        total_ms = 0.0
        for e in doc.get("engines", []):
            rank = str(e.get("rank"))
            degree.add_metric([rank], int(e.get("degree", 1)))
            for mode, x in sorted((e.get("stretch") or {}).items()):
                stretch.add_metric([rank, str(mode)], float(x))
            for mode, ms in sorted((e.get("live_ms") or {}).items()):
                live.add_metric([rank, str(mode)], float(ms))
            for key, fam in counters.items():
                fam.add_metric([rank], e.get(key, 0))
            for i, n in enumerate(e.get("switch_hist", [])):
                buckets[i] += n
            total_ms += e.get("switch_ms_sum", 0.0)
            session_hist = e.get("session_hist")
            if session_hist and len(session_hist) == len(SESSION_BUCKETS_S) + 1:
                sessions.add_metric(
                    [rank], _buckets(SESSION_BUCKETS_S, session_hist), e.get("session_s_sum", 0.0)
                )
        yield degree
        yield stretch
        yield live
        yield from counters.values()
        hist = HistogramMetricFamily(
            "flying_switch_latency_seconds", "bind received -> first TP group step"
        )
        hist.add_metric([], _buckets([b / 1e3 for b in SWITCH_BUCKETS_MS], buckets), total_ms / 1e3)
        yield hist
        yield sessions
        requests = CounterMetricFamily(
            "flying_requests", "finished requests by where they ran and priority",
            labels=["mode", "priority"],
        )
        for (mode, prio), n in sorted(_FINISHED.items()):
            requests.add_metric([mode, prio], n)
        yield requests
        for name, help_, src in (
            ("flying_ttft_seconds", "time to first token by mode (dp, tp2, tp4...)", _TTFT),
            ("flying_tpot_seconds", "time per output token after the first, by mode", _TPOT),
        ):
            fam = HistogramMetricFamily(name, help_, labels=["mode"])
            for mode, counts in sorted(src.counts.items()):
                fam.add_metric([mode], _buckets(src.bounds, list(counts)), src.sums[mode])
            yield fam


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
