"""A bind standby (``flying.session.standby``) takes slots from the free list only, and
every way it ends gives them back exactly: dropped untouched (the free list object put
back), dropped after the allocator moved (freed into the DP allocator, also while a
session's TP allocator is the scheduler's), or taken by a bind that needs exactly it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.unit


class _State:
    """The scope's toggle as ``standby.drop`` reads it: the session's running batch."""

    def __init__(self, batch):
        self.batch, self.entered = batch, False

    def other(self, obj, name):
        assert name == "running_batch"
        return self.batch


def _open_scope(scheduler, prepared, member, reservation, is_leader, faults=None):
    batch, prepared.spare_batch = prepared.spare_batch, None  # as ``_session_values``
    return SimpleNamespace(prepared=prepared, state=_State(batch), reservation=reservation,
                           is_leader=is_leader, dp_allocator=scheduler.token_to_kv_pool_allocator)


@pytest.fixture
def setup(monkeypatch):
    import torch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    from flying.session import standby, tp_scope

    monkeypatch.setattr(tp_scope, "open_scope", _open_scope)
    allocator = TokenToKVPoolAllocator(
        size=64, dtype=torch.float32, device="cpu", kvcache=SimpleNamespace(), need_sort=True
    )
    scheduler = SimpleNamespace(token_to_kv_pool_allocator=allocator)
    prepared = SimpleNamespace(per_slot=2, state=None, spare_batch="spare")
    engine = SimpleNamespace(
        standby=None, want=(2, 20), session=None, prepared={2: prepared}, dp_rank=1,
        faults=None, pool=SimpleNamespace(member=lambda degree: SimpleNamespace(tp_rank=1)),
    )
    return standby, engine, scheduler, allocator, prepared


def test_take_then_drop_puts_the_free_list_back(setup):
    standby, engine, scheduler, allocator, prepared = setup
    before = allocator.free_pages
    standby.take(engine, scheduler)
    sb = engine.standby
    assert sb is not None and sb.slots == 10 and sb.degree == 2 and not sb.is_leader
    assert allocator.available_size() == 64 - 10  # 20 TP tokens at 2 per DP slot
    assert prepared.spare_batch is None  # the opened scope took it
    standby.drop(engine, scheduler)
    assert engine.standby is None and allocator.free_pages is before
    assert allocator.available_size() == 64 and prepared.spare_batch == "spare"


def test_drop_after_the_allocator_moved_frees_the_slots(setup):
    standby, engine, scheduler, allocator, _ = setup
    standby.take(engine, scheduler)
    held = set(engine.standby.reservation.dp_slots.tolist())
    other = allocator.alloc(5)  # something else allocated since: no identity restore
    standby.drop(engine, scheduler)
    allocator.free(other)
    assert allocator.available_size() == 64
    allocator.merge_and_sort_free()
    assert held <= set(allocator.free_pages.tolist())


def test_claim_takes_a_fitting_standby_and_drops_one_that_does_not_fit(setup):
    standby, engine, scheduler, allocator, _ = setup
    standby.take(engine, scheduler)
    sb = standby.claim(engine, scheduler, 2, 19, is_leader=False)  # 10 DP slots, as made
    assert sb is not None and engine.standby is None
    assert allocator.available_size() == 54  # the bind owns the slots now
    allocator.free(sb.reservation.dp_slots)
    # another degree or role, more slots, or fewer (it would lend the session slots
    # it did not ask for): dropped, every slot back
    for degree, tokens, leader in ((4, 20, False), (2, 21, False), (2, 8, False), (2, 20, True)):
        standby.take(engine, scheduler)
        assert standby.claim(engine, scheduler, degree, tokens, leader) is None
        assert engine.standby is None and allocator.available_size() == 64


def test_no_standby_without_a_bind_to_size_it_or_without_free_slots(setup):
    standby, engine, scheduler, allocator, _ = setup
    engine.want = None
    standby.take(engine, scheduler)
    assert engine.standby is None
    engine.want = (2, 200)  # 100 DP slots: more than the free list holds
    standby.take(engine, scheduler)
    assert engine.standby is None and allocator.available_size() == 64
    engine.want, engine.session = (2, 20), object()  # a session runs: never
    standby.take(engine, scheduler)
    assert engine.standby is None


def test_drop_while_a_session_is_entered_frees_into_the_dp_allocator(setup):
    """An upgrade bind reserves its own slots and enters the session's TP state; the
    standby dropped after that must go back to the DP allocator, not the TP one."""
    import torch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    standby, engine, scheduler, allocator, _ = setup
    standby.take(engine, scheduler)
    allocator.alloc(3)  # the upgrade's own reservation: the free list moved
    tp = TokenToKVPoolAllocator(size=8, dtype=torch.float32, device="cpu",
                                kvcache=SimpleNamespace(), need_sort=True)
    scheduler.token_to_kv_pool_allocator = tp  # the TP state entered
    standby.drop(engine, scheduler)
    assert tp.available_size() == 8 and allocator.available_size() == 64 - 3
