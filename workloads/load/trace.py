"""Seeded synthetic request traces and their JSONL form.

A trace is a list of ``TraceRequest`` sorted by arrival time. The same trace is sent to every
system under comparison, so generation must be exactly reproducible from a seed. Each random
aspect (arrivals, lengths, priorities, long prompts, token ids) draws from its own child stream
of one ``numpy.random.SeedSequence``; turning on the priority or long-context options therefore
does not move arrivals or lengths, and ``paper`` vs ``paper-priority`` differ only in labels.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PRIORITIES = ("high", "normal", "low")
DEFAULT_TOKEN_ID_RANGE = (3, 500)

# Child-stream indices of the SeedSequence; fixed so that traces stay stable across versions.
_ARRIVALS, _LENGTHS, _PRIORITY, _LONG = range(4)
_TOKEN_STREAM_TAG = 7919


@dataclass
class TraceRequest:
    """One request of a trace; lengths are in tokens and ``arrival_s`` is from trace start."""

    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    priority: str = "normal"
    phase: str = "low"
    input_ids: list[int] | None = None


@dataclass(frozen=True)
class BurstyConfig:
    """Shape of a bursty trace, as in the Flying Serving paper's evaluation.

    Ranges are inclusive. Arrivals alternate between a low phase and a burst phase, each
    lasting a fixed duration; every phase draws its own rate uniformly from its range and
    arrivals inside it are Poisson (exponential gaps). With ``num_bursts`` the trace ends
    with the low phase after that many bursts (``num_requests`` is then an upper bound), so
    a trace has a fixed number of peaks whatever the rates draw.
    """

    num_requests: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    low_rate_range: tuple[float, float]
    burst_rate_range: tuple[float, float]
    low_duration_s: float = 60.0
    burst_duration_s: float = 60.0
    start_phase: str = "low"
    high_priority_fraction: float = 0.0
    long_fraction: float = 0.0
    long_prompt_range: tuple[int, int] | None = None
    token_id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE
    with_input_ids: bool = True
    num_bursts: int | None = None


def _streams(seed: int) -> list[np.random.Generator]:
    children = np.random.SeedSequence(seed).spawn(4)
    return [np.random.default_rng(child) for child in children]


def bursty_arrivals(config: BurstyConfig, rng: np.random.Generator) -> list[tuple[float, str]]:
    """Arrival times and phase labels for ``config.num_requests`` requests.

    When the next exponential gap would cross the end of a phase, the draw is discarded and
    the process restarts at the boundary with the next phase's rate; by memorylessness this
    is exactly a piecewise-constant-rate Poisson process.
    """
    if config.start_phase not in ("low", "burst"):
        raise ValueError(f"start_phase must be 'low' or 'burst', got {config.start_phase!r}")
    arrivals: list[tuple[float, str]] = []
    phase = config.start_phase
    phase_start = 0.0
    bursts = 0
    while len(arrivals) < config.num_requests:
        if config.num_bursts is not None and bursts == config.num_bursts and phase == "burst":
            break
        rate_range = config.low_rate_range if phase == "low" else config.burst_rate_range
        duration = config.low_duration_s if phase == "low" else config.burst_duration_s
        if duration <= 0:
            raise ValueError("phase durations must be positive")
        rate = float(rng.uniform(rate_range[0], rate_range[1]))
        phase_end = phase_start + duration
        t = phase_start
        while rate > 0 and len(arrivals) < config.num_requests:
            t += float(rng.exponential(1.0 / rate))
            if t >= phase_end:
                break
            arrivals.append((t, phase))
        phase_start = phase_end
        bursts += phase == "burst"
        phase = "burst" if phase == "low" else "low"
    return arrivals


def _uniform_ints(rng: np.random.Generator, bounds: tuple[int, int], n: int) -> np.ndarray:
    low, high = bounds
    if low > high or low < 1:
        raise ValueError(f"bad length range {bounds}")
    return rng.integers(low, high + 1, size=n)


def pick_fraction(rng: np.random.Generator, n: int, fraction: float) -> set[int]:
    """Exactly ``round(fraction * n)`` distinct indices, so the fraction is not left to luck."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    count = int(round(fraction * n))
    return {int(i) for i in rng.choice(n, size=count, replace=False)} if count else set()


def generate_bursty(config: BurstyConfig, seed: int = 0) -> list[TraceRequest]:
    """A bursty trace (optionally with priorities and long prompts) from ``config``."""
    arrival_rng, length_rng, priority_rng, long_rng = _streams(seed)
    arrivals = bursty_arrivals(config, arrival_rng)
    n = len(arrivals)
    prompts = _uniform_ints(length_rng, config.prompt_range, n)
    outputs = _uniform_ints(length_rng, config.output_range, n)
    high = pick_fraction(priority_rng, n, config.high_priority_fraction)
    long_ids = pick_fraction(long_rng, n, config.long_fraction)
    if long_ids:
        if config.long_prompt_range is None:
            raise ValueError("long_fraction > 0 needs long_prompt_range")
        long_lens = _uniform_ints(long_rng, config.long_prompt_range, n)
        for i in long_ids:
            prompts[i] = long_lens[i]
    trace = [
        TraceRequest(
            index=i,
            arrival_s=t,
            prompt_len=int(prompts[i]),
            output_len=int(outputs[i]),
            priority="high" if i in high else "normal",
            phase=phase,
        )
        for i, (t, phase) in enumerate(arrivals)
    ]
    if config.with_input_ids:
        attach_input_ids(trace, seed, config.token_id_range)
    return trace


def generate_mixed_priority(
    config: BurstyConfig, high_fraction: float = 0.2, seed: int = 0
) -> list[TraceRequest]:
    """The bursty trace of ``config`` with ``high_fraction`` of requests marked "high"."""
    return generate_bursty(dataclasses.replace(config, high_priority_fraction=high_fraction), seed)


def generate_long_context(
    config: BurstyConfig,
    long_fraction: float,
    long_prompt_range: tuple[int, int],
    seed: int = 0,
) -> list[TraceRequest]:
    """The bursty trace of ``config`` where ``long_fraction`` of prompts come from a long range.

    This exercises Flying's upgrade of prompts that exceed one engine's KV capacity.
    """
    changed = dataclasses.replace(
        config, long_fraction=long_fraction, long_prompt_range=long_prompt_range
    )
    return generate_bursty(changed, seed)


def token_ids_for(
    index: int,
    prompt_len: int,
    seed: int,
    id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE,
) -> list[int]:
    """Deterministic prompt token ids for request ``index``: ``prompt_len`` ids in [lo, hi).

    Ids depend only on (seed, index), so a large trace can be stored without ids and the client
    can rebuild the same prompt at send time. Random ids also defeat prefix caching, which
    would otherwise make later requests unrealistically cheap.
    """
    low, high = id_range
    if not 0 <= low < high:
        raise ValueError(f"bad token id range {id_range}")
    rng = np.random.default_rng([seed, _TOKEN_STREAM_TAG, index])
    return rng.integers(low, high, size=prompt_len).tolist()


def attach_input_ids(
    trace: Iterable[TraceRequest],
    seed: int,
    id_range: tuple[int, int] = DEFAULT_TOKEN_ID_RANGE,
) -> None:
    """Fill ``input_ids`` of every request that has none (in place)."""
    for req in trace:
        if req.input_ids is None:
            req.input_ids = token_ids_for(req.index, req.prompt_len, seed, id_range)


def request_to_dict(req: TraceRequest, include_ids: bool = True) -> dict:
    """JSON-ready dict of a request; ``input_ids`` is omitted when absent or not wanted."""
    data = dataclasses.asdict(req)
    if not include_ids or req.input_ids is None:
        data.pop("input_ids")
    return data


def request_from_dict(data: dict, index: int) -> TraceRequest:
    """A request from a JSONL record; only ``arrival_s``, ``prompt_len``, ``output_len`` needed."""
    priority = str(data.get("priority", "normal"))
    if priority not in PRIORITIES:
        raise ValueError(f"request {index}: unknown priority {priority!r}")
    ids = data.get("input_ids")
    req = TraceRequest(
        index=int(data.get("index", index)),
        arrival_s=float(data["arrival_s"]),
        prompt_len=int(data["prompt_len"]),
        output_len=int(data["output_len"]),
        priority=priority,
        phase=str(data.get("phase", "replay")),
        input_ids=[int(x) for x in ids] if ids is not None else None,
    )
    if req.input_ids is not None and len(req.input_ids) != req.prompt_len:
        raise ValueError(
            f"request {index}: {len(req.input_ids)} ids but prompt_len {req.prompt_len}"
        )
    return req


def save_trace(trace: Iterable[TraceRequest], path: str | Path, include_ids: bool = True) -> None:
    """Write one JSON object per request."""
    with open(path, "w", encoding="utf-8") as f:
        for req in trace:
            f.write(json.dumps(request_to_dict(req, include_ids), separators=(",", ":")) + "\n")


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSONL trace (ours, or any file with the three required keys), sorted by arrival."""
    trace: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                trace.append(request_from_dict(json.loads(line), len(trace)))
    trace.sort(key=lambda r: r.arrival_s)
    return trace
