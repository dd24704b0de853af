"""The markdown report of a comparison run (static DP vs static TP vs Flying, one trace).

Kept apart from ``compare`` (which starts servers) so that a report can be rebuilt from saved
results and tested on synthetic records. A report states how it was produced (command line,
machine, trace, each server's flags) because a number without its setup cannot be checked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workloads.load.slos import DEFAULT_SLOS
from workloads.load.trace import TraceRequest
from workloads.measure.metrics import Summary, render_comparison, render_markdown, summarize
from workloads.measure.records import RequestRecord, load_records, save_records
from workloads.reports.plots import PLOTS, plot_runs

#: Run names, in the order they are launched and shown.
RUN_NAMES = ("static-dp", "static-tp", "flying")

#: (numerator, denominator) pairs of the ratio tables.
RATIOS = (("flying", "static-dp"), ("flying", "static-tp"))

THROUGHPUT_KEYS = (
    "overall.goodput.request_goodput",
    "overall.goodput.slo_attainment",
    "throughput.output_throughput",
    "throughput.peak_output_throughput",
    "throughput.request_throughput",
    "throughput.makespan_s",
)
LATENCY_KEYS = (
    "overall.ttft_ms.p50",
    "overall.ttft_ms.p90",
    "overall.ttft_ms.p99",
    "overall.tpot_ms.p50",
    "overall.tpot_ms.p90",
    "overall.e2e_ms.p50",
    "overall.e2e_ms.p90",
    "overall.queue_ms.mean",
    "overall.queue_ms.p90",
)


@dataclass
class RunResult:
    """One system's run: how its server was started and what the trace replay measured."""

    name: str
    command: list[str] = field(default_factory=list)
    launcher_notes: list[str] = field(default_factory=list)
    started: str = ""
    ready_s: float | None = None
    replay_s: float | None = None
    #: time.time() when the replay started (the records' run clock is ~0 there): lines
    #: up request records with the server's logs and decision log
    replay_wall_s: float | None = None
    load_before: list[float] | None = None
    error: str | None = None
    log_tail: str = ""
    records: list[RequestRecord] = field(default_factory=list, repr=False)
    summary: Summary | None = None

    def ok(self) -> bool:
        """Whether the run produced records to report on (``error`` may still note a problem,
        e.g. a server that died during the replay: its failed requests are in the records)."""
        return bool(self.records) and self.summary is not None


def save_run(run: RunResult, run_dir: str | Path) -> None:
    """Write ``run.json`` (everything but records), ``records.jsonl`` and ``summary.json``."""
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    meta = {k: v for k, v in dataclasses.asdict(run).items() if k not in ("records", "summary")}
    (path / "run.json").write_text(json.dumps(meta, indent=2) + "\n")
    save_records(run.records, path / "records.jsonl")
    if run.summary is not None:
        (path / "summary.json").write_text(json.dumps(run.summary, indent=2) + "\n")


def load_run(run_dir: str | Path, slos: Mapping[str, float] | None = DEFAULT_SLOS) -> RunResult:
    """Read what ``save_run`` wrote; the summary is recomputed (with goodput under ``slos``)
    so old results get new fields."""
    path = Path(run_dir)
    meta = json.loads((path / "run.json").read_text())
    known = {f.name for f in dataclasses.fields(RunResult)}
    run = RunResult(**{k: v for k, v in meta.items() if k in known})
    records_file = path / "records.jsonl"
    run.records = load_records(records_file) if records_file.is_file() else []
    run.summary = summarize(run.records, slos=slos) if run.records else None
    return run


def machine_facts() -> dict[str, Any]:
    """Cores, memory and software versions: what a reader needs to compare numbers."""
    facts: dict[str, Any] = {
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cores": f"{len(os.sched_getaffinity(0))} usable of {os.cpu_count()}",
        "memory": _mem_total(),
        "python": platform.python_version(),
        "os": platform.platform(),
    }
    for module in ("torch", "sglang"):
        try:
            facts[module] = __import__(module).__version__
        except Exception as exc:  # report, never fail, on a broken install
            facts[module] = f"unavailable ({type(exc).__name__})"
    try:
        import torch

        facts["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception:
        facts["gpu"] = "unknown"
    return facts


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def describe_trace(trace: Sequence[TraceRequest]) -> dict[str, Any]:
    """Counts, span and length ranges of a trace, for the report's trace section."""
    if not trace:
        return {"requests": 0}
    prompts = [r.prompt_len for r in trace]
    outputs = [r.output_len for r in trace]
    span = trace[-1].arrival_s - trace[0].arrival_s
    phases: dict[str, int] = {}
    for r in trace:
        phases[r.phase] = phases.get(r.phase, 0) + 1
    return {
        "requests": len(trace),
        "span_s": round(span, 2),
        "mean_rate_req_s": round((len(trace) - 1) / span, 3) if span > 0 else None,
        "prompt_tokens": f"min {min(prompts)}, mean {sum(prompts) / len(prompts):.0f}, "
        f"max {max(prompts)}, total {sum(prompts)}",
        "output_tokens": f"min {min(outputs)}, mean {sum(outputs) / len(outputs):.0f}, "
        f"max {max(outputs)}, total {sum(outputs)}",
        "phases": ", ".join(f"{k}={v}" for k, v in sorted(phases.items())),
        "priorities": ", ".join(
            f"{p}={sum(1 for r in trace if r.priority == p)}"
            for p in sorted({r.priority for r in trace})
        ),
    }


def _bullets(facts: dict[str, Any]) -> list[str]:
    return [f"- {k}: {v}" for k, v in facts.items() if v is not None and v != ""]


def _run_row(run: RunResult) -> str:
    status = f"failed: {run.error}"
    if run.ok() and run.summary:
        overall = run.summary["overall"]
        status = f"{overall['completed']}/{overall['count']} ok"
        status += f"; {run.error}" if run.error else ""
    ready = f"{run.ready_s:.1f}" if run.ready_s is not None else "-"
    replay = f"{run.replay_s:.1f}" if run.replay_s is not None else "-"
    load = " / ".join(f"{x:.2f}" for x in run.load_before) if run.load_before else "-"
    return f"| {run.name} | {run.started or '-'} | {ready} | {replay} | {load} | {status} |"


def _commands(runs: Sequence[RunResult]) -> list[str]:
    """Each server's exact command and the defaults its launcher added."""
    lines = ["Server commands (host and port omitted):", ""]
    for run in runs:
        lines.append(f"- `{run.name}`: `{' '.join(run.command)}`")
        if run.launcher_notes:
            lines.append(f"  - launcher: {'; '.join(run.launcher_notes)}")
    return lines


def _ratio_section(by_name: dict[str, RunResult]) -> list[str]:
    lines: list[str] = []
    for num, den in RATIOS:
        a, b = by_name.get(num), by_name.get(den)
        lines += ["", f"### {num} / {den}", ""]
        if not (a and b and a.ok() and b.ok() and a.summary and b.summary):
            lines.append(f"Not available: needs successful `{num}` and `{den}` runs.")
            continue
        lines += ["Throughput (goodput, SLO attainment and throughputs: higher is better; makespan: lower):", ""]
        lines.append(render_comparison(a.summary, b.summary, (num, den), THROUGHPUT_KEYS))
        lines += ["", "Latency (lower is better):", ""]
        lines.append(render_comparison(a.summary, b.summary, (num, den), LATENCY_KEYS))
    return lines


def _modes_note(by_name: dict[str, RunResult]) -> str:
    flying = by_name.get("flying")
    if flying is None or not flying.ok() or not flying.summary:
        return ""
    modes = flying.summary.get("modes") or {}
    if not modes:
        return (
            "Engine modes: the `flying` run's responses carried no `meta_info.flying` mode "
            "information, so no mode spans are shaded (every request ran as a plain DP request "
            "as far as the client can tell)."
        )
    counts = ", ".join(f"{k}={v}" for k, v in sorted(modes.items()))
    return (
        f"Engine modes reported by the `flying` run (requests per mode): {counts}. Shaded bands "
        "on the plots mark times when requests of a non-DP mode were in flight."
    )


def render_report(
    runs: Sequence[RunResult],
    context: dict[str, Any],
    plot_files: Sequence[str] = tuple(PLOTS),
) -> str:
    """The report as markdown. ``context`` holds ``commands`` (or ``command``), ``machine``,
    ``trace``, ``title`` and ``started``.

    ``plot_files`` are image paths relative to the report (written by ``plot_runs``).
    """
    by_name = {run.name: run for run in runs}
    lines = [f"# {context.get('title', 'Comparison: static DP vs static TP vs Flying')}", ""]
    commands = context.get("commands") or [context[k] for k in ("command",) if context.get(k)]
    if commands:
        lines += ["Produced by:", "", "```bash", *commands, "```", ""]
    if context.get("started"):
        lines += [f"Started {context['started']}.", ""]
    lines += ["## Machine", "", *_bullets(context.get("machine", {})), ""]
    lines += ["## Trace", "", *_bullets(context.get("trace", {})), ""]
    lines += [
        "## Runs",
        "",
        "Each system served the same trace in turn, alone on the machine as far as this tool "
        "controls it (load average before the run is shown: other processes on the machine "
        "skew the numbers).",
        "",
        "| run | started | ready (s) | replay (s) | load avg 1/5/15 min before | result |",
        "|---|---|---|---|---|---|",
    ]
    lines += [_run_row(run) for run in runs]
    lines += ["", *_commands(runs)]
    for run in runs:
        lines.append("")
        if run.ok() and run.summary:
            lines.append(render_markdown(run.summary, title=run.name))
        else:
            lines.append(f"### {run.name}")
        if run.error:
            lines += ["", f"Run failed: {run.error}"]
            if run.log_tail:
                lines += ["", "Server log tail:", "", "```", run.log_tail.rstrip(), "```"]
    lines += ["", "## Ratios", ""]
    lines.append(
        "Each ratio is first/second of the same metric; `-` where a metric is missing or zero."
    )
    lines += _ratio_section(by_name)
    lines += ["", "## Over time", ""]
    note = _modes_note(by_name)
    if note:
        lines += [note, ""]
    for name in plot_files:
        title = PLOTS[Path(name).name][0] if Path(name).name in PLOTS else Path(name).stem
        lines += [f"![{title}]({name})", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_report(
    runs: Sequence[RunResult], out_dir: str | Path, context: dict[str, Any]
) -> Path:
    """Write the plots and ``report.md`` into ``out_dir``; returns the report's path."""
    out = Path(out_dir)
    series = {run.name: run.records for run in runs if run.ok()}
    written = plot_runs(series, out)
    text = render_report(runs, context, [p.name for p in written.values()])
    path = out / "report.md"
    path.write_text(text)
    return path
