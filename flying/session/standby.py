"""A bind's KV reservation and scope, made ready while an idle engine goes to sleep.

Why: on the CPU platform an engine sleeps when idle (``--sleep-on-idle``) and wakes cold:
right after the wake every torch op costs several times its warm cost. Reserving a
member's KV slots (``tp_scope.reserve_for``) and opening the session's scope
(``tp_scope.open_scope``) were ~0.6 ms of the ~1 ms from a member's bind to its first
group step, almost all of it such ops. Done just before the sleep (the engine has just
run SGLang's idle housekeeping, so it is warm), a bind that needs exactly what the
standby holds takes it and runs none of them.

What is made: for the degree and size of this engine's last bind (``want``), the DP
slots that size needs, taken from the allocator's free list only (no prefix is evicted,
no free list is merged), and the session's scope opened over them (not entered:
``open_scope`` touches nothing SGLang sees). A bind of another degree, role or size
drops it (a larger standby would lend the session slots it did not ask for).

Invariant: a standby exists only from SGLang's idle sleep to the end of the next step
boundary. It is dropped at the next input unless a bind came with it, and at the end
of that boundary unless the bind took it, so SGLang's idle leak check (in ``on_idle``,
before the sleep) never counts its slots as lost. Dropping puts the allocator's free
list object back when nothing touched the allocator since (no torch op on the path of
the DP request that woke the engine), and frees the slots otherwise.
"""

from __future__ import annotations

import dataclasses
import logging

from flying.session import tp_scope
from flying.substrate import kv_adaptor

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Standby:
    degree: int
    slots: int  # DP slots reserved (a bind takes the standby only if it needs as many)
    is_leader: bool
    reservation: kv_adaptor.Reservation
    scope: tp_scope.Scope
    #: the DP allocator's free list before and after the reservation (``drop``)
    free_before: object
    free_after: object


def take(engine, scheduler) -> None:
    """Make a standby for ``engine.want`` (degree, tokens) if the engine can (it is about
    to sleep idle: no session, in DP state, enough free slots without evicting)."""
    if engine.standby is not None or engine.want is None or engine.session is not None:
        return
    degree, tokens = engine.want
    prepared = engine.prepared.get(degree)
    allocator = scheduler.token_to_kv_pool_allocator
    if prepared is None or (prepared.state is not None and prepared.state.entered):
        return
    slots = -(-tokens // prepared.per_slot)
    if slots > len(allocator.free_pages):
        return  # it would merge the free lists or evict cached prefixes: not at idle
    free_before, reservation = allocator.free_pages, None
    try:
        member = engine.pool.member(degree)
        reservation = kv_adaptor.reserve(allocator, tokens, prepared.per_slot)
        if reservation is None:
            return
        free_after = allocator.free_pages
        is_leader = member.tp_rank == 0
        scope = tp_scope.open_scope(scheduler, prepared, member, reservation, is_leader, engine.faults)
    except Exception:  # noqa: BLE001 - a standby is an optimisation: binds open their own
        logger.exception("flying: engine %d: could not make a bind standby", engine.dp_rank)
        if reservation is not None:
            kv_adaptor.release(allocator, reservation)
        engine.want = None  # do not retry on every sleep
        return
    engine.standby = Standby(degree, slots, is_leader, reservation, scope, free_before, free_after)


def claim(engine, scheduler, degree: int, tokens: int, is_leader: bool) -> Standby | None:
    """The standby, for a bind of ``degree`` needing ``tokens`` in which this engine
    leads or not; None (and any other standby dropped, in the DP state) if there is
    none that is exactly what the bind would reserve: a larger one would lend the
    session slots it did not ask for, which the engine's DP requests and the requests
    joining the session would then lack. The caller owns what it returns: the
    reservation and the opened scope."""
    sb = engine.standby
    if sb is None:
        return None
    per_slot = sb.scope.prepared.per_slot
    if sb.degree != degree or sb.is_leader != is_leader or -(-tokens // per_slot) != sb.slots:
        drop(engine, scheduler)
        return None
    engine.standby = None
    return sb


def drop(engine, scheduler) -> None:
    """Give the standby's slots back and keep its scope's spare batch (see the module
    docstring); no-op without one."""
    sb = engine.standby
    if sb is None:
        return
    engine.standby = None
    allocator = sb.scope.dp_allocator  # the DP one, also when a session's TP state is entered
    if allocator.free_pages is sb.free_after:
        allocator.free_pages = sb.free_before
    else:
        kv_adaptor.release(allocator, sb.reservation)
    prepared = sb.scope.prepared
    if prepared.spare_batch is None:  # the scope took it; it never ran: keep it
        prepared.spare_batch = sb.scope.state.other(scheduler, "running_batch")
