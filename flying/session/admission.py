"""Admitting requests into a running TP session (continuous batching inside a group).

Without this, a bound group serves one request per bind and every further TP request
waits for the release, a new rendezvous and a new session: under a stream of TP
requests the group runs one request at a time. Here the leader offers, at each step,
the binds for the *same group* that have reached it (a contiguous prefix of its
pending queue, so the controller's total order is kept), and at the next step boundary
every member admits them:

1. each member waits (bounded) until it has received the offered binds: the controller
   sent them to every member, so they are in flight, not missing;
2. each member reserves the DP slots each one needs beyond the session's spare
   (``spare_tokens``: what its live requests cannot claim) from its own engine
   allocator, evicting cached DP prefixes for them as a bind does
   (``tp_scope.make_dp_room``);
3. the members agree on the number that every member could reserve (a MIN), give back
   the rest, and hand exactly those requests to SGLang in the same order.

Lockstep is preserved: every member admits the same requests, with the same number of
TP slots each, at the same step, so SGLang forms identical batches. A bind that could
not be admitted closes admission for the rest of the session; it runs in its own
session after the release, in order.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from flying.session import tp_scope
from flying.session.budget import kv_tokens_needed, resolved_max_new_tokens
from flying.session.containment import session_reqs
from flying.session.exchange import MAX_ADMITS
from flying.session.messages import Bind
from flying.substrate import kv_adaptor

logger = logging.getLogger(__name__)

#: Binds admitted per boundary (the width of ``exchange.offer``).
MAX_PER_STEP = MAX_ADMITS
#: How long a member waits for an offered bind to arrive on its socket.
ARRIVAL_TIMEOUT_S = 5.0
#: Added to an offered key whose bind is an upgrade (bind keys have 48 bits), so that a
#: member the bind has not reached yet knows what kind of offer it waits for.
UPGRADE_OFFER = 1 << 48


def tokens_needed(bind: Bind, dp_limit: int) -> int:
    """KV tokens one TP request of ``bind`` may use: prompt + max_new_tokens + slack.

    Without max_new_tokens (an OpenAI chat request without max_tokens) SGLang lets a
    request grow to the engine's max_req_len; the request gets that bound explicitly
    (``resolve_max_new_tokens``) and the group reserves it, so it may produce exactly
    what it would in DP.
    """
    resolve_max_new_tokens(bind.req, dp_limit)
    return kv_tokens_needed(len(bind.req.input_ids or ()), bind.req.sampling_params.max_new_tokens, dp_limit)


def resolve_max_new_tokens(req, dp_limit: int) -> int:
    """Give a request without max_new_tokens the bound SGLang gives it in DP
    (``max_req_len - prompt - 1``), so it produces the same tokens in a group, whose
    own max_req_len is its pooled capacity. Returns the bound."""
    params = req.sampling_params
    if params.max_new_tokens is None:
        params.max_new_tokens = resolved_max_new_tokens(len(req.input_ids or ()), None, dp_limit)
    return int(params.max_new_tokens)


def bind_key(bind: Bind) -> int:
    """The bind id as a non-negative int (48 bits: 12 hex digits)."""
    return int(bind.bind_id, 16)


def candidates(pending: deque[Bind], session_bind: Bind) -> list[int]:
    """Ids of the pending binds at the head of the queue for the session's own group. An
    upgrade bind (a member's running DP request outgrows its engine) is offered alone,
    at the head: it joins with its KV (``Lifecycle.upgrade_into``), not as a new request."""
    out = []
    for b in pending:
        if b.ranks != session_bind.ranks or b.degree != session_bind.degree:
            break
        if b.upgrade is not None:
            return out or [bind_key(b) + UPGRADE_OFFER]
        out.append(bind_key(b))
        if len(out) == MAX_PER_STEP:
            break
    return out


def _take(engine, scheduler, keys: list[int]) -> list[Bind]:
    """The pending binds with these keys, in order; waits for late arrivals (bounded).
    Returns a prefix: the binds found before the first one that never arrived."""
    deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
    found: list[Bind] = []
    for key in keys:
        while True:
            bind = next((b for b in engine.pending if bind_key(b) == key), None)
            if bind is not None:
                found.append(bind)
                break
            if time.monotonic() > deadline:
                logger.warning("flying: offered bind %x did not arrive; admitting fewer", key)
                return found
            engine.poll(scheduler)
            time.sleep(0.0005)
    return found


def admit(engine, scheduler, member, session, keys: list[int]) -> int:
    """Admit the offered binds on this member; returns how many joined (same on all)."""
    if keys and keys[0] >= UPGRADE_OFFER:  # offered alone; every member must have it
        binds = _take(engine, scheduler, [keys[0] - UPGRADE_OFFER])
        if member.min_int(len(binds)) == 0:
            session.admitting = False  # it forms its own session after this one, in order
            return 0
        return engine.upgrade_into(scheduler, binds[0])
    binds = _take(engine, scheduler, keys)
    per_slot = session.prepared.per_slot
    spare = spare_tokens(scheduler, session.capacity, engine.dp_limit)
    reservations: list = []  # per bind: its Reservation, or None (the session's spare covers it)
    for bind in binds:
        if engine.aborts.hits(bind.req.rid):
            break  # an aborted request is not admitted; its bind runs (and aborts) later
        tokens = tokens_needed(bind, engine.dp_limit)
        short = tokens - spare
        if short <= 0:
            spare -= tokens
            reservations.append(None)
            continue
        tp_scope.make_dp_room(session, -(-short // per_slot))  # cached DP prefixes give way
        res = kv_adaptor.reserve(session.dp_allocator, short, per_slot)
        if res is None:
            break
        spare += int(res.tp_slots.numel()) - tokens
        reservations.append(res)
    agreed = agree(member, session.dp_allocator, reservations)
    if agreed < len(keys):
        session.admitting = False  # the rest run in their own sessions, in order
    for bind, res in zip(binds[:agreed], reservations[:agreed], strict=True):
        engine.pending.remove(bind)
        if res is not None:
            session.grow(res)
        session.hand(scheduler, bind.req, bind.reason)
    return agreed


def spare_tokens(scheduler, capacity: int, dp_limit: int) -> int:
    """TP tokens of the session's pool that no live request of it may still claim:
    ``capacity`` less each unfinished request's bound (prompt + output bound + slack,
    its shared prefix counted in full). A request admitted within it needs no new
    reservation, so a long session reuses the slots its finished requests left (in
    its prefix cache or free). Before, every admission reserved its whole bound and
    nothing came back until the release, so under steady load the engines ran out,
    admission closed and later arrivals waited for the whole session to drain. The same on
    every member: the same requests in the same state (lockstep). Runs in the TP state.
    May be negative (a joined request's bound came from its own budget)."""
    claimed = sum(
        kv_tokens_needed(len(r.origin_input_ids), r.sampling_params.max_new_tokens, dp_limit)
        for r in session_reqs(scheduler) if not r.finished()
    )
    return capacity - claimed


def agree(member, dp_allocator, reservations: list) -> int:
    """How many of this member's ``reservations`` (a prefix, in order) every member of
    the group could make (one MIN); the rest are given back. Same answer on all."""
    agreed = member.min_int(len(reservations))
    for res in reservations[agreed:]:
        if res is not None:
            kv_adaptor.release(dp_allocator, res)
    return agreed
