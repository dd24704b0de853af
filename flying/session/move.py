"""Ending a group session at once: its running requests move into DP on its members.

When a member has DP work (the per-step exchange sums it) and the session may hand its
requests over (``--flying-move-to-dp``: the adaptive policy's light-load groups by
default), the session does not wait for its requests to finish: at the next TP step
boundary, on every member at the same step,

1. the session's requests must all be decoding (nothing waiting, no chunked prefill,
   the last TP batch a decode batch); otherwise the move waits for a later step;
2. the members leave the TP state and share (one all-gather) their DP room (free +
   evictable slots + the session's own reserved slots) and DP load; every member
   computes the same ``assign``ment: each request to the least loaded member with room
   for its tokens plus one decode token. If a request fits nowhere the session keeps
   running and tries again ``RETRY_STEPS`` group steps later (DP work keeps running
   between group steps);
3. every member's head shard of every token goes to the members that take requests.
   In the usual move every request goes to one member, and no member waits for
   another (``flying.session.handoff``): each other member publishes its rows in its
   outbox and returns to its DP work at once, while the taker, when it has the room
   beside the session's own rows, takes DP slots, copies its own heads from its TP
   view and then writes each peer's heads from the peer's outbox, layer by layer as
   they are written (each byte copied once on each side). Where the group cannot publish (replicated heads, no shared memory)
   the others stream their rows through the group's segment in step with the taker
   (``kv_stream.send_rows`` / ``gather_rows``). Otherwise every member reads
   its shard (``kv_relayout.read_block`` on its TP view), the members gather them, and
   each member that was assigned requests gives the session's reserved slots back,
   takes DP slots and writes whole rows (all heads; one copy of each distinct head
   group when heads are replicated). Each taker rewrites its requests'
   ``req_to_token`` rows, re-homes them in the
   DP prefix cache (root lock, nothing protected: the tree learns their tokens when
   they finish, as for any DP request) and merges them into its DP running batch
   (SGLang's ``merge_batch``, the way a prefill batch joins it); every member frees the
   rows of the requests another member took;
4. the session is released on every member.

The requests keep every token they produced and their sampling state (penalties,
logprobs, stream offsets live in each member's ``Req`` copy and batch, identical in
lockstep); nothing is prefilled again. A request that lands on a member other than the
leader is answered by that member from then on (SGLang's detokenizer and HTTP side key
a stream by request id, not by engine; aborts reach every engine). Invariant: after a
move, every KV slot and request row is owned exactly once (a member's DP allocator or
a DP request), as after a release.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from flying.session import handoff, layout_log, tp_scope
from flying.session.faults import adopt_delay_s
from flying.substrate import kv_relayout, kv_stream
from scheduler.relayout import assign

logger = logging.getLogger(__name__)

#: Group steps a session waits after a move was refused (a request fit on no member).
RETRY_STEPS = 8
#: Why a request's report says it left its group.
MOVED_REASON = "moved to DP with its KV: DP work arrived"


def kv_len(req) -> int:
    """Tokens whose KV a decoding request holds: all but its last output token (the
    next step's input)."""
    return len(req.origin_input_ids) + len(req.output_ids) - 1


def allowed(mode: str, reasons: set[str]) -> bool:
    """Whether a session whose binds had ``reasons`` may move to DP under ``mode``
    (``--flying-move-to-dp``)."""
    if mode == "all":
        return True
    return mode == "policy" and bool(reasons) and reasons <= {"policy"}


def ready(scheduler) -> bool:
    """Every request of the session is decoding (same answer on every member: lockstep)."""
    last = scheduler.last_batch
    return (
        not scheduler.waiting_queue
        and scheduler.chunked_req is None
        and (last is None or last.forward_mode.is_decode())
        and not scheduler.running_batch.is_empty()
    )


@dataclass(frozen=True)
class Moved:
    requests: int  # requests that landed in DP on this member
    tokens: int  # their tokens of KV
    bytes_in: int  # KV bytes this member received from its peers
    ms: float  # from the members' agreement to the requests landing in DP
    reqs: tuple = ()  # this member's landed requests
    #: what the members agreed on (``assign``'s inputs and owners), for the decision log
    decision: dict | None = None
    #: on the taker of a published move: the most steps a sender ran meanwhile
    peer_steps: int = 0


def to_dp(scheduler, s, dp_limit: int, faults=None, timeout_s: float = 30.0,
          mail: handoff.Mail | None = None) -> Moved | None:
    """Move the session's running requests into DP on its members (every member calls
    this at the same boundary, in the session's TP state), spread by ``assign``.
    Returns None, back in the TP state with nothing changed, if some request fits on no
    member, or may grow beyond one engine's limit (``dp_limit``: prompt + max_new_tokens,
    as SGLang admits a DP request; a long-context request stays in its group); otherwise the session's scope is left and its requests are gone from it
    (the caller releases the session). A member that takes a request the leader was
    answering answers it from here on: its copy of the request has run every step in
    lockstep (same tokens, same stream offsets), and its output now goes to SGLang's
    detokenizer like any DP request's."""
    batch, last = scheduler.running_batch, scheduler.last_batch
    batch.filter_batch()
    reqs = list(batch.reqs)
    lens = [kv_len(r) for r in reqs]
    if not reqs or any(r.kv.kv_allocated_len != n for r, n in zip(reqs, lens, strict=True)):
        return None
    if any(len(r.origin_input_ids) + r.sampling_params.max_new_tokens > dp_limit for r in reqs):
        return None
    table = scheduler.req_to_token_pool.req_to_token
    tp_slots = torch.cat([table[r.kv.req_pool_idx, :n] for r, n in zip(reqs, lens, strict=True)])
    scope = s.scope
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    scheduler.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
    scheduler.last_batch = None
    scope.leave()
    taking = None
    try:
        # the usual move, every request to one member: its peers publish and leave
        address = ([-1, 0] if mail is None else
                   mail.address(s.member, scope.prepared.split, scope.prepared.tp_pool, len(tp_slots)))
        members = s.member.gather_ints([_room(scheduler, scope), _dp_load(scheduler), os.getpid(),
                                        *address])
        owners = assign(lens, [m[0] for m in members], [m[1] for m in members])
        decision = {"lens": lens, "rooms": [int(m[0]) for m in members],
                    "loads": [int(m[1]) for m in members], "owners": owners}
        if owners is None:
            if s.is_leader:  # the others refused alike; it recurs: logged once per try
                layout_log.write("move", {**layout_log.about(s.bind, s.bind.ranks[0]),
                                          **decision})
            scope.enter()
            scheduler.running_batch, scheduler.last_batch = batch, last
            return None
        t0 = time.perf_counter()  # agreed: from here on it is the relayout's own cost
        me, tp_pool, written = s.member.tp_rank, scope.prepared.tp_pool, None
        shards = None
        publishes = len(set(owners)) == 1 and all(m[3] >= 0 for m in members)
        if publishes and owners[0] == me:
            taking = handoff.Taking(mail, s.member, [tuple(m[2:5]) for m in members], timeout_s)
        if faults is not None:
            faults.check("move")
        if len(set(owners)) > 1:
            shards = kv_relayout.exchange(s.member, kv_relayout.read_block(tp_pool, tp_slots))
        elif owners[0] != me and publishes:
            handoff.send(mail, scope, tp_slots, scheduler.forward_ct, timeout_s)
            s.answerer = False  # the taker owns them now
        elif owners[0] != me:
            kv_stream.send_rows(s.member, tp_pool, tp_slots, owners[0])
        elif taking is not None:
            written, shards = taking.gather(scheduler, scope, tp_slots, adopt_delay_s())
        else:
            written, shards = _gather_here(scheduler, scope, s.member, tp_slots)
    except BaseException:
        if taking is not None and taking.resolve(scope.prepared.tp_pool, tp_slots.numel()):
            s.answerer = True  # the leader published: it answers them no more
        if not scope.entered:
            scope.enter()
        scheduler.running_batch, scheduler.last_batch = batch, last
        raise
    keep = [i for i, owner in enumerate(owners) if owner == me]
    for i, req in enumerate(reqs):
        if owners[i] != me:
            scheduler.req_to_token_pool.free(req)
    if keep:
        tokens = None  # every request is this member's: all tokens, in order
        if len(keep) < len(reqs):
            starts = [sum(lens[:i]) for i in range(len(lens))]
            tokens = torch.cat([torch.arange(starts[i], starts[i] + lens[i]) for i in keep])
        batch.filter_batch(keep_indices=keep)
        _land(scheduler, scope, batch, [reqs[i] for i in keep], [lens[i] for i in keep],
              shards, tokens, written)
    peers = s.member.group.degree - 1
    k0 = tp_pool.k_buffer[0]
    return Moved(
        len(keep), sum(lens[i] for i in keep),
        peers * kv_relayout.block_bytes(len(tp_pool.k_buffer), tp_slots.numel(), k0.shape[1],
                                        k0.shape[2], k0.element_size()),
        (time.perf_counter() - t0) * 1e3, tuple(reqs[i] for i in keep), decision,
        taking.peer_steps if taking is not None else 0,
    )


def _gather_here(scheduler, scope, member, tp_slots: torch.Tensor):
    """The member that takes every request of a move: ``(slots, None)`` with every head
    of their tokens already written into fresh DP ``slots`` (``gather_rows``: straight
    from its own TP view and the segment, no block in between) when the engine has that
    room beside the session's own rows; else ``(None, shards)``, the members' blocks,
    written once those rows are back (``_land``)."""
    n = tp_slots.numel()
    if tp_scope.dp_room(scheduler) < n:
        block = kv_relayout.read_block(scope.prepared.tp_pool, tp_slots)
        return None, kv_relayout.gather_to(member, block, member.tp_rank)
    slots = tp_scope.take_dp_slots(scheduler, n)  # disjoint from the rows tp_slots are in
    try:
        kv_stream.gather_rows(member, scope.prepared.split, scope.prepared.tp_pool, tp_slots,
                              scope.dp_pool, slots)
    except BaseException:  # no request points at them yet
        scheduler.token_to_kv_pool_allocator.free(slots)
        raise
    return slots, None


def _dp_load(scheduler) -> int:
    """DP requests on this engine (DP state): running, waiting, and just prefilled (a
    prefill batch that SGLang's next formation merges into the running batch)."""
    last = scheduler.last_batch
    fresh = 0
    if last is not None and last is not scheduler.running_batch and last.forward_mode.is_extend():
        fresh = sum(1 for r in last.reqs if not r.finished() and r is not scheduler.chunked_req)
    return len(scheduler.running_batch.reqs) + len(scheduler.waiting_queue) + fresh


def holds_dp(scheduler, scope) -> bool:
    """Whether the engine's DP batch (DP state) cannot run its next decode step unless
    the session gives back the KV slots it reserved on this engine.

    SGLang meets a short pool by retracting DP requests, and aborts the last one when
    even that is not enough; a slot a group holds is one plain SGLang would have had.
    So such a DP step is held (its requests keep their KV) and the session yields.
    A step that would not fit even with the reservations back is SGLang's to handle,
    as without Flying. ``check_decode_mem`` evicts from the prefix cache first, as
    SGLang's own check does at the same boundary."""
    running = scheduler.running_batch
    if running is None or running.is_empty() or running.check_decode_mem():
        return False
    need = running.new_tokens_required_next_decode()
    return scheduler.token_to_kv_pool_allocator.available_size() + _reserved(scope) >= need


def _reserved(scope) -> int:
    """DP slots the session reserved on this engine (back to it when the session ends)."""
    return sum(int(r.dp_slots.numel()) for r in scope.reservations)


def _room(scheduler, scope) -> int:
    """DP slots the leader could give the moved requests (free, evictable in its
    prefix cache, and the session's own reservations, returned before the move)."""
    return tp_scope.dp_room(scheduler) + _reserved(scope)


def _land(scheduler, scope, batch, reqs, lens, shards: list[torch.Tensor] | None,
          tokens: torch.Tensor | None, written: torch.Tensor | None = None) -> None:
    """A member, DP state: write its requests' rows from the members' shards (``shards``:
    [layers, 2, n, H_kv/f, d] each, TP-rank order; one copy of each distinct head group
    is written when heads are replicated; ``tokens``: which of the n are these
    requests', None for all) unless ``written`` holds them already (``_gather_here``),
    re-point the requests at them and merge them into the DP running batch."""
    scope.release_all()  # their TP sub-slots are read: the reserved rows are free again
    slots = written
    if slots is None:
        slots = tp_scope.take_dp_slots(scheduler, sum(lens))
        try:
            kv_relayout.write_shards(scope.dp_pool, slots,
                                     kv_relayout.distinct(shards, scope.prepared.split), tokens)
        except BaseException:  # no request points at them: nothing else would free them
            scheduler.token_to_kv_pool_allocator.free(slots)
            raise
    rehome(scheduler, reqs, lens, slots)
    batch.token_to_kv_pool_allocator = scheduler.token_to_kv_pool_allocator
    batch.tree_cache = scheduler.tree_cache
    batch.batch_is_full = False
    merge_into_running(scheduler, batch)


def rehome(scheduler, reqs: list, lens: list[int], slots: torch.Tensor) -> None:
    """Point the requests' rows at ``slots`` (their tokens in order, ``lens`` each) and
    give them to the prefix cache of the scheduler's current state. The cache they came
    from (a session's, which is disabled, or the DP one they were released from) holds
    nothing of theirs: they own all their KV and start at the tree's root, like a
    request whose prompt matched nothing."""
    table = scheduler.req_to_token_pool.req_to_token
    cache = scheduler.tree_cache
    start = 0
    for req, n in zip(reqs, lens, strict=True):
        table[req.kv.req_pool_idx, :n] = slots[start : start + n].to(table.dtype)
        start += n
        req.kv.kv_allocated_len = req.kv.kv_committed_len = n
        req.kv.cache_protected_len = req.kv.cache_inserted_len = 0
        req.last_node = cache.root_node_handle(req.extra_key)
        req.lock = cache.lock(req.last_node)


def merge_into_running(scheduler, batch) -> None:
    """Add a decode batch of moved requests to the running batch of the scheduler's
    current state (SGLang's ``merge_batch``, the way a prefill batch joins it).

    ``merge_batch`` concatenates per-request lists and is not atomic: a list that is a
    list on one side and None on the other fails half way, leaving a running batch
    whose lists no longer match its requests (the engine then dies in its next
    ``filter_batch``). So the two sides are made alike first."""
    running = scheduler.running_batch
    if running.is_empty():
        scheduler.running_batch = batch
        return
    for side, other in ((running, batch), (batch, running)):
        if side.multimodal_inputs is None and other.multimodal_inputs is not None:
            side.multimodal_inputs = [None] * len(side.reqs)
    running.merge_batch(batch)
    running.batch_is_full = False
