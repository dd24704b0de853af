"""The SLOs a comparison grades goodput at, handed to its Flying run.

``workloads.targets`` grades every system at SLOs taken from static TP's quiet service
in the same comparison (4x its quiet TTFT p50, 1.5x its quiet TPOT p50:
``workloads.reports.slo_stats.quiet_slos``, pooled over the rounds). The adaptive node
picks the layout predicted to serve the most requests within *its* SLOs, and left to
itself it derives them at start-up from one engine's quiet step. Where the two differ
the node optimises one target and is scored at another: on the hidden-1024 model's
cpu-burst the node derived 32.6 ms a token and the rounds were scored at 280 ms (static
TP's quiet phase there is the backlog of the first burst). At 32.6 ms no DP engine
meets the SLO once two requests share it (its batch-2 step is 42 ms), so the node
formed a TP-2 group in a lull beside 108 running DP requests, whose tokens then came
slower than static DP's. Given the scored SLOs it stayed in DP from the first burst on
and took its group only while quiet (2 rounds, `--runs static-dp,flying`).

An operator sets the node's SLOs to what they hold it to (``--flying-slo-ttft``,
``--flying-slo-tpot``); compare does the same for its Flying run once a static TP run
of the comparison has given them (the systems' order rotates, so a round whose Flying
run comes first is given the earlier rounds'). ``--flying-own-slos`` leaves the node to
derive its own; SLO flags in ``--flying-args`` win.
"""

from __future__ import annotations

import re
from pathlib import Path

from workloads.measure.records import RequestRecord, load_records
from workloads.reports.slo_stats import quiet_slos

#: The launcher's SLO flags: present in ``--flying-args``, they are the run's.
SLO_FLAGS = ("--flying-slo-ttft", "--flying-slo-tpot")
#: The quiet phase's name in the phased presets (``workloads.targets --quiet``); a trace
#: without it (Poisson, a replayed trace) is graded on all of static TP's requests.
QUIET = "low"

_ROUND = re.compile(r"round\d+")


def static_tp_records(out: Path) -> list[RequestRecord]:
    """Static TP's records of the comparison ``out`` belongs to: ``out``'s own and,
    for a round of ``workloads.compare --rounds``, every other round's run so far."""
    dirs = [out]
    if _ROUND.fullmatch(out.name):
        dirs += [d for d in sorted(out.parent.iterdir()) if d != out and d.is_dir()
                 and _ROUND.fullmatch(d.name)]
    records: list[RequestRecord] = []
    for d in dirs:
        path = d / "static-tp" / "records.jsonl"
        if path.is_file():
            records += load_records(path)
    return records


def graded_slos(out: Path) -> tuple[float, float] | None:
    """(TTFT, TPOT) in ms that ``workloads.targets`` would grade the comparison ``out``
    at from the static TP runs finished so far; None before any has finished."""
    records = [r for r in static_tp_records(out) if r.success]
    if not records:
        return None
    quiet = QUIET if any(r.phase == QUIET for r in records) else None
    ttft, tpot = quiet_slos(records, quiet)
    return (round(ttft, 1), round(tpot, 2)) if ttft > 0 and tpot > 0 else None


def slo_args(out: Path, flying_args: list[str], own: bool) -> list[str]:
    """The SLO flags to add to a Flying run's ``flying_args`` (none where ``own``, where
    ``flying_args`` sets one, or before static TP has run)."""
    if own or any(a.split("=")[0] in SLO_FLAGS for a in flying_args):
        return []
    slos = graded_slos(out)
    if slos is None:
        return []
    return [SLO_FLAGS[0], f"{slos[0]:g}", SLO_FLAGS[1], f"{slos[1]:g}"]
