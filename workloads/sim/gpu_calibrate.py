"""One GPU's measured share of a step, in place of the first-principles formula's.

``workloads.sim.gpu_measure`` times one TP rank's kernels on a real GPU (decode at a few
batch sizes, prefill at a few token counts; no all-reduce, no scheduler). A calibrated
profile keeps the formula's other terms (the per-step CPU overhead, the all-reduces over
NVLink, the KV pool) and takes the GPU's share from the measurement:

- between two measured sizes: the measured curve, linear between them (as
  ``scheduler.costs.Curve`` interpolates);
- below the smallest: the formula plus the measured excess at the smallest (the excess
  there is a fixed floor: kernel launches and latency-bound small kernels, which do not
  shrink with the work);
- above the largest: the formula times the measured ratio at the largest (the excess
  there is an efficiency: bandwidth or FLOPs below the datasheet's).

Pure Python (reads the JSON ``gpu_measure`` wrote; no torch).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scheduler.costs import interpolate
from workloads.sim.profile import PROFILES_DIR

#: Where the shipped measurements live (``gpu_measure``'s output files, by device).
MEASURED_DIR = PROFILES_DIR / "gpu-shard-steps"
#: ``gpu_relayout``'s output files, by device.
RELAYOUT_DIR = PROFILES_DIR / "gpu-relayout"


@dataclass(frozen=True)
class Measured:
    """One (model, ranks) row: milliseconds by decode batch and by prefill tokens."""

    decode: dict[int, float]
    prefill: dict[int, float]


def load_measured(path: str | Path) -> tuple[str, dict[tuple[str, int], Measured]]:
    """The device name and the rows of a ``gpu_measure`` file, by (model name, ranks);
    rows the device skipped (weights too large) are left out."""
    doc = json.loads(Path(path).read_text())
    rows = {
        (r["model"], r["ranks"]): Measured(
            {int(b): float(ms) for b, ms in r["decode_ms"].items()},
            {int(t): float(ms) for t, ms in r["prefill_ms"].items()})
        for r in doc["rows"] if "skipped" not in r
    }
    return doc["device"], rows


def calibrated(formula: Callable[[int], float], points: dict[int, float], x: int) -> float:
    """The measured ``points`` (size -> ms) extended by ``formula`` (size -> ms) as the
    module docstring says. ``points`` must not be empty."""
    xs = sorted(points)
    lo, hi = xs[0], xs[-1]
    if x <= lo:
        return formula(x) + points[lo] - formula(lo)
    if x >= hi:
        return formula(x) * points[hi] / formula(hi)
    return interpolate(tuple((float(b), points[b]) for b in xs), x)


def relayout_fit(path: str | Path, model: str) -> tuple[str, float, float]:
    """The device, and ``(fixed ms, ms per 1k tokens)`` of one GPU's side of a move to DP
    for ``model`` ("Llama-3-8B" matches the file's "llama3-8b"): the least-squares line
    through the measured sizes of every degree, of this code's relayout ("current")."""
    doc = json.loads(Path(path).read_text())
    key = model.lower().replace("-", "")
    pts = [(r["tokens"] / 1000.0, r["ms"]) for r in doc["rows"]
           if r["model"].replace("-", "") == key and r["direction"] == "to_dp"
           and r.get("impl", "current") == "current"]
    if len({x for x, _ in pts}) < 2:
        raise ValueError(f"{path}: fewer than two sizes measured for {model}")
    n, sx, sy = len(pts), sum(x for x, _ in pts), sum(y for _, y in pts)
    slope = (n * sum(x * y for x, y in pts) - sx * sy) / (n * sum(x * x for x, _ in pts) - sx * sx)
    return doc["device"], (sy - slope * sx) / n, slope
