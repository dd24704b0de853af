"""Admission into a running group: a request within the session's spare KV takes no new
reservation; one beyond it reserves only the shortfall (``admission.spare_tokens``)."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import torch

from flying.session import admission
from flying.session.messages import Bind

LIMIT = 4096  # the engine's max_req_len (bounds a request without max_new_tokens)


def _req(rid: str, prompt: int, new: int | None, finished: bool = False):
    return SimpleNamespace(
        rid=rid, origin_input_ids=[1] * prompt, input_ids=[1] * prompt,
        sampling_params=SimpleNamespace(max_new_tokens=new), finished=lambda: finished,
    )


def _scheduler(running=(), waiting=()):
    return SimpleNamespace(
        waiting_queue=list(waiting), running_batch=SimpleNamespace(reqs=list(running)),
        last_batch=None, chunked_req=None,
    )


def test_spare_is_the_pool_less_every_unfinished_requests_bound():
    live, done = _req("a", 100, 60), _req("b", 50, 10, finished=True)
    waiting = _req("c", 20, 20)
    sched = _scheduler(running=[live, done], waiting=[waiting])
    bound = admission.kv_tokens_needed
    assert admission.spare_tokens(sched, 1000, LIMIT) == 1000 - bound(100, 60, LIMIT) - bound(20, 20, LIMIT)


class _Allocator:
    def __init__(self, free: int):
        self.free_slots = list(range(free))
        self.freed: list[int] = []

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int):
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, slots) -> None:
        self.freed.extend(int(s) for s in slots)


def _bind(rid: str, prompt: int, new: int) -> Bind:
    key = f"{len(rid):012x}"
    return Bind(bind_id=key, degree=2, ranks=(0, 1), req=_req(rid, prompt, new), issued_at=0.0)


def _admit(binds, capacity: int, running, dp_free: int):
    grown, handed, evicted = [], [], []
    cache = SimpleNamespace(token_to_kv_pool_allocator="the session's",
                            evict=lambda params: evicted.append(params.num_tokens))
    session = SimpleNamespace(
        prepared=SimpleNamespace(per_slot=2), capacity=capacity, dp_allocator=_Allocator(dp_free),
        dp_cache=cache, admitting=True, grow=grown.append, evicted=evicted,
        hand=lambda sched, req, reason: handed.append(req.rid),
    )
    engine = SimpleNamespace(pending=deque(binds), dp_limit=LIMIT,
                             aborts=SimpleNamespace(hits=lambda rid: False), poll=lambda s: None)
    member = SimpleNamespace(min_int=lambda n: n)
    keys = [admission.bind_key(b) for b in binds]
    n = admission.admit(engine, _scheduler(running=running), member, session, keys)
    return n, grown, handed, session


def test_a_request_within_the_spare_takes_no_reservation_and_one_beyond_it_the_shortfall():
    bound = admission.kv_tokens_needed
    running = [_req("a", 100, 60)]
    capacity = bound(100, 60, LIMIT) + bound(30, 10, LIMIT) + 6  # room for one more, plus 6
    fits, over = _bind("b", 30, 10), _bind("cc", 40, 20)
    n, grown, handed, session = _admit([fits, over], capacity, running, dp_free=100)
    assert n == 2 and handed == ["b", "cc"]
    # "b" fits in the spare; "cc" needs bound(40, 20) tokens of which 6 are spare
    short = bound(40, 20, LIMIT) - 6
    assert len(grown) == 1 and grown[0].tp_slots.numel() == 2 * -(-short // 2)
    assert session.dp_allocator.available_size() == 100 - -(-short // 2)
    assert session.evicted == []  # the engine had the room


def test_without_dp_room_for_the_shortfall_admission_closes_and_keeps_order():
    running = [_req("a", 100, 60)]
    capacity = admission.kv_tokens_needed(100, 60, LIMIT)  # no spare
    n, grown, handed, session = _admit([_bind("b", 30, 10)], capacity, running, dp_free=5)
    assert n == 0 and grown == [] and handed == [] and not session.admitting
    # it asked the DP prefix cache for the missing slots first, with the engine's allocator
    need = -(-admission.kv_tokens_needed(30, 10, LIMIT) // 2)
    assert session.evicted == [need - 5]
    assert session.dp_cache.token_to_kv_pool_allocator == "the session's"  # restored
