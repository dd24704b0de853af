"""``python -m workloads.simulate``: one trace, one node, several policies, simulated.

    python -m workloads.simulate --preset cpu-burst --profile cpu-demo --engines 2 \\
        --policies static-dp,static-tp,adaptive [--goodput ttft:100 tpot:20] --out DIR
    python -m workloads.simulate --preset paper --profile h200-llama3-8b --engines 8 \\
        --policies static-dp,static-tp2,static-tp4,static-tp8,adaptive
    python -m workloads.simulate --profile-from-log decisions.jsonl --preset cpu-burst
    python -m workloads.simulate --profile-from-log RUN/flying/decisions.jsonl \\
        --steps-from-records RUN/flying/records.jsonl --preset cpu-three-peak
    python -m workloads.simulate --preset paper --profile h100-llama3-8b \\
        --arrival poisson --rates 10,20,40,80        # goodput against rate

Every trace option of the other tools works (``workloads.load.cli``), and every Flying flag
(``--flying-move-to-dp``, ``--flying-slo-ttft``, ...: ``flying.node.config``) applies
to every policy. Prints a side-by-side table per policy, and per phase where the trace
has phases; with ``--out``, writes per policy the records (``records.jsonl``, the
client's format), the summary, the decision log (``decisions.jsonl``, replayable by
``python -m scheduler.replay``) and the layout over time, plus ``report.md`` and
``simulated.png``. Every output says it is simulated.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from flying.node.config import ConfigError, FlyingConfig, add_cli_args, from_cli_args
from workloads.load.cli import (
    add_goodput_args,
    add_trace_args,
    positive_int,
    slos_from_args,
    trace_from_args,
)
from workloads.measure.metrics import Summary, flatten, summarize
from workloads.measure.records import load_records, save_records
from workloads.sim import profile as profiles
from workloads.sim.record_costs import costs_from_records
from workloads.sim.run import SimResult, degrees_of, policy_settings, simulate

DEFAULT_POLICIES = "static-dp,static-tp,adaptive"


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workloads.simulate",
                                     description=__doc__.splitlines()[0])
    add_trace_args(parser, default_preset="cpu-burst")
    add_goodput_args(parser)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--profile", help=f"a profile file, or one of: {', '.join(profiles.shipped())}")
    where.add_argument("--profile-from-log", metavar="JSONL",
                       help="build the profile from a node's --flying-decision-log")
    where.add_argument("--profile-from-status", metavar="JSON",
                       help="build the profile from a saved /flying/status document")
    parser.add_argument("--kv-heads", type=int, default=0,
                        help="the model's KV heads (a status document does not say)")
    parser.add_argument("--kv-tokens", type=int, help="KV tokens per engine (a decision log "
                        "says the pool; one written before the controller knew it says "
                        "min(context, KV pool): give the pool where it is larger)")
    parser.add_argument("--frontend-ms", type=float, help="per-request latency outside "
                        "the engines, added to every TTFT and E2E (default: the profile's)")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, help="SGLang's "
                        "overlap loop holds a step's tokens to the next step's end "
                        "(default: the profile's; off on the GPU profiles)")
    parser.add_argument("--steps-from-records", metavar="JSONL", help="a run's client "
                        "records (workloads.client): the steps its server ran replace the "
                        "profile's (workloads.sim.record_costs; with --save-profile, a "
                        "profile of that server)")
    parser.add_argument("--save-profile", metavar="JSON", help="write the profile used here")
    parser.add_argument("--engines", type=positive_int,
                        help="engines (default: the profile's node)")
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help="comma list: static-dp, static-tp, static-tpM, adaptive, manual")
    parser.add_argument("--rates", type=rate_list, help="comma list of req/s: re-time the trace at each "
                        "(--arrival, default poisson) and print goodput against rate")
    parser.add_argument("--out", help="directory for records, summaries, logs, report, plot")
    parser.add_argument("--no-plot", action="store_true")
    add_cli_args(parser)
    for action in parser._actions:  # Flying's help texts hold a literal "%" (tp_gain)
        if action.dest.startswith("flying_") and action.help:
            action.help = action.help.replace("%", "%%")
    return parser.parse_args(argv)


def rate_list(text: str) -> list[float]:
    """An argparse type: a comma list of rates above 0 (req/s)."""
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        rates = []
    if not rates or not all(r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"expected a comma list of req/s above 0, got {text!r}")
    return rates


def load_profile(args: argparse.Namespace) -> profiles.Profile:
    try:
        return _load_profile(args)
    except FileNotFoundError as err:  # a profile name or file that is not there
        raise SystemExit(f"workloads.simulate: error: {err}") from None


def _load_profile(args: argparse.Namespace) -> profiles.Profile:
    if args.profile_from_log:
        profile = profiles.from_decision_log(args.profile_from_log)
    elif args.profile_from_status:
        profile = profiles.from_status(args.profile_from_status, kv_heads=args.kv_heads)
    else:
        profile = profiles.load(args.profile or "cpu-demo")
    if args.frontend_ms is not None:
        profile = replace(profile, frontend_ms=args.frontend_ms)
    if args.overlap is not None:
        profile = replace(profile, overlap=args.overlap)
    if args.kv_tokens:
        profile = replace(profile, kv_tokens=args.kv_tokens)
    if args.steps_from_records:
        records = load_records(args.steps_from_records)
        engines = args.engines or profile.max_engines
        costs, said = costs_from_records(records, engines, profile.costs, profile.frontend_ms,
                                         profile.overlap)
        profile = replace(profile, costs=costs, source=f"{profile.source}; steps from "
                          f"{Path(args.steps_from_records).name} ({said})")
    return profile


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def row(stats: Summary) -> list[str]:
    """TTFT p50/p90, TPOT p50, ITL p99, goodput and SLO attainment of one group."""
    f = flatten(stats)
    att = f.get("goodput.slo_attainment")
    return [_f(f.get("ttft_ms.p50")), _f(f.get("ttft_ms.p90")), _f(f.get("tpot_ms.p50"), 2),
            _f(f.get("itl_ms.p99"), 2), _f(f.get("goodput.request_goodput"), 2),
            _f(None if att is None else 100 * att)]


def table(results: Sequence[SimResult], summaries: Sequence[Summary]) -> str:
    """The side-by-side markdown table (and one per phase where there are phases)."""
    base = flatten(summaries[0]).get("throughput.output_throughput") if summaries else None
    head = ["policy", "TTFT p50", "TTFT p90", "TPOT p50", "ITL p99", "goodput req/s",
            "SLO att. %", "output tok/s", f"vs {results[0].policy}", "sessions", "moves",
            "done/n"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res, s in zip(results, summaries, strict=True):
        tok = flatten(s).get("throughput.output_throughput")
        ratio = _f(tok / base, 3) if tok and base else "-"
        c, o = res.counters, s["overall"]
        lines.append("| " + " | ".join([res.policy, *row(o), _f(tok), ratio,
                                         str(c["sessions"]), str(c["moves"]),
                                         f"{o['completed']}/{o['count']}"]) + " |")
    phases = sorted({p for s in summaries for p in s.get("by_phase", {})})
    if len(phases) > 1:
        lines += ["", "| policy | phase | TTFT p50 | TTFT p90 | TPOT p50 | ITL p99 | "
                      "goodput req/s | SLO att. % |", "|" + "---|" * 8]
        for res, s in zip(results, summaries, strict=True):
            for phase in phases:
                stats = s["by_phase"].get(phase)
                if stats:
                    lines.append("| " + " | ".join([res.policy, phase, *row(stats)]) + " |")
    return "\n".join(lines)


def describe(profile: profiles.Profile, engines: int, slos: dict[str, float]) -> str:
    return (f"SIMULATED (workloads.simulate), not measured: profile `{profile.name}` "
            f"({profile.kind}: {profile.source}), {engines} engines, KV "
            f"{profile.kv_tokens} tokens/engine, overlap loop "
            f"{'on' if profile.overlap else 'off'}, frontend {profile.frontend_ms:g} ms; "
            "goodput SLOs "
            + ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items()))


def write(out: Path, results: Sequence[SimResult], summaries: Sequence[Summary],
          report: str, plot_title: str | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for res, s in zip(results, summaries, strict=True):
        run = out / res.policy
        run.mkdir(exist_ok=True)
        save_records(res.records, run / "records.jsonl")
        (run / "summary.json").write_text(json.dumps({"simulated": True, **s}, indent=1) + "\n")
        (run / "decisions.jsonl").write_text("".join(line + "\n" for line in res.decisions))
        (run / "layout.json").write_text(json.dumps(
            {"simulated": True, "degrees": list(res.degrees), "counters": res.counters,
             "layout": [[round(t, 6), ds] for t, ds in res.layout]}) + "\n")
    (out / "report.md").write_text(report + "\n")
    if plot_title is not None:
        from workloads.sim.plots import plot

        plot(results, out / "simulated.png", plot_title)


def _check_policies(policies: Sequence[str], base: FlyingConfig, profile: profiles.Profile,
                    engines: int) -> None:
    """A bad ``--policies`` name is a one-line usage error before anything runs (it was
    a traceback after the first policy's minutes of simulation)."""
    if not policies:
        raise SystemExit("workloads.simulate: error: --policies names no policy")
    for name in policies:
        try:
            degrees_of(policy_settings(name, base), profile, engines)
        except ConfigError as err:
            raise SystemExit(f"workloads.simulate: error: --policies {name!r}: {err} "
                             "(or static-tpM for a static layout of TP-M groups)") from None
        except ValueError as err:
            raise SystemExit(f"workloads.simulate: error: --policies {name!r}: {err}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    base = from_cli_args(args)
    profile = load_profile(args)
    if args.save_profile:
        profile.save(args.save_profile)
    engines = args.engines or profile.max_engines
    slos = slos_from_args(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    _check_policies(policies, base, profile, engines)
    if args.rates:
        from workloads.sim.sweep import sweep

        print(sweep(args, profile, engines, base, policies, slos))
        return 0
    trace, source = trace_from_args(args)
    results, summaries = [], []
    for name in policies:
        res = simulate(trace, profile, engines, policy_settings(name, base), name=name)
        results.append(res)
        summaries.append(summarize(res.records, slos=slos))
        print(f"[simulate] {name}: {len(trace)} requests in {res.wall_s:.1f} s "
              f"(degrees {list(res.degrees) or 'none'})", file=sys.stderr)
    command = shlex.join(["python", "-m", "workloads.simulate",
                          *(sys.argv[1:] if argv is None else argv)])
    report = "\n\n".join([f"# {describe(profile, engines, slos)}",
                          f"`{command}`",
                          f"Trace: {source}", table(results, summaries),
                          "Profile assumptions: " + "; ".join(profile.assumptions or ("none",))])
    print(report)
    if args.out:
        title = f"{profile.name}, {engines} engines, {source.split(':')[0]}"
        write(Path(args.out), results, summaries, report, None if args.no_plot else title)
    return 0
