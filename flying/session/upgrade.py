"""Long-context upgrade: a running DP request whose decode outgrows its engine joins a group.

SGLang bounds a request that has no max_new_tokens of its own (an OpenAI chat request
without ``max_tokens``, ``/generate`` with ``"max_new_tokens": null``) by the length
limit of the engine it runs on (``Scheduler.init_req_max_new_tokens``: ``max_req_len -
prompt - 1``). Where one engine's KV pool is shorter than the model's context, a TP-m
group pools m engines' KV, so such a request may go on there, without recomputing
anything, instead of ending at one engine's limit:

1. ``Watch.note`` (hook on ``init_req_max_new_tokens``): the engine remembers which of
   its DP requests came without a bound of their own (a ``WeakSet`` of SGLang's ``Req``;
   nothing is added to the ``Req``);
2. ``Watch.check`` (every step boundary, DP state): once such a running request is
   within ``AHEAD`` tokens of its bound, the engine asks the DP controller, once, with
   an ``Upgrade`` message on the controller's own input socket;
3. the controller's policy (``scheduler.policy.Policy.upgrade``) picks the degree and
   sends a bind for the holder's aligned group, in its one total order of binds;
4. ``gather`` (every member, DP state, right after the bind's rendezvous): the members
   share the request's lengths (from the holder) and their free KV room; the request's
   new bound (``new_total``) is what every member can reserve; the holder takes the
   request out of DP (``join._take_out``), every member reserves and they agree; the
   holder sends each member its head shard and the request's state (``join.carry``),
   and the session lands it like any join (``join.land``) with max_new_tokens lifted.

If the ask comes too late, the group cannot form, or it has no more room than one
engine, the request ends at the engine's limit, as it would in plain SGLang. The
request's own engine need not lead the group: the holder is the source of the KV, the
leader answers for the group with its copy of the request (as after a move).
"""

from __future__ import annotations

import logging
import time
import weakref

from flying.session import join, layout_log, move, tp_scope
from flying.session.budget import ADMISSION_SLACK
from flying.session.messages import Bind, Upgrade
from scheduler.relayout import new_total as new_total  # re-exported (its old home)
from scheduler.relayout import upgrade_total

logger = logging.getLogger(__name__)

#: Output tokens before its bound at which a request asks for a group: the ask, the
#: bind and the members' next step boundary must all happen before it ends.
AHEAD = 64
#: Why an upgraded request's report says it ran in a group.
UPGRADED_REASON = "long context: its decode outgrew one engine"


class Watch:
    """An engine's requests without a bound of their own, and its asks for groups."""

    def __init__(self, dp_rank: int, enabled: bool, counters):
        self.dp_rank = dp_rank
        #: a group may hold more than this engine (degrees, context and policy allow it)
        self.enabled = enabled
        self.unbounded: weakref.WeakSet = weakref.WeakSet()
        self.counters = counters  # the engine's (``upgrade_asks``)
        self._sock = None

    def note(self, scheduler, req, unbounded: bool) -> None:
        """SGLang just bounded ``req``; remember it if it came without a bound of its own
        (an ``SGLANG_MAX_NEW_TOKENS_LIMIT`` is an operator's bound: it stays)."""
        if self.enabled and unbounded and not (getattr(scheduler, "max_new_tokens_limit", 0) or 0) > 0:
            self.unbounded.add(req)

    def check(self, scheduler) -> None:
        """DP state, step boundary: ask for a group for each noted running request that
        is within ``AHEAD`` tokens of its bound (once per request)."""
        if not self.unbounded:
            return
        for req in scheduler.running_batch.reqs:
            if req in self.unbounded and due(req):
                self.unbounded.discard(req)
                self.ask(req.rid)

    def ask(self, rid: str, from_degree: int = 1) -> None:
        """Send the controller an ``Upgrade`` for ``rid``, which this engine holds in DP
        (``from_degree`` 1) or leads in a TP group (``flying.session.regroup``)."""
        import zmq
        from sglang.srt.managers.io_struct import sock_send, wrap_as_pickle

        from flying.session.messages import upgrade_endpoint

        try:
            if self._sock is None:
                self._sock = zmq.Context.instance().socket(zmq.PUSH)
                self._sock.setsockopt(zmq.LINGER, 0)
                self._sock.connect(upgrade_endpoint())
            ask = Upgrade(rid, self.dp_rank, time.time(), from_degree)
            sock_send(self._sock, wrap_as_pickle(ask), zmq.NOBLOCK)
            self.counters.upgrade_asks += 1
            where = "the engine" if from_degree == 1 else f"its TP-{from_degree} group"
            logger.info("flying: engine %d asks for a group for request %s (outgrows %s)",
                        self.dp_rank, rid, where)
        except Exception:  # noqa: BLE001 - no ask: the request ends at this engine's limit
            logger.exception("flying: engine %d could not ask for a group for %s", self.dp_rank, rid)


def due(req) -> bool:
    """``req`` is within ``AHEAD`` tokens of its bound and could join a group."""
    left = req.sampling_params.max_new_tokens - len(req.output_ids)
    return 0 < left <= AHEAD and join.joinable(req)


def gather(engine, scheduler, bind: Bind, member, faults=None) -> join.Joining | None:
    """Every member of an upgrade bind's session, DP state, after the rendezvous: take
    the holder's request into the group with its KV. None (nothing changed) if it is
    gone, cannot join, or the group would not let it grow."""
    up = bind.upgrade
    if up.from_degree > 1:  # a group's request into the larger group around it
        from flying.session import regroup

        return regroup.gather(engine, scheduler, bind, member, faults)
    src = bind.ranks.index(up.holder)
    is_src = engine.dp_rank == up.holder
    req = _running(scheduler, up.rid) if is_src else None
    n = move.kv_len(req) if req is not None else 0
    prompt = len(req.origin_input_ids) if req is not None else 0
    bound = req.sampling_params.max_new_tokens if req is not None else 0
    # The holder's request frees its own n slots when it leaves DP; every member keeps
    # what its other running DP requests may still need.
    room = max(0, tp_scope.dp_room(scheduler) + n - dp_needs(scheduler, req))
    rows, total, log = share_growth(engine, scheduler, bind, member, [n, prompt, bound, room])
    n, prompt, bound = rows[src][:3]
    per_slot = engine.prepared[bind.degree].per_slot
    if not total:
        if log is not None:
            layout_log.write("upgrade_join", log)
        return None
    block, payload = None, b""
    if is_src:
        req.sampling_params.max_new_tokens = total - prompt  # travels with the copies
        block, payload = join._take_out(scheduler, [req])
    joining = join.Joining(
        [req] if is_src else [], [n], None, [], time.perf_counter(), block, source=is_src,
        dp_bounds=[bound], upgrade=True,
    )
    room = tp_scope.dp_room(scheduler) if log is not None else 0
    res = tp_scope.reserve_for(scheduler, total + ADMISSION_SLACK, per_slot)
    joining.reservations = [res] if res is not None else []
    agreed = join.agree(member, scheduler.token_to_kv_pool_allocator, joining.reservations)
    if log is not None:
        log.update(room=room, reserved=len(joining.reservations), joined=agreed)
        joining.log = log
    if not agreed:
        if log is not None:
            layout_log.write("upgrade_join", log)
        if is_src:
            join.restore(scheduler, joining)
        return None
    join.carry(member, scheduler, joining, payload, bind.degree, src, faults)
    logger.info(
        "flying: request %s joins a TP-%d group: up to %d tokens (was %d)",
        up.rid, bind.degree, total, prompt + bound,
    )
    return joining


def share_growth(engine, scheduler, bind: Bind, member, mine: list[int]):
    """Every member of an upgrade's group: share ``mine`` (``[kv, prompt, bound, room]``,
    the request's three from its source only) and compute how far the request may grow
    there (``upgrade_total``: 0 if not beyond its bound). Returns (the members' rows,
    the total, the decision log's line or None without a log)."""
    up = bind.upgrade
    rows = member.gather_ints(mine)
    limits = (engine.prepared[bind.degree].per_slot, int(scheduler.max_total_num_tokens),
              int(scheduler.model_config.context_len) - 1)
    total = upgrade_total(rows, bind.ranks.index(up.holder), *limits)
    log = None
    if layout_log.enabled():
        log = {**layout_log.about(bind, engine.dp_rank), "rid": up.rid, "holder": up.holder,
               "from_degree": up.from_degree, "rows": rows, "per_slot": limits[0],
               "engine_slots": limits[1], "context_limit": limits[2], "total": total}
    return rows, total, log


def _running(scheduler, rid: str):
    """The running DP request ``rid`` if it can join a group now, else None."""
    for req in scheduler.running_batch.reqs:
        if req.rid == rid:
            return req if join.eligible(req, move.kv_len(req)) else None
    return None



def dp_needs(scheduler, req=None) -> int:
    """KV tokens this engine's other running DP requests may still use (their bounds
    less what they produced): left to them, so that a group never holds them for KV.
    On the holder ``req``'s own slots count as room: they are freed when it leaves."""
    return sum(
        max(0, r.sampling_params.max_new_tokens - len(r.output_ids))
        for r in scheduler.running_batch.reqs
        if r is not req and not r.finished()
    )
