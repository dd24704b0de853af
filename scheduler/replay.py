"""Replay the policy offline from the decision log a server writes (JSON lines).

The DP controller writes one line per decision it makes (``--flying-decision-log``):
``{"request": {...}, "loads": [...], "costs": {...}, "decision": {...}}``, and for the
adaptive goodput rule also its other inputs (``traffic``: the arrival estimate,
``switch``: measured switch costs, ``slo``: the node's SLOs) and what it predicted
(``predictions``: per layout, goodput, TTFT, TPOT, output rate). Replaying
feeds the same inputs to a fresh ``Policy`` (in order, so the hysteresis state evolves
the same way) and reports every decision that differs: the server's decisions are
reproducible offline, and a changed policy can be checked against real traffic before
it ships::

    python -m scheduler.replay decisions.jsonl --engines 2 --degrees 2 --capacity 2042
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import asdict

from scheduler.policy import (
    Costs,
    Decision,
    EngineLoad,
    Node,
    Policy,
    PolicyConfig,
    Request,
    Slo,
    SwitchCosts,
    Traffic,
)


def record(
    req: Request, loads: list[EngineLoad] | None, decision: Decision, costs: Costs | None = None,
    traffic: Traffic | None = None, switch: SwitchCosts | None = None, slo: Slo | None = None,
    **context,
) -> str:
    """One log line: the policy's inputs and its decision (``context``: extra fields a
    reader may want, e.g. the request id, time and predictions; replay ignores them)."""
    doc = {
        **context,
        "request": asdict(req),
        "loads": [asdict(e) for e in loads] if loads is not None else None,
        "costs": costs.to_json() if costs is not None else None,
        "decision": asdict(decision),
    }
    for name, value in (("traffic", traffic), ("switch", switch), ("slo", slo)):
        if value is not None:
            doc[name] = asdict(value)
    return json.dumps(doc)


def replay(
    lines: Iterable[str], config: PolicyConfig, node: Node
) -> tuple[int, list[tuple[int, Decision, Decision]]]:
    """(decisions replayed, [(line number, recorded, replayed)] for every placement (mode,
    degree) or reason that differs)."""
    policy = Policy(config.validate(), node)
    diffs, n = [], 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        ev = json.loads(line)
        loads = None if ev["loads"] is None else [EngineLoad(**e) for e in ev["loads"]]
        if ev.get("slo") and not (config.slo_ttft_ms or config.slo_tpot_ms):
            policy.slo = Slo(**ev["slo"])  # the node's SLOs as it used them
        traffic = Traffic(**ev["traffic"]) if ev.get("traffic") else None
        switch = SwitchCosts(**ev["switch"]) if ev.get("switch") else None
        got = policy.decide(
            Request(**ev["request"]), loads, Costs.from_json(ev.get("costs")), traffic, switch
        )
        want = Decision(**ev["decision"])
        n += 1
        if got != want:
            diffs.append((i, want, got))
    return n, diffs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scheduler.replay", description=__doc__.split("\n")[0])
    ap.add_argument("log", help="a decision log written with --flying-decision-log")
    ap.add_argument("--config", help="the log's first line names the node and config; "
                    "this JSON overrides config fields, e.g. '{\"tp_gain\": 0.2}'")
    args = ap.parse_args(argv)
    with open(args.log) as f:
        lines = f.read().splitlines()
    head = json.loads(lines[0])
    config = PolicyConfig(**{**head["config"], **json.loads(args.config or "{}")})
    node = Node(**{**head["node"], "degrees": tuple(head["node"]["degrees"])})
    n, diffs = replay(lines[1:], config, node)
    for i, want, got in diffs:
        print(f"line {i + 2}: logged {want.mode}/{want.degree} ({want.reason}) -> "
              f"replayed {got.mode}/{got.degree} ({got.reason})")
    print(f"{n} decisions replayed, {len(diffs)} differ")
    return 1 if diffs else 0


if __name__ == "__main__":
    raise SystemExit(main())
