"""#21's targets over a directory of comparison rounds, every round's requests pooled.

One round of ``workloads.compare`` runs each system once; on the demo model's cpu-burst
two servers of one layout differ up to 2x in goodput from one run to the next (their
bursts sit at the TPOT SLO, where a few ms move half the requests across it:
docs/BENCHMARKS.md, #21 session 62), so one round's ratio, or the median of a few,
says as much about the servers as about the policy. Here each system's rounds are
pooled:

- goodput: every round's requests within SLO over the sum of the rounds' spans, and
  throughput: every output token over the same; Flying against the better static
  layout;
- the latency targets of ``workloads.targets`` (burst TTFT p90 and ITL p99 against
  static DP, the quiet phase's TTFT and TPOT p50 against the better static layout): a
  percentile of every round's requests (or gaps) together.

Each ratio gets an interval from resampling *rounds* (the same round indices for every
system: a round's runs are minutes apart) with replacement, the better static layout
chosen again in each resample.

The SLOs are one pair for every round: given, or derived as ``workloads.targets`` does
(4x static TP's quiet TTFT p50, 1.5x its quiet TPOT p50) from static TP's quiet
requests of all rounds together; a round's own SLOs would move with its server.

As in ``workloads.reports.pooled``, the interval takes rounds as independent; the
machine's slow spells last minutes, so it is narrower than the truth.

    python -m workloads.reports.pooled_targets OUT [--burst burst] [--quiet low] \\
        [--slo-ttft MS] [--slo-tpot MS]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from workloads.measure.records import RequestRecord, load_records
from workloads.reports.pooled import intervals
from workloads.reports.slo_stats import (
    RUNS,
    complete,
    output_tokens,
    quiet_slos,
    round_dirs,
    samples,
    span,
    within_slo,
)

#: (label, sample, percentile, against, sign, goal); a sample is named by its phase
#: key ("burst" / "quiet" / "all") and metric; against "dp" (static DP) or "best"
#: (the better static layout: the higher rate, the lower latency).
FIGURES = (
    ("goodput (req/s)", "good", 0, "best", ">=", 1.0),
    ("throughput (tok/s)", "tokens", 0, "best", ">=", 0.98),
    ("TTFT p90, burst (ms)", "burst ttft", 90, "dp", "<=", 1.10),
    ("TTFT p50, quiet (ms)", "quiet ttft", 50, "best", "<=", 1.05),
    ("TPOT p50, quiet (ms)", "quiet tpot", 50, "best", "<=", 1.05),
    ("ITL p99 (ms)", "all itl", 99, "dp", "<=", 1.5),
)


@dataclass(frozen=True)
class Run:
    """One system's run of one round: requests within SLO, output tokens, span (s), and
    its latency samples in seconds (``FIGURES``' sample names)."""

    good: int
    tokens: int
    span_s: float
    samples: dict[str, np.ndarray]


def pooled_slos(rounds: Sequence[dict[str, list[RequestRecord]]],
                quiet: str | None) -> tuple[float, float]:
    """(TTFT, TPOT) SLOs in ms from static TP's quiet requests of every round."""
    return quiet_slos([r for rnd in rounds for r in rnd["static-tp"]], quiet)


def _samples(records: list[RequestRecord], burst: str, quiet: str) -> dict[str, np.ndarray]:
    phases: dict[str, Callable[[RequestRecord], bool]] = {
        "burst": lambda r: r.phase == burst, "quiet": lambda r: r.phase == quiet,
        "all": lambda r: True}
    names = [sample for _, sample, *_ in FIGURES if " " in sample]  # "phase metric"
    return {name: np.array(samples(records, phases[name.split()[0]], name.split()[1]))
            for name in names}


def runs(rounds: Sequence[dict[str, list[RequestRecord]]], slos: tuple[float, float],
         burst: str = "burst", quiet: str = "low") -> list[dict[str, Run]]:
    """Each round's ``Run`` per system; a round lacking a system's run is dropped."""
    out = []
    for rnd in rounds:
        spans = {name: span(rnd.get(name) or []) for name in RUNS}
        if not all(spans.values()):
            continue
        out.append({name: Run(within_slo(rnd[name], *slos), output_tokens(rnd[name]),
                              float(spans[name]),  # type: ignore[arg-type]
                              _samples(rnd[name], burst, quiet)) for name in RUNS})
    return out


def _value(rounds: Sequence[dict[str, Run]], picks: Sequence[int], name: str,
           sample: str, q: float) -> float:
    """One system's pooled figure over the rounds ``picks``: a rate for goodput and
    throughput, else a percentile in ms (nan without a sample)."""
    mine = [rounds[i][name] for i in picks]
    if sample in ("good", "tokens"):
        return sum(getattr(r, sample) for r in mine) / sum(r.span_s for r in mine)
    pooled = np.concatenate([r.samples[sample] for r in mine])
    return float(np.percentile(pooled, q)) * 1e3 if pooled.size else float("nan")


def figures(rounds: Sequence[dict[str, Run]], picks: Sequence[int]) -> dict[str, tuple]:
    """Per figure of ``FIGURES``: (static DP, static TP, Flying, Flying's ratio) pooled
    over the rounds ``picks`` (repeats allowed)."""
    out = {}
    for label, sample, q, against, sign, _goal in FIGURES:
        dp, tp, fl = (_value(rounds, picks, name, sample, q) for name in RUNS)
        base = dp if against == "dp" else (max(dp, tp) if sign == ">=" else min(dp, tp))
        out[label] = (dp, tp, fl, fl / base if base > 0 else float("nan"))
    return out


def compare(rounds: Sequence[dict[str, Run]], draws: int = 2000, seed: int = 0,
            level: float = 0.90) -> list[tuple]:
    """Per figure: (label, DP, TP, Flying, ratio, low, high): the ratio's ``level``
    interval from ``draws`` resamples of the rounds (``pooled.intervals``)."""
    n = len(rounds)
    if n == 0:
        return []
    whole = figures(rounds, range(n))
    bands = intervals(n, lambda picks: {label: row[3] for label, row in
                                        figures(rounds, picks).items()}, draws, seed, level)
    return [(label, *row, *bands[label]) for label, row in whole.items()]


def table(rows: list[tuple], rounds: int, slos: tuple[float, float],
          level: float = 0.90) -> str:
    lines = [f"Every request of {rounds} rounds pooled per system (goodput: TTFT <= "
             f"{slos[0]:.0f} ms, TPOT <= {slos[1]:.1f} ms for all); the interval "
             f"resamples rounds, {level:.0%}:", "",
             "| figure | static DP | static TP | Flying | Flying ratio | interval | goal |",
             "|---|---:|---:|---:|---:|---:|---|"]
    goals = {label: (sign, goal, against) for label, _s, _q, against, sign, goal in FIGURES}
    for label, dp, tp, fl, ratio, low, high in rows:
        if np.isnan(fl):  # a phase the trace does not have
            continue
        sign, goal, against = goals[label]
        versus = "static DP" if against == "dp" else "better static"
        lines.append(f"| {label} | {dp:.2f} | {tp:.2f} | {fl:.2f} | {ratio:.2f} | "
                     f"{low:.2f}-{high:.2f} | {sign} {goal:g}x {versus} |")
    return "\n".join(lines)


def report(out: Path, burst: str = "burst", quiet: str = "low",
           slos: tuple[float | None, float | None] = (None, None)) -> str:
    """The pooled table of ``out``'s rounds; empty without two rounds of every system."""
    rounds = [{name: load_records(d / name / "records.jsonl") for name in RUNS}
              for d in round_dirs(out) if complete(d)]
    if len(rounds) < 2:
        return ""
    phased = any(r.phase == quiet for rnd in rounds for r in rnd["static-tp"])
    derived = pooled_slos(rounds, quiet if phased else None)  # no such phase: every request
    fixed = (slos[0] or derived[0], slos[1] or derived[1])
    counted = runs(rounds, fixed, burst, quiet)
    return table(compare(counted), len(counted), fixed) if counted else ""


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="a workloads.compare --rounds N output directory")
    p.add_argument("--burst", default="burst", help="phase name of the bursts")
    p.add_argument("--quiet", default="low", help="phase name of the quiet periods")
    p.add_argument("--slo-ttft", type=float, help="TTFT SLO in ms (default: derived)")
    p.add_argument("--slo-tpot", type=float, help="TPOT SLO in ms (default: derived)")
    args = p.parse_args(argv)
    text = report(args.out, args.burst, args.quiet, (args.slo_ttft, args.slo_tpot))
    if not text:
        raise SystemExit(f"no two complete rounds in {args.out}")
    print(text)


if __name__ == "__main__":
    main()
