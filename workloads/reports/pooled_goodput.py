"""#21's goodput targets over a directory of comparison rounds, every round pooled.

One round of ``workloads.compare`` runs each system once; on the demo model's cpu-burst
two servers of one layout differ up to 2x in goodput from one run to the next (their
bursts sit at the TPOT SLO, where a few ms move half the requests across it:
docs/BENCHMARKS.md, #21 session 62), so one round's ratio, or the median of a few,
says as much about the servers as about the policy. Here each system's rounds are
pooled: its goodput is every round's requests within SLO over the sum of the rounds'
spans (and its throughput, every output token over the same), and Flying's ratio to
the better static layout gets an interval from resampling *rounds* (the same round
indices for every system: a round's runs are minutes apart) with replacement, the
better static layout chosen again in each resample.

The SLOs are one pair for every round: given, or derived as ``workloads.targets`` does
(4x static TP's quiet TTFT p50, 1.5x its quiet TPOT p50) from static TP's quiet
requests of all rounds together; a round's own SLOs would move with its server.

As in ``workloads.reports.pooled``, the interval takes rounds as independent; the
machine's slow spells last minutes, so it is narrower than the truth.

    python -m workloads.reports.pooled_goodput OUT [--quiet low] [--slo-ttft MS] [--slo-tpot MS]
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from workloads.measure.records import RequestRecord, load_records
from workloads.reports.slo_stats import (
    RUNS,
    output_tokens,
    quiet_slos,
    round_dirs,
    span,
    within_slo,
)


@dataclass(frozen=True)
class Tally:
    """One system's run of one round: requests within SLO, output tokens, span (s)."""

    good: int
    tokens: int
    span_s: float


def pooled_slos(rounds: Sequence[dict[str, list[RequestRecord]]],
                quiet: str | None) -> tuple[float, float]:
    """(TTFT, TPOT) SLOs in ms from static TP's quiet requests of every round."""
    return quiet_slos([r for rnd in rounds for r in rnd["static-tp"]], quiet)


def tallies(rounds: Sequence[dict[str, list[RequestRecord]]],
            slos: tuple[float, float]) -> list[dict[str, Tally]]:
    """Each round's ``Tally`` per system; a round lacking a system's run is dropped."""
    out = []
    for rnd in rounds:
        spans = {name: span(rnd.get(name) or []) for name in RUNS}
        if not all(spans.values()):
            continue
        out.append({name: Tally(within_slo(rnd[name], *slos), output_tokens(rnd[name]),
                                float(spans[name])) for name in RUNS})  # type: ignore[arg-type]
    return out


def figures(rounds: Sequence[dict[str, Tally]], picks: Sequence[int]) -> dict[str, tuple]:
    """Per figure (goodput req/s, throughput tok/s): (static DP, static TP, Flying,
    Flying / the better static) pooled over the rounds ``picks`` (repeats allowed)."""
    out = {}
    for label, pick in (("goodput", lambda t: t.good), ("throughput", lambda t: t.tokens)):
        rates = [sum(pick(rounds[i][n]) for i in picks) / sum(rounds[i][n].span_s for i in picks)
                 for n in RUNS]
        best = max(rates[:2])
        out[label] = (*rates, rates[2] / best if best > 0 else float("nan"))
    return out


def compare(rounds: Sequence[dict[str, Tally]], draws: int = 2000, seed: int = 0,
            level: float = 0.90) -> list[tuple]:
    """Per figure: (label, DP, TP, Flying, ratio, low, high): the ratio's ``level``
    interval from ``draws`` resamples of the rounds."""
    n = len(rounds)
    if n == 0:
        return []
    whole = figures(rounds, range(n))
    rng = np.random.default_rng(seed)
    drawn: dict[str, list[float]] = {label: [] for label in whole}
    for _ in range(draws):
        picks = rng.integers(0, n, n).tolist()
        for label, row in figures(rounds, picks).items():
            drawn[label].append(row[3])
    tail = (1.0 - level) / 2 * 100
    rows = []
    for label, row in whole.items():
        low, high = np.nanpercentile(drawn[label], [tail, 100 - tail])
        rows.append((label, *row, float(low), float(high)))
    return rows


def table(rows: list[tuple], rounds: int, slos: tuple[float, float],
          level: float = 0.90) -> str:
    lines = [f"Every request of {rounds} rounds pooled per system (TTFT <= {slos[0]:.0f} ms, "
             f"TPOT <= {slos[1]:.1f} ms for all); the interval resamples rounds, "
             f"{level:.0%}:", "",
             "| figure | static DP | static TP | Flying | Flying / better static | "
             "interval | goal |", "|---|---:|---:|---:|---:|---:|---|"]
    goals = {"goodput": ">= 1.0", "throughput": ">= 0.98"}
    units = {"goodput": "req/s", "throughput": "tok/s"}
    for label, dp, tp, fl, ratio, low, high in rows:
        lines.append(f"| {label} ({units[label]}) | {dp:.2f} | {tp:.2f} | {fl:.2f} | "
                     f"{ratio:.2f} | {low:.2f}-{high:.2f} | {goals[label]} |")
    return "\n".join(lines)


def report(out: Path, quiet: str | None = "low",
           slos: tuple[float | None, float | None] = (None, None)) -> str:
    """The pooled table of ``out``'s rounds; empty without two rounds of every system."""
    rounds = [{name: load_records(d / name / "records.jsonl") for name in RUNS
               if (d / name / "records.jsonl").is_file()} for d in round_dirs(out)]
    rounds = [r for r in rounds if len(r) == len(RUNS)]
    if len(rounds) < 2:
        return ""
    derived = pooled_slos(rounds, quiet)
    fixed = (slos[0] or derived[0], slos[1] or derived[1])
    counted = tallies(rounds, fixed)
    return table(compare(counted), len(counted), fixed) if counted else ""


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="a workloads.compare --rounds N output directory")
    p.add_argument("--quiet", default="low", help="phase name of the quiet periods")
    p.add_argument("--slo-ttft", type=float, help="TTFT SLO in ms (default: derived)")
    p.add_argument("--slo-tpot", type=float, help="TPOT SLO in ms (default: derived)")
    args = p.parse_args(argv)
    text = report(args.out, args.quiet, (args.slo_ttft, args.slo_tpot))
    if not text:
        raise SystemExit(f"no two complete rounds in {args.out}")
    print(text)


if __name__ == "__main__":
    main()
