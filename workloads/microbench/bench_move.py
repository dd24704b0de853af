"""Cost of moving a running request between layouts, per 1k tokens of context.

One Flying server (``--dp-size 2 --flying-move-to-dp all``). For each context length:

- TP -> DP: a TP-2 request with that prompt starts in a group; as soon as it decodes, a
  short DP request arrives and the session hands the request to DP on a member (its
  KV head shards gathered from the other member). The ``move_ms_sum`` /
  ``moved_tokens`` / ``moved_bytes`` deltas (``/flying/status``) of the member that took
  it give the cost (before session 60 the leader's only: a move onto the other member
  went uncounted, hence runs of "1/3"); the other member's ``move_ms_sum`` delta is how
  long the sender's own DP work paused for it (publishing its rows), and the taker's
  ``moved_peer_steps`` how many steps the sender ran while the move was in flight.
- DP -> TP: a DP request with that prompt runs on engine 0; a short TP-2 request binds
  the group and the running request joins it (its KV scattered into both members'
  shards). The leader's ``join_ms_sum`` / ``moved_tokens_to_tp`` deltas give the cost.

- DP -> TP-2 (upgrade), with ``--upgrade-contexts``: a server whose engines hold about
  that many tokens of KV (``--max-total-tokens``); a request without max_new_tokens
  runs on engine 1 until it outgrows it and the group [0, 1] takes it with its KV from
  engine 1 (``flying.session.upgrade``). Same counters as a join.

Each is repeated ``--repeats`` times; the table has the medians. Not a test: the numbers
depend on the machine.

    python -m workloads.bench_move [--model-path DIR] [--contexts 256,1024,2048]
        [--upgrade-contexts 1024] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import requests

from workloads.microbench.bench_switch import _prompts, _serve

TP2 = {"X-Flying-TP": "2"}


def _engines(server) -> dict[int, dict]:
    """Every engine's status, by rank."""
    doc = requests.get(server.url + "/flying/status", timeout=30).json()
    return {e["rank"]: e for e in doc["engines"]}


def _leader(server) -> dict:
    return _engines(server)[0]


def _generate(server, ids: list[int], new: int, headers: dict | None = None, **extra) -> None:
    payload = {
        "input_ids": ids, **extra,
        "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
    }
    r = requests.post(server.url + "/generate", json=payload, headers=headers or {}, timeout=600)
    r.raise_for_status()


#: Seconds between status polls. Each poll costs the HTTP server CPU that the engines'
#: two cores would otherwise have during the move it waits for; the move's cost is
#: timed in the server, so a coarser poll loses nothing.
POLL_S = 0.1


def _wait(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def _moved_on(before: dict[int, dict], after: dict[int, dict]) -> int | None:
    """The engine that took a moved request into DP (its ``moved_to_dp`` rose), if any:
    the member it lands on, which need not be the leader."""
    return next((r for r in after if after[r]["moved_to_dp"] > before[r]["moved_to_dp"]), None)


def _one(server, ids: list[int], to_dp: bool) -> tuple[float, int, int] | None:
    """One move; (ms, tokens, bytes received), or None if none happened. A move to DP is
    timed on the member that took the request (its copy is on the request's path); a
    join on the leader."""
    engines_before = _engines(server)
    before = engines_before[0]  # the leader (``_leader``)
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
    if to_dp:
        moved = _wait(lambda: _moved_on(engines_before, _engines(server)) is not None, 10)
    else:
        moved = _wait(lambda: _leader(server)["moved_to_tp"] > before["moved_to_tp"], 10)
    long.join(timeout=600)
    if not moved:
        return None
    if to_dp:
        engines_after = _engines(server)
        rank = _moved_on(engines_before, engines_after)
        b, a = engines_before[rank], engines_after[rank]
        sb, sa = engines_before[1 - rank], engines_after[1 - rank]  # the sender
        return (a["move_ms_sum"] - b["move_ms_sum"], a["moved_tokens"] - b["moved_tokens"],
                a["moved_bytes"] - b["moved_bytes"], sa["move_ms_sum"] - sb["move_ms_sum"],
                a.get("moved_peer_steps", 0) - b.get("moved_peer_steps", 0))
    after = _leader(server)
    return (after["join_ms_sum"] - before["join_ms_sum"],
            after["moved_tokens_to_tp"] - before["moved_tokens_to_tp"], 0)


def _upgrade(server, seed: int) -> tuple[float, int, int] | None:
    """One request outgrows engine 1 into the group; (the leader's join ms, the tokens
    that joined, 0) or None if it did not."""
    before = _engines(server)
    ids = _prompts(1, 32, seed=seed)[0]
    payload = {"input_ids": ids, "routed_dp_rank": 1,
               "sampling_params": {"max_new_tokens": None, "temperature": 0, "ignore_eos": True}}
    requests.post(server.url + "/generate", json=payload, timeout=900).raise_for_status()
    after = _engines(server)
    if after[1]["upgraded"] == before[1]["upgraded"]:
        return None
    return (after[0]["join_ms_sum"] - before[0]["join_ms_sum"],
            after[1]["moved_tokens_to_tp"] - before[1]["moved_tokens_to_tp"], 0)


def _upgrade_rows(model_args: list[str], contexts: list[int], repeats: int, out: Path) -> list[str]:
    from flying.session.upgrade import AHEAD

    rows = []
    for n in contexts:
        server = _serve(
            [*model_args, "--dp-size", "2", "--max-total-tokens", str(n + AHEAD + 2),
             "--flying-policy", "static-dp"],
            out / f"server-upgrade-{n}.log",
        )
        try:
            got = [g for g in (_upgrade(server, 900 + i) for i in range(repeats)) if g is not None]
        finally:
            server.stop()
        rows.append(_row("DP -> TP-2 (upgrade)", n, got, repeats, "the same, holder -> member"))
    return rows


def _row(direction: str, n: int, got: list, repeats: int, peer: str) -> str:
    if not got:
        return f"| {direction} | {n} | 0/{repeats} | | | | |"
    ms = statistics.median(g[0] for g in got)
    tokens = statistics.median(g[1] for g in got)
    return (f"| {direction} | {n} | {len(got)}/{repeats} | {tokens:.0f} | "
            f"{ms:.2f} | {ms / (tokens / 1000):.2f} | {peer} |")


def run(model_args: list[str], contexts: list[int], repeats: int, out: Path,
        upgrade_contexts: list[int] | None = None) -> str:
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
                nbytes = statistics.median(g[2] for g in got) if got else 0
                peer = "the same, leader -> member"
                if to_dp and got:  # and what the sender's own DP work saw of the move
                    peer = (f"{nbytes / 2**20:.2f} MiB; the sender paused "
                            f"{statistics.median(g[3] for g in got):.2f} ms and stepped "
                            f"{statistics.median(g[4] for g in got):.0f}x meanwhile")
                rows.append(_row("TP-2 -> DP" if to_dp else "DP -> TP-2", n, got, repeats, peer))
    finally:
        server.stop()
    rows += _upgrade_rows(model_args, upgrade_contexts or [], repeats, out)
    table = "\n".join(rows)
    (out / "table.md").write_text(table + "\n")
    return table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the embedded demo model")
    p.add_argument("--contexts", default="256,1024,2048")
    p.add_argument("--upgrade-contexts", default="",
                   help="also measure the long-context upgrade at these contexts (one server each)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("results/bench_move"))
    a = p.parse_args(argv)
    model_args = ["--model-path", a.model_path] if a.model_path else []
    if not model_args:
        from flying.node.demo_model import ensure_demo_model

        model_args = ["--model-path", str(ensure_demo_model())]
    contexts = [int(x) for x in a.contexts.split(",")]
    upgrade_contexts = [int(x) for x in a.upgrade_contexts.split(",") if x]
    print(run(model_args, contexts, a.repeats, a.out, upgrade_contexts))


if __name__ == "__main__":
    main()
