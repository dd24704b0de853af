"""Replay the policy offline from a recorded event log (JSON lines).

Each line is one decision the server made: ``{"request": {...}, "loads": [...],
"decision": {...}}``. Replaying feeds the same inputs to a fresh ``Policy`` (in order, so
the hysteresis state evolves the same way) and reports every decision that differs:
a changed policy can be checked against real traffic before it ships.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict

from scheduler.policy import Decision, EngineLoad, Node, Policy, PolicyConfig, Request


def record(req: Request, loads: list[EngineLoad] | None, decision: Decision) -> str:
    return json.dumps(
        {
            "request": asdict(req),
            "loads": [asdict(e) for e in loads] if loads is not None else None,
            "decision": asdict(decision),
        }
    )


def replay(lines: Iterable[str], config: PolicyConfig, node: Node) -> list[tuple[int, Decision, Decision]]:
    """(line number, recorded, replayed) for every placement (mode, degree) that differs."""
    policy = Policy(config.validate(), node)
    diffs = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        ev = json.loads(line)
        loads = None if ev["loads"] is None else [EngineLoad(**e) for e in ev["loads"]]
        got = policy.decide(Request(**ev["request"]), loads)
        want = Decision(**ev["decision"])
        if (got.mode, got.degree) != (want.mode, want.degree):
            diffs.append((i, want, got))
    return diffs
