"""PNG plots of several runs of one trace, overlaid: concurrency, P90 TTFT, queue time.

Overlaying the runs on one time axis is the point: the same trace is replayed against every
system, so at any time t each line answers "what was this system doing with the same load".
Where a run's records carry Flying mode info, the spans in which requests of a non-DP mode
were in flight are shaded, so a TTFT dip can be read against the mode that caused it.
matplotlib is imported lazily (Agg backend), so the rest of workloads does not need it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

from workloads.measure.records import RequestRecord
from workloads.reports.timeseries import (
    Point,
    concurrency_series,
    mode_series,
    queue_p90_series,
    ttft_p90_series,
)

#: The run that may carry engine modes; its spans are shaded on every plot.
MODES_RUN = "flying"

#: Modes that mean "no group formed"; spans of these are not shaded.
PLAIN_MODES = frozenset({"dp"})

_MODE_COLORS = ("tab:orange", "tab:purple", "tab:cyan", "tab:olive", "tab:brown")

Series = Callable[[Sequence[RequestRecord], float], list[Point]]

#: file name -> (title, y label, series function, bucket kind)
PLOTS: dict[str, tuple[str, str, Series, str]] = {
    "concurrency.png": ("In-flight requests", "requests", concurrency_series, "fine"),
    "ttft_p90.png": ("P90 TTFT by send time", "ms", ttft_p90_series, "coarse"),
    "queue_p90.png": ("P90 engine queue time (SGLang meta_info.queue_time)", "ms", queue_p90_series, "coarse"),
}


def latency_bucket_s(runs: dict[str, Sequence[RequestRecord]], target_points: int = 40) -> float:
    """Bucket length for percentile series: about ``target_points`` buckets over the run.

    One-second buckets hold one or two requests at CPU rates, which makes a P90 per bucket
    mere noise; a whole number of seconds keeps bucket edges readable.
    """
    ends = [r.end_s for recs in runs.values() for r in recs if r.end_s is not None]
    span = max(ends) if ends else 0.0
    return float(max(1, math.ceil(span / target_points)))


def mode_spans(
    series: Sequence[tuple[float, dict[str, int]]], bucket_s: float
) -> list[tuple[float, float, str]]:
    """(start, end, mode) spans where requests of a non-plain mode were in flight.

    Consecutive buckets with the same mode present merge into one span, so a plot gets one
    shaded band per episode instead of one per second.
    """
    spans: list[tuple[float, float, str]] = []
    open_at: dict[str, float] = {}
    for t, counts in series:
        present = {m for m, c in counts.items() if c > 0 and m not in PLAIN_MODES}
        for mode in list(open_at):
            if mode not in present:
                spans.append((open_at.pop(mode), t, mode))
        for mode in present:
            open_at.setdefault(mode, t)
    end = series[-1][0] + bucket_s if series else 0.0
    spans += [(start, end, mode) for mode, start in open_at.items()]
    return sorted(spans)


def _shade(ax, spans: list[tuple[float, float, str]]) -> None:
    """Shade mode spans, one legend entry per mode."""
    colors: dict[str, str] = {}
    for start, end, mode in spans:
        first = mode not in colors
        color = colors.setdefault(mode, _MODE_COLORS[len(colors) % len(_MODE_COLORS)])
        label = f"{MODES_RUN}: {mode} in flight" if first else None
        ax.axvspan(start, end, color=color, alpha=0.15, lw=0, label=label)


def plot_runs(
    runs: dict[str, Sequence[RequestRecord]],
    out_dir: str | Path,
    fine_bucket_s: float = 0.5,
    coarse_bucket_s: float | None = None,
) -> dict[str, Path]:
    """Write every plot of ``PLOTS`` into ``out_dir``; returns file name -> path.

    A plot whose series is empty for every run (e.g. no server reported queue times) is still
    written, with a note, so the report's image links never dangle.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    coarse = coarse_bucket_s or latency_bucket_s(runs)
    spans: list[tuple[float, float, str]] = []
    if MODES_RUN in runs:
        spans = mode_spans(mode_series(runs[MODES_RUN], fine_bucket_s), fine_bucket_s)
    written: dict[str, Path] = {}
    for name, (title, ylabel, series_fn, kind) in PLOTS.items():
        bucket = fine_bucket_s if kind == "fine" else coarse
        fig, ax = plt.subplots(figsize=(9, 4), dpi=100)
        values: list[float] = []
        for run, records in runs.items():
            points = [(t, v) for t, v in series_fn(records, bucket) if v is not None]
            if not points:
                continue
            values += [v for _, v in points]
            xs, ys = zip(*points, strict=True)
            if kind == "fine":  # a count held over each bucket: draw it as steps
                ax.plot(xs, ys, "-", label=run, drawstyle="steps-post", lw=1.2)
            else:
                ax.plot(xs, ys, "o-", label=run, markersize=3, lw=1.2)
        _shade(ax, spans)
        if kind == "coarse" and values and min(values) > 0 and max(values) > 50 * min(values):
            ax.set_yscale("log")  # runs orders of magnitude apart stay readable side by side
        if not values:
            ax.text(0.5, 0.5, "no data reported", ha="center", va="center",
                    transform=ax.transAxes)
        suffix = "" if kind == "fine" else f" ({bucket:g} s buckets)"
        ax.set_title(title + suffix)
        ax.set_xlabel("time since trace start (s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        path = out / name
        fig.savefig(path)
        plt.close(fig)
        written[name] = path
    return written
