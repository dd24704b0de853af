"""Requests the controller sent that the engines' load snapshots do not show yet.

An engine publishes its load snapshot (SGLang's ``LoadSnapshot``: running and waiting
requests) after a step, and takes new input only at the top of its loop. A request sent
while the engine runs a step (a group's prefill of a clump of arrivals runs for
seconds on a CPU) is in no snapshot until the engine has received it and published
again; the adaptive policy, which reads the snapshots at each arrival, saw an empty
node while the requests it had just placed queued. (Hidden-1024 model, Azure code
trace, session 76: 8 running and 0 waiting in every snapshot while 20-40 requests were
placed in the group and not yet prefilled; replayed with the loads the node had, the
policy keeps the group through the clump, where it switched to DP and its moves put 27
requests past the TPOT SLO.)

So the controller keeps each engine's sends (the time each request went out, the
engine that answers it: a group's leader for a bind) and adds to the engine's waiting
count those sent after the snapshot's ``timestamp``, which Flying's engines set to the
time their loop last took input (``FlyingEngine.count_load``): what an engine had
received is in its snapshot, what it had not is counted here. Sends older than an
engine's snapshot are forgotten. Same host, one clock (``time.time``).

Which engine SGLang's own dispatch chose is read where it sends: the worker sockets
are wrapped (``Watched``), and a send counts while a request is being dispatched
(``InFlight.dispatching``), so control messages SGLang sends to every engine do not.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator

from scheduler.policy import EngineLoad


class InFlight:
    """Per engine, the times requests were sent to it (``time.time``), oldest first."""

    def __init__(self, num_engines: int):
        self.sent: list[deque[float]] = [deque() for _ in range(num_engines)]
        self._armed = False

    def note(self, rank: int, t: float | None = None) -> None:
        if 0 <= rank < len(self.sent):
            self.sent[rank].append(time.time() if t is None else t)

    @contextlib.contextmanager
    def dispatching(self) -> Iterator[None]:
        """While SGLang dispatches one request: the send a ``Watched`` socket sees is it."""
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def sending(self, rank: int) -> None:
        """A ``Watched`` socket of engine ``rank`` is sending: count it if a request is
        being dispatched (once: the request's one send)."""
        if self._armed:
            self._armed = False
            self.note(rank)

    def add(self, loads: list[EngineLoad], stamps: dict[int, float]) -> list[EngineLoad]:
        """``loads`` (from snapshots taken at ``stamps``: rank -> timestamp) with each
        engine's sends after its stamp added as waiting; older sends are forgotten."""
        out = []
        for load in loads:
            sent = self.sent[load.rank] if 0 <= load.rank < len(self.sent) else deque()
            stamp = stamps.get(load.rank, 0.0)
            while sent and sent[0] <= stamp:
                sent.popleft()
            out.append(EngineLoad(load.rank, load.running, load.waiting + len(sent))
                       if sent else load)
        return out


class Watched:
    """A worker socket of the controller that tells ``InFlight`` when it sends; the
    rest is the socket's own."""

    def __init__(self, sock, rank: int, ledger: InFlight):
        self._sock, self._rank, self._ledger = sock, rank, ledger

    def send_pyobj(self, *args, **kwargs):
        self._ledger.sending(self._rank)
        return self._sock.send_pyobj(*args, **kwargs)

    def send(self, *args, **kwargs):
        self._ledger.sending(self._rank)
        return self._sock.send(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


def watch(workers, ledger: InFlight) -> None:
    """Wrap each of the controller's worker sockets (a list indexed by engine; None
    where this node runs no such engine) in place."""
    for rank, sock in enumerate(workers):
        if sock is not None and not isinstance(sock, Watched):
            workers[rank] = Watched(sock, rank, ledger)
