"""When a group step's result may stay queued for SGLang's overlap loop (``overlap``)."""

from __future__ import annotations

import dataclasses
from collections import deque
from types import SimpleNamespace

import pytest

from flying.session import overlap
from flying.session.admission import UPGRADE_OFFER
from flying.session.exchange import Shared

pytestmark = pytest.mark.unit


def _running() -> Shared:
    return Shared(offers=[], aborts=[], dp_waiting=0, busy=1)


def test_a_plain_boundary_keeps_the_result_and_admission_does_too():
    assert overlap.keeps(_running())
    assert overlap.keeps(dataclasses.replace(_running(), offers=[17]))


def test_a_prefill_with_nothing_else_running_keeps_its_result_as_sglangs_tp_does():
    """The exchange of a prefill step with nothing else running reads "done" (its request
    joins the running batch at the next formation): its first token waits for the next
    step, as in SGLang's own TP, not sent a step early with a two-step gap after it."""
    prefill = dataclasses.replace(_running(), busy=0)
    assert prefill.done and overlap.keeps(prefill)


@pytest.mark.parametrize("field, value", [
    ("aborts", [5]), ("dp_waiting", 1), ("dp_held", 1), ("dp_arrived", 1),
    ("parking", 2), ("offers", [UPGRADE_OFFER + 3]),
])
def test_anything_that_needs_the_requests_up_to_date_processes_it(field, value):
    assert not overlap.keeps(dataclasses.replace(_running(), **{field: value}))


def _batch(i: int, last: bool = False, all_last: bool = False):
    reqs = [SimpleNamespace(next_output_finishes_by_length=lambda: all_last),
            SimpleNamespace(next_output_finishes_by_length=lambda: last or all_last)]
    return SimpleNamespace(name=f"batch{i}", reqs=reqs)


class _Scheduler:
    def __init__(self, queued: int, last: bool = False, all_last: bool = False):
        self.result_queue = deque((_batch(i, last, all_last), f"result{i}")
                                  for i in range(queued))
        self.last_batch = "last"
        self.processed: list = []

    def process_batch_result(self, batch, result):
        self.processed.append((batch, result))


def test_a_kept_result_is_left_for_the_loop_and_a_processed_one_is_not_popped_twice():
    result, sched = overlap.PendingResult(), _Scheduler(1)
    assert result.keep(sched) and result.kept
    result.formed(sched)  # the loop pops it after the next step: nothing done here
    assert not result.kept and sched.last_batch == "last" and len(sched.result_queue) == 1

    result.process(sched)
    assert [(b.name, r) for b, r in sched.processed] == [("batch0", "result0")]
    assert not sched.result_queue
    result.formed(sched)
    assert sched.last_batch is None  # the loop finds no last batch to pop


def test_nothing_queued_nothing_kept_and_the_normal_loop_has_no_queue():
    result = overlap.PendingResult()
    assert not result.keep(_Scheduler(0))
    assert not result.keep(SimpleNamespace())  # --disable-overlap-schedule
    result.process(SimpleNamespace())
    assert not result.processed


def test_a_result_whose_every_request_ends_is_not_kept():
    """Their last tokens go out now, not behind the next step (a prefill, maybe)."""
    result = overlap.PendingResult()
    assert not result.keep(_Scheduler(1, all_last=True)) and not result.kept


def test_a_result_where_one_request_ends_among_running_ones_is_kept():
    """Processed early, the running requests' tokens would go out a step early and
    their next gap would be two steps: kept, as SGLang's loop keeps it."""
    result = overlap.PendingResult()
    assert result.keep(_Scheduler(1, last=True)) and result.kept
