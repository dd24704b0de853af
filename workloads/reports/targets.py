"""The switching targets, as ratios of one comparison run (static DP, static TP, Flying).

Reads what ``python -m workloads.compare`` wrote (one directory per run, same trace, one
after another on the same machine) and prints, for Flying against the static layouts:

- burst-phase TTFT p90 / static DP (target <= 1.10);
- quiet-phase TTFT p50 and TPOT p50 / the better static layout (target <= 1.05);
- output throughput / static DP (target >= 0.98);
- priority requests' TTFT p90 against both static layouts (target: below both);
- P99 inter-token latency and the longest inter-token gap (the longest pause a running
  request saw) / static DP (target <= 1.5);
- goodput (requests per second within both SLOs, SGLang's definition) against the
  better static layout (target >= 1.0), with the SLOs taken from static TP's quiet
  service in the same run: TTFT <= 4x its quiet TTFT p50, TPOT <= 1.5x its quiet TPOT
  p50 (``--slo-ttft`` / ``--slo-tpot`` set them instead); and output throughput against
  the better static layout (target >= 0.98);
- Flying's switches (binds), DP steps run between group steps, and TP requests.

    python -m workloads.targets results/compare-cpu-burst [--burst burst --quiet low] \\
        [--plot modes.png]

For a directory of rounds (``workloads.compare --rounds N``: ``round1`` .. ``roundN``, each
a whole comparison with its own servers) it prints Flying's ratio per target in every
round, their median, and whether the median and how many rounds meet the goal: on a
small shared machine two servers of one layout differ by 10-30 % from one start to the
next, so one round's ratio says as much about the servers as about the policy. It then
prints the targets with every round's requests pooled (``workloads.reports.
pooled_targets``): one SLO pair for all rounds, an interval from resampling rounds.
"""

from __future__ import annotations

import argparse
import json
import operator
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from workloads.measure.records import RequestRecord, load_records
from workloads.reports import pooled_targets
from workloads.reports.slo_stats import (
    RUNS,
    complete,
    complete_only,
    goodput,
    quiet_slos,
    round_dirs,
    stat,
    throughput,
)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def rows(records: dict[str, list[RequestRecord]], burst: str, quiet: str,
         slos: tuple[float, float] | None = None) -> list[tuple]:
    """(target, static DP, static TP, Flying, ratio, goal, met) per target."""
    out = []
    ttft_slo, tpot_slo = slos or quiet_slos(records["static-tp"], quiet)
    good = [goodput(records[r], ttft_slo, tpot_slo) for r in RUNS]
    best = max((g for g in good[:2] if g is not None), default=None)
    ratio = _ratio(good[2], best)
    out.append((f"goodput (req/s, TTFT <= {ttft_slo:.0f} ms, TPOT <= {tpot_slo:.1f} ms)",
                *good, ratio, 1.0, None if ratio is None else ratio >= 1.0))
    tputs = [throughput(records[r]) for r in RUNS]
    best = max((t for t in tputs[:2] if t is not None), default=None)
    ratio = _ratio(tputs[2], best)
    out.append(("output throughput vs the better static (tok/s)", *tputs, ratio, 0.98,
                None if ratio is None else ratio >= 0.98))

    def add(name, metric, q, pick, goal, against="dp"):
        dp, tp, fl = (stat(records[r], pick, metric, q) for r in RUNS)
        base = {"dp": dp, "best": min(v for v in (dp, tp) if v is not None) if dp or tp else None}[against]
        ratio = _ratio(fl, base)
        out.append((name, dp, tp, fl, ratio, goal, None if ratio is None else ratio <= goal))

    add(f"TTFT p90, phase={burst} (ms)", "ttft", 90, lambda r: r.phase == burst, 1.10)
    add(f"TTFT p50, phase={quiet} (ms)", "ttft", 50, lambda r: r.phase == quiet, 1.05, "best")
    add(f"TPOT p50, phase={quiet} (ms)", "tpot", 50, lambda r: r.phase == quiet, 1.05, "best")
    add("ITL p99 (ms)", "itl", 99, lambda r: True, 1.5)
    add("longest inter-token gap (ms)", "itl_max", 100, lambda r: True, 1.5)
    dp, tp, fl = (throughput(records[r]) for r in RUNS)
    ratio = _ratio(fl, dp)
    out.append(("output throughput (tok/s)", dp, tp, fl, ratio, 0.98,
                None if ratio is None else ratio >= 0.98))
    prio = [stat(records[r], lambda r: r.priority == "high", "ttft", 90) for r in RUNS]
    if prio[2] is not None:
        best = min(v for v in prio[:2] if v is not None)
        out.append(("priority TTFT p90 (ms)", *prio, _ratio(prio[2], best), 1.0, prio[2] < best))
    return out


def render(rows_: list[tuple]) -> str:
    lines = [
        "| target | static DP | static TP | Flying | Flying ratio | goal | met |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for name, dp, tp, fl, ratio, goal, met in rows_:
        sign, against = _goal(name)
        lines.append(
            f"| {name} | {_fmt(dp)} | {_fmt(tp)} | {_fmt(fl)} | {_fmt(ratio, 2)} | "
            f"{sign} {goal:g}x {against} | {'-' if met is None else ('yes' if met else 'no')} |"
        )
    return "\n".join(lines)


def render_rounds(per_round: list[list[tuple]]) -> str:
    """Flying's ratio per target in each round (``rows``), the median, and whether the
    median and each round meet the goal. Targets are matched by name up to their
    parenthesis (the goodput SLOs are each round's own)."""
    goals: dict[str, tuple[float, str, str]] = {}  # key -> (goal, sign, against)
    ratios: dict[str, list[float | None]] = {}
    for i, rows_ in enumerate(per_round):
        for name, _dp, _tp, _fl, ratio, goal, _met in rows_:
            key = name.split(" (")[0]
            goals.setdefault(key, (goal, *_goal(name)))
            ratios.setdefault(key, [None] * len(per_round))[i] = ratio
    n = len(per_round)
    lines = ["| target | " + " | ".join(f"round {i + 1}" for i in range(n))
             + " | median | goal | median met | rounds met |",
             "|---|" + "---:|" * (n + 1) + "---|---|---|"]
    for key, (goal, sign, against) in goals.items():
        values = ratios[key]
        known = [v for v in values if v is not None]
        median = float(np.median(known)) if known else None

        def met(v: float | None, goal: float = goal, sign: str = sign) -> bool:
            return v is not None and _MEETS[sign](v, goal)

        lines.append(
            f"| {key} | " + " | ".join(_fmt(v, 2) for v in values)
            + f" | {_fmt(median, 2)} | {sign} {goal:g}x {against} | "
            f"{'-' if median is None else ('yes' if met(median) else 'no')} | "
            f"{sum(met(v) for v in values)} of {n} |")
    return "\n".join(lines)


#: How a ratio meets its goal, per ``_goal``'s sign.
_MEETS = {">=": operator.ge, "<=": operator.le, "<": operator.lt}


def _goal(name: str) -> tuple[str, str]:
    """(sign, baseline) of a target row: how Flying's ratio must compare with its goal,
    and against what."""
    if name.startswith("priority"):
        return "<", "both static"
    sign = ">=" if "throughput" in name or "goodput" in name else "<="
    if "goodput" in name or "better static" in name:
        return sign, "better static"
    return sign, "best static" if "phase=" in name and "p50" in name else "static DP"


def flying_counters(out: Path) -> str:
    """The Flying run's engine counters, if the comparison saved its final status."""
    path = out / "flying" / "status.json"
    if not path.is_file():
        return ""
    totals = json.loads(path.read_text()).get("totals", {})
    keys = ("binds", "tp_requests", "tp_steps", "dp_steps_in_session", "moved_to_dp", "handed_back",
            "moved_to_tp", "faulted_sessions")
    return ", ".join(f"{k} {totals[k]}" for k in keys if k in totals)


def plot_modes(records: list[RequestRecord], path: Path, bucket_s: float = 1.0) -> None:
    """Flying's placement over time against the arrival rate: requests per second that
    arrived (bars) and, per bucket, how many of them ran in a TP group (line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    span = max(r.arrival_s for r in records) + bucket_s
    n = int(span / bucket_s) + 1
    arrived, grouped = [0] * n, [0] * n
    for r in records:
        b = int(r.arrival_s / bucket_s)
        arrived[b] += 1
        grouped[b] += int((r.flying or {}).get("mode") == "tp")
    xs = [i * bucket_s for i in range(n)]
    fig, ax = plt.subplots(figsize=(9, 3))
    ax.bar(xs, [a / bucket_s for a in arrived], width=bucket_s, align="edge", color="#bbb",
           label="arrivals (req/s)")
    ax.step(xs, [g / bucket_s for g in grouped], where="post", color="C3",
            label="of them in a TP group (req/s)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("req/s")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="a workloads.compare output directory")
    ap.add_argument("--burst", default="burst", help="phase name of the bursts")
    ap.add_argument("--quiet", default="low", help="phase name of the quiet periods")
    ap.add_argument("--plot", type=Path, help="write Flying's modes over time (PNG) here")
    ap.add_argument("--slo-ttft", type=float, help="goodput TTFT SLO in ms (default: 4x "
                    "static TP's quiet TTFT p50)")
    ap.add_argument("--slo-tpot", type=float, help="goodput TPOT SLO in ms (default: 1.5x "
                    "static TP's quiet TPOT p50)")
    args = ap.parse_args(argv)
    rounds = [] if (args.out / "flying").is_dir() else round_dirs(args.out)
    done = complete_only(rounds)
    if rounds and not done:
        raise SystemExit(f"{args.out}: no round has every system's records yet")
    if not rounds and not complete(args.out):
        raise SystemExit(f"{args.out}: not a workloads.compare output with every system's "
                         f"records ({', '.join(RUNS)})")
    rounds = done
    if rounds:
        per_round = [rows(*_inputs(d, args)) for d in rounds]
        print(render_rounds(per_round))
        for d in rounds:
            counters = flying_counters(d)
            print(f"\n{d.name}: Flying engines (summed over engines): {counters or '-'}")
        pooled = pooled_targets.report(args.out, args.burst, args.quiet,
                                       (args.slo_ttft, args.slo_tpot))
        if pooled:
            print(f"\n{pooled}")
        return
    records, burst, quiet, slos = _inputs(args.out, args)
    if args.plot:
        plot_modes(records["flying"], args.plot)
    print(render(rows(records, burst, quiet, slos)))
    counters = flying_counters(args.out)
    if counters:
        print(f"\nFlying engines (summed over engines): {counters}")


def _inputs(out: Path, args: argparse.Namespace
            ) -> tuple[dict[str, list[RequestRecord]], str, str, tuple[float, float] | None]:
    """(records per system, burst phase, quiet phase, SLOs) of one comparison."""
    records = {r: load_records(out / r / "records.jsonl") for r in RUNS}
    slos = None
    if args.slo_ttft or args.slo_tpot:
        derived = quiet_slos(records["static-tp"], args.quiet)
        slos = (args.slo_ttft or derived[0], args.slo_tpot or derived[1])
    return records, args.burst, args.quiet, slos


if __name__ == "__main__":
    main()
