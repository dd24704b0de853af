"""Measured step costs: how long one decode step takes in each mode, on this engine.

The policy picks a TP group for latency only where a group's step is measurably faster
than one engine's (``scheduler.policy.Costs``). The engines measure it themselves, as
the interval between consecutive step boundaries (formation, forward, sampling, output
processing, and for a group its exchange and state switch: everything a request waits
for per token), for single-request decode steps, per TP degree (1 = DP). The start-up probe's requests
calibrate it (one per degree, in a group and in DP); serving traffic keeps it current.
TP steps with DP steps interleaved are not counted (their interval includes another
batch's work).

The cost of a degree is a low percentile (``QUANTILE``) of its last ``WINDOW`` samples:
the step's own cost. On a shared machine other processes (the HTTP server, the
detokenizer, the other engines' prefills) stretch some steps; a mean would charge that
to whichever mode happened to run during a burst, and DP runs during bursts far more
often than a group does, so a mean made DP look slow exactly when groups do not pay.

A low percentile of recent samples is not enough under sustained load: when every
sample of a window is stretched (a benchmark at a steady rate keeps both cores busy),
DP's recent cost rises while a group's, measured only when a group runs, stays at the
start-up probe's quiet-machine value, so a group that is slower than one engine looked
faster (SGLang's serving benchmark at 6 req/s formed such groups on the demo model).
So a degree's cost is the lowest its windowed percentile has been (``best``): each
mode's capability, for DP and TP measured alike by the probe on the same quiet machine
and lowered by traffic when a mode runs faster, never raised by contention that would
stretch either mode.
"""

from __future__ import annotations

import time
from collections import deque

#: Samples kept per degree, and the percentile of them that is the degree's cost.
WINDOW = 64
QUANTILE = 0.25
#: Steps longer than this are not samples of a step (an engine stalled or slept).
MAX_SAMPLE_S = 5.0
#: A window's percentile becomes a degree's best only from this many samples on (the
#: probe's calibration gives 15 per degree); until then the percentile itself is used.
MIN_SAMPLES = 8


class StepClock:
    """Single-request decode step time per degree: ``decode_ms()`` -> {degree: ms}."""

    def __init__(self) -> None:
        self._ms: dict[int, deque[float]] = {}
        self._samples: dict[int, int] = {}
        self._best: dict[int, float] = {}  # degree -> lowest windowed percentile seen
        self._open: tuple[int, float] | None = None  # (degree, started) of a counted step

    def boundary(self) -> float:
        """A step boundary starts: close the step in progress (if it was a sample) at
        this instant; returns the instant, the start of the step being formed."""
        now = time.perf_counter()
        if self._open is not None:
            deg, started = self._open
            if now - started <= MAX_SAMPLE_S:
                self.record(deg, (now - started) * 1e3)
        self._open = None
        return now

    def label(self, degree: int | None, started: float) -> None:
        """The step that started at ``started`` is a sample of ``degree`` (None: not)."""
        self._open = (degree, started) if degree is not None else None

    def record(self, degree: int, ms: float) -> None:
        window = self._ms.setdefault(degree, deque(maxlen=WINDOW))
        window.append(ms)
        self._samples[degree] = self._samples.get(degree, 0) + 1
        if len(window) >= MIN_SAMPLES:
            self._best[degree] = min(self._best.get(degree, float("inf")), _low(window))

    def decode_ms(self) -> dict[int, float]:
        """Per degree: its best windowed percentile (see the module docstring), or the
        percentile of its first few samples while it has fewer than ``MIN_SAMPLES``."""
        return {
            degree: round(self._best.get(degree, _low(window)), 4)
            for degree, window in sorted(self._ms.items())
        }

    def samples(self) -> dict[int, int]:
        return dict(sorted(self._samples.items()))


def _low(window: deque[float]) -> float:
    ordered = sorted(window)
    return ordered[int(QUANTILE * (len(ordered) - 1))]


def sample_degree(batch, degree: int, interleaved: bool) -> int | None:
    """The degree a step of ``batch`` is a sample of: single-request decode steps only."""
    if batch is None or interleaved or len(batch.reqs) != 1:
        return None
    return degree if batch.forward_mode.is_decode() else None
