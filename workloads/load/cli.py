"""Command-line options shared by every workloads tool: which trace, how it arrives, SLOs.

One definition, so ``client``, ``compare``, ``export`` and ``sidebyside`` name a workload the
same way: ``--preset`` or ``--trace``, optionally re-timed by a standard arrival process
(``--arrival gamma --rate 2 --burstiness 0.5``), cut with ``--limit``; named trace files
are looked up in ``--traces-dir`` / ``$FLYING_TRACES_DIR``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from workloads.load.arrivals import ARRIVAL_KINDS, RAMP_STRATEGIES, ArrivalProcess, retime
from workloads.load.replay import DEFAULT_TRACES_DIR, TRACES_ENV, replay_trace
from workloads.load.slos import DEFAULT_SLOS, parse_slos
from workloads.load.trace import TraceRequest, load_trace


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (a usage error, not a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def add_trace_args(parser: argparse.ArgumentParser, default_preset: str = "cpu-small") -> None:
    """The trace options (see the module docstring)."""
    from workloads.load.presets import PRESETS

    group = parser.add_argument_group("trace")
    group.add_argument("--preset", default=default_preset, choices=sorted(PRESETS))
    group.add_argument("--trace", help="trace file (overrides --preset): our JSONL, or a "
                       "Vidur/Azure CSV replayed unscaled")
    group.add_argument("--seed", type=int, default=0, help="trace and prompt-token seed")
    group.add_argument("--limit", type=positive_int, help="only the first N requests")
    group.add_argument("--traces-dir", help=f"directory of named trace files (default "
                       f"${TRACES_ENV}, else {DEFAULT_TRACES_DIR})")
    group.add_argument("--arrival", choices=ARRIVAL_KINDS,
                       help="re-time the trace with this arrival process (lengths kept)")
    group.add_argument("--rate", type=float, help="mean req/s of --arrival (ramp: start rate)")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape of --arrival gamma/ramp (1 = Poisson, < 1 burstier)")
    group.add_argument("--ramp-end-rate", type=float, help="req/s at the end of --arrival ramp")
    group.add_argument("--ramp-strategy", choices=RAMP_STRATEGIES, default="linear")


def add_goodput_args(parser: argparse.ArgumentParser) -> None:
    """``--goodput KEY:MS ...`` as in ``sglang.benchmark.serving`` (defaults: DEFAULT_SLOS)."""
    default = " ".join(f"{k}:{v:g}" for k, v in DEFAULT_SLOS.items())
    parser.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                        help=f"goodput SLOs in ms, KEY in ttft, tpot, e2el (default {default})")


def slos_from_args(args: argparse.Namespace) -> dict[str, float]:
    """The SLOs the options ask for."""
    return parse_slos(args.goodput) if args.goodput else dict(DEFAULT_SLOS)


def arrival_from_args(args: argparse.Namespace) -> ArrivalProcess | None:
    """The ``--arrival`` process, or None to keep the trace's own arrivals."""
    if not args.arrival:
        if getattr(args, "rate", None) is not None:  # a rate alone would be ignored
            raise SystemExit("error: --rate needs --arrival (e.g. --arrival poisson --rate 2) "
                             "to re-time the trace; without it the trace keeps its arrivals")
        return None
    if args.rate is None:
        raise SystemExit("error: --arrival needs --rate")
    try:
        return ArrivalProcess(args.arrival, args.rate, burstiness=args.burstiness,
                              end_rate=args.ramp_end_rate, strategy=args.ramp_strategy)
    except ValueError as err:  # a rate, burstiness or ramp end out of range
        raise SystemExit(f"error: --arrival {args.arrival}: {err}") from None


def trace_from_args(args: argparse.Namespace) -> tuple[list[TraceRequest], str]:
    """The trace the options name, and a one-line description of where it came from."""
    from workloads.load.presets import PRESETS, build_preset

    if args.traces_dir:  # presets resolve their files lazily, through the variable
        os.environ[TRACES_ENV] = str(Path(args.traces_dir).expanduser())
    if args.trace:
        path = Path(args.trace)
        if not path.is_file():
            raise SystemExit(f"error: --trace {args.trace}: no such file")
        csv = path.suffix.lower() == ".csv"
        trace = replay_trace(path, seed=args.seed) if csv else load_trace(path)
        source = f"file {args.trace}"
    else:
        trace = build_preset(args.preset, args.seed)
        source = f"preset `{args.preset}` (seed {args.seed}): {PRESETS[args.preset].description}"
    process = arrival_from_args(args)
    if process is not None:
        trace = retime(trace, process, args.seed)
        source += f"; re-timed: {process.describe()}"
    if args.limit is not None:
        trace = trace[: args.limit]
        source += f"; first {args.limit} requests only (--limit)"
    return trace, source
