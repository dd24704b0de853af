"""Prometheus' side of the dashboard: scraping a server's /metrics, and the computations
Prometheus runs on what it scraped (a counter's rate across resets, ``histogram_quantile``).

``workloads.reports.dashboard`` evaluates each panel's PromQL with these on scrapes of a
real server, so its rendering needs no Prometheus; the scrapes are saved as JSON lines
(one scrape a line: ``{"t": seconds since the first, "samples": [[name, labels, value]]}``)
and can be rendered again without a server.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path

#: One scraped sample: metric sample name, labels, value.
Sample = tuple[str, dict[str, str], float]
#: A scrape: seconds since the first scrape, and its samples.
Scrape = tuple[float, list[Sample]]


def window_start(scrapes: Sequence[Scrape], i: int, window_s: float) -> int:
    """Index of the earliest scrape within ``window_s`` before scrape ``i``."""
    j = i
    while j > 0 and scrapes[i][0] - scrapes[j - 1][0] <= window_s + 1e-9:
        j -= 1
    return j


def rates(a: Scrape, b: Scrape, name: str) -> list[tuple[dict[str, str], float]]:
    """Per-series rate between two scrapes; a series that went down was reset (counts
    from zero again), as in Prometheus' ``rate``; a new series started from zero."""
    before = {_key(labels): v for n, labels, v in a[1] if n == name}
    dt = b[0] - a[0]
    out = []
    for n, labels, v in b[1]:
        if n == name:
            prev = before.get(_key(labels), 0.0)
            out.append((labels, (v - prev if v >= prev else v) / dt))
    return out


def _key(labels: dict[str, str]) -> tuple:
    return tuple(sorted(labels.items()))


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' ``histogram_quantile``: linear within the bucket holding rank q * count;
    the lowest bucket starts at 0; a rank in +Inf returns the highest finite bound; no
    observations -> NaN."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][0] != math.inf or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    prev_le, prev_n = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            if le == math.inf:
                return prev_le
            if n == prev_n:
                return le
            return prev_le + (le - prev_le) * (rank - prev_n) / (n - prev_n)
        prev_le, prev_n = le, n
    return prev_le


def parse_metrics(text: str) -> list[Sample]:
    """Every sample of a /metrics response (Prometheus text format)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels), float(s.value))
            for fam in text_string_to_metric_families(text) for s in fam.samples]


class Scraper(threading.Thread):
    """Scrapes ``url``/metrics every ``every_s`` until stopped; what Prometheus would do."""

    def __init__(self, url: str, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.url, self.every_s = url.rstrip("/"), every_s
        self.scrapes: list[Scrape] = []
        self.errors = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        import requests

        t0 = time.monotonic()
        while not self._stop_event.is_set():
            t = time.monotonic()
            try:
                resp = requests.get(self.url + "/metrics", timeout=5)
                resp.raise_for_status()
                self.scrapes.append((t - t0, parse_metrics(resp.text)))
            except Exception:  # noqa: BLE001 - a missed scrape is a gap, as in Prometheus
                self.errors += 1
            self._stop_event.wait(max(0.0, self.every_s - (time.monotonic() - t)))

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)


def save_scrapes(scrapes: Sequence[Scrape], path: Path) -> None:
    with open(path, "w") as f:
        for t, samples in scrapes:
            f.write(json.dumps({"t": t, "samples": samples}) + "\n")


def load_scrapes(path: Path) -> list[Scrape]:
    out: list[Scrape] = []
    for line in Path(path).read_text().splitlines():
        doc = json.loads(line)
        out.append((doc["t"], [(n, labels, v) for n, labels, v in doc["samples"]]))
    return out
