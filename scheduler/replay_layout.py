"""Replay of the engines' layout changes in a decision log: moves, joins, upgrades' joins.

Each engine of a group writes its own line for a layout change it takes part in
(``flying.session.layout_log``), with the values the members shared, the decision, and
its own share. Two kinds of check:

- per line, the pure decision (``scheduler.relayout``) re-run on the logged inputs gives
  the logged decision, and what the member measured agrees with it (a moved request's
  tokens where ``assign`` put it; a member's reservations where its room allows);
- per change (the lines of one bind), the members agreed: the same shared inputs and
  decision on every line, and, once every member's line is there, the MIN of their
  reservations is how many joined.

A group whose lines are not all there (a write failed) is checked line by line only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.relayout import (
    ADMISSION_SLACK,
    assign,
    joinable,
    reservable,
    running_budget,
    upgrade_total,
)

#: The kinds of line this module replays, in the order a report lists them.
KINDS = ("move", "join", "upgrade_join")
#: Per kind, the fields every member's line of one change must agree on.
_SHARED = {
    "move": ("lens", "rooms", "loads", "owners"),
    "join": ("lens", "budgets", "per_slot", "joined"),
    "upgrade_join": ("rows", "total", "joined"),
}


def check(ev: dict) -> list[str]:
    """What differs between one layout-change line and its replay ([] if nothing)."""
    return {"move": _move, "join": _join, "upgrade_join": _upgrade_join}[ev["kind"]](ev)


def _move(ev: dict) -> list[str]:
    lens, owners = ev["lens"], ev["owners"]
    got = assign(lens, ev["rooms"], ev["loads"])
    out = [] if got == owners else [f"assign gives {got}, logged {owners}"]
    if "requests" in ev:  # a member's share of a move it made
        me = ev["ranks"].index(ev["rank"])
        mine = [i for i, o in enumerate(owners or ()) if o == me]
        want = (len(mine), sum(lens[i] for i in mine))
        if owners is None or (ev["requests"], ev["tokens"]) != want:
            out.append(f"member {me} landed {ev['requests']} request(s), {ev['tokens']} tokens; "
                       f"the assignment gives it {want[0]}, {want[1]}")
    return out


def _join(ev: dict) -> list[str]:
    out = []
    if "requests" in ev:  # a member holding candidates: their budgets from their inputs
        reqs = ev["requests"]
        budgets = [running_budget(r["kv"], r["max_new_tokens"], r["outputs"]) for r in reqs]
        if not _within(list(zip([r["kv"] for r in reqs], budgets, strict=True)),
                       list(zip(ev["lens"], ev["budgets"], strict=True))):
            out.append(f"budgets {budgets}, not among the logged {ev['budgets']}")
    out += _reserved(ev, ev["budgets"])
    return out


def _within(part: list, whole: list) -> bool:
    """Whether ``part`` is a run of consecutive items of ``whole`` (a member's own
    candidates among every member's, which are listed in rank order)."""
    n = len(part)
    return any(whole[i : i + n] == part for i in range(len(whole) - n + 1))


def _upgrade_join(ev: dict) -> list[str]:
    src = ev["ranks"].index(ev["holder"])
    total = upgrade_total(ev["rows"], src, ev["per_slot"], ev["engine_slots"],
                          ev["context_limit"])
    out = [] if total == ev["total"] else [f"new total {total}, logged {ev['total']}"]
    if "reserved" in ev:
        out += _reserved(ev, [ev["total"] + ADMISSION_SLACK])
    return out


def _reserved(ev: dict, budgets: list[int]) -> list[str]:
    """A member's reservations: what its room holds, and no fewer than joined."""
    got = reservable(budgets, ev["room"], ev["per_slot"])
    out = [] if got == ev["reserved"] else [
        f"room {ev['room']} reserves {got}, logged {ev['reserved']}"]
    if ev["joined"] > ev["reserved"]:
        out.append(f"{ev['joined']} joined, but this member reserved {ev['reserved']}")
    return out


@dataclass
class Groups:
    """The lines of each change (kind, bind), for the checks across members."""

    lines: dict[tuple[str, str], list[tuple[int, dict]]] = field(default_factory=dict)

    def add(self, i: int, ev: dict) -> None:
        if ev["kind"] == "move" and ev["owners"] is None:
            return  # a refused move: the leader's line only, once per try
        self.lines.setdefault((ev["kind"], ev["bind"]), []).append((i, ev))

    def check(self) -> list[tuple[int, str, str]]:
        """(first line, kind, what differs) for every change whose members disagree."""
        out = []
        for (kind, bind), lines in self.lines.items():
            first, ev = lines[0]
            for name in _SHARED[kind]:
                values = [e.get(name) for _, e in lines]
                if any(v != values[0] for v in values):
                    out.append((first, kind, f"bind {bind}: members logged {name} {values}"))
            if len({e["rank"] for _, e in lines}) < ev["degree"]:
                continue  # a member's line is missing: nothing to sum over
            if kind == "move":
                landed = sum(e["requests"] for _, e in lines)
                if landed != len(ev["lens"]):
                    out.append((first, kind, f"bind {bind}: {landed} of {len(ev['lens'])} "
                                             "requests landed"))
            elif "reserved" in ev:
                agreed = joinable([e["reserved"] for _, e in lines])
                if agreed != ev["joined"]:
                    out.append((first, kind, f"bind {bind}: members reserved for {agreed}, "
                                             f"logged {ev['joined']} joined"))
        return out
