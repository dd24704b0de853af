"""Goodput against rate over several comparison runs, and the policy's predicted goodput
against the measured one.

Input: ``workloads.compare`` output directories of one trace re-timed at different
rates (``--arrival poisson --rate R``), each with static DP, static TP and Flying, and
Flying's decision log at ``<dir>/flying/decisions.jsonl``. Output: one table row per
rate (goodput req/s of each system and Flying's ratio to the better static layout,
TTFT p90, TPOT p50, throughput), a plot of goodput against rate, and a second table of
the model's error: for Flying's run, the goodput the policy predicted for the layout it
chose (mean over its placement decisions) against the goodput measured under the same
SLOs (the node's own, from the log).

One set of SLOs for the whole sweep (goodput is comparable across rates only so): 4x
static TP's TTFT p50 and 1.5x its TPOT p50 at the lowest rate, unless given.

    python -m workloads.rate_sweep DIR [DIR ...] [--slo-ttft MS --slo-tpot MS] [--plot PNG]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from workloads.measure.records import RequestRecord, load_records
from workloads.reports.slo_stats import (
    RUNS,
    complete_only,
    goodput,
    quiet_slos,
    stat,
    throughput,
)
from workloads.reports.targets import _fmt


def offered_rate(records: list[RequestRecord]) -> float:
    """Requests per second the trace offered (arrivals over their span)."""
    arrivals = sorted(r.arrival_s for r in records)
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else 0.0
    return (len(arrivals) - 1) / span if span > 0 else 0.0


def predicted_vs_measured(out: Path, records: list[RequestRecord]) -> dict | None:
    """The chosen layout's predicted goodput (mean over placements) and the measured
    goodput under the node's last SLOs, for Flying's run in ``out``; None without a
    decision log."""
    path = out / "flying" / "decisions.jsonl"
    if not path.exists():
        return None
    predicted, loaded, logged_loaded, slo = [], [], False, None
    for line in path.read_text().splitlines()[1:]:
        ev = json.loads(line)
        preds, decision = ev.get("predictions"), ev.get("decision")
        if not preds or not decision:
            continue
        # the layout the request was placed in: its degree's (layout names: "2xDP",
        # "1xTP2", "1xTP2+2xDP"; a mixed layout on 4+ engines counts for both)
        tag = f"TP{decision.get('degree', 1)}" if decision.get("mode") == "tp" else None
        fits = [n for n in preds if (tag in n if tag else "TP" not in n or "DP" in n)]
        if fits:
            predicted.append(max(preds[n]["goodput"] for n in fits))
            # at the costs the steps ran at (absent: nothing stretched, the same)
            loaded.append(max(preds[n].get("loaded", preds[n])["goodput"] for n in fits))
            logged_loaded |= any("loaded" in preds[n] for n in fits)
        slo = ev.get("slo") or slo
    if not predicted or not slo:
        return None
    measured = goodput(records, slo["ttft_ms"], slo["tpot_ms"]) or 0.0
    mean = sum(predicted) / len(predicted)
    out = {"slo": slo, "predicted": mean, "measured": measured,
           "error": (mean - measured) / measured if measured else None,
           "loaded": None, "loaded_error": None}
    if logged_loaded:  # logs from before the policy recorded it have none
        out["loaded"] = sum(loaded) / len(loaded)
        out["loaded_error"] = (out["loaded"] - measured) / measured if measured else None
    return out


def sweep(dirs: Sequence[Path], slos: tuple[float, float] | None) -> tuple[list[dict], tuple]:
    runs = []
    for out in dirs:
        records = {r: load_records(out / r / "records.jsonl") for r in RUNS}
        runs.append({"dir": out, "rate": offered_rate(records["static-dp"]), "records": records})
    runs.sort(key=lambda run: run["rate"])
    if slos is None:
        slos = quiet_slos(runs[0]["records"]["static-tp"], None)
    for run in runs:
        recs = run["records"]
        run["goodput"] = {r: goodput(recs[r], *slos) or 0.0 for r in RUNS}
        run["ttft_p90"] = {r: stat(recs[r], lambda x: True, "ttft", 90) for r in RUNS}
        run["tpot_p50"] = {r: stat(recs[r], lambda x: True, "tpot", 50) for r in RUNS}
        run["tok_s"] = {r: throughput(recs[r]) for r in RUNS}
        run["model"] = predicted_vs_measured(run["dir"], recs["flying"])
    return runs, slos


def _trio(run: dict, key: str) -> str:
    return " / ".join(_fmt(run[key][r]) for r in RUNS)


def render(runs: list[dict], slos: tuple[float, float]) -> str:
    out = [f"Goodput SLOs: TTFT <= {slos[0]:.0f} ms, TPOT <= {slos[1]:.1f} ms", "",
           "| rate (req/s) | goodput DP | TP | Flying | Flying / better static "
           "| TTFT p90 DP / TP / Flying (ms) | TPOT p50 DP / TP / Flying (ms) "
           "| tok/s DP / TP / Flying |", "|---:|---:|---:|---:|---:|---|---|---|"]
    for run in runs:
        g = run["goodput"]
        best = max(g["static-dp"], g["static-tp"])
        ratio = g["flying"] / best if best else None
        out.append(f"| {run['rate']:.2f} | {g['static-dp']:.2f} | {g['static-tp']:.2f} "
                   f"| {g['flying']:.2f} | {_fmt(ratio, 2)} | {_trio(run, 'ttft_p90')} "
                   f"| {_trio(run, 'tpot_p50')} | {_trio(run, 'tok_s')} |")
    out += ["", "The policy's prediction (Flying's run, the node's own SLOs):", "",
            "| rate (req/s) | node SLOs (TTFT / TPOT ms) | predicted goodput | error "
            "| at the steps' running costs | error | measured |",
            "|---:|---|---:|---:|---:|---:|---:|"]
    for run in runs:
        m = run["model"]
        if m is None:
            continue
        out.append(f"| {run['rate']:.2f} | {m['slo']['ttft_ms']:.0f} / {m['slo']['tpot_ms']:.1f} "
                   f"| {m['predicted']:.2f} | {_pct(m['error'])} | {_fmt(m['loaded'], 2)} "
                   f"| {_pct(m['loaded_error'])} | {m['measured']:.2f} |")
    out += ["", "Predicted goodput: the model at each mode's quiet step costs (its best); at "
            "the steps' running costs: the same model with each mode's steps stretched as "
            "they ran when it last served (`Costs.lately`; \"-\" there: a log from before "
            "the policy recorded it). An error is \"-\" where nothing was measured "
            "within the SLOs."]
    return "\n".join(out)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.0f} %"


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    rates = [run["rate"] for run in runs]
    for name, style in zip(RUNS, ("o-", "s--", "^-"), strict=True):
        ax.plot(rates, [run["goodput"][name] for run in runs], style, label=name)
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("goodput (req/s within both SLOs)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", type=Path, nargs="+", help="workloads.compare output directories")
    ap.add_argument("--slo-ttft", type=float, help="TTFT SLO in ms (default: see above)")
    ap.add_argument("--slo-tpot", type=float, help="TPOT SLO in ms (default: see above)")
    ap.add_argument("--plot", type=Path, help="write goodput against rate (PNG) here")
    args = ap.parse_args(argv)
    if (args.slo_ttft is None) != (args.slo_tpot is None):
        ap.error("give both --slo-ttft and --slo-tpot, or neither")
    slos = (args.slo_ttft, args.slo_tpot) if args.slo_ttft is not None else None
    dirs = complete_only(args.dirs)
    if not dirs:
        raise SystemExit("no directory has every system's records yet")
    runs, slos = sweep(dirs, slos)
    print(render(runs, slos))
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
