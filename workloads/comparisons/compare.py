"""Static DP vs static TP vs Flying on one model and one trace, in one command.

Each system is started in turn with ``python -m flying.launch`` (one server at a time, so they
never share the cores), the same trace is replayed against it open loop with
``workloads.client``, the server is stopped, and a markdown report with tables, ratios and
plots is written. Runs:

- ``static-dp``: ``--dp-size N`` with Flying's TP degrees off (``--flying-tp-degrees none``
  when the launcher has that flag): SGLang's own DP controller and N independent replicas;
  the Flying plugin only provides the CPU platform.
- ``static-tp``: ``--tp-size N --dp-size 1``: one SGLang replica sharded N ways.
- ``flying``: ``--dp-size N`` plus whatever ``--flying-args`` says; the report shows what it
  measured, whatever mode its engines ran in. With ``--flying-graded-slos`` it is given the
  SLOs ``workloads.targets`` grades goodput at, once a static TP run of the comparison has
  given them (``workloads.comparisons.graded_slos``); by default it derives its own.

CLI::

    python -m workloads.compare --preset cpu-small [--runs static-dp,flying] [--limit 20] \\
        [--arrival gamma --rate 2 --burstiness 0.5] [--goodput ttft:100 tpot:20] \\
        [--model-path DIR] [--engines 2] [--flying-args "..."] [--server-args "..."] [--out DIR]
        [--rounds N] [--flying-graded-slos]
        (every run gets --enable-metrics so responses carry server queue times, and the
        Flying run a decision log, OUT/flying/decisions.jsonl, unless --flying-args names one)
    python -m workloads.compare --report-only DIR   # rebuild report.md from saved runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from workloads.comparisons.graded_slos import slo_args
from workloads.load.cli import add_goodput_args, add_trace_args, slos_from_args, trace_from_args
from workloads.load.slos import DEFAULT_SLOS
from workloads.load.trace import TraceRequest
from workloads.measure.client import run_trace
from workloads.measure.metrics import summarize
from workloads.measure.server import STARTUP_TIMEOUT_S, ServerFailed, start_server
from workloads.reports.report import (
    RUN_NAMES,
    RunResult,
    describe_trace,
    load_run,
    machine_facts,
    save_run,
    write_report,
)

#: SGLang puts ``queue_time`` into a response's meta_info only with metrics enabled; every run
#: gets it, so the (small) cost of collecting metrics is the same for all systems.
METRICS_FLAG = "--enable-metrics"
#: The flag of Flying's decision log; compare gives every Flying run one in its own
#: directory (``workloads.sim.validate`` and ``scheduler.replay`` read it there).
DECISION_LOG_FLAG = "--flying-decision-log"


def log(message: str) -> None:
    """One timestamped progress line, flushed so a long run shows where it is."""
    print(f"[compare {datetime.now():%H:%M:%S}] {message}", flush=True)


def launcher_has_flag(flag: str) -> bool:
    """Whether ``flying.node.launch`` knows Flying flag ``flag`` (flags are added over time)."""
    from flying.node.config import flag_reference

    return any(name == flag for name, _, _ in flag_reference())


def run_args(
    name: str,
    model_path: str,
    engines: int,
    server_args: Sequence[str] = (),
    flying_args: Sequence[str] = (),
) -> list[str]:
    """``flying.node.launch`` flags (without host/port) for run ``name``."""
    base = ["--model-path", model_path]
    if name == "static-dp":
        off = ["--flying-tp-degrees", "none"] if launcher_has_flag("--flying-tp-degrees") else []
        return [*base, "--dp-size", str(engines), *off, *server_args]
    if name == "static-tp":
        return [*base, "--tp-size", str(engines), "--dp-size", "1", *server_args]
    if name == "flying":
        return [*base, "--dp-size", str(engines), *flying_args, *server_args]
    raise ValueError(f"unknown run {name!r}; known: {', '.join(RUN_NAMES)}")


def _save_status(url: str, path: Path) -> None:
    """Flying's engine counters after the replay (switches, steps), if the server has them."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/flying/status", timeout=30) as resp:
            path.write_bytes(resp.read())
    except Exception as exc:  # noqa: BLE001 - static layouts without Flying's routes
        log(f"no /flying/status: {exc}")


def launcher_notes(log_path: Path) -> list[str]:
    """Defaults the launcher added (its "adding --x" lines) and Flying's resolved degrees."""
    notes: list[str] = []
    for line in log_path.read_text(errors="replace").splitlines():
        text = line.split("] ", 1)[-1]
        if "adding --" in text or text.startswith("Flying TP degrees"):
            notes.append(text.strip())
    return notes


def run_one(
    name: str,
    args: Sequence[str],
    trace: Sequence[TraceRequest],
    run_dir: Path,
    port: int | None,
    seed: int,
    timeout_s: float,
    retries: int = 2,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    slos: dict[str, float] | None = None,
) -> RunResult:
    """Start the server, replay the trace, stop the server; failures end up in the result.

    ``port`` None: a free one, and another where it was taken before the server bound it
    (``start_server``'s retry; a port picked here could not be retried)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    result = RunResult(
        name=name,
        command=["python", "-m", "flying.node.launch", *args],
        started=f"{datetime.now():%Y-%m-%d %H:%M:%S}",
        load_before=[round(x, 2) for x in os.getloadavg()],
    )
    log(f"{name}: starting server: {shlex.join(result.command)}")
    try:
        server, result.ready_s = start_server(
            args, run_dir / "server.log", port=port, retries=retries,
            timeout_s=startup_timeout_s, on_retry=lambda msg: log(f"{name}: {msg}"),
        )
    except ServerFailed as exc:
        result.error, result.log_tail = str(exc), exc.log_tail
        log(f"{name}: FAILED: {exc}")
    else:
        try:
            log(f"{name}: ready in {result.ready_s:.1f} s; replaying {len(trace)} requests")
            start, result.replay_wall_s = time.monotonic(), time.time()
            result.records = asyncio.run(
                run_trace(trace, server.url, seed=seed, overall_timeout=timeout_s,
                          progress=sys.stderr.isatty())
            )
            result.replay_s = time.monotonic() - start
            result.summary = summarize(result.records, slos=slos)
            ok = sum(r.success for r in result.records)
            log(f"{name}: done: {ok}/{len(result.records)} ok in {result.replay_s:.1f} s")
            if server.proc.poll() is not None:
                result.error = f"server exited with code {server.proc.returncode} during replay"
                result.log_tail = server.log_tail()
            else:
                _save_status(server.url, run_dir / "status.json")
        finally:
            server.stop()
            log(f"{name}: server stopped")
    result.launcher_notes = launcher_notes(run_dir / "server.log")
    save_run(result, run_dir)
    return result


def build_trace(args: argparse.Namespace) -> tuple[list[TraceRequest], dict[str, Any]]:
    """The trace to replay and its description for the report."""
    trace, source = trace_from_args(args)
    return trace, {"source": source, **describe_trace(trace)}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="checkpoint directory (default: the demo model)")
    parser.add_argument("--engines", type=int, default=2, help="N: dp size / tp size")
    add_trace_args(parser)
    add_goodput_args(parser)
    parser.add_argument("--runs", default=",".join(RUN_NAMES),
                        help=f"comma list out of {','.join(RUN_NAMES)}")
    parser.add_argument("--flying-args", default="", help="extra flags for the flying run")
    parser.add_argument("--server-args", default="", help="extra SGLang flags for every run")
    parser.add_argument("--flying-graded-slos", action="store_true",
                        help="give the Flying run the SLOs workloads.targets grades at, once a "
                        "static TP run of the comparison has given them (default: the node "
                        "derives its own; workloads.comparisons.graded_slos)")
    parser.add_argument("--no-queue-metrics", action="store_true",
                        help="do not add --enable-metrics (then no server queue times)")
    parser.add_argument("--out", help="output directory (default results/compare-<time>)")
    parser.add_argument("--port", type=int, help="server port (default: a free one)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="replay limit per run, s")
    parser.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S,
                        help="seconds to wait for each server")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every system this many times, into OUT/round1..N, the "
                        "order rotated each round (default 1: OUT itself)")
    parser.add_argument("--title", help="report title")
    parser.add_argument("--report-only", metavar="DIR",
                        help="rebuild DIR/report.md from the runs saved in DIR; start nothing")
    args = parser.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = sorted(set(runs) - set(RUN_NAMES))
    if unknown or not runs:
        parser.error(f"--runs: unknown {unknown}; choose from {', '.join(RUN_NAMES)}")
    args.runs = [r for r in RUN_NAMES if r in runs]
    if args.engines < 1:
        parser.error("--engines must be >= 1")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.rounds > 1 and DECISION_LOG_FLAG in shlex.split(args.flying_args):
        parser.error(f"--rounds: each round's Flying run logs its decisions to "
                     f"OUT/roundK/flying/decisions.jsonl; drop {DECISION_LOG_FLAG} from "
                     "--flying-args")
    return args


def merge_context(path: Path, context: dict[str, Any]) -> dict[str, Any]:
    """Context for a directory that may already hold runs of an earlier invocation.

    Re-running one system into an existing directory (``--runs static-dp --out DIR``) keeps the
    other systems' results; that is only meaningful for the same trace and model, so anything
    else is refused, and the report lists every command that contributed.
    """
    if not path.is_file():
        return context
    old = json.loads(path.read_text())
    for key in ("trace",):
        if old.get(key) != context[key]:
            raise SystemExit(f"error: {path.parent} holds runs of another {key}; use a new --out")
    if old.get("machine", {}).get("model") != context["machine"]["model"]:
        raise SystemExit(f"error: {path.parent} holds runs of another model; use a new --out")
    earlier = old.get("commands") or ([old["command"]] if old.get("command") else [])
    return {**context, "commands": [*earlier, *context["commands"]],
            "started": old.get("started", context["started"])}


def rebuild_report(out: Path) -> Path:
    """Re-render ``report.md`` from ``context.json`` and the saved runs in ``out``."""
    context = json.loads((out / "context.json").read_text())
    slos = context.get("goodput_slos_ms", DEFAULT_SLOS)
    runs = [load_run(out / name, slos) for name in RUN_NAMES if (out / name / "run.json").is_file()]
    return write_report(runs, out, context)


def main(argv: Sequence[str] | None = None) -> None:
    """Run every requested system on the trace and write the report; with ``--rounds N``
    N times over, into ``OUT/round1`` .. ``OUT/roundN``, the systems' order rotated each
    round (one server per system and round: ``workloads.targets OUT`` then reports
    every round's ratios and their median, so a ratio is not one server's luck)."""
    args = parse_args(argv)
    if args.report_only:
        path = rebuild_report(Path(args.report_only))
        log(f"report rebuilt: {path}")
        return
    shown = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join(["python", "-m", "workloads.compare", *shown])
    if args.model_path:
        model_path = args.model_path
    else:
        from flying.node.demo_model import ensure_demo_model

        model_path = str(ensure_demo_model())
    out = Path(args.out or f"results/compare-{datetime.now():%Y%m%d-%H%M%S}")
    trace, trace_facts = build_trace(args)
    if not trace:
        raise SystemExit("error: the trace is empty")
    if args.rounds == 1:
        _round(args, out, args.runs, command, model_path, trace, trace_facts)
        return
    for r in range(args.rounds):
        runs = args.runs[r % len(args.runs):] + args.runs[:r % len(args.runs)]
        log(f"round {r + 1} of {args.rounds}")
        _round(args, out / f"round{r + 1}", runs, command, model_path, trace, trace_facts)
    log(f"rounds: {out}; their targets: python -m workloads.targets {out}")


def _round(args: argparse.Namespace, out: Path, runs: list[str], command: str,
           model_path: str, trace: list[TraceRequest], trace_facts: dict[str, Any]) -> None:
    """One comparison: every system in ``runs`` on the trace, then the report in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    context = {
        "title": args.title or "Static DP vs static TP vs Flying",
        "commands": [command],
        "started": f"{datetime.now():%Y-%m-%d %H:%M:%S}",
        "machine": {**machine_facts(), "model": model_path, "engines (N)": args.engines},
        "trace": trace_facts,
        "goodput_slos_ms": slos_from_args(args),
    }
    context = merge_context(out / "context.json", context)
    (out / "context.json").write_text(json.dumps(context, indent=2) + "\n")
    log(f"{len(trace)} requests over {trace_facts.get('span_s')} s; runs: {', '.join(runs)};"
        f" output in {out}")
    server_args, flying_args = shlex.split(args.server_args), shlex.split(args.flying_args)
    if not args.no_queue_metrics and METRICS_FLAG not in server_args:
        server_args.append(METRICS_FLAG)
    if DECISION_LOG_FLAG not in flying_args:
        flying_args += [DECISION_LOG_FLAG, str(out / "flying" / "decisions.jsonl")]
    results: list[RunResult] = []
    for name in runs:
        given = slo_args(out, flying_args, args.flying_graded_slos) if name == "flying" else []
        if given:
            log(f"flying: given the SLOs workloads.targets grades at: {shlex.join(given)}")
        launch = run_args(name, model_path, args.engines, server_args, flying_args + given)
        results.append(run_one(name, launch, trace, out / name, args.port, args.seed,
                               args.timeout,
                               startup_timeout_s=args.startup_timeout,
                               slos=context["goodput_slos_ms"]))
    path = rebuild_report(out)  # includes runs saved earlier into the same directory
    log(f"report: {path}")
    for run in results:
        if run.ok() and run.summary:
            tp = run.summary["throughput"]
            ttft = run.summary["overall"]["ttft_ms"]
            log(f"{run.name}: output {tp['output_throughput'] or 0:.1f} tok/s, "
                f"TTFT p50 {ttft['p50'] or 0:.0f} ms, p90 {ttft['p90'] or 0:.0f} ms")
        else:
            log(f"{run.name}: failed: {run.error}")


if __name__ == "__main__":
    main()

