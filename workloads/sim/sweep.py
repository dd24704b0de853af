"""Goodput against arrival rate: the same trace re-timed at each rate, every policy.

``python -m workloads.simulate --rates 10,20,40 [--arrival poisson]`` re-times the
trace with ``workloads.load.arrivals`` (lengths kept, arrivals from ``--arrival``, Poisson
by default) at each rate, simulates every policy and prints one row per rate: each
policy's goodput (req/s within the SLOs) and, in brackets, its SLO attainment. Past
saturation a policy's goodput stops growing with the rate: where that happens is the
node's capacity under that policy.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from flying.node.config import FlyingConfig
from workloads.load.arrivals import ArrivalProcess, retime
from workloads.load.cli import trace_from_args
from workloads.measure.metrics import goodput_stats, throughput_stats
from workloads.sim.profile import Profile
from workloads.sim.run import policy_settings, simulate


def sweep(args: argparse.Namespace, profile: Profile, engines: int, base: FlyingConfig,
          policies: Sequence[str], slos: dict[str, float]) -> str:
    trace, source = trace_from_args(args)
    kind = args.arrival or "poisson"
    head = ["rate req/s", *policies]
    lines = [f"SIMULATED goodput (req/s within {slos}) [SLO attainment %] against rate; "
             f"profile {profile.name}, {engines} engines; trace {source}, re-timed {kind}",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rate in args.rates:  # req/s above 0 (``cli.rate_list``)
        timed = retime(trace, ArrivalProcess(kind, rate, burstiness=args.burstiness), args.seed)
        cells = [f"{rate:g}"]
        for name in policies:
            res = simulate(timed, profile, engines, policy_settings(name, base), name=name,
                           log=False)
            span = throughput_stats(res.records)["makespan_s"]
            good = goodput_stats(res.records, slos, span) or {}
            cells.append(f"{good.get('request_goodput', 0):.2f} "
                         f"[{100 * good.get('slo_attainment', 0):.0f}]")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
