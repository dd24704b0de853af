"""Multi-turn chat on Flying's defaults and on the same server with groups off.

A chat client sends each turn as the whole history (earlier prompts and answers) plus a
new message, after the user's think time. What a user sees is each turn's first token,
which depends on how much of the history the engine finds in its prefix cache. This
tool starts both servers (``workloads.vs_groups_off``'s two systems), then runs the
same conversations on each, one conversation at a time, alternating the systems per
conversation, each turn streamed on ``/generate`` with token ids (greedy, the answer's
length fixed) and its TTFT, end-to-end time and ``cached_tokens`` recorded. It prints,
per system and as the ratio flying / groups-off, the first turn's, the second turn's and
the later turns' TTFT p50 and p90, the later turns' E2E p50 and the share of their
prompt tokens found cached.

CLI::

    python -m workloads.chat_turns [--model-path DIR] [--conversations 4] [--turns 8] \\
        [--system-len 200] [--message-len 120] [--answer-len 32] [--think-s 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from datetime import datetime

import requests

from workloads.comparisons.vs_groups_off import (
    DEFAULT_SERVER_ARGS,
    SYSTEMS,
    prepare,
    start_systems,
    stop_all,
)
from workloads.measure.server import Server


def log(message: str) -> None:
    print(f"[chat_turns {datetime.now():%H:%M:%S}] {message}", flush=True)


def turn(url: str, ids: list[int], answer_len: int) -> dict:
    """One streamed turn: TTFT and E2E (ms), cached tokens, the answer's ids."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {
        "max_new_tokens": answer_len, "temperature": 0, "ignore_eos": True}}
    start, ttft, last = time.perf_counter(), None, None
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            text = line.decode()
            if not text.startswith("data:") or text == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            last = json.loads(text[5:])
    if last is None or ttft is None:
        raise RuntimeError(f"no tokens streamed from {url}")
    return {"prompt": len(ids), "cached": int(last["meta_info"].get("cached_tokens") or 0),
            "ttft_ms": ttft * 1e3, "e2e_ms": (time.perf_counter() - start) * 1e3,
            "answer": last["output_ids"]}


def conversation(url: str, seed: int, args: argparse.Namespace) -> list[dict]:
    """One conversation of ``args.turns`` turns (the same ids for a seed on any server)."""
    rng = random.Random(seed)
    history = [rng.randrange(5, 500) for _ in range(args.system_len)]
    rows = []
    for t in range(args.turns):
        ids = history + [rng.randrange(5, 500) for _ in range(args.message_len)]
        row = turn(url, ids, args.answer_len)
        row["turn"] = t
        rows.append(row)
        history = ids + row.pop("answer")
        time.sleep(args.think_s)
    return rows


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def figures(rows: list[dict]) -> dict[str, float]:
    first = [r["ttft_ms"] for r in rows if r["turn"] == 0]
    second = [r["ttft_ms"] for r in rows if r["turn"] == 1]
    later = [r for r in rows if r["turn"] >= 2]
    return {
        "TTFT p50, turn 1": statistics.median(first),
        "TTFT p50, turn 2": statistics.median(second),
        "TTFT p50, turns 3+": statistics.median(r["ttft_ms"] for r in later),
        "TTFT p90, turns 3+": _p([r["ttft_ms"] for r in later], 0.9),
        "E2E p50, turns 3+": statistics.median(r["e2e_ms"] for r in later),
        "cached share, turns 3+": sum(r["cached"] for r in later) / sum(r["prompt"] for r in later),
    }


def table(rows: dict[str, list[dict]]) -> str:
    figs = {name: figures(r) for name, r in rows.items()}
    lines = ["| figure | flying | groups-off | flying / groups-off |", "|---|---:|---:|---:|"]
    for key in figs["flying"]:
        a, b = figs["flying"][key], figs["groups-off"][key]
        ratio = f"{a / b:.2f}" if b else "-"
        fmt = "{:.2f}" if key.startswith("cached") else "{:.0f}"
        lines.append(f"| {key} | {fmt.format(a)} | {fmt.format(b)} | {ratio} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", help="checkpoint directory (default: the demo model)")
    p.add_argument("--server-args", default=DEFAULT_SERVER_ARGS,
                   help=f"flags for both servers (default {DEFAULT_SERVER_ARGS!r})")
    p.add_argument("--flying-args", default="", help="extra flags for Flying's server only")
    p.add_argument("--conversations", type=int, default=4, help="conversations per system")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-len", type=int, default=200, help="the first prompt's history")
    p.add_argument("--message-len", type=int, default=120, help="each turn's new message")
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--think-s", type=float, default=2.0, help="pause between turns")
    p.add_argument("--out", help="output directory (default results/chat-turns-<time>)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    out = prepare(args, "chat-turns")
    servers: dict[str, Server] = {}
    rows: dict[str, list[dict]] = {name: [] for name in SYSTEMS}
    try:
        start_systems(args.model_path, args.server_args, out, {"flying": args.flying_args},
                      servers, say=log)
        for c in range(args.conversations):
            order = list(SYSTEMS) if c % 2 == 0 else list(reversed(SYSTEMS))
            for name in order:
                got = conversation(servers[name].url, seed=c + 1, args=args)
                for r in got:
                    r["conversation"] = c
                rows[name] += got
                log(f"conversation {c + 1}/{args.conversations} {name}: TTFT "
                    + " ".join(f"{r['ttft_ms']:.0f}" for r in got) + " ms, cached "
                    + " ".join(str(r["cached"]) for r in got))
    finally:
        stop_all(servers)
    (out / "turns.json").write_text(json.dumps(rows, indent=1) + "\n")
    text = table(rows)
    (out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
