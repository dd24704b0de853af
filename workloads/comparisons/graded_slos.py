"""The SLOs a comparison grades goodput at, for its Flying run (``--flying-graded-slos``).

``workloads.targets`` grades every system at SLOs taken from static TP's quiet service
in the same comparison (4x its quiet TTFT p50, 1.5x its quiet TPOT p50:
``workloads.reports.slo_stats.quiet_slos``, pooled over the rounds). The adaptive node
picks the layout predicted to serve the most requests within *its* SLOs, by default
derived at start-up from one engine's quiet step, and the two can differ by far: on the
cpu-burst presets static TP's quiet phase is the backlog of the first burst, and the
hidden-1024 rounds were graded at TPOT <= 280 ms where the node derived 32.6 ms. At
32.6 ms no DP engine meets the SLO once two requests share it (its batch-2 step is
42 ms), so the node formed a TP-2 group in a lull beside 108 running DP requests.

``compare --flying-graded-slos`` gives the Flying run the graded SLOs, as an operator
gives a node the SLOs they hold it to (``--flying-slo-ttft``, ``--flying-slo-tpot``),
once a static TP run of the comparison has given them (the systems' order rotates, so
a round whose Flying run comes first is given the earlier rounds'); SLO flags in
``--flying-args`` win. Not the default: the policy's rules were measured at the node's
own SLOs, and at the looser graded ones other paths decide (session 80, BENCHMARKS.md:
h1024 cpu-burst 0.79 -> 1.00, the Azure code replay 1.27 -> 0.63, a switch to DP for
latency in a clump).
"""

from __future__ import annotations

from pathlib import Path

from workloads.measure.records import RequestRecord, load_records
from workloads.reports.slo_stats import quiet_slos, round_dirs

#: The launcher's SLO flags: present in ``--flying-args``, they are the run's.
SLO_FLAGS = ("--flying-slo-ttft", "--flying-slo-tpot")
#: The quiet phase's name in the phased presets (``workloads.targets --quiet``); a trace
#: without it (Poisson, a replayed trace) is graded on all of static TP's requests.
QUIET = "low"

def static_tp_records(out: Path) -> list[RequestRecord]:
    """Static TP's records of the comparison ``out`` belongs to: ``out``'s own and,
    for a round of ``workloads.compare --rounds``, every other round's run so far."""
    rounds = round_dirs(out.parent)
    dirs = rounds if out in rounds else [out]
    records: list[RequestRecord] = []
    for d in dirs:
        path = d / "static-tp" / "records.jsonl"
        if path.is_file():
            records += load_records(path)
    return records


def graded_slos(out: Path) -> tuple[float, float] | None:
    """(TTFT, TPOT) in ms that ``workloads.targets`` would grade the comparison ``out``
    at from the static TP runs finished so far; None before any has finished."""
    records = static_tp_records(out)
    if not records:
        return None
    quiet = QUIET if any(r.phase == QUIET for r in records) else None
    ttft, tpot = quiet_slos(records, quiet)
    return (round(ttft, 1), round(tpot, 2)) if ttft > 0 and tpot > 0 else None


def slo_args(out: Path, flying_args: list[str], graded: bool) -> list[str]:
    """The SLO flags to add to a Flying run's ``flying_args`` (none unless ``graded``,
    where ``flying_args`` sets one, or before static TP has run)."""
    if not graded or any(a.split("=")[0] in SLO_FLAGS for a in flying_args):
        return []
    slos = graded_slos(out)
    if slos is None:
        return []
    return [SLO_FLAGS[0], f"{slos[0]:g}", SLO_FLAGS[1], f"{slos[1]:g}"]
