"""Simulated against measured: replay a ``workloads.compare`` run in the simulator.

``python -m workloads.sim.validate RUN_DIR [--decision-log PATH]`` reads what
``workloads.compare`` saved (``context.json``: the engine count and goodput SLOs; per
system ``<system>/records.jsonl``), rebuilds the trace from the records (each carries
its arrival, lengths, priority and phase), builds the measured profile from the Flying
run's decision log (``flying/decisions.jsonl``, or ``--decision-log``: pass
``--flying-args "--flying-decision-log RUN_DIR/flying/decisions.jsonl"`` to compare)
or else from its saved ``flying/status.json``, simulates each system on that trace,
and prints simulated and measured TTFT p50/p90, TPOT p50 and goodput with the
simulation's relative error. Goodput is scored on both sides at ``workloads.targets``'
SLOs (from static TP's quiet service in the run, ``scoring_slos``).

Systems: ``static-dp`` (SGLang's DP, groups off) is simulated as ``static-dp`` without
TP degrees; ``static-tp`` (SGLang's own ``--tp-size N``) as one Flying group of N
(``static-tpN``: Flying's measured group costs stand for SGLang's TP; every step's
tokens held to the next step's end, as SGLang's overlap loop holds them); ``flying`` as
the policy named in the decision log's head line (adaptive by default), with its
settings, its groups' steps overlapped as a node overlaps them (``group_loop_of``: as
before session 50 for a run whose status document predates it). The engines run SGLang's overlap loop (a step's tokens reach the client when
the next step ends, ``--no-overlap`` for a run under ``--disable-overlap-schedule``),
and every TTFT and E2E gets ``--frontend-ms`` (default ``CPU_FRONTEND_MS``, this CPU
machine's measured frontend: not fitted to the runs). The error says how far the simulator's assumptions (docs/SIMULATOR.md) are
from the machine the run measured.

The cost curves are the engines' at the run's end (the saved ``status.json``), which
hold every batch the run measured; ``--curves log`` takes the log's last decision's.

``--stretch logged`` runs the profile at the costs its steps ran at in the Flying run:
each degree's points times the mean of the stretch its decision log recorded (how much
slower the engines' steps ran than their best points, ``Costs.loaded``), where the
default (``none``) runs them at their best, a quiet machine's.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from flying.node.config import FlyingConfig
from scheduler.costs import Costs
from workloads.load.slos import DEFAULT_SLOS
from workloads.load.trace import TraceRequest
from workloads.measure.metrics import Summary, flatten, summarize
from workloads.measure.records import RequestRecord, load_records
from workloads.reports.targets import quiet_slos
from workloads.sim.node import GroupLoop
from workloads.sim.profile import CPU_FRONTEND_MS, Profile, from_decision_log, from_status
from workloads.sim.record_costs import costs_from_records
from workloads.sim.run import policy_settings, simulate

SYSTEMS = ("static-dp", "static-tp", "flying")
#: (label, key in a flattened summary: ``workloads.measure.metrics.flatten``)
METRICS = (
    ("TTFT p50 (ms)", "overall.ttft_ms.p50"),
    ("TTFT p90 (ms)", "overall.ttft_ms.p90"),
    ("TPOT p50 (ms)", "overall.tpot_ms.p50"),
    ("goodput (req/s)", "overall.goodput.request_goodput"),
)


def trace_of(records: Sequence[RequestRecord]) -> list[TraceRequest]:
    """The trace a run replayed, from its records."""
    trace = [TraceRequest(r.index, r.arrival_s, r.prompt_len, r.output_len, r.priority,
                          r.phase or "replay") for r in records]
    return sorted(trace, key=lambda r: r.arrival_s)


def measured_profile(run_dir: Path, decision_log: str | None, kv_heads: int,
                     curves: str = "end") -> Profile:
    """The log's profile (its pool size from the status document where there is one: a
    log written before the controller knew the pool holds ``min(context, KV pool)``),
    else the status document's. With ``curves="end"`` the cost curves are the status
    document's too, saved when the run ended: the log's last decision knows only the
    batches run before the last arrival (h1024 cpu-burst: DP decode measured to batch 5
    there, to 77 at the end; extrapolated, the simulated TPOT p50 was 3x the measured)."""
    log = Path(decision_log) if decision_log else run_dir / "flying" / "decisions.jsonl"
    status = run_dir / "flying" / "status.json"
    if log.is_file():
        profile = from_decision_log(log)
        if status.is_file():
            saved = from_status(status)
            profile = replace(profile, kv_tokens=saved.kv_tokens)
            if curves == "end":
                profile = replace(profile, costs=saved.costs,
                                  source=profile.source + "; curves from the run's end "
                                  "(status.json)")
        return profile
    if status.is_file():
        return from_status(status, kv_heads=kv_heads)
    raise SystemExit(f"error: no decision log ({log}) and no {status}: nothing measured to "
                     "build the profile from")


def group_loop_of(run_dir: Path) -> GroupLoop:
    """How the Flying run's groups met the overlap loop: ``"normal"`` where its saved
    status document predates the ``overlapped_tp_steps`` counter (a node before session
    50 processed each group step's result at once), else ``"flying"`` (``SimNode``)."""
    status = run_dir / "flying" / "status.json"
    if status.is_file():
        totals = json.loads(status.read_text()).get("totals")
        if isinstance(totals, dict) and "overlapped_tp_steps" not in totals:
            return "normal"
    return "flying"


def held_admissions(run_dir: Path) -> bool:
    """Whether the Flying run's groups could hold an arrival (``scheduler.hold``): its
    saved status document has the ``held_admissions`` counter (since session 52)."""
    status = run_dir / "flying" / "status.json"
    if status.is_file():
        totals = json.loads(status.read_text()).get("totals")
        return isinstance(totals, dict) and "held_admissions" in totals
    return True


def system_loop(system: str, flying_loop: GroupLoop) -> GroupLoop:
    """The group loop a measured system's groups ran: SGLang's own TP always overlaps."""
    return "sglang" if system == "static-tp" else flying_loop


def logged_stretch(log: Path) -> dict[int, float]:
    """Per degree, the mean stretch over the log's placement lines that carry one."""
    seen: dict[int, list[float]] = {}
    for line in log.read_text().splitlines():
        ev = json.loads(line) if line.strip() else {}
        for degree, x in ((ev.get("costs") or {}).get("stretch") or {}).items():
            seen.setdefault(int(degree), []).append(float(x))
    return {d: sum(xs) / len(xs) for d, xs in sorted(seen.items())}


def settings(system: str, engines: int, head: dict | None) -> tuple[str, FlyingConfig]:
    """(simulated policy name, Flying settings) standing for a measured system."""
    if system == "static-dp":
        return "static-dp", replace(FlyingConfig(), policy="static-dp", tp_degrees="none")
    if system == "static-tp":
        return f"static-tp{engines}", FlyingConfig()
    config = dict((head or {}).get("config") or {})
    cfg = FlyingConfig(
        policy=config.get("policy", "adaptive"),
        **{k: config[p] for k, p in (("priority_threshold", "priority_threshold"),
                                     ("light_load", "light_load"), ("heavy_load", "heavy_load"),
                                     ("tp_gain", "tp_gain"), ("slo_ttft", "slo_ttft_ms"),
                                     ("slo_tpot", "slo_tpot_ms"), ("phase_s", "phase_s"))
           if p in config},
    )
    return cfg.policy, cfg


def _head(run_dir: Path, decision_log: str | None) -> dict | None:
    log = Path(decision_log) if decision_log else run_dir / "flying" / "decisions.jsonl"
    if not log.is_file():
        return None
    for line in log.read_text().splitlines():
        if line.strip():
            ev = json.loads(line)
            if "kind" not in ev and "config" in ev and "node" in ev:
                return ev
    return None


def scoring_slos(run_dir: Path, context: dict, quiet: str = "low") -> dict[str, float]:
    """The goodput SLOs both sides are scored at: ``workloads.targets``' (4x static TP's
    quiet TTFT p50, 1.5x its quiet TPOT p50, phase ``quiet`` where the trace has it),
    the ones the run's targets were judged by; else the run's own ``goodput_slos_ms``.
    (``workloads.compare`` saves SGLang's benchmark defaults there, which no request on
    this machine meets: a 0 against a 0 validates nothing.)"""
    records_file = run_dir / "static-tp" / "records.jsonl"
    if records_file.is_file():
        records = load_records(records_file)
        phase = quiet if any(r.phase == quiet for r in records) else None
        ttft, tpot = quiet_slos(records, phase)
        if ttft > 0 and tpot > 0:
            return {"ttft": round(ttft, 1), "tpot": round(tpot, 1)}
    return dict(context.get("goodput_slos_ms") or DEFAULT_SLOS)


def errors(simulated: Summary, measured: Summary) -> list[tuple[str, float | None, float | None, float | None]]:
    """(metric, simulated, measured, relative error of the simulation)."""
    out = []
    sims, meass = flatten(simulated), flatten(measured)
    for label, key in METRICS:
        sim, meas = sims.get(key), meass.get(key)
        err = (sim - meas) / meas if sim is not None and meas else None
        out.append((label, sim, meas, err))
    return out


Row = tuple[str, str, str, float | None, float | None, float | None]


def validate(run_dir: Path, decision_log: str | None = None, kv_heads: int = 0,
             frontend_ms: float = CPU_FRONTEND_MS, overlap: bool = True,
             stretch: str = "none", curves: str = "end", steps: str = "profile") -> str:
    """The report: a header, what was measured per system, the table of errors."""
    header, notes, rows = compare_run(run_dir, decision_log, kv_heads, frontend_ms, overlap,
                                      stretch, curves, steps)
    lines = [header, *notes, "", "| system | simulated as | metric | simulated | measured | error |",
             "|---|---|---|---|---|---|"]
    for system, name, label, sim, meas, err in rows:
        cells = [system, name, label, _fmt(sim), _fmt(meas),
                 "-" if err is None else f"{100 * err:+.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare_run(run_dir: Path, decision_log: str | None = None, kv_heads: int = 0,
                frontend_ms: float = CPU_FRONTEND_MS, overlap: bool = True,
                stretch: str = "none", curves: str = "end",
                steps: str = "profile", flying_as: str | None = None,
                ) -> tuple[str, list[str], list[Row]]:
    """(header, notes, rows): each system simulated on the run's trace; a row is
    (system, simulated as, metric, simulated, measured, relative error). ``flying_as``:
    a policy to simulate Flying's arm under instead of its own (the layouts a run
    took, where the adaptive policy has changed since)."""
    context_file = run_dir / "context.json"
    context = json.loads(context_file.read_text()) if context_file.is_file() else {}
    slos = scoring_slos(run_dir, context)
    profile = replace(measured_profile(run_dir, decision_log, kv_heads, curves),
                      frontend_ms=frontend_ms, overlap=overlap)
    engines = int((context.get("machine") or {}).get("engines (N)") or profile.max_engines)
    head = _head(run_dir, decision_log)
    scaled = ""
    if stretch == "logged":
        log = Path(decision_log) if decision_log else run_dir / "flying" / "decisions.jsonl"
        factors = logged_stretch(log) if log.is_file() else {}
        costs = Costs(profile.costs.decode_ms, profile.costs.curves, factors)
        profile = replace(profile, costs=costs.loaded())
        scaled = "; stretch as logged " + ", ".join(
            f"TP-{d}: {costs.factor(d):g}" if d > 1 else f"DP: {costs.factor(d):g}"
            for d in sorted(set(profile.costs.decode_ms) | set(factors)))
    flying_loop = group_loop_of(run_dir)
    header = (f"SIMULATED vs MEASURED: {run_dir} ({engines} engines; profile: {profile.source}; "
              f"overlap loop {'on' if overlap else 'off'}"
              f"{f' (Flying groups: {flying_loop})' if overlap else ''}; frontend {frontend_ms:g} ms; "
              f"goodput SLOs {slos}{scaled})")
    notes: list[str] = []
    rows: list[Row] = []
    for system in SYSTEMS:
        records_file = run_dir / system / "records.jsonl"
        if not records_file.is_file():
            continue
        records = load_records(records_file)
        name, cfg = settings(system, engines, head)
        if system == "flying" and flying_as:
            name = flying_as
        if not held_admissions(run_dir):
            cfg = replace(cfg, hold_steps=0)  # a node before the hold
        own = profile
        loop = system_loop(system, flying_loop)
        if steps == "records":  # this server's own steps, from its client's token times
            costs, said = costs_from_records(records, engines, profile.costs, frontend_ms,
                                             overlap, loop)
            own = replace(profile, costs=costs)
            notes.append(f"{system}'s steps from its records: {said}")
        result = simulate(trace_of(records), own, engines, policy_settings(name, cfg),
                          name=name, log=False, group_loop=loop)
        for label, sim, meas, err in errors(summarize(result.records, slos=slos),
                                            summarize(records, slos=slos)):
            rows.append((system, name, label, sim, meas, err))
    return header, notes, rows


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workloads.sim.validate",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a workloads.compare output directory")
    parser.add_argument("--decision-log", help="the Flying run's --flying-decision-log "
                        "(default RUN_DIR/flying/decisions.jsonl)")
    parser.add_argument("--kv-heads", type=int, default=0,
                        help="the model's KV heads, when the profile comes from status.json")
    parser.add_argument("--frontend-ms", type=float, default=CPU_FRONTEND_MS,
                        help="per-request latency outside the engines, added to every "
                        f"TTFT and E2E (default {CPU_FRONTEND_MS:g}: this CPU machine's)")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                        help="SGLang's overlap loop (--no-overlap: the runs used "
                        "--disable-overlap-schedule)")
    parser.add_argument("--stretch", choices=("none", "logged"), default="none",
                        help="run the profile's steps at their best points (none) or "
                        "slowed by the mean stretch the decision log recorded (logged)")
    parser.add_argument("--curves", choices=("end", "log"), default="end",
                        help="the cost curves as the engines published them at the run's "
                        "end (status.json, the default) or at the log's last decision")
    parser.add_argument("--steps", choices=("profile", "records"), default="profile",
                        help="every system at the measured profile's step costs (profile) "
                        "or each at the steps its own records show "
                        "(records: workloads.sim.record_costs)")
    args = parser.parse_args(argv)
    print(validate(Path(args.run_dir), args.decision_log, args.kv_heads, args.frontend_ms,
                   args.overlap, args.stretch, args.curves, args.steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
