"""The status writer: an engine's status reaches the store off the engine's loop."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from flying.session import engine as engine_mod
from flying.session.engine import FlyingEngine
from flying.session.status_writer import StatusWriter

pytestmark = pytest.mark.unit


class GatedStore:
    """A store whose ``set`` waits for ``gate`` (a launcher not scheduled yet)."""

    def __init__(self, fail_first: int = 0):
        self.gate = threading.Event()
        self.writes: list[tuple[str, str]] = []
        self.entered = threading.Event()
        self.fail_first = fail_first

    def set(self, key: str, value: str) -> None:
        self.entered.set()
        self.gate.wait(5)
        if self.fail_first:
            self.fail_first -= 1
            raise RuntimeError("connection reset")
        self.writes.append((key, value))


def _writer(store) -> StatusWriter:
    return StatusWriter(lambda: store, "flying/status/0")


def test_submit_returns_while_the_store_is_slow_and_the_latest_document_wins():
    store = GatedStore()
    w = _writer(store)
    w.submit("a")
    assert store.entered.wait(2)  # the thread is inside set("a"), held at the gate
    start = time.monotonic()
    seqs = [w.submit(doc) for doc in ("b", "c", "d")]
    assert time.monotonic() - start < 0.1
    assert not w.flush(seqs[-1], 0.05)  # not written yet: flush says so
    store.gate.set()
    assert w.flush(seqs[-1], 2)
    assert [v for _, v in store.writes] == ["a", "d"]  # b, c replaced before written
    assert {k for k, _ in store.writes} == {"flying/status/0"}
    w.close()


def test_a_failed_write_is_retried_on_a_new_connection():
    store = GatedStore(fail_first=1)
    store.gate.set()
    connects = []

    def connect():
        connects.append(1)
        return store

    w = StatusWriter(connect, "flying/status/1")
    w.submit("x")
    assert w.flush(1, 5)
    assert store.writes == [("flying/status/1", "x")] and len(connects) == 2
    w.close()


def _busy_engine(monkeypatch, inline_store, writer_store):
    monkeypatch.setattr(engine_mod.status, "document", lambda rank, eng, sched: f"doc{rank}")
    engine = FlyingEngine(dp_rank=0, pool=None, bind_timeout_s=1.0)
    engine.pool = SimpleNamespace(store=inline_store, members={})
    engine.status_out = _writer(writer_store)
    scheduler = SimpleNamespace(
        waiting_queue=["r"], running_batch=SimpleNamespace(is_empty=lambda: True)
    )
    return engine, scheduler


def test_a_timed_refresh_never_waits_on_the_store(monkeypatch):
    inline, slow = GatedStore(), GatedStore()
    inline.gate.set()
    engine, scheduler = _busy_engine(monkeypatch, inline, slow)
    start = time.monotonic()
    engine.publish(scheduler)  # became busy: nothing yet
    engine._status_at = 0.0  # and due
    engine.publish(scheduler)
    engine._status_at = 0.0  # and due again
    engine.publish(scheduler)
    assert time.monotonic() - start < 0.5  # the store is held for 5 s
    assert inline.writes == []  # not through the engine's own (shared) store client
    slow.gate.set()
    assert engine.status_out.flush(2, 2) and slow.writes[-1][1] == "doc0"


def test_becoming_busy_builds_no_document_falling_idle_does(monkeypatch):
    """The step that serves a request arriving at an idle engine is not held up by a
    status document; the engine falling idle publishes at once (nothing steps after),
    and so does a session starting (its mode and bind count)."""
    built = []
    engine, busy = _busy_engine(monkeypatch, GatedStore(), GatedStore())
    monkeypatch.setattr(engine_mod.status, "document",
                        lambda rank, eng, sched: built.append(rank) or f"doc{rank}")
    engine.publish(busy)
    assert built == []
    engine._status_at -= engine_mod.STATUS_EVERY_S  # a busy engine's timed refresh
    engine.publish(busy)
    assert built == [0]
    idle = SimpleNamespace(waiting_queue=[], running_batch=SimpleNamespace(is_empty=lambda: True))
    engine.publish(idle)
    assert built == [0, 0]
    engine.publish(idle)  # still idle, not due: nothing
    assert built == [0, 0]
    engine.session = SimpleNamespace(bind=SimpleNamespace(degree=2))  # a bind: an event
    engine.publish(busy)
    assert built == [0, 0, 0]
    engine.publish(busy)  # in the session, not due: nothing
    assert built == [0, 0, 0]
    engine.status_out.close()


def test_an_event_publish_is_in_the_store_before_the_engine_goes_on(monkeypatch):
    inline, store = GatedStore(), GatedStore()
    engine, scheduler = _busy_engine(monkeypatch, inline, store)
    threading.Timer(0.2, store.gate.set).start()
    engine.publish(scheduler, force=True)
    assert store.writes == [("flying/status/0", "doc0")]
