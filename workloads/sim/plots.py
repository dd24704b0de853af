"""The simulator's figure: the node's layout over time, P90 TTFT and in-flight requests.

One PNG, every panel per policy on the trace's clock, titled SIMULATED with the profile
(a simulated figure must never pass for a measured one). The series are
``workloads.reports.timeseries``' (the same the measured reports plot); the layout panel is
the simulator's own: how many engines were in DP and in groups of each degree.
matplotlib is imported lazily (Agg backend).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from workloads.reports.plots import latency_bucket_s
from workloads.reports.timeseries import concurrency_series, ttft_p90_series
from workloads.sim.run import SimResult


def layout_steps(layout: Sequence[tuple[float, list[int]]], end: float
                 ) -> tuple[list[float], dict[int, list[int]]]:
    """(times, engines per degree at each time) of a layout history, as steps: each
    change holds until the next (the last until ``end``)."""
    degrees = sorted({d for _, ds in layout for d in ds})
    times: list[float] = []
    counts: dict[int, list[int]] = {d: [] for d in degrees}
    for i, (t, ds) in enumerate(layout):
        nxt = layout[i + 1][0] if i + 1 < len(layout) else max(end, t)
        for x in (t, nxt):
            times.append(x)
            for d in degrees:
                counts[d].append(sum(1 for v in ds if v == d))
    return times, counts


def plot(results: Sequence[SimResult], path: str | Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the layout of a static policy is its name: only the others get a layout panel
    grouped = [r for r in results if not r.policy.startswith("static")
               and any(max(ds) > 1 for _, ds in r.layout)]
    rows = len(grouped) + 2
    fig, axes = plt.subplots(rows, 1, figsize=(10, 2.2 * rows + 1), dpi=100, sharex=True)
    runs = {r.policy: r.records for r in results}
    end = max((rec.end_s or 0.0 for recs in runs.values() for rec in recs), default=0.0)
    for ax, res in zip(axes, grouped, strict=False):
        times, counts = layout_steps(res.layout, end)
        labels = ["DP" if d == 1 else f"TP-{d}" for d in counts]
        ax.stackplot(times, *counts.values(), labels=labels, alpha=0.7, step=None)
        ax.set_ylabel("engines")
        ax.set_title(f"{res.policy}: engines by mode", fontsize=9)
        ax.legend(loc="upper right", fontsize=7)
    bucket = latency_bucket_s(runs)
    ttft_ax, conc_ax = axes[len(grouped)], axes[len(grouped) + 1]
    for name, recs in runs.items():
        pts = [(t, v) for t, v in ttft_p90_series(recs, bucket) if v is not None]
        if pts:
            ttft_ax.plot(*zip(*pts, strict=True), "o-", ms=2, lw=1, label=name)
        conc = concurrency_series(recs, 1.0)
        if conc:
            conc_ax.plot(*zip(*conc, strict=True), lw=1, drawstyle="steps-post", label=name)
    ttft_ax.set_ylabel("ms")
    ttft_ax.set_title(f"P90 TTFT by send time ({bucket:g} s buckets)", fontsize=9)
    ttft_ax.set_yscale("log")
    conc_ax.set_ylabel("requests")
    conc_ax.set_title("in-flight requests", fontsize=9)
    conc_ax.set_xlabel("time since trace start (s)")
    for ax in (ttft_ax, conc_ax):
        ax.legend(loc="upper right", fontsize=7)
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"SIMULATED: {title}", fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
