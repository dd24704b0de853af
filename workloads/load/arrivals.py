"""Arrival processes under the names other serving benchmarks use.

Benchmarks are only comparable when their load shapes are: vLLM's and SGLang's serving
benchmarks send requests as a Poisson process at ``--request-rate``, or as a gamma process
whose ``--burstiness`` is the gamma shape (1 = Poisson, < 1 burstier, > 1 more regular;
vLLM also ramps the rate with ``--ramp-up-strategy linear|exponential`` from
``--ramp-up-start-rps`` to ``--ramp-up-end-rps``). SGLang 0.5.23's ``serving.py`` keeps only
Poisson (``get_request``), so the definitions are restated here, equal to theirs:

- ``poisson``: exponential gaps with mean ``1 / rate``;
- ``gamma``: gaps ~ Gamma(shape=burstiness, scale=1 / (rate * burstiness)), mean ``1 / rate``;
- ``constant``: every gap ``1 / rate``;
- ``ramp``: the rate moves from ``rate`` (first request) to ``end_rate`` (last request),
  linearly or exponentially in the request index; each gap is a gamma draw (Poisson with
  the default burstiness 1) at the current rate.

As in those benchmarks, the first request is sent at time 0. The bursty low/burst phases of
the Flying Serving paper are a piecewise-rate Poisson process (``trace.bursty_arrivals``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from workloads.load.trace import TraceRequest

ARRIVAL_KINDS = ("poisson", "gamma", "constant", "ramp")
RAMP_STRATEGIES = ("linear", "exponential")

#: Seed-stream tag of re-timed traces, apart from every stream of ``trace.generate_bursty``.
_RETIME_TAG = 104729


@dataclass(frozen=True)
class ArrivalProcess:
    """How requests arrive: ``kind`` out of ARRIVAL_KINDS, at mean ``rate`` req/s.

    ``burstiness`` is the gamma shape (``gamma`` and ``ramp``); ``end_rate`` and ``strategy``
    shape the ``ramp``.
    """

    kind: str = "poisson"
    rate: float = 1.0
    burstiness: float = 1.0
    end_rate: float | None = None
    strategy: str = "linear"

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_KINDS:
            raise ValueError(f"unknown arrival process {self.kind!r}; use one of {ARRIVAL_KINDS}")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.kind == "ramp":
            if self.end_rate is None or not self.end_rate > 0:
                raise ValueError("a ramp needs end_rate > 0")
            if self.strategy not in RAMP_STRATEGIES:
                raise ValueError(f"ramp strategy must be one of {RAMP_STRATEGIES}")

    def describe(self) -> str:
        """One line for reports: the process and its parameters."""
        if self.kind == "ramp":
            return (f"ramp {self.strategy} {self.rate:g} -> {self.end_rate:g} req/s"
                    f" (burstiness {self.burstiness:g})")
        if self.kind == "gamma":
            return f"gamma, {self.rate:g} req/s, burstiness {self.burstiness:g}"
        return f"{self.kind}, {self.rate:g} req/s"


def ramp_rates(process: ArrivalProcess, n: int) -> np.ndarray:
    """The rate at which each of ``n`` requests is issued (vLLM's ramp-up definition)."""
    if process.kind != "ramp" or process.end_rate is None:
        return np.full(n, process.rate)
    progress = np.arange(n) / max(n - 1, 1)
    if process.strategy == "linear":
        return process.rate + (process.end_rate - process.rate) * progress
    return process.rate * (process.end_rate / process.rate) ** progress


def gaps(process: ArrivalProcess, n: int, rng: np.random.Generator) -> np.ndarray:
    """The ``n - 1`` gaps between ``n`` consecutive arrivals, in seconds."""
    if n < 2:
        return np.zeros(0)
    if process.kind == "constant":
        return np.full(n - 1, 1.0 / process.rate)
    if process.kind == "poisson":
        return rng.exponential(1.0 / process.rate, size=n - 1)
    # gamma, and ramp: the gap after request i is drawn at request i's rate.
    rates = ramp_rates(process, n)[:-1]
    shape = process.burstiness
    return rng.gamma(shape, 1.0 / (rates * shape))


def arrival_times(process: ArrivalProcess, n: int, rng: np.random.Generator) -> list[float]:
    """``n`` arrival times from 0, in seconds."""
    if n <= 0:
        return []
    return [0.0, *np.cumsum(gaps(process, n, rng)).tolist()]


def retime(
    trace: Sequence[TraceRequest], process: ArrivalProcess, seed: int = 0
) -> list[TraceRequest]:
    """``trace`` with its arrivals replaced by ``process`` (lengths, ids, priorities kept).

    The phase label becomes the process kind, so reports group by the new shape. The draws
    depend only on (seed, process, len(trace)).
    """
    rng = np.random.default_rng([seed, _RETIME_TAG])
    times = arrival_times(process, len(trace), rng)
    return [
        dataclasses.replace(req, arrival_s=t, phase=process.kind)
        for req, t in zip(trace, times, strict=True)
    ]
