"""TP -> TP upgrade: a group's request that outgrows the group goes on in a larger one.

A request without a bound of its own that was upgraded into a TP-m group
(``flying.session.upgrade``) may grow there to what m engines pool. Near that bound it
moves, with its KV and nothing recomputed, into the larger aligned group around the
first (aligned groups nest: ``flying.substrate.layout``):

1. ``ask`` (the group's leader, each TP boundary): the request is the session's only
   one and within ``upgrade.AHEAD`` tokens of its bound: the leader asks the controller
   once (an ``Upgrade`` with ``from_degree`` m). The policy (``Policy.upgrade``) picks
   the larger group and its bind reaches every member in the controller's one total
   order of binds;
2. ``parking`` (every member, each TP step): that bind is at the head of this member's
   queue. The per-step exchange counts the members that have it;
3. ``park`` (every member at the same boundary, TP state, once all m have it and the
   request is still the session's only one and decoding): the members all-gather their
   head shards, the leader keeps the full block ``[layers, 2, n, H_kv, d]`` with its
   ``Req`` (``Parked``), every member frees the request's row, and the session ends;
4. the larger group's bind, now at the head of each old member's queue, forms at their
   next boundary; ``gather`` (every member of the larger group, DP state, after the
   rendezvous) takes the parked request in as ``upgrade.gather`` takes a DP request:
   the old leader is the source (``join.carry`` scatters its heads to the new members)
   and the request's bound grows to what the larger group pools.

The request is never lost: if the larger group does not form or cannot let it grow, it
ends with finish reason "length" and every token it produced (at most ``AHEAD`` fewer
than its group's bound: the price of asking in time). A second request in the session,
or a second ask, keeps today's behaviour: the request ends at its group's limit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from flying.session import join, join_wire, layout_log, move, tp_scope, upgrade
from flying.session.budget import ADMISSION_SLACK
from flying.substrate import kv_relayout

logger = logging.getLogger(__name__)

#: Why a request that left its group for a larger one ends early (the larger group
#: could not take it).
ENDED_REASON = "its group's limit: the larger group could not take it"


@dataclass
class Parked:
    """The old leader's request between its group's end and the larger group's bind."""

    rid: str
    req: object  # SGLang's Req (the original: the leader answered for the group)
    full: torch.Tensor  # every head of its KV: [layers, 2, n, H_kv, d]
    n: int  # tokens of KV (all but the last output token)
    degree: int  # the group it left
    t: float  # perf_counter when parked


def ask(engine, scheduler, s) -> None:
    """Leader, TP state, before forming a step: ask once for a larger group for the
    session's only request when it nears its bound (``s.growable``: it came without a
    bound of its own and was upgraded here)."""
    if not (s.is_leader and s.growable) or scheduler.waiting_queue:
        return
    if max(engine.prepared, default=0) <= s.bind.degree:  # no larger group on this node
        s.growable.clear()
        return
    reqs = scheduler.running_batch.reqs
    if len(reqs) == 1 and reqs[0].rid in s.growable and upgrade.due(reqs[0]):
        s.growable.discard(reqs[0].rid)
        engine.watch.ask(reqs[0].rid, from_degree=s.bind.degree)


def parking(engine, s) -> bool:
    """The bind at the head of this member's queue takes the session's request into a
    larger group that contains this one."""
    head = engine.pending[0] if engine.pending else None
    up = head.upgrade if head is not None else None
    return (
        up is not None
        and up.from_degree == s.bind.degree
        and up.holder == s.bind.ranks[0]
        and head.degree > s.bind.degree
        and set(s.bind.ranks) <= set(head.ranks)
    )


def park(engine, scheduler, s) -> bool:
    """Every member, TP state, the same boundary (every member reported ``parking``):
    take the session's only request out with its KV (the leader keeps it, ``Parked``).
    False, nothing changed, unless it is alone and decoding with no step in flight
    (the same answer on every member: lockstep)."""
    rid = engine.pending[0].upgrade.rid
    reqs = [r for r in scheduler.running_batch.reqs if not r.finished()]
    if len(reqs) != 1 or reqs[0].rid != rid or not move.ready(scheduler):
        return False
    req = reqs[0]
    n = move.kv_len(req)
    if req.kv.kv_allocated_len != n:
        return False
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    t0 = time.perf_counter()
    slots = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n]
    prepared = s.scope.prepared
    shards = kv_relayout.exchange(s.member, kv_relayout.read_block(prepared.tp_pool, slots))
    scheduler.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
    scheduler.last_batch = None
    scheduler.req_to_token_pool.free(req)
    if s.is_leader:
        full = kv_relayout.join_shards(kv_relayout.distinct(shards, prepared.split))
        engine.parked = Parked(rid, req, full, n, s.bind.degree, t0)
    logger.info("flying: engine %d: request %s left its TP-%d group for a larger one "
                "(%d tokens of KV, %.2f ms)", engine.dp_rank, rid, s.bind.degree, n,
                (time.perf_counter() - t0) * 1e3)
    return True


def gather(engine, scheduler, bind, member, faults=None) -> join.Joining | None:
    """Every member of the larger group's session, DP state, after the rendezvous: take
    the parked request in with its KV (``upgrade.gather`` for a request that left a
    group). None if it is not parked (it finished first), or the group cannot let it
    grow: then it ends (``finish``)."""
    up = bind.upgrade
    src = bind.ranks.index(up.holder)
    parked = take(engine, scheduler, up.rid)
    req = parked.req if parked is not None else None
    n = parked.n if parked is not None else 0
    prompt = len(req.origin_input_ids) if req is not None else 0
    bound = req.sampling_params.max_new_tokens if req is not None else 0
    room = max(0, tp_scope.dp_room(scheduler) - upgrade.dp_needs(scheduler))
    rows, total, log = upgrade.share_growth(engine, scheduler, bind, member,
                                            [n, prompt, bound, room])
    n, prompt, bound = rows[src][:3]
    per_slot = engine.prepared[bind.degree].per_slot
    if log is not None and parked is not None:  # how long it waited since it left its group
        log["parked_ms"] = round((time.perf_counter() - parked.t) * 1e3, 3)
    agreed = 0
    if total:  # the same on every member (shared rows): all reserve and agree, or none
        room = tp_scope.dp_room(scheduler)
        res = tp_scope.reserve_for(scheduler, total + ADMISSION_SLACK, per_slot)
        agreed = join.agree(member, scheduler.token_to_kv_pool_allocator,
                            [res] if res is not None else [])
        if log is not None:
            log.update(room=room, reserved=int(res is not None), joined=agreed)
    if not agreed:
        if log is not None:
            layout_log.write("upgrade_join", log)
        if parked is not None:
            finish(scheduler, [parked.req])
        return None
    payload = b""
    if parked is not None:
        req.sampling_params.max_new_tokens = total - prompt  # travels with the copies
        payload = join_wire.pickled([req])
    joining = join.Joining(
        [req] if parked is not None else [], [n], None, [res], time.perf_counter(),
        parked.full if parked is not None else None, source=parked is not None,
        dp_bounds=[bound], log=log, parked=True, upgrade=True,
    )
    join.carry(member, scheduler, joining, payload, bind.degree, src, faults)
    logger.info("flying: request %s joins a TP-%d group: up to %d tokens (was %d in TP-%d)",
                up.rid, bind.degree, total, prompt + bound, up.from_degree)
    return joining


def take(engine, scheduler, rid: str) -> Parked | None:
    """This engine's parked request ``rid`` (the engine no longer holds it), or None.
    Another parked request (never: a park is followed by its own bind) ends here."""
    parked, engine.parked = engine.parked, None
    if parked is not None and parked.rid != rid:
        logger.error("flying: engine %d parked %s, not %s", engine.dp_rank, parked.rid, rid)
        finish(scheduler, [parked.req])
        return None
    return parked


def finish(scheduler, reqs: list) -> None:
    """Source, DP state: parked requests the larger group did not take end here with
    finish reason "length" and what they produced (they hold no KV any more)."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    for req in reqs:
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        try:
            scheduler.output_streamer.stream_output([req], req.return_logprob)
            logger.warning("flying: request %s ended at %s", req.rid, ENDED_REASON)
        except Exception as exc:  # noqa: BLE001 - the last resort is an explicit answer
            logger.exception("flying: could not end request %s", req.rid)
            join.abort(scheduler, [req], f"moving into a larger TP group failed: {exc}")
