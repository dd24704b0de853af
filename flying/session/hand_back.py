"""Handing a group's not-yet-started requests back to DP when the group is to end.

A session that hands its requests to DP (``flying.session.move``) can move them only
when every one is decoding: a request still waiting in the group's queue was first
prefilled in the group, in TP steps as large as the queue (with DP steps between
them), and only then moved with its KV. Where a group took a clump of arrivals between
two of the policy's evaluations and the policy then switched the node to DP, that was
19-27 requests prefilled in two TP steps of ~2.5 s each before the move, and their
TPOT 2-3x static DP's for the same requests (hidden-1024 model, the Azure code trace,
session 76: 27 of the 36 requests that missed the TPOT SLO).

A waiting request that has produced nothing and holds no KV can start over in DP as
it arrived, the way containment re-runs one (``containment.abandon``): nothing was
sent to its client, nothing is prefilled twice. So when a session wants to move
(``Lifecycle._tp_form``: DP work arrived at a member and the session may hand its
requests over), its waiting requests leave the group at once, spread over its members
in queue order; the requests already prefilled move when they decode.

The same holds for the binds placed in the group that had not joined it yet (pending
while the session wanted to move, which admits no one): a policy bind issued before a
member's session last wanted to move (``stale``) is voted down by that member, and the
bind's request is served in DP by one of its members (``runner``, spread by bind id)
instead of forming a new group beside the DP work that just ended the old one; an
engine votes down all the stale binds at the head of its queue at one boundary
(``FlyingEngine._vote_down_stale``), so their requests are prefilled together in DP.
(Same trace, once the policy saw its queue: 11 binds pending at the move formed a
group of 11 beside 16 running DP requests, 12 TP steps and 12 DP steps interleaved;
voted down one per boundary, 8 requests were prefilled one per DP step, the running
requests' TPOT 290-550 ms against 77-266 in static DP.)

Lockstep: every member holds the same queue (the same requests in the same order, the
same produced tokens) and the move was decided from shared values, so every member
takes the same requests out of its TP state; each then starts its share in DP (the
member that starts a request answers it, as after a move). A long-context request
(prompt and bound beyond one engine) stays in its group.
"""

from __future__ import annotations

import logging

from flying.session import containment, report

logger = logging.getLogger(__name__)

#: Why a handed-back request's report says it ran in DP.
HANDED_BACK_REASON = "handed to DP before its prefill: its group was ending"
#: A member's vote against a policy bind issued before its session last wanted to move.
STALE_VOTE = "its group handed its requests to DP after this bind was issued"
#: The most stale binds an engine votes down at one step boundary.
STALE_PER_STEP = 32


def stale(engine, bind) -> bool:
    """Whether ``bind`` (a placement by the adaptive policy, which may move to DP) was
    issued before this member's session last wanted to move to DP (``left_at``; the
    controller's and the engines' clocks are the host's)."""
    from flying.session import move

    return (bind.upgrade is None and bind.reason == "policy"
            and move.allowed(engine.move_to_dp, {bind.reason})
            and bind.issued_at < engine.left_at)


def runner(bind, reason: str) -> int:
    """The member that serves a bind's request in DP when the bind did not form: one of
    its members by bind id for a stale bind (so a group's worth of them spread as DP
    dispatch would), the leader otherwise (the member that answers a group's request)."""
    if reason == STALE_VOTE:
        return bind.ranks[int(bind.bind_id, 16) % len(bind.ranks)]
    return bind.ranks[0]


def startable(scheduler, dp_limit: int) -> list:
    """The session's waiting requests (TP state) that can start in DP as they arrived:
    nothing produced, no KV, and their prompt and bound within what one engine holds
    (``dp_limit``; a request without a bound: its prompt), in queue order."""
    return [req for req in scheduler.waiting_queue
            if not req.output_ids and not req.kv.holds_kv and _fits(req, dp_limit)]


def _fits(req, dp_limit: int) -> bool:
    """Containment's rule for a bounded request (``containment._fits``: prompt + bound
    within ``dp_limit``); one without a bound starts in DP if its prompt fits."""
    if req.sampling_params.max_new_tokens is None:
        return len(req.origin_input_ids) < dp_limit
    return containment._fits(req, dp_limit)


def share(rids: list[str], ranks: tuple[int, ...], rank: int) -> list[str]:
    """The rids member ``rank`` starts in DP: every ``len(ranks)``-th in queue order,
    from the member's place in ``ranks`` (the same split on every member)."""
    i = ranks.index(rank)
    return rids[i::len(ranks)]


def hand_back(engine, scheduler, s) -> int:
    """Every member, TP state, the same boundary: take the session's startable waiting
    requests out of its queue and start this member's share of them in DP; returns
    how many this member started. The scope is left for the DP state and entered
    again (as an upgrade joining the session does), a kept group step's result
    processed first, in the TP state."""
    reqs = startable(scheduler, engine.dp_limit)
    rids = [r.rid for r in reqs if r.rid in s.scope.tokenized]
    if not rids:
        return 0
    gone = set(rids)
    scheduler.waiting_queue = [r for r in scheduler.waiting_queue if r.rid not in gone]
    arrived = {rid: s.scope.tokenized.pop(rid) for rid in rids}
    s.scope.handed.difference_update(gone)
    mine = share(rids, tuple(s.bind.ranks), engine.dp_rank)
    if engine.result.kept:
        engine.result.process(scheduler)
    s.scope.leave()
    try:
        for rid in mine:
            start(scheduler, arrived[rid], engine.aborts.hits(rid))
    finally:
        s.scope.enter()
    engine.counters.handed_back += len(mine)
    logger.info(
        "flying: engine %d: %d waiting request(s) of bind %s handed back to DP (%d here)",
        engine.dp_rank, len(rids), s.bind.bind_id, len(mine),
    )
    return len(mine)


def start(scheduler, tokenized, aborted: bool) -> None:
    """Start ``tokenized`` (the request as it arrived) in DP (DP state); one whose abort
    this member has seen is aborted there at once, through SGLang's own path, so its
    client gets SGLang's abort answer."""
    from sglang.srt.managers.io_struct import AbortReq

    scheduler.handle_generate_request(tokenized)
    report.mark(scheduler, tokenized.rid, 1, HANDED_BACK_REASON)
    if aborted:
        scheduler.abort_request(AbortReq(rid=tokenized.rid))
