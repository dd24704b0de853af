"""The simulator's event loop, and the check that no engines wait on each other's binds."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence


class Loop:
    """Events in time order (ties: in the order they were scheduled)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list = []
        self._seq = 0

    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._heap, (t, self._seq, fn, args))
        self._seq += 1

    def run(self, after: Callable[[], None] | None = None) -> None:
        while self._heap:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)
            if after is not None:
                after()


def assert_no_wait_cycle(engines: Sequence) -> None:
    """No cycle of engines waiting in rendezvous for binds held up by each other."""
    waits: dict[int, list[int]] = {}
    for e in engines:
        if e.state == "rdv":
            bind = e.pending[0]
            waits[e.rank] = [r for r in bind.ranks if engines[r].state == "rdv"
                             and engines[r].pending[0] is not bind]
    seen: dict[int, int] = {}

    def visit(r: int) -> None:
        seen[r] = 1
        for nxt in waits.get(r, ()):
            assert seen.get(nxt) != 1, f"engines wait on each other's binds: {r} -> {nxt}"
            if nxt not in seen:
                visit(nxt)
        seen[r] = 2

    for r in waits:
        if r not in seen:
            visit(r)
