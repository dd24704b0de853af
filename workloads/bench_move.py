"""Cost of moving a running request between layouts, per 1k tokens of context.

One Flying server (``--dp-size 2 --flying-move-to-dp all``). For each context length:

- TP -> DP: a TP-2 request with that prompt starts in a group; as soon as it decodes, a
  short DP request arrives and the session hands the request to DP on a member (its
  KV head shards gathered from the other member). The leader's ``move_ms_sum`` /
  ``moved_tokens`` / ``moved_bytes`` deltas (``/flying/status``) give the cost.
- DP -> TP: a DP request with that prompt runs on engine 0; a short TP-2 request binds
  the group and the running request joins it (its KV scattered into both members'
  shards). The leader's ``join_ms_sum`` / ``moved_tokens_to_tp`` deltas give the cost.

Each is repeated ``--repeats`` times; the table has the medians. Not a test: the numbers
depend on the machine.

    python -m workloads.bench_move [--model-path DIR] [--contexts 256,1024,2048] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import requests

from workloads.bench_switch import _prompts, _serve

TP2 = {"X-Flying-TP": "2"}


def _leader(server) -> dict:
    doc = requests.get(server.url + "/flying/status", timeout=30).json()
    return next(e for e in doc["engines"] if e["rank"] == 0)


def _generate(server, ids: list[int], new: int, headers: dict | None = None, **extra) -> None:
    payload = {
        "input_ids": ids, **extra,
        "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
    }
    r = requests.post(server.url + "/generate", json=payload, headers=headers or {}, timeout=600)
    r.raise_for_status()


def _wait(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _one(server, ids: list[int], to_dp: bool) -> tuple[float, int, int] | None:
    """One move; (ms, tokens, bytes received by the leader), or None if none happened."""
    before = _leader(server)
    long_kw = {} if to_dp else {"routed_dp_rank": 0}
    long = threading.Thread(
        target=_generate, args=(server, ids, 256, TP2 if to_dp else None), kwargs=long_kw,
        daemon=True,
    )
    long.start()
    # Decoding: its prompt is prefilled (and, in a group, a few steps have run).
    if not _wait(lambda: _leader(server)["prefill_tokens"] - before["prefill_tokens"] >= len(ids), 300):
        raise TimeoutError("the long request did not start")
    time.sleep(0.2)
    _generate(server, ids[:8], 4, None if to_dp else TP2)
    key = "moved_to_dp" if to_dp else "moved_to_tp"
    moved = _wait(lambda: _leader(server)[key] > before[key], 10)
    long.join(timeout=600)
    if not moved:
        return None
    after = _leader(server)
    if to_dp:
        return (after["move_ms_sum"] - before["move_ms_sum"],
                after["moved_tokens"] - before["moved_tokens"],
                after["moved_bytes"] - before["moved_bytes"])
    return (after["join_ms_sum"] - before["join_ms_sum"],
            after["moved_tokens_to_tp"] - before["moved_tokens_to_tp"], 0)


def run(model_args: list[str], contexts: list[int], repeats: int, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    total = max(16384, 4 * max(contexts) + 2048)
    server = _serve(
        [*model_args, "--dp-size", "2", "--max-total-tokens", str(total),
         "--flying-policy", "static-dp", "--flying-tp-gain", "-10", "--flying-move-to-dp", "all"],
        out / "server.log",
    )
    rows = ["| direction | context tokens | moves | moved tokens | ms per move (median) | ms per 1k tokens | KV bytes between the members |",
            "|---|---|---|---|---|---|---|"]
    try:
        for n in contexts:
            for to_dp in (True, False):
                tries = [_one(server, _prompts(1, n, seed=100 * n + i + 7 * to_dp)[0], to_dp)
                         for i in range(repeats)]
                got = [g for g in tries if g is not None]
                if not got:
                    rows.append(f"| {'TP-2 -> DP' if to_dp else 'DP -> TP-2'} | {n} | 0/{repeats} | | | | |")
                    continue
                ms = statistics.median(g[0] for g in got)
                tokens = statistics.median(g[1] for g in got)
                nbytes = statistics.median(g[2] for g in got)
                peer = f"{nbytes / 2**20:.2f} MiB" if to_dp else "the same, leader -> member"
                rows.append(
                    f"| {'TP-2 -> DP' if to_dp else 'DP -> TP-2'} | {n} | {len(got)}/{repeats} | {tokens:.0f} | "
                    f"{ms:.2f} | {ms / (tokens / 1000):.2f} | {peer} |"
                )
    finally:
        server.stop()
    table = "\n".join(rows)
    (out / "table.md").write_text(table + "\n")
    return table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the embedded demo model")
    p.add_argument("--contexts", default="256,1024,2048")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("results/bench_move"))
    a = p.parse_args(argv)
    model_args = ["--model-path", a.model_path] if a.model_path else []
    if not model_args:
        from flying.node.demo_model import ensure_demo_model

        model_args = ["--model-path", str(ensure_demo_model())]
    contexts = [int(x) for x in a.contexts.split(",")]
    print(run(model_args, contexts, a.repeats, a.out))


if __name__ == "__main__":
    main()
