"""The run layout of ``workloads.compare``'s output and the statistics every report of
it reads: percentiles of a run's requests, its span, throughput, requests within SLO
(SGLang's goodput definition) and the SLOs derived from a quiet phase.

A comparison directory holds one directory per system (``RUNS``), or, with ``--rounds
N``, ``round1`` .. ``roundN`` each holding them (``round_dirs``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from workloads.measure.records import RequestRecord

RUNS = ("static-dp", "static-tp", "flying")


def pct(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values`` (seconds) in ms; None for none."""
    return float(np.percentile(np.asarray(values), q)) * 1e3 if len(values) else None


def samples(records: list[RequestRecord], pick: Callable[[RequestRecord], bool],
            metric: str) -> list[float]:
    """Seconds of ``metric`` (ttft, tpot, or itl: every gap) over the successful
    requests ``pick`` takes."""
    ok = [r for r in records if r.success and pick(r)]
    if metric == "ttft":
        return [r.ttft_s for r in ok if r.ttft_s is not None]
    if metric == "tpot":
        return [r.tpot_s for r in ok if r.tpot_s is not None]
    if metric == "itl":
        return [g for r in ok for g in r.itl_s]
    raise ValueError(metric)


def stat(records: list[RequestRecord], pick: Callable[[RequestRecord], bool], metric: str,
         q: float) -> float | None:
    """The ``q``-th percentile (ms) of ``metric`` (``samples``; itl_max: the longest
    gap) over the successful requests ``pick`` takes."""
    if metric == "itl_max":
        gaps = samples(records, pick, "itl")
        return max(gaps) * 1e3 if gaps else None
    return pct(samples(records, pick, metric), q)


def span(records: list[RequestRecord]) -> float | None:
    """Seconds from the first request sent to the last one ended; None without any."""
    spans = [(r.send_s, r.end_s) for r in records if r.send_s is not None and r.end_s is not None]
    if not spans:
        return None
    return max(e for _, e in spans) - min(s for s, _ in spans)


def output_tokens(records: list[RequestRecord]) -> int:
    """Output tokens of the requests that succeeded."""
    return sum(r.output_tokens for r in records if r.success)


def within_slo(records: list[RequestRecord], ttft_ms: float, tpot_ms: float) -> int:
    """Requests that finished within both SLOs (SGLang's goodput definition)."""
    return sum(
        1 for r in records if r.success and r.ttft_s is not None
        and r.ttft_s * 1e3 <= ttft_ms and (r.tpot_s is None or r.tpot_s * 1e3 <= tpot_ms)
    )


def throughput(records: list[RequestRecord]) -> float | None:
    """Output tokens per second over the run's span."""
    s = span(records)
    return output_tokens(records) / s if s else None


def quiet_slos(records: list[RequestRecord], quiet: str | None) -> tuple[float, float]:
    """(TTFT, TPOT) SLOs in ms: 4x and 1.5x the p50 of ``records``' quiet phase (None:
    of every record, for a trace without phases)."""
    def pick(r: RequestRecord) -> bool:
        return quiet is None or r.phase == quiet

    ttft = stat(records, pick, "ttft", 50)
    tpot = stat(records, pick, "tpot", 50)
    return 4.0 * (ttft or 0.0), 1.5 * (tpot or 0.0)


def goodput(records: list[RequestRecord], ttft_ms: float, tpot_ms: float) -> float | None:
    """Requests per second that finished within both SLOs, over the run's span."""
    s = span(records)
    return within_slo(records, ttft_ms, tpot_ms) / s if s else None


def round_dirs(out: Path) -> list[Path]:
    """``out``'s round directories (``workloads.compare --rounds``) in order; [] for a
    single comparison."""
    rounds = [p for p in out.glob("round*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(rounds, key=lambda p: int(p.name[5:]))


def complete(out: Path) -> bool:
    """Whether every system of ``RUNS`` has its records in ``out`` (a round still
    running, or one whose run failed, has not)."""
    return all((out / name / "records.jsonl").is_file() for name in RUNS)


def complete_only(dirs: Sequence[Path]) -> list[Path]:
    """The ones of ``dirs`` that are ``complete``; each other one is named on stderr."""
    done = [d for d in dirs if complete(d)]
    for d in dirs:
        if d not in done:
            print(f"{d}: not every system's records are there yet (a run still going, or "
                  "one that failed): left out", file=sys.stderr)
    return done
