"""The dashboard's panels as data: what each shows, its PromQL for Grafana, and the same
computation on series scraped from a real server (``workloads.reports.dashboard`` writes
the JSON Grafana imports and renders the panels from these).

Each ``Target`` writes its PromQL expression and evaluates the same expression (rate over
a window, sum by labels, ``histogram_quantile``, ``count_values``) on scrapes, so the
JSON and the rendering come from one definition.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from workloads.reports.scrapes import Scrape, histogram_quantile, rates, window_start

#: Panel filters, named as in SGLang's own dashboard (examples/monitoring/grafana).
INSTANCE = 'instance=~"$instance"'
MODEL = 'model_name=~"$model_name"'
RATE = "$__rate_interval"

#: A panel's evaluated lines: legend -> (times, values).
Lines = dict[str, tuple[list[float], list[float]]]


@dataclass(frozen=True)
class Target:
    """One query of a panel, as PromQL for Grafana and as the same computation in Python.

    ``kind``: ``raw`` (the series as they are), ``sum`` (gauge summed by ``by``), ``rate``
    (counter rate summed by ``by``), ``quantile`` (``histogram_quantile(q)`` over bucket
    rates summed by ``le`` and ``by``), ``count`` (how many series compare true with
    ``cmp``, e.g. ``"> 1"``: ``sum(x > bool 1)``, which is 0 rather than absent when none
    does, so a line never breaks).
    """

    kind: str
    metric: str
    legend: str
    by: tuple[str, ...] = ()
    q: float = 0.0
    sglang: bool = False
    cmp: str = ""

    def selector(self, name: str | None = None) -> str:
        filters = INSTANCE + (f", {MODEL}" if self.sglang else "")
        return f"{name or self.metric}{{{filters}}}"

    def promql(self) -> str:
        by = f" by ({', '.join(self.by)})" if self.by else ""
        if self.kind == "raw":
            return self.selector()
        if self.kind == "sum":
            return f"sum{by} ({self.selector()})"
        if self.kind == "rate":
            return f"sum{by} (rate({self.selector()}[{RATE}]))"
        if self.kind == "quantile":
            le_by = ", ".join(("le", *self.by))
            bucket = self.selector(self.metric + "_bucket")
            return f"histogram_quantile({self.q}, sum by ({le_by}) (rate({bucket}[{RATE}])))"
        if self.kind == "count":
            op, value = self.cmp.split()
            return f"sum({self.selector()} {op} bool {value})"
        raise ValueError(f"unknown target kind {self.kind!r}")

    def series(self) -> list[str]:
        """The sample names this target reads (what /metrics must export)."""
        return [self.metric + "_bucket"] if self.kind == "quantile" else [self.metric]

    def evaluate(self, scrapes: Sequence[Scrape], window_s: float) -> Lines:
        """The expression on scraped samples; rates over the trailing ``window_s``. Every
        line has a value (NaN where its series is absent, a gap in Grafana) at every
        evaluated time."""
        points: dict[str, dict[float, float]] = defaultdict(dict)
        times: list[float] = []
        for i, (t, samples) in enumerate(scrapes):
            if self.kind in ("rate", "quantile"):
                j = window_start(scrapes, i, window_s)
                if j == i:
                    continue
                values = rates(scrapes[j], scrapes[i], self.series()[0])
            else:
                values = [(labels, v) for name, labels, v in samples if name == self.metric]
            times.append(t)
            for legend, v in self._combine(values).items():
                points[legend][t] = v
        return {legend: (times, [vs.get(t, math.nan) for t in times])
                for legend, vs in points.items()}

    def _combine(self, values: list[tuple[dict[str, str], float]]) -> dict[str, float]:
        if self.kind == "raw":
            return {_legend(self.legend, labels): v for labels, v in values}
        if self.kind == "count":
            op, value = self.cmp.split()
            test = {"==": float.__eq__, ">": float.__gt__, "<": float.__lt__}[op]
            return {self.legend: float(sum(test(v, float(value)) for _labels, v in values))}
        groups: dict[tuple, float] = defaultdict(float)
        keys = ("le", *self.by) if self.kind == "quantile" else self.by
        for labels, v in values:
            groups[tuple(labels.get(k, "") for k in keys)] += v
        if self.kind != "quantile":
            return {_legend(self.legend, dict(zip(self.by, k, strict=True))): v
                    for k, v in groups.items()}
        hists: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
        for (le, *rest), v in groups.items():
            hists[tuple(rest)].append((float(le), v))
        return {_legend(self.legend, dict(zip(self.by, k, strict=True))):
                histogram_quantile(self.q, buckets) for k, buckets in hists.items()}


@dataclass(frozen=True)
class Panel:
    """A Grafana time-series panel: what it shows (``description``) and its targets."""

    title: str
    unit: str
    description: str
    targets: tuple[Target, ...]
    stepped: bool = False
    stacked: bool = False


def _q(metric: str, by: tuple[str, ...] = (), qs: Sequence[float] = (0.5, 0.9, 0.99),
       sglang: bool = False) -> tuple[Target, ...]:
    suffix = "".join(" {{" + b + "}}" for b in by)
    return tuple(Target("quantile", metric, f"p{round(q * 100)}{suffix}", by, q, sglang)
                 for q in qs)


PANELS: tuple[Panel, ...] = (
    Panel("Engine TP degree", "none",
          "Per engine: 1 = a DP replica, 2 / 4 = a member of a bound TP-2 / TP-4 group.",
          (Target("raw", "flying_engine_tp_degree", "engine {{engine}}"),), stepped=True),
    Panel("Engines by mode", "none",
          "How many engines serve as DP replicas and how many are members of TP groups.",
          (Target("count", "flying_engine_tp_degree", "DP engines", cmp="== 1"),
           Target("count", "flying_engine_tp_degree", "engines in TP groups", cmp="> 1")),
          stepped=True, stacked=True),
    Panel("Binds and releases", "ops",
          "Group binds and releases per second, counted once per member engine; aborted "
          "binds ran out of the bounded handshake.",
          (Target("rate", "flying_binds_total", "binds"),
           Target("rate", "flying_releases_total", "releases"),
           Target("rate", "flying_aborted_binds_total", "aborted binds"))),
    Panel("Preemptions", "ops",
          "DP requests paused (KV kept) by TP sessions per second, and requests served in "
          "TP sessions per second (counted per member engine).",
          (Target("rate", "flying_preempted_dp_requests_total", "preempted DP requests"),
           Target("rate", "flying_tp_requests_total", "TP session requests"))),
    Panel("Group session length", "s",
          "Bind to release of TP group sessions, as each member engine saw it.",
          _q("flying_session_seconds")),
    Panel("Switch latency", "s",
          "Bind received to the group's first step (rendezvous and mode scope set-up).",
          _q("flying_switch_latency_seconds")),
    Panel("TTFT by mode", "s",
          "Time to first token of finished requests, by where they ran (dp, tp2, tp4...).",
          _q("flying_ttft_seconds", ("mode",), (0.5, 0.9))),
    Panel("TPOT by mode", "s",
          "Time per output token after the first, by where the request ran.",
          _q("flying_tpot_seconds", ("mode",), (0.5, 0.9))),
    Panel("Finished requests by mode", "reqps",
          "Finished requests per second by mode (dp / tp) and priority.",
          (Target("rate", "flying_requests_total", "{{mode}} prio {{priority}}",
                  ("mode", "priority")),)),
    Panel("SGLang time to first token", "s",
          "SGLang's own TTFT histogram (all modes together).",
          _q("sglang:time_to_first_token_seconds", sglang=True)),
    Panel("SGLang end-to-end request latency", "s",
          "SGLang's own end-to-end latency histogram.",
          _q("sglang:e2e_request_latency_seconds", sglang=True)),
    Panel("SGLang running requests", "none", "Requests in running batches, per engine.",
          (Target("sum", "sglang:num_running_reqs", "engine {{dp_rank}}", ("dp_rank",),
                  sglang=True),)),
    Panel("SGLang queued requests", "none", "Requests waiting in the engines' queues.",
          (Target("sum", "sglang:num_queue_reqs", "engine {{dp_rank}}", ("dp_rank",),
                  sglang=True),)),
    Panel("SGLang generation throughput", "none", "Generated tokens per second, per engine.",
          (Target("sum", "sglang:gen_throughput", "engine {{dp_rank}}", ("dp_rank",),
                  sglang=True),)),
    Panel("SGLang KV token usage", "percentunit", "Share of KV slots in use, per engine.",
          (Target("sum", "sglang:token_usage", "engine {{dp_rank}}", ("dp_rank",),
                  sglang=True),)),
)


def _legend(fmt: str, labels: dict[str, str]) -> str:
    """Grafana's ``{{label}}`` legend substitution."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()
