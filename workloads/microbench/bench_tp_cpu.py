"""End-to-end: one engine vs vanilla SGLang ``--tp-size 2`` on the CPU platform.

Serves a compute-heavier preset (the demo model's architecture scaled up until a decode
step is dominated by its GEMMs rather than by per-step Python work) with
``python -m flying.launch`` in turn as

- ``one``: ``--tp-size 1 --dp-size 1`` (one engine, all cores, one torch thread per core);
- ``tp2``: ``--tp-size 2 --dp-size 1`` (each rank pinned to its share of the cores),
  device collectives through Flying's shared-memory all-reduce;
- ``tp2-gloo``: the same with ``FLYING_SHM_ALLREDUCE=0``, i.e. every collective on gloo.

One server at a time, so they never share the cores. Each sends ``--requests`` single
requests one after another (greedy, fixed prompt and output lengths, after two warm-up
requests) and records the client-side latency. Prints a markdown table with the median
latency, the time per output token and each run's ratio to ``one``.

CLI::

    python -m workloads.bench_tp_cpu [--runs one,tp2,tp2-gloo] [--requests 8] \\
        [--prompt-len 64] [--new-tokens 32] [--hidden 1024] [--layers 8]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from workloads.measure.server import Server, start_server

RUNS = {
    "one": (["--tp-size", "1"], {}),
    "tp2": (["--tp-size", "2"], {}),
    "tp2-gloo": (["--tp-size", "2"], {"FLYING_SHM_ALLREDUCE": "0"}),
}


def heavy_spec(hidden: int, layers: int):
    """The demo architecture scaled up: same head dim ratio, GQA 4:1, MLP 2.75x hidden."""
    from flying.node.demo_model import DemoSpec

    heads = max(8, hidden // 64)
    return DemoSpec(
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(4, heads // 4),
        init_std=0.02,
    )


def generate(server: Server, ids: list[int], new_tokens: int) -> float:
    """Client-side latency (s) of one greedy request of exactly ``new_tokens`` tokens."""
    t0 = time.perf_counter()
    body = server.generate_ids(ids, new_tokens, timeout=600)
    assert len(body["output_ids"]) == new_tokens
    return time.perf_counter() - t0


@dataclass
class Result:
    name: str
    latencies: list[float]
    startup_s: float
    path_lines: list[str]

    @property
    def median(self) -> float:
        return statistics.median(self.latencies)


def run_one(name: str, model: Path, prompts: list[list[int]], new_tokens: int,
            log_dir: Path) -> Result:
    args, env = RUNS[name]
    print(f"{name}: starting", flush=True)
    server, startup = start_server(
        ["--model-path", str(model), "--dp-size", "1", "--max-total-tokens", "4096", *args],
        log_dir / f"{name}.log", env=env, retries=2, on_retry=print,
    )
    try:
        for p in prompts[:2]:
            generate(server, p, new_tokens)  # warm-up
        lat = [generate(server, p, new_tokens) for p in prompts[2:]]
    finally:
        server.stop()
    log = (log_dir / f"{name}.log").read_text(errors="replace")
    lines = sorted({ln.split("] ", 1)[-1] for ln in log.splitlines()
                    if "flying: group" in ln and ("uses" in ln or " via " in ln)})
    print(f"{name}: median {statistics.median(lat) * 1e3:.0f} ms", flush=True)
    return Result(name, lat, startup, lines)


def table(results: list[Result], new_tokens: int) -> str:
    base = next((r for r in results if r.name == "one"), results[0])
    out = ["| run | median latency (ms) | min (ms) | ms per output token | vs one |",
           "|---|---:|---:|---:|---:|"]
    for r in results:
        out.append(f"| {r.name} | {r.median * 1e3:.0f} | {min(r.latencies) * 1e3:.0f} | "
                   f"{r.median / new_tokens * 1e3:.1f} | {r.median / base.median:.2f}x |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="one,tp2,tp2-gloo")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    from flying.node.demo_model import ensure_demo_model

    spec = heavy_spec(args.hidden, args.layers)
    model = ensure_demo_model(spec)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(args.prompt_len)]
               for _ in range(args.requests + 2)]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench_tp_cpu_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results = [run_one(n, model, prompts, args.new_tokens, log_dir)
               for n in args.runs.split(",")]
    print(f"\nModel {spec.key()}; {args.requests} sequential requests, prompt "
          f"{args.prompt_len} tokens, {args.new_tokens} output tokens; {os.cpu_count()} cores; "
          f"logs in {log_dir}\n")
    print(table(results, args.new_tokens))
    for r in results:
        for line in r.path_lines:
            print(f"- {r.name}: {line}")


if __name__ == "__main__":
    main()
