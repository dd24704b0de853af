"""``flying.session.grammar.settle``: a TP request SGLang queued for its grammar leaves the
grammar queue for the waiting queue where it is handed in, never at a later step.

The grammar manager here is a test double of SGLang's (its queue and its
``get_ready_grammar_requests``: ready futures move, the rest stay); the real one is
exercised on live servers (``tests/integration/test_constrained.py``)."""

from __future__ import annotations

import threading
from concurrent import futures
from types import SimpleNamespace

import pytest

from flying.session import grammar

pytestmark = pytest.mark.unit


class Manager:
    def __init__(self, sync_size: int = 1):
        self.grammar_queue: list = []
        self.grammar_sync_size = sync_size

    def get_ready_grammar_requests(self) -> list:
        ready = [r for r in self.grammar_queue
                 if not isinstance(r.grammar, futures.Future) or r.grammar.done()]
        self.grammar_queue = [r for r in self.grammar_queue if r not in ready]
        return ready


class Scheduler:
    def __init__(self, manager: Manager):
        self.grammar_manager = manager
        self.waiting_queue: list = []

    def _add_request_to_queue(self, req) -> None:
        self.waiting_queue.append(req)


def _req(rid: str, grammar_value=None) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, grammar=grammar_value)


def test_a_request_not_queued_is_left_alone():
    sched = Scheduler(Manager())
    sched.waiting_queue.append(_req("a", "compiled"))
    grammar.settle(sched, "a")
    assert [r.rid for r in sched.waiting_queue] == ["a"]


def test_a_queued_request_is_waited_for_and_moved_to_the_waiting_queue():
    sched = Scheduler(Manager())
    fut: futures.Future = futures.Future()
    sched.grammar_manager.grammar_queue.append(_req("a", fut))
    threading.Timer(0.05, fut.set_result, args=("compiled",)).start()
    grammar.settle(sched, "a")
    assert [r.rid for r in sched.waiting_queue] == ["a"]
    assert sched.grammar_manager.grammar_queue == []


def test_a_grammar_that_fails_to_compile_is_moved_for_sglang_to_abort():
    sched = Scheduler(Manager())
    fut: futures.Future = futures.Future()
    fut.set_exception(ValueError("bad schema"))
    sched.grammar_manager.grammar_queue.append(_req("a", fut))
    grammar.settle(sched, "a")
    assert [r.rid for r in sched.waiting_queue] == ["a"]


def test_a_grammar_not_ready_in_time_raises(monkeypatch):
    monkeypatch.setattr(grammar, "WAIT_S", 0.01)
    sched = Scheduler(Manager())
    sched.grammar_manager.grammar_queue.append(_req("a", futures.Future()))
    with pytest.raises(grammar.GrammarTimeout, match="a"):
        grammar.settle(sched, "a")
    assert sched.waiting_queue == []


def test_an_engine_of_several_ranks_is_refused():
    sched = Scheduler(Manager(sync_size=2))
    sched.grammar_manager.grammar_queue.append(_req("a", futures.Future()))
    with pytest.raises(RuntimeError, match="one-rank"):
        grammar.settle(sched, "a")


def test_a_request_left_in_the_grammar_queue_by_a_fault_is_rerun_in_dp():
    """A compile that did not finish where the request was handed in leaves it in the
    session's grammar queue; a failed session's containment re-runs it in DP (it was
    handed, so only the queues name it) and empties that queue."""
    from flying.session import containment

    sched = Scheduler(Manager())
    queued = SimpleNamespace(rid="a", grammar=futures.Future(), finished_output=False,
                             send_token_offset=0, kv=SimpleNamespace(holds_kv=False))
    sched.grammar_manager.grammar_queue.append(queued)
    sched.running_batch = SimpleNamespace(reqs=[])
    sched.last_batch = sched.chunked_req = None
    assert containment.session_reqs(sched) == [queued]
    tokenized = {"a": "the request as it arrived"}
    rerun, resume = containment.abandon(sched, True, "grammar", tokenized, {"a"})
    assert rerun == ["the request as it arrived"] and resume == []
    assert sched.grammar_manager.grammar_queue == []
