"""Flying's Grafana dashboard: its panels as data, the JSON Grafana imports, and a rendering.

The dashboard (docs/grafana/flying-dashboard.json) is generated from ``PANELS`` below, so the
PromQL in the JSON and the computations behind the rendered image come from one definition:
each ``Target`` writes its PromQL expression and evaluates the same expression (rate over a
window, sum by labels, ``histogram_quantile``, ``count_values``) on series scraped from a
real server. Grafana is not available on every machine (e.g. this project's CI), so
``docs/grafana/dashboard.png`` is such a rendering of a real run, not a Grafana screenshot.

CLI::

    # write the dashboard JSON Grafana imports
    python -m workloads.dashboard --write-json docs/grafana/flying-dashboard.json
    # start a demo server with --enable-metrics, run a preset, scrape /metrics every 0.5 s,
    # render the panels (wrap in `flock /tmp/flying-server.lock` on a shared machine)
    python -m workloads.dashboard --preset cpu-small-priority --out docs/grafana/dashboard.png
    # against a server already running with --enable-metrics
    python -m workloads.dashboard --url http://127.0.0.1:30000 --preset cpu-small
    # render again from saved scrapes, no server
    python -m workloads.dashboard --from-scrapes scrapes.jsonl --out dashboard.png
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workloads.reports.scrapes import (
    Scrape,
    Scraper,
    histogram_quantile,
    load_scrapes,
    rates,
    save_scrapes,
    window_start,
)

#: Panel filters, named as in SGLang's own dashboard (examples/monitoring/grafana).
INSTANCE = 'instance=~"$instance"'
MODEL = 'model_name=~"$model_name"'
RATE = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

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


# -- Grafana JSON -----------------------------------------------------------------------------


def _variable(name: str, label: str, query: str, include_all: bool) -> dict[str, Any]:
    """A query variable in SGLang's dashboard style (label_values over the datasource)."""
    return {
        "current": {"text": "All", "value": "$__all"} if include_all else {},
        "datasource": DATASOURCE,
        "definition": query,
        "includeAll": include_all,
        **({"allValue": ".*"} if include_all else {}),
        "label": label,
        "name": name,
        "options": [],
        "query": {"qryType": 1, "query": query,
                  "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "refresh": 1,
        "regex": "",
        "type": "query",
    }


def _panel_json(panel: Panel, panel_id: int) -> dict[str, Any]:
    col, row = (panel_id - 1) % 2, (panel_id - 1) // 2
    return {
        "datasource": DATASOURCE,
        "description": panel.description,
        "fieldConfig": {
            "defaults": {
                "color": {"mode": "palette-classic"},
                "custom": {
                    "drawStyle": "line",
                    "lineInterpolation": "stepAfter" if panel.stepped else "linear",
                    "lineWidth": 1,
                    "fillOpacity": 10 if panel.stepped else 0,
                    "showPoints": "never",
                    "spanNulls": False,
                    "stacking": {"group": "A", "mode": "normal" if panel.stacked else "none"},
                },
                "unit": panel.unit,
            },
            "overrides": [],
        },
        "gridPos": {"h": 8, "w": 12, "x": 12 * col, "y": 8 * row},
        "id": panel_id,
        "options": {
            "legend": {"calcs": [], "displayMode": "list", "placement": "bottom",
                       "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        },
        "targets": [
            {"datasource": DATASOURCE, "editorMode": "code", "expr": t.promql(),
             "legendFormat": t.legend, "range": True, "refId": chr(ord("A") + i)}
            for i, t in enumerate(panel.targets)
        ],
        "title": panel.title,
        "type": "timeseries",
    }


def dashboard_json() -> dict[str, Any]:
    """The dashboard Grafana imports: Flying's panels first, then SGLang's own series."""
    return {
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard",
        }]},
        "description": "Flying (SGLang DP engines bound into TP groups on demand): modes, "
                       "binds, preemptions, session lengths, per-mode TTFT/TPOT, SGLang series.",
        "editable": True,
        "graphTooltip": 1,
        "links": [],
        "panels": [_panel_json(p, i) for i, p in enumerate(PANELS, start=1)],
        "refresh": "5s",
        "schemaVersion": 41,
        "tags": ["flying", "sglang"],
        "templating": {"list": [
            {"current": {}, "hide": 0, "includeAll": False, "label": "datasource",
             "name": "datasource", "options": [], "query": "prometheus", "refresh": 1,
             "regex": "", "type": "datasource"},
            _variable("instance", "instance", "label_values(flying_engine_tp_degree, instance)",
                      include_all=True),
            _variable("model_name", "model name", "label_values(model_name)", include_all=True),
        ]},
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": "Flying Dashboard",
        "uid": "flying-dashboard",
        "version": 1,
    }


# -- scraping and rendering ---------------------------------------------------------------------


def render(scrapes: Sequence[Scrape], out: Path, window_s: float = 5.0, title: str = "") -> None:
    """Every panel of ``PANELS`` evaluated on ``scrapes``, in the dashboard's 2-column grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = math.ceil(len(PANELS) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(15, 2.6 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, PANELS, strict=False):
        base: list[float] | None = None
        for target in panel.targets:
            for legend, (ts, vs) in sorted(target.evaluate(scrapes, window_s).items()):
                style = {"drawstyle": "steps-post"} if panel.stepped else {}
                if panel.stacked:  # Grafana's normal stacking: each line on the previous
                    low = base or [0.0] * len(vs)
                    vs = [lo + v for lo, v in zip(low, vs, strict=True)]
                    ax.fill_between(ts, low, vs, step="post" if panel.stepped else None,
                                    alpha=0.25)
                    base = vs
                ax.plot(ts, vs, label=legend, linewidth=1.2, **style)
        ax.set_title(panel.title, fontsize=10, loc="left")
        ax.set_ylabel({"none": "", "ops": "/s", "reqps": "req/s", "percentunit": "share"}
                      .get(panel.unit, panel.unit), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left", ncol=3)
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", color="grey")
    for ax in axes.flat[len(PANELS):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("seconds since the first scrape", fontsize=8)
    fig.suptitle(title or "Flying dashboard panels", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(out, dpi=90)
    plt.close(fig)


def run_workload(url: str, preset: str, seed: int, limit: int | None, every_s: float,
                 tail_s: float) -> tuple[list[Scrape], dict[str, Any]]:
    """Scrape ``url`` while the preset runs (open loop, the project's client), then
    ``tail_s`` more seconds so the rates fall back to zero on the plots."""
    from workloads.load.presets import build_preset
    from workloads.measure.client import _run, run_trace

    trace = build_preset(preset, seed)[:limit]
    scraper = Scraper(url, every_s)
    scraper.start()
    time.sleep(2 * every_s)
    records = _run(run_trace(trace, url, seed=seed, progress=False))
    time.sleep(tail_s)
    scraper.stop()
    return scraper.scrapes, {"requests": len(records),
                             "failed": sum(not r.success for r in records),
                             "scrape_errors": scraper.errors}


def main(argv: list[str] | None = None) -> None:
    """CLI: write the JSON, or run a preset against a (launched) server and render."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write-json", type=Path, help="write the dashboard JSON here and exit")
    p.add_argument("--url", help="a running server (started with --enable-metrics)")
    p.add_argument("--from-scrapes", type=Path, help="render saved scrapes; no server")
    p.add_argument("--preset", default="cpu-small-priority")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, help="send only the first N requests")
    p.add_argument("--every", type=float, default=0.5, help="scrape period, seconds")
    p.add_argument("--window", type=float, default=5.0, help="rate window, seconds")
    p.add_argument("--tail", type=float, default=8.0, help="seconds scraped after the run")
    p.add_argument("--out", type=Path, default=Path("docs/grafana/dashboard.png"))
    p.add_argument("--scrapes-out", type=Path, help="save the scrapes (JSONL) here")
    p.add_argument("--server-log", type=Path, default=Path("dashboard-server.log"))
    p.add_argument("server_args", nargs="*", help="extra launcher flags (after --)")
    args = p.parse_args(argv)
    if args.write_json:
        args.write_json.write_text(json.dumps(dashboard_json(), indent=2) + "\n")
        return
    title = f"Flying dashboard panels: preset {args.preset}, scraped every {args.every:g} s"
    if args.from_scrapes:
        render(load_scrapes(args.from_scrapes), args.out, args.window, title)
        return
    server = None
    url = args.url
    if url is None:
        from workloads.measure.server import start_server

        flags = ["--dp-size", "2", "--enable-metrics", *args.server_args]
        server, startup_s = start_server(flags, args.server_log)
        url = server.url
        print(f"server ready in {startup_s:.0f} s at {url}", flush=True)
    try:
        scrapes, info = run_workload(url, args.preset, args.seed, args.limit, args.every,
                                     args.tail)
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(info), flush=True)
    if args.scrapes_out:
        save_scrapes(scrapes, args.scrapes_out)
    render(scrapes, args.out, args.window, title)
    print(f"wrote {args.out} from {len(scrapes)} scrapes", flush=True)


if __name__ == "__main__":
    main()
