"""``flying.node.in_flight``: the controller counts a request it sent as waiting on the
engine that answers it until that engine's snapshot, stamped when its loop last took
input, shows it; SGLang's choice of engine is read at the worker socket it sends on."""

from __future__ import annotations

import pytest

from flying.node.in_flight import InFlight, Watched, watch
from scheduler.policy import EngineLoad

pytestmark = pytest.mark.unit


class Sock:
    def __init__(self):
        self.sent: list = []
        self.closed = False

    def send_pyobj(self, obj, **kwargs):
        self.sent.append(obj)

    def send(self, data, **kwargs):
        self.sent.append(data)

    def close(self):
        self.closed = True


def loads(*pairs):
    return [EngineLoad(r, run, wait) for r, (run, wait) in enumerate(pairs)]


def test_sends_after_an_engines_stamp_count_as_waiting_and_older_ones_are_forgotten():
    ledger = InFlight(2)
    for t in (1.0, 2.0, 3.0):
        ledger.note(0, t)
    ledger.note(1, 2.5)
    got = ledger.add(loads((1, 0), (0, 1)), {0: 1.5, 1: 3.0})
    assert [(e.running, e.waiting) for e in got] == [(1, 2), (0, 1)]
    assert list(ledger.sent[0]) == [2.0, 3.0] and not ledger.sent[1]
    got = ledger.add(loads((3, 0), (0, 0)), {0: 3.0, 1: 3.0})  # engine 0 took both
    assert [(e.running, e.waiting) for e in got] == [(3, 0), (0, 0)]


def test_a_watched_socket_counts_only_the_send_of_a_request_being_dispatched():
    ledger = InFlight(3)
    workers = [Sock(), None, Sock()]
    watch(workers, ledger)
    assert isinstance(workers[0], Watched) and workers[1] is None
    workers[2].send_pyobj("control")  # SGLang's messages to every engine: not requests
    with ledger.dispatching():
        workers[2].send(b"req")
        workers[0].send(b"a second send in the same dispatch is not another request")
    assert [len(s) for s in ledger.sent] == [0, 0, 1]
    workers[0].close()  # the rest is the socket's own
    assert workers[0]._sock.closed and workers[2]._sock.sent == ["control", b"req"]
    watch(workers, ledger)  # idempotent
    assert isinstance(workers[0]._sock, Sock)


def test_a_dispatch_that_raises_disarms_the_ledger():
    ledger = InFlight(1)
    workers = [Sock()]
    watch(workers, ledger)
    with pytest.raises(RuntimeError), ledger.dispatching():
        raise RuntimeError("no worker")
    workers[0].send(b"x")
    assert not ledger.sent[0]
