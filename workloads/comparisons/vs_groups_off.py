"""Flying's defaults vs the same server with groups off, measured by SGLang's own benchmark.

The project's promise is that Flying's defaults never leave a node worse than plain
SGLang (design invariant 8). This tool checks it the way a new user would: it starts two
servers on the same model (groups off first: ``START_ORDER``), both up for the whole run,

- ``flying``: ``python -m flying.launch`` with Flying's defaults,
- ``groups-off``: the same with ``--flying-tp-degrees none`` (SGLang's own DP controller),

and runs ``python -m sglang.benchmark.serving`` (``--dataset-name random-ids``, Poisson
arrivals) against them in alternating rounds (flying, groups-off, flying, ...), so that a
drifting machine affects both alike. Only one server has traffic at a time; the idle one
sleeps (``--sleep-on-idle``). It prints one table of every latency and throughput figure
SGLang reports, per system (median over rounds) and as ratios flying / groups-off
(above 1 is worse for latencies, below 1 is worse for throughputs), then each round's
ratios with their median and spread, and every request of each system's rounds pooled
with a paired bootstrap interval over rounds (``workloads.reports.pooled``: what a run
of R rounds resolves).

``--one-at-a-time``: no second server at all. Each benchmark run gets a server of its
own, started for it and stopped after it (systems alternating, as above), so nothing
else is resident on the machine during a run and no server has a start-order advantage;
it costs one start-up per run (~40 s on the demo model).

CLI::

    python -m workloads.vs_groups_off [--model-path DIR] [--rate 6] [--num-prompts 120] \\
        [--input-len 128] [--output-len 64] [--rounds 2] [--server-args "--dp-size 2"] \\
        [--restart-swapped | --one-at-a-time] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from workloads.comparisons.sidebyside import run_sglang
from workloads.measure.server import Server, start_server
from workloads.reports import pooled

DEFAULT_SERVER_ARGS = "--dp-size 2"
SYSTEMS = {"flying": [], "groups-off": ["--flying-tp-degrees", "none"]}
#: The order the servers start in: groups off first. Two identical servers (both groups
#: off, ``--flying-args "--flying-tp-degrees none"``) read the first-started one 1-22 %
#: faster in the medians of the latency figures, in two runs with either start order
#: (demo model, 6 req/s, 3 rounds, 2026-11-29); started first, the baseline gets
#: whatever advantage that is, not Flying (``--restart-swapped`` balances it).
START_ORDER = ("groups-off", "flying")

#: (key in SGLang's result line, label, True if higher is better)
FIGURES = [
    ("completed", "completed", True),
    ("request_throughput", "requests/s", True),
    ("output_throughput", "output tok/s", True),
    ("mean_ttft_ms", "TTFT mean (ms)", False),
    ("median_ttft_ms", "TTFT p50", False),
    ("p90_ttft_ms", "TTFT p90", False),
    ("p99_ttft_ms", "TTFT p99", False),
    ("mean_tpot_ms", "TPOT mean (ms)", False),
    ("median_tpot_ms", "TPOT p50", False),
    ("p99_tpot_ms", "TPOT p99", False),
    ("median_itl_ms", "ITL p50 (ms)", False),
    ("p95_itl_ms", "ITL p95", False),
    ("p99_itl_ms", "ITL p99", False),
    ("max_itl_ms", "ITL max", False),
    ("median_e2e_latency_ms", "E2E p50 (ms)", False),
    ("p90_e2e_latency_ms", "E2E p90", False),
    ("p99_e2e_latency_ms", "E2E p99", False),
]


def log(message: str) -> None:
    print(f"[vs_groups_off {datetime.now():%H:%M:%S}] {message}", flush=True)


def prepare(args: argparse.Namespace, tool: str) -> Path:
    """Fill in the demo model where no ``--model-path`` was given; the run's output
    directory (``--out``, default ``results/<tool>-<time>``), created."""
    if not args.model_path:
        from flying.node.demo_model import ensure_demo_model

        args.model_path = str(ensure_demo_model())
    out = Path(args.out or f"results/{tool}-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    return out


def start_systems(model_path: str, server_args: str, out: Path, own: dict[str, str],
                  servers: dict[str, Server], say=log,
                  order: Sequence[str] = START_ORDER, tag: str = "") -> None:
    """Start every system of ``SYSTEMS`` on ``model_path`` into ``servers``, in
    ``order`` (the caller stops them, also those started before a failure):
    ``server_args`` for both, ``own`` per system (name -> extra flags); server logs
    ``<name><tag>.server.log``."""
    for name in order:
        args = ["--model-path", model_path, *shlex.split(server_args), *SYSTEMS[name],
                *shlex.split(own.get(name, ""))]
        say(f"starting {name}: python -m flying.launch {shlex.join(args)}")
        servers[name], ready_s = start_server(args, out / f"{name}{tag}.server.log", retries=1)
        say(f"{name} ready in {ready_s:.0f} s at {servers[name].url}")


def stop_all(servers: dict[str, Server]) -> None:
    """Stop every server in ``servers`` and forget them."""
    for server in servers.values():
        server.stop()
    servers.clear()


def bench_command(url: str, args: argparse.Namespace, seed: int, out: Path) -> list[str]:
    """SGLang's serving benchmark as a new user would run it (random ids, Poisson)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return [
        sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang",
        "--host", host, "--port", port, "--dataset-name", "random-ids",
        "--tokenizer", args.model_path, "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", "1.0",
        "--request-rate", f"{args.rate:g}", "--num-prompts", str(args.num_prompts),
        "--seed", str(seed), "--output-file", str(out), "--disable-tqdm",
    ]


def max_itl_ms(result: dict[str, Any]) -> float | None:
    """The longest gap between two tokens of any request (``--output-details`` lists them)."""
    itls = [gap for per_req in result.get("itls") or [] for gap in per_req]
    return max(itls) * 1e3 if itls else result.get("max_itl_ms")


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    """Median over rounds per system, and the ratio flying / groups-off."""
    head = ["figure", "flying", "groups-off", "flying / groups-off", "worse?"]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---:|---:|---|"]
    for key, label, higher_better in FIGURES:
        vals = {name: [r[key] for r in rs if r.get(key) is not None]
                for name, rs in results.items()}
        if not all(vals.values()):
            continue
        a, b = (statistics.median(vals[name]) for name in ("flying", "groups-off"))
        ratio = a / b if b else float("nan")
        worse = (ratio < 1.0) if higher_better else (ratio > 1.0)
        lines.append(f"| {label} | {a:.1f} | {b:.1f} | {ratio:.2f} | {'worse' if worse else ''} |")
    return "\n".join(lines)


#: The figures of the per-round table (``rounds_table``): key in SGLang's result line, label.
ROUND_FIGURES = [
    ("median_ttft_ms", "TTFT p50"), ("p90_ttft_ms", "TTFT p90"), ("p99_ttft_ms", "TTFT p99"),
    ("median_tpot_ms", "TPOT p50"), ("median_itl_ms", "ITL p50"), ("p95_itl_ms", "ITL p95"),
    ("p99_itl_ms", "ITL p99"), ("output_throughput", "output tok/s"),
]


def rounds_table(results: dict[str, list[dict[str, Any]]]) -> str:
    """Each round's ratio flying / groups-off per figure, their median and range: a
    round pairs two runs minutes apart, so its ratio cancels the machine's drift, and
    the spread says how far one round can be trusted."""
    fly, off = results["flying"], results["groups-off"]
    n = min(len(fly), len(off))
    head = ["figure", *(f"round {i + 1}" for i in range(n)), "median", "range"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (n + 2)]
    for key, label in ROUND_FIGURES:
        ratios = [a[key] / b[key] for a, b in zip(fly[:n], off[:n], strict=True)
                  if a.get(key) is not None and b.get(key)]
        if len(ratios) != n or not n:
            continue
        cells = [f"{r:.2f}" for r in ratios]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        lines.append(f"| {label} | " + " | ".join(cells)
                     + f" | {statistics.median(ratios):.2f} | {spread} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", help="checkpoint directory (default: the demo model)")
    p.add_argument("--server-args", default=DEFAULT_SERVER_ARGS,
                   help=f"flags for both servers (default {DEFAULT_SERVER_ARGS!r})")
    p.add_argument("--off-args", default="",
                   help="extra flags for the groups-off server only (e.g. to isolate one cause)")
    p.add_argument("--flying-args", default="",
                   help="extra flags for Flying's server only (e.g. --flying-decision-log PATH)")
    p.add_argument("--rate", type=float, default=6.0, help="Poisson request rate, req/s")
    p.add_argument("--num-prompts", type=int, default=120)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per system")
    p.add_argument("--out", help="output directory (default results/vs-groups-off-<time>)")
    p.add_argument("--timeout", type=float, default=900.0, help="limit per benchmark run, s")
    p.add_argument("--restart-swapped", action="store_true",
                   help="restart both servers after half the rounds (rounded up), started "
                        "in the other order, so the first-started server's advantage falls "
                        "on both systems (rounds.json says which started first per round; a "
                        "--flying-decision-log is rewritten by the second start)")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="a server of its own per benchmark run, stopped after it: nothing "
                        "else resident during a run (one start-up per run)")
    args = p.parse_args(argv)
    if args.one_at_a_time and args.restart_swapped:
        p.error("--one-at-a-time and --restart-swapped exclude each other")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    out = prepare(args, "vs-groups-off")
    servers: dict[str, Server] = {}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in SYSTEMS}
    own = {"flying": args.flying_args, "groups-off": args.off_args}
    half = (args.rounds + 1) // 2 if args.restart_swapped else args.rounds
    first: list[str] = []  # per round: the server started first
    starts: Sequence[str] = START_ORDER
    try:
        for rnd in range(args.rounds):
            if rnd in (0, half) and not args.one_at_a_time:
                stop_all(servers)
                starts = START_ORDER if rnd == 0 else tuple(reversed(START_ORDER))
                start_systems(args.model_path, args.server_args, out, own, servers,
                              order=starts, tag="" if rnd == 0 else ".swapped")
            first.append("none (one at a time)" if args.one_at_a_time else starts[0])
            order = list(SYSTEMS) if rnd % 2 == 0 else list(reversed(SYSTEMS))
            for name in order:
                if args.one_at_a_time:
                    stop_all(servers)
                    start_systems(args.model_path, args.server_args, out, own, servers,
                                  order=(name,), tag=f".round{rnd}")
                res_path = out / f"{name}.round{rnd}.jsonl"
                cmd = bench_command(servers[name].url, args, seed=rnd + 1, out=res_path)
                cmd.append("--output-details")
                log(f"round {rnd + 1}/{args.rounds} {name}: {shlex.join(cmd[1:])}")
                result = run_sglang(cmd, res_path, out / f"{name}.round{rnd}.log", args.timeout)
                result["max_itl_ms"] = max_itl_ms(result)
                results[name].append({k: result.get(k) for k, _, _ in FIGURES})
                log(f"  {name}: TTFT p90 {result['p90_ttft_ms']:.1f} ms, "
                    f"ITL max {result['max_itl_ms']:.1f} ms, "
                    f"{result['output_throughput']:.1f} tok/s")
    finally:
        stop_all(servers)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "rounds.json").write_text(json.dumps({"started_first": first}) + "\n")
    text = table(results) + "\n\nPer round, flying / groups-off:\n\n" + rounds_table(results)
    text += "\n\n" + pooled.report(out)
    (out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
