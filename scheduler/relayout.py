"""The pure decisions of a relayout: where moved requests land, how many join, how far an
upgrade grows.

The engines (``flying.session.move``, ``join``, ``upgrade``) make these decisions from
values every member of a group shares, so each member computes the same answer; the
decision log records their inputs and ``scheduler.replay`` feeds them back here. Pure
and deterministic (no torch, no I/O): the same inputs give the same decision on every
member and offline.
"""

from __future__ import annotations

from collections.abc import Mapping

#: Tokens a TP session reserves beyond prompt + max_new_tokens: SGLang's admission keeps
#: one page per request and one slot of headroom (strict ``<``) free.
ADMISSION_SLACK = 4
#: Most running DP requests that join one forming session, from all its members
#: together (``flying.session.join``); the rest run their DP steps between the group's.
MAX_JOIN = 8


def assign(lens: list[int], rooms: list[int], loads: list[int]) -> list[int] | None:
    """The member (TP rank) each moved request lands on, or None if one fits nowhere.

    Requests in batch order, each to the member with the fewest DP requests counting
    those already assigned (lowest rank on ties), among those with room for its KV plus
    one decode token. Spreading them keeps a group's requests from piling onto one
    engine, where SGLang's dispatch would take many new requests to even it out."""
    left, count, owners = list(rooms), list(loads), []
    for n in lens:
        fits = [r for r in range(len(left)) if left[r] >= n + 1]
        if not fits:
            return None
        r = min(fits, key=lambda i: (count[i], i))
        left[r] -= n + 1
        count[r] += 1
        owners.append(r)
    return owners


def running_budget(kv: int, max_new_tokens: int, outputs: int,
                   slack: int = ADMISSION_SLACK) -> int:
    """KV tokens a running DP request needs in a group: the ``kv`` tokens it holds, what
    it may still produce (its bound less its ``outputs``; at least the next token) and
    the admission slack. ``max_new_tokens`` is already resolved (never None)."""
    return int(kv) + max(int(max_new_tokens) - int(outputs), 1) + slack


def reservable(budgets: list[int], room: int, per_slot: int) -> int:
    """How many of ``budgets`` (tokens each, in order) a member with ``room`` DP slots
    (free and evictable) reserves at ``per_slot`` tokens per DP slot: the longest prefix
    whose whole slots fit. A member stops at the first that does not fit, so that every
    member's reservations are a prefix of the same list."""
    taken = 0
    for i, tokens in enumerate(budgets):
        taken += -(-int(tokens) // per_slot)
        if taken > room:
            return i
    return len(budgets)


def joinable(reserved: list[int]) -> int:
    """How many requests join: what every member could reserve (a MIN over members)."""
    return min(reserved) if reserved else 0


def new_total(room: int, per_slot: int, engine_slots: int, context_limit: int) -> int:
    """Tokens (prompt + output) a request may reach in a group whose members can each
    give ``room`` DP slots, a slot holding ``per_slot`` tokens' head shards (the degree,
    or H_kv when the group replicates KV heads): what they pool less SGLang's admission
    slack, at most a whole group's pool, never beyond the model's context
    (``context_limit``)."""
    pooled = min(room, engine_slots) * per_slot - ADMISSION_SLACK
    return max(0, min(pooled, context_limit))


def upgrade_total(rows: list[list[int]], src: int, per_slot: int, engine_slots: int,
                  context_limit: int) -> int:
    """The tokens an upgraded request may reach in its group, or 0 if it stays in DP.

    ``rows``: per member (TP rank order) ``[kv, prompt, bound, room]``, where only the
    holder's (TP rank ``src``) first three are the request's (its KV tokens, prompt and
    DP bound of new tokens; kv 0: the request is gone) and ``room`` is what each member
    can give it. The request goes only if the group lets it grow beyond its DP bound."""
    kv, prompt, bound = rows[src][:3]
    total = new_total(min(r[3] for r in rows), per_slot, engine_slots, context_limit)
    return total if kv > 0 and total - prompt > bound else 0


def serving_other(holder: int, m: int, current: int, busy: Mapping[int, int]) -> int | None:
    """An engine of the TP-``m`` group around ``holder`` that serves a group other than
    that one and the holder's own TP-``current`` group (``busy``: rank -> degree), or None."""
    want = holder // m * m
    own = holder // current * current if current > 1 else -1
    for r in range(want, want + m):
        d = busy.get(r, 1)
        if d > 1 and (r // d * d, d) not in ((want, m), (own, current)):
            return r
    return None
