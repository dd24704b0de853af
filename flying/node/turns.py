"""The DP controller's conversation index: which engine holds a conversation's history.

The policy runs a conversation's turn in DP where it would have put it in a group
(``scheduler.policy``, rule 4, from ``scheduler.conversations``); this module is its
mechanism in the controller process: it keys each request's prompt (``look_up``, before
the policy decides), and after the placement sends such a turn to the engine holding its
conversation (SGLang's own ``routed_dp_rank``, which its dispatch honours before its load
balancing), remembers where every prompt went and counts whether it continued an
earlier one (``place``; ``continued_share`` is the policy's sign of chat traffic), and
``learn`` reads where SGLang's round robin sent the others. A turn the layout runs in DP
anyway, or whose history no engine holds, is SGLang's to dispatch, as with groups off.
Only under the adaptive policy, only once the start-up probe has opened the groups, and
never for a request that names its own engine (``routed_dp_rank`` from the client is a
DP-only feature: the request never reaches here with it unset by Flying). Advice only:
any failure leaves SGLang's dispatch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from scheduler.conversations import ConversationIndex, Turn, affinity_rank, chain, is_turn

logger = logging.getLogger(__name__)


@dataclass
class Lookup:
    keys: list[int]
    turn: Turn | None
    prompt_len: int = 0

    @property
    def tokens(self) -> int:
        return self.turn.tokens if self.turn is not None else 0


def look_up(controller, req) -> Lookup | None:
    """The prompt's keys and the earlier prompt it continues, if any; None where the
    request has no token ids (embeddings) or the index fails (logged)."""
    try:
        ids = getattr(req, "input_ids", None)
        if not ids:
            return None
        index = getattr(controller, "_flying_turns", None)
        if index is None:
            index = controller._flying_turns = ConversationIndex()
        keys = chain(ids)
        return Lookup(keys, index.turn_of(keys), len(ids))
    except Exception:  # noqa: BLE001 - advice: placement goes on without it
        logger.exception("flying: conversation lookup failed for request %s",
                         getattr(req, "rid", "?"))
        return None


def uncached(found: Lookup) -> int:
    """The prompt tokens ``found``'s request prefills where it runs in DP: a turn
    (``is_turn``) whose history one engine holds only what follows it (``place`` sends
    it there); any other prompt all of them (a history that ran in a group is cached
    nowhere). What the arrival estimate counts as a request's prompt: the layouts'
    service is predicted from it, and the policy's cost model sees no cached prefixes
    otherwise (under chat traffic it charged each turn's whole history, put DP's TPOT
    at 233 ms where it streamed 80, and kept choosing a group for turns that each then
    ran in DP)."""
    turn = found.turn
    if turn is not None and turn.rank >= 0 and is_turn(turn.tokens, found.prompt_len):
        return found.prompt_len - turn.tokens
    return found.prompt_len


def place(controller, req, found: Lookup | None, in_group: bool, turn: bool,
          within: tuple[int, ...] = ()) -> None:
    """After placement: a turn the policy ran in DP instead of a group (``turn``) goes
    to its conversation's engine (``affinity_rank`` over the engines SGLang may dispatch
    to now, of a mixed layout's DP engines ``within`` where those are set); every other
    DP request is SGLang's to dispatch, as with groups off, or was routed already (a
    mixed layout's). Every prompt is remembered with its engine (-1: a group, or
    SGLang's choice until ``learn`` reads it)."""
    if found is None:
        return
    try:
        routed = getattr(req, "routed_dp_rank", None)
        rank = routed if not in_group and isinstance(routed, int) and routed >= 0 else -1
        # ``turn``: the policy found ``found.turn`` long enough (``is_turn``)
        # a turn whose history no engine holds (it ran in a group) is SGLang's to
        # place: the loads read here lag the requests just sent, so "least loaded"
        # would send turns arriving together to one engine
        if turn and not in_group and found.turn is not None and found.turn.rank >= 0 \
                and routed is None:
            loads = dispatchable_loads(controller)
            if within and any(r in loads for r in within):
                loads = {r: n for r, n in loads.items() if r in within}
            if loads:
                rank = affinity_rank(found.turn.rank, loads)
                req.routed_dp_rank = rank
                logger.debug("flying: request %s continues a conversation (%d tokens); "
                             "engine %d", req.rid, found.turn.tokens, rank)
        index = controller._flying_turns
        index.remember(found.keys, rank)
        # counted once placed: the share the policy read did not count this prompt,
        # which no later turn can have continued yet
        index.count(found.keys, found.turn, found.prompt_len)
        # a DP request left to SGLang's dispatch: ``learn`` finds its engine after it
        controller._flying_unrouted = (req.rid, found.keys) if rank < 0 and not in_group \
            else None
    except Exception:  # noqa: BLE001 - advice: SGLang's dispatch decides
        logger.exception("flying: conversation placement failed for request %s",
                         getattr(req, "rid", "?"))


def round_robin_mark(controller) -> int | None:
    """SGLang's round-robin counter before it dispatches a request (None: another
    load-balance method, whose choice is not read back)."""
    method = getattr(controller, "load_balance_method", None)
    if getattr(method, "name", "") != "ROUND_ROBIN":
        return None
    return getattr(controller, "round_robin_counter", None)


def learn(controller, req, mark: int | None) -> None:
    """After SGLang's round robin dispatched a request ``place`` left to it: remember the
    engine it chose (the last slot its counter passed: ``active[(counter - 1) % n]``),
    so that the conversation's next turn goes there and finds this one cached."""
    unrouted = getattr(controller, "_flying_unrouted", None)
    controller._flying_unrouted = None
    if mark is None or unrouted is None or unrouted[0] != getattr(req, "rid", None):
        return
    try:
        active = list(controller._active_workers)
        after = controller.round_robin_counter
        if after != mark and active and getattr(req, "routed_dp_rank", None) is None:
            controller._flying_turns.remember(unrouted[1], active[(after - 1) % len(active)])
    except Exception:  # noqa: BLE001 - advice only
        logger.exception("flying: could not read where request %s went", req.rid)


def continued_share(controller) -> float:
    """``ConversationIndex.continued_share`` of the controller's index (0.0 without one)."""
    index = getattr(controller, "_flying_turns", None)
    return index.continued_share() if index is not None else 0.0


def dispatchable_loads(controller) -> dict[int, int]:
    """Rank -> running + waiting requests, of the engines SGLang's dispatch sends to now
    (active, with a socket, not marked down); {} if unknown."""
    from flying.node.placement import loads_of

    active = set(getattr(controller, "_active_workers", ()))
    status = getattr(controller, "status", None)
    workers = getattr(controller, "workers", ())
    ok = {r for r in active if r < len(workers) and workers[r] is not None
          and (status is None or status[r])}
    loads = loads_of(controller.load_snapshot_reader.read_all())
    return {e.rank: e.requests for e in loads if e.rank in ok}
