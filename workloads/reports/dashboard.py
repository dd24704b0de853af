"""Flying's Grafana dashboard: the JSON Grafana imports, and a rendering of its panels.

The dashboard (docs/grafana/flying-dashboard.json) is generated from the panels of
``workloads.reports.panels``, so the PromQL in the JSON and the computations behind the
rendered image come from one definition. Grafana is not available on every machine
(e.g. this project's CI), so ``docs/grafana/dashboard.png`` is such a rendering of a
real run, not a Grafana screenshot.

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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workloads.reports.panels import PANELS, Panel
from workloads.reports.scrapes import Scrape, Scraper, load_scrapes, save_scrapes

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


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
