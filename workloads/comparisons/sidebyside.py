"""The project's client and SGLang's serving benchmark measure one trace on one Flying server.

Two clients that disagree on a number are only comparable when they send the same requests
at the same times to the same server. This tool exports the trace to SGLang's Mooncake
format (``workloads.export``), rebuilds the project trace from that file with SGLang's own
loader (identical prompts, lengths and times), starts one server (or uses ``--url``), sends
one warm-up request, replays the trace with ``workloads.client``, then runs
``python -m sglang.benchmark.serving --dataset-name mooncake --use-trace-timestamps`` on it,
and prints one table: requests, TTFT p50/p90, TPOT p50, output throughput and goodput, each
client by its own definitions.

CLI::

    python -m workloads.sidebyside [--preset cpu-three-peak] [--model-path DIR] \\
        [--server-args "--dp-size 2"] [--goodput ttft:100 tpot:20] [--out DIR] [--url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import requests

from workloads.load.cli import add_goodput_args, add_trace_args, slos_from_args, trace_from_args
from workloads.load.export import (
    load_mooncake,
    load_tokenizer,
    mooncake_records,
    sglang_block_tokens,
    write_jsonl,
)
from workloads.measure.client import run_trace
from workloads.measure.metrics import Summary, summarize
from workloads.measure.records import save_records
from workloads.measure.server import Server, start_server

DEFAULT_SERVER_ARGS = "--dp-size 2 --enable-metrics"


def log(message: str) -> None:
    """One timestamped progress line."""
    print(f"[sidebyside {datetime.now():%H:%M:%S}] {message}", flush=True)


def warm_up(url: str, input_ids: list[int]) -> None:
    """One short request before the clients, as SGLang's benchmark sends before its run."""
    payload = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 4}}
    requests.post(url + "/generate", json=payload, timeout=120).raise_for_status()


def sglang_command(url: str, dataset: Path, n: int, slos: dict[str, float], out: Path,
                   headers: Sequence[str] = ()) -> list[str]:
    """The ``sglang.benchmark.serving`` command that replays ``dataset`` against ``url``."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang",
           "--host", host, "--port", port, "--dataset-name", "mooncake",
           "--dataset-path", str(dataset), "--num-prompts", str(n), "--use-trace-timestamps",
           "--goodput", *(f"{k}:{v:g}" for k, v in slos.items()),
           "--output-file", str(out), "--disable-tqdm"]
    return [*cmd, "--header", *headers] if headers else cmd


def run_sglang(cmd: Sequence[str], out: Path, log_path: Path, timeout_s: float) -> dict[str, Any]:
    """Run SGLang's benchmark; its result line (the last JSON line of ``out``)."""
    with open(log_path, "w") as logf:
        proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout_s,
                              check=False)
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"sglang.benchmark.serving exited {proc.returncode}:\n{tail}")
    return json.loads(out.read_text().strip().splitlines()[-1])


def row_ours(summary: Summary, n: int) -> list[str]:
    """The table row of the project's client."""
    o, tp, good = summary["overall"], summary["throughput"], summary["overall"].get("goodput")
    return ["workloads.client", f"{o['completed']}/{n}", _f(o["ttft_ms"]["p50"]),
            _f(o["ttft_ms"]["p90"]), _f(o["tpot_ms"]["p50"]), _f(tp["output_throughput"]),
            _f(good and good["request_goodput"], 2),
            _f(good and good["slo_attainment"] * 100.0)]


def row_sglang(result: dict[str, Any], n: int) -> list[str]:
    """The table row of SGLang's benchmark, from its result file."""
    return ["sglang.benchmark.serving", f"{result['completed']}/{n}",
            _f(result["median_ttft_ms"]), _f(result["p90_ttft_ms"]),
            _f(result["median_tpot_ms"]), _f(result["output_throughput"]),
            _f(result.get("request_goodput"), 2),
            _f(result["slo_attainment"] * 100.0 if "slo_attainment" in result else None)]


def _f(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{float(value):.{digits}f}"


def table(rows: Sequence[Sequence[str]], slos: dict[str, float]) -> str:
    """The markdown table of both clients."""
    slo = ", ".join(f"{k} {v:g} ms" for k, v in slos.items())
    head = ["client", "ok", "TTFT p50 (ms)", "TTFT p90", "TPOT p50 (ms)", "output tok/s",
            f"goodput req/s ({slo})", "SLO attainment %"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trace_args(parser, default_preset="cpu-three-peak")
    add_goodput_args(parser)
    parser.add_argument("--model-path", help="checkpoint directory (default: the demo model)")
    parser.add_argument("--server-args", default=DEFAULT_SERVER_ARGS,
                        help=f"flags for the server (default {DEFAULT_SERVER_ARGS!r})")
    parser.add_argument("--url", help="use this running server instead of starting one "
                        "(--model-path must then name its model, for the tokenizer)")
    parser.add_argument("--out", help="output directory (default results/sidebyside-<time>)")
    parser.add_argument("--timeout", type=float, default=900.0, help="limit per client, s")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Export, serve, run both clients one after the other, print the table."""
    args = parse_args(argv)
    slos = slos_from_args(args)
    if args.model_path:
        model = args.model_path
    else:
        from flying.node.demo_model import ensure_demo_model

        model = str(ensure_demo_model())
    out = Path(args.out or f"results/sidebyside-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    trace, source = trace_from_args(args)
    tokenizer = load_tokenizer(model)
    dataset = out / "trace.mooncake.jsonl"
    write_jsonl(mooncake_records(trace, sglang_block_tokens(tokenizer)), dataset)
    same = load_mooncake(dataset, tokenizer)
    log(f"{len(same)} requests over {same[-1].arrival_s:.1f} s ({source}); output in {out}")
    server: Server | None = None
    url = args.url
    if url is None:
        server_args = ["--model-path", model, *shlex.split(args.server_args)]
        log(f"starting python -m flying.launch {shlex.join(server_args)}")
        server, ready_s = start_server(server_args, out / "server.log", retries=1)
        url = server.url
        log(f"ready in {ready_s:.0f} s")
    try:
        warm_up(url, same[0].input_ids or [1])
        log("workloads.client: replaying")
        records = asyncio.run(run_trace(same, url, overall_timeout=args.timeout, progress=False))
        save_records(records, out / "client.records.jsonl")
        ours = summarize(records, slos=slos)
        (out / "client.summary.json").write_text(json.dumps(ours, indent=2) + "\n")
        cmd = sglang_command(url, dataset, len(same), slos, out / "sglang.result.jsonl")
        log(f"sglang.benchmark.serving: {shlex.join(cmd[1:])}")
        theirs = run_sglang(cmd, out / "sglang.result.jsonl", out / "sglang.log", args.timeout)
    finally:
        if server is not None:
            server.stop()
    text = table([row_ours(ours, len(same)), row_sglang(theirs, len(same))], slos)
    (out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
