"""Named trace presets, so every benchmark run names its workload in one word.

``paper`` reproduces the Flying Serving evaluation workload (design brief, section 2). The paper
gives the rate ranges but not the phase lengths; we use 60 s per phase, long enough that a
burst builds a real queue (20 req/s on average for a minute) and a low phase drains it, and
that 4,000 requests span about three low/burst cycles (~1,410 requests per 120 s cycle).

The ``cpu-*`` presets shrink the same shape to a 2-core CPU serving the tiny demo model
(512-token vocabulary, KV pools of a few thousand tokens per engine): lengths are divided by
roughly 20 (prompts) and 10 (outputs), rates by roughly 7, and phases are 15 s, so 80 requests
arrive within ~50 s and a run including the drain takes 2-3 minutes.

The standard load shapes (``cpu-poisson``, ``cpu-gamma``, ``cpu-constant``, ``cpu-ramp``;
definitions in ``workloads.load.arrivals``) keep cpu-small's lengths and its mean rate of ~1.5
req/s, so they differ from it and from each other only in how requests arrive. The
``*-three-peak`` presets are the paper's low/burst shape cut to exactly three bursts.

CLI: ``python -m workloads.presets --list`` or
``python -m workloads.presets --preset cpu-small --seed 0 --out trace.jsonl``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace

from workloads.load.arrivals import ArrivalProcess, retime
from workloads.load.replay import AZURE_CODE, AZURE_CONV, SAMPLE, ReplayOptions, replay_trace
from workloads.load.trace import BurstyConfig, TraceRequest, generate_bursty, save_trace


@dataclass(frozen=True)
class Preset:
    """A named trace: ``build(seed)`` returns the trace."""

    description: str
    build: Callable[[int], list[TraceRequest]]


# Paper workload. Ids are not materialised (4,000 prompts of ~2k tokens would be ~8M ints);
# the client rebuilds each prompt from (seed, index) just before sending it.
PAPER = BurstyConfig(
    num_requests=4000,
    prompt_range=(128, 4000),
    output_range=(64, 512),
    low_rate_range=(2.0, 5.0),
    burst_rate_range=(10.0, 30.0),
    low_duration_s=60.0,
    burst_duration_s=60.0,
    with_input_ids=False,
)

CPU_SMALL = BurstyConfig(
    num_requests=80,
    prompt_range=(16, 192),
    output_range=(8, 48),
    low_rate_range=(0.3, 0.6),
    burst_rate_range=(2.0, 4.0),
    low_duration_s=15.0,
    burst_duration_s=15.0,
)

# Saturating CPU variant: bursts well above what 2 engines of the demo model decode, so
# queues build up and load-adaptive switching has something to do.
CPU_BURST = replace(
    CPU_SMALL,
    num_requests=160,
    output_range=(32, 96),
    low_rate_range=(0.5, 1.0),
    burst_rate_range=(12.0, 20.0),
    low_duration_s=10.0,
    burst_duration_s=5.0,
)

# Share of latency-critical requests in the mixed-priority runs. The paper does not state it;
# 20% keeps the priority class a minority (so binding TP groups for it is affordable) while
# giving ~800 (paper) / 16 (cpu-small) samples for its percentiles.
HIGH_PRIORITY_FRACTION = 0.2

# Long-context CPU variant: 10% of prompts far above cpu-small's range. Sized for engines with
# 2,048 KV slots (the integration tests' setting): every long prompt plus its output exceeds one
# engine's pool yet fits a TP-2 group's 4,096, and stays under the demo model's 8,192 positions.
# Retune to the server's max_total_num_tokens when it differs.
CPU_LONG_FRACTION = 0.1
CPU_LONG_PROMPT_RANGE = (2560, 3840)

# Azure replays at the cpu-small budget: the first 80 requests, lengths scaled by the same
# factors that map the paper's maxima to cpu-small's (192/4000 prompts, 48/512 outputs) and
# clamped to cpu-small's ranges, gaps scaled to cpu-small's mean rate of ~1.5 req/s.
CPU_SMALL_RATE = 1.5
AZURE_CPU = ReplayOptions(
    target_rate=CPU_SMALL_RATE,
    prompt_scale=192 / 4000,
    output_scale=48 / 512,
    prompt_clamp=CPU_SMALL.prompt_range,
    output_clamp=CPU_SMALL.output_range,
    limit=CPU_SMALL.num_requests,
)


# Three peaks: low, burst, low, burst, low, burst, low. The paper's rates and lengths with its
# 60 s phases (~4,400 requests over 420 s), and a CPU variant with cpu-small's lengths and
# rates in 10 s phases (~110 requests over 70 s: a run of a minute or two).
PAPER_THREE_PEAK = replace(PAPER, num_requests=10_000, num_bursts=3)
CPU_THREE_PEAK = replace(
    CPU_SMALL, num_requests=1000, low_duration_s=10.0, burst_duration_s=10.0, num_bursts=3
)

# Standard shapes at cpu-small's budget: 80 requests, mean 1.5 req/s. Gamma burstiness 0.25
# (gap coefficient of variation 2) is a clearly bursty client; the ramp goes from a quarter
# to about three times the mean rate.
CPU_SHAPES = {
    "cpu-poisson": ArrivalProcess("poisson", CPU_SMALL_RATE),
    "cpu-gamma": ArrivalProcess("gamma", CPU_SMALL_RATE, burstiness=0.25),
    "cpu-constant": ArrivalProcess("constant", CPU_SMALL_RATE),
    "cpu-ramp": ArrivalProcess("ramp", 0.4, end_rate=4.0),
}


def _bursty(config: BurstyConfig) -> Callable[[int], list[TraceRequest]]:
    return lambda seed: generate_bursty(config, seed)


def _shaped(process: ArrivalProcess) -> Callable[[int], list[TraceRequest]]:
    """cpu-small's requests (lengths, ids) arriving by ``process``."""
    return lambda seed: retime(generate_bursty(CPU_SMALL, seed), process, seed)


PRESETS: dict[str, Preset] = {
    "paper": Preset(
        "Paper workload: 4000 req, prompts U[128,4000], outputs U[64,512], "
        "low 2-5 req/s / burst 10-30 req/s, 60 s phases",
        _bursty(PAPER),
    ),
    "paper-priority": Preset(
        "paper + 20% of requests high priority",
        _bursty(replace(PAPER, high_priority_fraction=HIGH_PRIORITY_FRACTION)),
    ),
    "cpu-small": Preset(
        "CPU demo: 80 req, prompts U[16,192], outputs U[8,48], "
        "low 0.3-0.6 req/s / burst 2-4 req/s, 15 s phases",
        _bursty(CPU_SMALL),
    ),
    "cpu-burst": Preset(
        "CPU saturating: 160 req, prompts U[16,192], outputs U[32,96], "
        "low 0.5-1 req/s (10 s) / burst 12-20 req/s (5 s)",
        _bursty(CPU_BURST),
    ),
    "cpu-small-priority": Preset(
        "cpu-small + 20% of requests high priority",
        _bursty(replace(CPU_SMALL, high_priority_fraction=HIGH_PRIORITY_FRACTION)),
    ),
    "cpu-small-long": Preset(
        "cpu-small + 10% of prompts U[2560,3840] (beyond one 2048-slot engine, within TP-2)",
        _bursty(
            replace(
                CPU_SMALL, long_fraction=CPU_LONG_FRACTION, long_prompt_range=CPU_LONG_PROMPT_RANGE
            )
        ),
    ),
    **{
        name: Preset(f"cpu-small's 80 requests, arrivals {process.describe()}", _shaped(process))
        for name, process in CPU_SHAPES.items()
    },
    "paper-three-peak": Preset(
        "Paper workload cut to three 60 s bursts (10-30 req/s) between four 60 s low phases "
        "(2-5 req/s): ~4,400 req over 420 s",
        _bursty(PAPER_THREE_PEAK),
    ),
    "cpu-three-peak": Preset(
        "cpu-small's lengths and rates, three 10 s bursts (2-4 req/s) between four 10 s low "
        "phases (0.3-0.6 req/s): ~110 req over 70 s",
        _bursty(CPU_THREE_PEAK),
    ),
    "sample-cpu": Preset(
        "The bundled synthetic sample trace (workloads/traces/sample_trace.csv), first 80 req, "
        "scaled like azure-conv-cpu",
        lambda seed: replay_trace(SAMPLE, AZURE_CPU, seed),
    ),
    "azure-conv-cpu": Preset(
        "First 80 req of Azure conv 2023, lengths x192/4000 -> [16,192] and x48/512 -> [8,48], "
        "mean rate 1.5 req/s",
        lambda seed: replay_trace(AZURE_CONV, AZURE_CPU, seed),
    ),
    "azure-code-cpu": Preset(
        "First 80 req of Azure code 2023, scaled like azure-conv-cpu",
        lambda seed: replay_trace(AZURE_CODE, AZURE_CPU, seed),
    ),
}


def build_preset(name: str, seed: int = 0) -> list[TraceRequest]:
    """The trace of preset ``name`` for ``seed``."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name].build(seed)


def main(argv: list[str] | None = None) -> None:
    """Write a preset's trace as JSONL, or list the presets."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list presets and exit")
    parser.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="JSONL file to write")
    parser.add_argument("--no-ids", action="store_true", help="omit input_ids from the file")
    args = parser.parse_args(argv)
    if args.list or not args.out:
        for name, preset in PRESETS.items():
            print(f"{name:20s} {preset.description}")
        return
    trace = build_preset(args.preset, args.seed)
    save_trace(trace, args.out, include_ids=not args.no_ids)
    span = trace[-1].arrival_s if trace else 0.0
    print(f"wrote {len(trace)} requests spanning {span:.1f} s to {args.out}")


if __name__ == "__main__":
    main()
