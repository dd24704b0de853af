"""Controller side of binding: turn a TP-marked request into one Bind per member.

Runs inside SGLang's DataParallelController process (the one place every request passes
through), which gives the one total order of binds the deadlock argument rests on: each
engine receives its binds in the order they were issued and runs them in that order.
"""

from __future__ import annotations

import itertools
import time
import uuid

from flying.layout import Group, groups_of
from flying.messages import Bind, unmark


class BindIssuer:
    """Chooses the group for a degree (round robin over its aligned groups) and sends."""

    def __init__(self, num_engines: int, degrees: list[int]):
        self.num_engines = num_engines
        self._next = {m: itertools.cycle(groups_of(m, num_engines)) for m in degrees}
        self.issued = 0

    def choose(self, degree: int) -> Group:
        if degree not in self._next:
            raise ValueError(f"TP degree {degree} not available; allowed {sorted(self._next)}")
        return next(self._next[degree])

    def make_binds(self, req, degree: int) -> list[tuple[int, Bind]]:
        """(engine rank, Bind) for every member; the request's marker is removed."""
        _, user_key = unmark(req.routing_key)
        req.routing_key = user_key
        group = self.choose(degree)
        bind = Bind(
            bind_id=uuid.uuid4().hex[:12],
            degree=degree,
            ranks=group.ranks,
            req=req,
            issued_at=time.time(),
        )
        self.issued += 1
        return [(rank, bind) for rank in group.ranks]
