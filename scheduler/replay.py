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

    python -m scheduler.replay decisions.jsonl

Every layout change is in the same log, one line each with a ``kind``: "upgrade" (the
controller's answer to an engine's ask, ``Policy.upgrade``), and from the engines
"move", "join" and "upgrade_join" (``scheduler.replay_layout``: the pure relayout
decisions re-run on their logged inputs). A placement line has no kind (or "place"),
so older logs replay as before. The report counts, per kind, the lines replayed and
those that differ; the exit status is 1 if any differ.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from scheduler import replay_layout
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


def record_upgrade(holder: int, decision: Decision, from_degree: int = 1,
                   busy: dict[int, int] | None = None, **context) -> str:
    """One upgrade line: engine ``holder`` asked for a group for a running request it
    holds at degree ``from_degree`` (``context``: its id, the time), ``busy`` engines
    served groups, and ``Policy.upgrade(holder, from_degree, busy)`` answered ``decision``."""
    return json.dumps({"kind": "upgrade", **context, "holder": holder,
                       "from_degree": from_degree, "busy": {str(r): d for r, d in (busy or {}).items()},
                       "decision": asdict(decision)})


PLACE = "place"
#: Every kind of line, in the order the report lists them.
KINDS = (PLACE, "upgrade", *replay_layout.KINDS)


def _kind(ev: dict) -> str | None:
    """A line's kind; None for the head line (node and config)."""
    if "kind" not in ev and "config" in ev and "node" in ev:
        return None
    return ev.get("kind", PLACE)


class _Placer:
    """A fresh policy fed the logged placements in order (its hysteresis state evolves
    as the server's did), and asked the logged upgrades."""

    def __init__(self, config: PolicyConfig, node: Node):
        self.config = config.validate()
        self.policy = Policy(self.config, node)

    def place(self, ev: dict) -> tuple[Decision, Decision]:
        """(logged, replayed) decision of a placement line."""
        loads = None if ev["loads"] is None else [EngineLoad(**e) for e in ev["loads"]]
        traffic = Traffic(**ev["traffic"]) if ev.get("traffic") else None
        switch = SwitchCosts(**ev["switch"]) if ev.get("switch") else None
        got = self.policy.decide(
            Request(**ev["request"]), loads, Costs.from_json(ev.get("costs")), traffic, switch
        )
        return Decision(**ev["decision"]), got

    def upgrade(self, ev: dict) -> tuple[Decision, Decision]:
        busy = {int(r): int(d) for r, d in (ev.get("busy") or {}).items()}
        got = self.policy.upgrade(int(ev["holder"]), int(ev.get("from_degree", 1)), busy)
        return Decision(**ev["decision"]), got


def replay(
    lines: Iterable[str], config: PolicyConfig, node: Node
) -> tuple[int, list[tuple[int, Decision, Decision]]]:
    """(placements replayed, [(line number, recorded, replayed)] for every placement
    (mode, degree) or reason that differs). Lines of other kinds are skipped."""
    placer = _Placer(config, node)
    diffs, n = [], 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        ev = json.loads(line)
        if _kind(ev) != PLACE:
            continue
        want, got = placer.place(ev)
        n += 1
        if got != want:
            diffs.append((i, want, got))
    return n, diffs


@dataclass
class Replayed:
    """What a whole log replayed to: lines per kind, and each difference as (line
    number, kind, what differs)."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    diffs: list[tuple[int, str, str]] = field(default_factory=list)

    def differing(self, kind: str) -> int:
        """Lines of ``kind`` that differ (a change whose members disagree counts once)."""
        return len({i for i, k, _ in self.diffs if k == kind})


def replay_log(lines: Iterable[str], config: PolicyConfig | None,
               node: Node | None) -> Replayed:
    """Replay every line of a log: placements and upgrades through a fresh ``Policy``
    (``config`` and ``node``: from the head line; None if the log has none, which only
    a log of the engines' layout changes may lack), the engines' layout changes through
    ``scheduler.replay_layout``."""
    placer = _Placer(config, node) if config is not None and node is not None else None
    out, groups = Replayed(), replay_layout.Groups()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        ev = json.loads(line)
        kind = _kind(ev)
        if kind is None:
            continue
        if kind not in out.counts:
            out.diffs.append((i, kind, f"unknown kind {kind!r}"))
            continue
        out.counts[kind] += 1
        if kind in (PLACE, "upgrade"):
            if placer is None:
                out.diffs.append((i, kind, "no head line (node and config) to replay it with"))
                continue
            want, got = placer.place(ev) if kind == PLACE else placer.upgrade(ev)
            if got != want:
                out.diffs.append((i, kind, f"logged {_show(want)} -> replayed {_show(got)}"))
            continue
        out.diffs += [(i, kind, text) for text in replay_layout.check(ev)]
        groups.add(i, ev)
    out.diffs += groups.check()
    out.diffs.sort(key=lambda d: d[0])
    return out


def _show(d: Decision) -> str:
    return f"{d.mode}/{d.degree} ({d.reason})"


def _head(lines: list[str]) -> dict | None:
    """The log's head line (the controller writes it first; engines may have written
    before it where the controller started its log late)."""
    for line in lines:
        if line.strip():
            ev = json.loads(line)
            if _kind(ev) is None:
                return ev
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scheduler.replay", description=__doc__.split("\n")[0])
    ap.add_argument("log", help="a decision log written with --flying-decision-log")
    ap.add_argument("--config", help="the log's head line names the node and config; "
                    "this JSON overrides config fields, e.g. '{\"tp_gain\": 0.2}'")
    args = ap.parse_args(argv)
    try:
        with open(args.log) as f:
            lines = f.read().splitlines()
    except OSError as err:
        ap.error(f"cannot read the log: {err}")
    head = _head(lines)
    config = node = None
    if head is not None:
        config = PolicyConfig(**{**head["config"], **json.loads(args.config or "{}")})
        node = Node(**{**head["node"], "degrees": tuple(head["node"]["degrees"])})
    result = replay_log(lines, config, node)
    for i, kind, text in result.diffs:
        print(f"line {i + 1} ({kind}): {text}")
    for kind in KINDS:
        print(f"{kind}: {result.counts[kind]} replayed, {result.differing(kind)} differ")
    total = sum(result.counts.values())
    print(f"{total} decisions replayed, {len({i for i, _, _ in result.diffs})} differ")
    return 1 if result.diffs else 0


if __name__ == "__main__":
    raise SystemExit(main())
