"""Time series of a run for plots: concurrency, P90 TTFT, queue time and engine modes over time.

All series use fixed buckets of ``bucket_s`` seconds on the run clock (0 = trace start), so
series of different systems replaying the same trace line up. Latency series group requests by
the bucket they were sent in: a point answers "how did requests sent at this time fare".
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from workloads.measure.metrics import flying_mode
from workloads.measure.records import RequestRecord

Point = tuple[float, float | None]


def _horizon(records: Sequence[RequestRecord], bucket_s: float) -> int:
    """Number of buckets that cover every sent request's lifetime."""
    ends = [r.end_s for r in records if r.end_s is not None]
    return int(math.floor(max(ends) / bucket_s)) + 1 if ends else 0


def concurrency_series(records: Sequence[RequestRecord], bucket_s: float = 1.0) -> list[Point]:
    """In-flight requests at each bucket start t: those with ``send_s <= t < end_s``."""
    spans = [(r.send_s, r.end_s) for r in records if r.send_s is not None and r.end_s is not None]
    points: list[Point] = []
    for k in range(_horizon(records, bucket_s)):
        t = k * bucket_s
        points.append((t, float(sum(1 for s, e in spans if s <= t < e))))
    return points


def percentile_series(
    records: Sequence[RequestRecord],
    value: Callable[[RequestRecord], float | None],
    q: float = 90.0,
    bucket_s: float = 1.0,
) -> list[Point]:
    """q-th percentile of ``value`` (seconds, reported in ms) over successful requests by send
    bucket; None where a bucket has no sample."""
    buckets: dict[int, list[float]] = {}
    for rec in records:
        v = value(rec)
        if rec.success and rec.send_s is not None and v is not None:
            buckets.setdefault(int(math.floor(rec.send_s / bucket_s)), []).append(v * 1000.0)
    horizon = _horizon(records, bucket_s)
    return [
        (k * bucket_s, float(np.percentile(buckets[k], q)) if k in buckets else None)
        for k in range(horizon)
    ]


def ttft_p90_series(records: Sequence[RequestRecord], bucket_s: float = 1.0) -> list[Point]:
    """P90 TTFT (ms) of the requests sent in each bucket."""
    return percentile_series(records, lambda r: r.ttft_s, 90.0, bucket_s)


def queue_p90_series(records: Sequence[RequestRecord], bucket_s: float = 1.0) -> list[Point]:
    """P90 server-reported queue time (ms) of the requests sent in each bucket."""
    return percentile_series(records, lambda r: r.queue_time_s, 90.0, bucket_s)


def mode_series(
    records: Sequence[RequestRecord], bucket_s: float = 1.0
) -> list[tuple[float, dict[str, int]]]:
    """In-flight requests per Flying mode at each bucket start (requests without one omitted)."""
    spans = [
        (r.send_s, r.end_s, mode)
        for r in records
        if r.send_s is not None and r.end_s is not None and (mode := flying_mode(r)) is not None
    ]
    series: list[tuple[float, dict[str, int]]] = []
    for k in range(_horizon(records, bucket_s)):
        t = k * bucket_s
        series.append((t, dict(Counter(m for s, e, m in spans if s <= t < e))))
    return series
