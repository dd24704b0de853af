"""Which engines a bind goes to: the controller's round robin over aligned groups.

``BindIssuer`` turns a decision (a degree, and for a mixed layout the engines its groups
may use) into one ``Bind`` per member, in the one order the controller issues them: the
total order of binds the deadlock argument rests on (``flying.node.controller``). Pure
bookkeeping that imports nothing of SGLang, so the simulator (``workloads.sim.control``)
uses it as the live node does.
"""

from __future__ import annotations

import itertools
import time
import uuid

from flying.session.messages import Bind, Upgrade, read_mark
from flying.substrate.layout import Group, group_containing, groups_of


class BindIssuer:
    """Chooses the group for a degree (round robin over its aligned groups, or over
    those within a mixed layout's group engines) and the DP engine for a request a
    mixed layout runs in DP (round robin over its DP engines), and makes the binds."""

    def __init__(self, num_engines: int, degrees: list[int]):
        self.num_engines = num_engines
        self.degrees = sorted(degrees)
        self._next = {m: itertools.cycle(groups_of(m, num_engines)) for m in degrees}
        self._within: dict[tuple, int] = {}  # (degree, engines) -> round-robin counter
        self.issued = 0

    def choose(self, degree: int, within: tuple[int, ...] = ()) -> Group:
        """The next group of ``degree``: of all its aligned groups, or (``within``, a
        mixed layout's group engines: ``Policy.engines_for``) of those inside it."""
        if degree not in self._next:
            raise ValueError(f"TP degree {degree} not available; allowed {sorted(self._next)}")
        inside = [g for g in groups_of(degree, self.num_engines)
                  if set(g.ranks) <= set(within)] if within else []
        if not inside:
            return next(self._next[degree])
        return inside[self._turn((degree, within), len(inside))]

    def dp_engine(self, within: tuple[int, ...], usable: set[int] | None = None) -> int | None:
        """The next of a mixed layout's DP engines (``within``) SGLang may dispatch to
        (``usable``; None: all), or None where none may."""
        ok = [r for r in within if usable is None or r in usable]
        return ok[self._turn((1, tuple(ok)), len(ok))] if ok else None

    def _turn(self, key: tuple, n: int) -> int:
        i = self._within.get(key, 0)
        self._within[key] = i + 1
        return i % n

    def make_binds(
        self, req, degree: int, group: Group | None = None, reason: str = "explicit",
        slo_tpot_ms: float = 0.0,
    ) -> list[tuple[int, Bind]]:
        """(engine rank, Bind) for every member; the request's marker is removed;
        ``slo_tpot_ms``: its TPOT SLO (``Bind.slo_tpot_ms``)."""
        req.routing_key = read_mark(req.routing_key).user_key
        group = group or self.choose(degree)
        bind = Bind(
            bind_id=uuid.uuid4().hex[:12],
            degree=degree,
            ranks=group.ranks,
            req=req,
            issued_at=time.time(),
            reason=reason,
            slo_tpot_ms=slo_tpot_ms,
        )
        self.issued += 1
        return [(rank, bind) for rank in group.ranks]

    def upgrade_binds(self, ask: Upgrade, degree: int) -> list[tuple[int, Bind]]:
        """(engine rank, Bind) for every member of the aligned group around the engine
        holding the request that asked (``flying.session.upgrade``)."""
        group = group_containing(degree, ask.holder)
        bind = Bind(uuid.uuid4().hex[:12], degree, group.ranks, None, time.time(), "long", ask)
        self.issued += 1
        return [(rank, bind) for rank in group.ranks]
