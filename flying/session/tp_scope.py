"""The mode scope: switch one engine's SGLang scheduler and model runner into TP mode.

Two parts, both attribute toggles (``flying.substrate.toggle``):
- ``Prepared`` (per TP degree, built once at engine start-up): the layer views, the TP
  view of the KV pool, an attention backend bound to it, and which SGLang components
  hold the tree cache, the allocator and the pool size (found once, by scanning).
- ``Scope`` (per group session): the session's allocator over its reserved sub-slots, its
  own prefix cache (``_session_cache``), queues and limits. ``enter()`` switches the engine
  into the session's TP state, ``leave()`` back to its DP state, keeping both sides'
  state; the engine does that around every TP step, so DP steps can run between them.

What the TP state swaps:
- model layers -> TP shard views (``weight_views.tp_layers``), reductions on the group;
- model runner: KV pool -> TP view of the same memory (its heads split, or replicated
  when the model has fewer KV heads than the degree: ``layout.KvSplit``), allocator -> the reserved
  sub-slots, attention backend -> an instance bound to the TP view;
- scheduler: allocator and the session's own prefix cache for TP requests (they never
  enter the DP radix tree: different index space, partial heads), its DP queues (waiting and
  grammar) and running batch (stashed, untouched: hard preemption keeps their KV),
  capacity limits;
- sampling: the sampler's token sync (SGLang's ``_sync_token_ids_across_tp``) shares the
  leader's token ids with every member, every step;
- outputs: non-leaders send nothing to the client (the leader answers for the group).
"""

from __future__ import annotations

import dataclasses

import torch

from flying.session import grammar, report
from flying.session.holders import pool_size_holders, references
from flying.substrate import kv_adaptor
from flying.substrate.layout import KvSplit
from flying.substrate.toggle import Toggle
from flying.substrate.weight_views import build_shards, layer_toggle


class _NullSender:
    """Stands in for the detokenizer socket on non-leader members."""

    def send_output(self, *args, **kwargs) -> None:
        return None


def _runner(scheduler):
    return scheduler.tp_worker.model_runner


def reserve_for(scheduler, tokens: int, per_slot: int):
    """Reserve DP slots for ``tokens`` tokens of a TP session at ``per_slot`` tokens per
    DP slot (``Prepared.per_slot``), evicting cached DP prefixes if needed."""
    _make_room(scheduler, -(-tokens // per_slot))
    return kv_adaptor.reserve(scheduler.token_to_kv_pool_allocator, tokens, per_slot)


def _make_room(scheduler, slots: int) -> None:
    """Evict cached DP prefixes until ``slots`` DP slots are free (DP state), if it can."""
    _evict(scheduler.tree_cache, scheduler.token_to_kv_pool_allocator, slots)


def make_dp_room(scope: Scope, slots: int) -> None:
    """``_make_room`` from inside the session's TP state (an admission). While the state
    is entered the DP tree's allocator attribute is the session's (one of the swapped
    references), so it points back at the engine's for the eviction (``finally``)."""
    cache = scope.dp_cache
    swapped = cache.token_to_kv_pool_allocator
    cache.token_to_kv_pool_allocator = scope.dp_allocator
    try:
        _evict(cache, scope.dp_allocator, slots)
    finally:
        cache.token_to_kv_pool_allocator = swapped


def _evict(cache, allocator, slots: int) -> None:
    short = slots - allocator.available_size()
    if short > 0:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        cache.evict(EvictParams(num_tokens=short))


def dp_room(scheduler) -> int:
    """DP slots this engine could give now (DP state): free, and evictable from its
    prefix cache."""
    evictable = int(getattr(scheduler.tree_cache, "evictable_size", lambda: 0)())
    return scheduler.token_to_kv_pool_allocator.available_size() + evictable


def take_dp_slots(scheduler, tokens: int) -> torch.Tensor:
    """``tokens`` DP slots from the engine's allocator (DP state), evicting cached DP
    prefixes if needed; raises if the engine has not that many."""
    _make_room(scheduler, tokens)
    slots = scheduler.token_to_kv_pool_allocator.alloc(tokens)
    if slots is None:
        raise RuntimeError(f"flying: engine has no {tokens} free KV slots for a move")
    return slots


def release(scheduler, reservation) -> None:
    if reservation is not None:
        kv_adaptor.release(scheduler.token_to_kv_pool_allocator, reservation)


def reject(scheduler, req, message: str) -> None:
    """Answer a TP request that could not be bound with an explicit error."""
    scheduler.handle_generate_request(req)
    for r in scheduler.waiting_queue:
        if r.rid == req.rid and not r.finished():
            r.set_finish_with_abort(message)


def _session_cache(scheduler, allocator):
    """The session's prefix cache: SGLang's radix tree over the TP sub-slots, as on each
    rank of SGLang's ``--tp-size`` (off where the engine's is: ``--disable-radix-cache``,
    a non-radix cache, pages > 1). Lockstep: every member takes the same requests in
    the same order, so the members' trees match and their prefills match the same
    prefix (LRU order comes from SGLang's access counter, not a clock; a mismatch fails
    the step's lockstep check and ends the session). It lives for the session: its
    nodes point into the reservations, so ``Scope.release_all`` empties it first."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    dp = scheduler.tree_cache
    enabled = (
        type(dp) is UnifiedRadixCache and not dp.disable
        and tuple(dp.tree_components) == (ComponentType.FULL,)
        and int(getattr(dp, "page_size", 1)) == 1
    )
    params = CacheInitParams(
        disable=not enabled,
        req_to_token_pool=scheduler.req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=1,
    )
    params.tree_components = (ComponentType.FULL,)
    return UnifiedRadixCache(params)


@dataclasses.dataclass
class Prepared:
    """Everything a TP-``degree`` session needs that does not depend on the session,
    built at engine start-up so that entering a group is a swap (no views, pools or
    backends are built on the bind path)."""

    degree: int
    layers: Toggle  # the model's layers as this engine's TP rank
    tp_pool: object  # the KV pool viewed as [rows*f, H_kv/f, d], f = split.shards
    backend: object  # the attention backend bound to ``tp_pool``
    #: (holder, attribute) of every reference to the DP tree cache / the DP allocator
    cache_refs: list[tuple[object, str]]
    allocator_refs: list[tuple[object, str]]
    size_holders: list[object]  # components with their own ``max_total_num_tokens``
    #: which KV heads each rank holds (split, or replicated when H_kv < degree)
    split: KvSplit
    #: the TP allocator and the session's prefix cache, made at the first session and reused
    #: (re-pointed at each session's reservation): one session per degree at a time
    allocator: object = None
    cache: object = None
    #: the TP state's toggle, made at the first session and reloaded with each session's
    #: own values (``_session_values``): building ~35 entries cost ~0.25 ms of a bind
    state: Toggle | None = None
    #: an empty ``ScheduleBatch`` for the next session's running batch, made after the
    #: last session (building one costs ~0.1-0.2 ms on the bind's path)
    spare_batch: object = None

    @property
    def per_slot(self) -> int:
        """Tokens one DP slot holds in this degree's KV view: the degree, or H_kv when
        heads are replicated (a group then pools H_kv x one engine's KV, not m x)."""
        return self.split.shards


def prepare(scheduler, member) -> Prepared:
    """Build the per-degree objects for ``member``'s group (once, at start-up)."""
    runner = _runner(scheduler)
    degree = member.group.degree
    shards = build_shards(runner.model, degree, member.tp_rank)
    tp_pool = kv_adaptor.view_pool(runner.token_to_kv_pool, degree)
    # The backend reads the pool at construction: build it with the TP view in place.
    pool_swap = Toggle([(runner, "token_to_kv_pool", tp_pool)])
    pool_swap.enter()
    try:
        backend = type(runner.attn_backend)(runner)
    finally:
        pool_swap.leave()
    cache, allocator = scheduler.tree_cache, scheduler.token_to_kv_pool_allocator
    refs = references(scheduler, {id(cache): "cache", id(allocator): "allocator"})
    return Prepared(
        degree, layer_toggle(shards, member.all_reduce, runner.model), tp_pool, backend,
        [(h, n) for h, n, kind in refs if kind == "cache"],
        [(h, n) for h, n, kind in refs if kind == "allocator"],
        pool_size_holders(scheduler),
        KvSplit(runner.token_to_kv_pool.head_num, degree),
    )


@dataclasses.dataclass
class Scope:
    """One group session's TP state on one member, and its KV bookkeeping.

    ``reservations`` are the DP slots lent to the session (one per admitted request);
    their TP sub-slots are the TP allocator's whole supply, and ``capacity`` (their
    count) is what the scheduler sees as its pool while the session runs. Invariant:
    ``capacity == sum(r.tp_slots.numel() for r in reservations)``. While ``entered``,
    the scheduler's queues, batches, allocator and limits are the session's; otherwise
    they are the engine's DP ones (the session's are kept in the toggles).
    """

    scheduler: object
    prepared: Prepared
    dp_allocator: object
    tp_allocator: object
    reservations: list
    state: Toggle
    capacity: int = 0
    admitting: bool = True  # False once an offered request could not be admitted
    #: rid -> the request as it arrived (to re-run it in DP if the session fails early)
    tokenized: dict = dataclasses.field(default_factory=dict)
    handed: set = dataclasses.field(default_factory=set)  # rids handed to SGLang
    reasons: set = dataclasses.field(default_factory=set)  # the binds' reasons (Bind.reason)
    #: the engine's DP pool and prefix cache (what the TP state swaps out)
    dp_pool: object = None
    dp_cache: object = None

    @property
    def entered(self) -> bool:
        return self.state.entered

    def enter(self) -> None:
        """DP state -> the session's TP state (scheduler, KV, backend, then layers)."""
        self.state.enter()
        self.prepared.layers.enter()

    def leave(self) -> None:
        """The session's TP state -> DP state (no-op if not entered)."""
        self.prepared.layers.leave()
        self.state.leave()

    def hand(self, scheduler, req, reason: str = "explicit") -> None:
        """Give a joining request to SGLang (remembered for containment)."""
        self.tokenized[req.rid] = req
        self.handed.add(req.rid)
        self.reasons.add(reason)
        scheduler.handle_generate_request(req)
        grammar.settle(scheduler, req.rid)  # in every member's batch at the same step
        report.mark(scheduler, req.rid, self.prepared.degree)

    def grow(self, reservation) -> None:
        """Add a reservation's sub-slots to the TP allocator (while entered)."""
        self.reservations.append(reservation)
        self.tp_allocator.free(reservation.tp_slots)
        self._set_capacity(self.capacity + int(reservation.tp_slots.numel()))

    def _set_capacity(self, capacity: int) -> None:
        self.capacity = capacity
        for holder in self.prepared.size_holders:
            _set(holder, "max_total_num_tokens", capacity)
        for name in ("max_req_len", "max_req_input_len"):
            setattr(self.scheduler, name, capacity - 1)

    def release_all(self) -> None:
        """Give every reserved DP slot back to the engine (after leaving), first emptying
        the session's prefix cache, whose nodes point into them."""
        cache = self.prepared.cache
        if cache is not None and not cache.disable:
            cache.reset()
        for res in self.reservations:
            kv_adaptor.release(self.dp_allocator, res)
        self.reservations = []


def _set(obj: object, name: str, value: object) -> None:
    try:
        setattr(obj, name, value)
    except dataclasses.FrozenInstanceError:  # SGLang components that are frozen dataclasses
        object.__setattr__(obj, name, value)


def _token_sync(member, faults):
    """The sampler's per-step token sync, bound to the group: the leader's ids win.
    ``ids``: [bs] int tensor, overwritten in place (SGLang's contract)."""

    def sync(ids, sampling_info) -> None:
        if faults is not None:
            faults.check("sample")
        member.share_tokens_(ids)

    return sync


def _degree_values(scheduler, prepared: Prepared, member, is_leader: bool, faults) -> list:
    """The TP state's entries that are the same for every session of this degree."""
    runner = _runner(scheduler)
    allocator, cache = prepared.allocator, prepared.cache
    values = [
        *[(h, n, cache) for h, n in prepared.cache_refs],
        *[(h, n, allocator) for h, n in prepared.allocator_refs],
        (runner, "token_to_kv_pool", prepared.tp_pool),
        (runner, "token_to_kv_pool_allocator", allocator),
        (runner, "attn_backend", prepared.backend),
        (runner.sampler, "_sync_token_ids_across_tp", _token_sync(member, faults)),
    ]
    if not is_leader:
        values.append((scheduler.output_streamer, "send_to_detokenizer", _NullSender()))
        values.append((scheduler.ipc_channels, "send_to_tokenizer", _NullSender()))
    return values


def _session_values(scheduler, prepared: Prepared, capacity: int) -> list:
    """The TP state's entries that each session starts afresh (queues, batches, limits)."""
    restock(prepared)  # normally made after the last session already
    batch, prepared.spare_batch = prepared.spare_batch, None
    return [
        (scheduler, "waiting_queue", []),
        (scheduler, "running_batch", batch),
        (scheduler, "last_batch", None),
        (scheduler, "chunked_req", None),
        # DP requests waiting for their grammar: SGLang moves them into the waiting
        # queue when ready, which in a TP step would put them into one member's batch.
        # The session's own stays empty at step boundaries (``grammar.settle``).
        (scheduler.grammar_manager, "grammar_queue", []),
        *[(h, "max_total_num_tokens", capacity) for h in prepared.size_holders],
        (scheduler, "max_req_len", capacity - 1),
        (scheduler, "max_req_input_len", capacity - 1),
    ]


def restock(prepared: Prepared) -> None:
    """Make the next session's empty running batch now (after a session, off any bind)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    if prepared.spare_batch is None:
        prepared.spare_batch = ScheduleBatch(reqs=[], batch_is_full=False)


def open_scope(scheduler, prepared: Prepared, member, reservation, is_leader: bool, faults=None) -> Scope:
    """The session's TP state (not entered). The caller enters and leaves it around
    TP steps and releases the reservations (``Scope.release_all``) after the last leave.
    Opening touches nothing SGLang sees (the toggle is not entered), so a scope opened
    for a bind that then aborts is simply dropped."""
    runner = _runner(scheduler)
    dp_allocator = scheduler.token_to_kv_pool_allocator
    if prepared.allocator is None:
        prepared.allocator = kv_adaptor.make_tp_allocator(dp_allocator, prepared.tp_pool, reservation)
        prepared.cache = _session_cache(scheduler, prepared.allocator)
    else:
        kv_adaptor.reset_tp_allocator(prepared.allocator, reservation)
    capacity = int(reservation.tp_slots.numel())
    fresh = _session_values(scheduler, prepared, capacity)
    state = prepared.state
    if state is not None and not state.entered:
        state.reload(len(state) - len(fresh), fresh)
    else:  # the first session of this degree (kept), or one beside an entered one
        state = Toggle(_degree_values(scheduler, prepared, member, is_leader, faults) + fresh)
        prepared.state = prepared.state or state
    return Scope(
        scheduler, prepared, dp_allocator, prepared.allocator, [reservation], state, capacity,
        dp_pool=runner.token_to_kv_pool, dp_cache=scheduler.tree_cache,
    )
