"""The mode scope: switch one engine's SGLang scheduler and model runner into TP mode.

``session_scope`` swaps, and restores in ``finally``:
- model layers -> TP shard views (``weight_views.tp_layers``), reductions on the group;
- model runner: KV pool -> TP view of the same memory, allocator -> the reserved
  sub-slots, attention backend -> an instance bound to the TP view;
- scheduler: allocator and a disabled prefix cache for TP requests (they never enter
  the DP radix tree: different index space, partial heads), its DP queues (waiting and
  grammar) and running batch (stashed, untouched: hard preemption keeps their KV),
  capacity limits;
- sampling: the sampler's token sync (SGLang's ``_sync_token_ids_across_tp``) shares the
  leader's token ids with every member, every step;
- outputs: non-leaders send nothing to the client (the leader answers for the group).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from flying.substrate import kv_adaptor
from flying.substrate.weight_views import build_shards, tp_layers


class _NullSender:
    """Stands in for the detokenizer socket on non-leader members."""

    def send_output(self, *args, **kwargs) -> None:
        return None


def _runner(scheduler):
    return scheduler.tp_worker.model_runner


def reserve_for(scheduler, tokens: int, degree: int):
    """Reserve DP slots for a TP session, evicting cached DP prefixes if needed."""
    allocator = scheduler.token_to_kv_pool_allocator
    slots = -(-tokens // degree)
    short = slots - allocator.available_size()
    if short > 0:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        scheduler.tree_cache.evict(EvictParams(num_tokens=short))
    return kv_adaptor.reserve(allocator, tokens, degree)


def release(scheduler, reservation) -> None:
    if reservation is not None:
        kv_adaptor.release(scheduler.token_to_kv_pool_allocator, reservation)


def reject(scheduler, req, message: str) -> None:
    """Answer a TP request that could not be bound with an explicit error."""
    scheduler.handle_generate_request(req)
    for r in scheduler.waiting_queue:
        if r.rid == req.rid and not r.finished():
            r.set_finish_with_abort(message)


def _disabled_cache(scheduler, allocator):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    params = CacheInitParams(
        disable=True,
        req_to_token_pool=scheduler.req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=1,
    )
    params.tree_components = (ComponentType.FULL,)
    return UnifiedRadixCache(params)


def _set(obj: object, name: str, value: object) -> None:
    try:
        setattr(obj, name, value)
    except dataclasses.FrozenInstanceError:  # SGLang components that are frozen dataclasses
        object.__setattr__(obj, name, value)


@contextlib.contextmanager
def _swap(pairs: list[tuple[object, str, object]]) -> Iterator[None]:
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in pairs]
    try:
        for obj, name, value in pairs:
            _set(obj, name, value)
        yield
    finally:
        for obj, name, old in reversed(saved):
            _set(obj, name, old)


_SHARDS: dict[tuple[int, int], object] = {}
_POOLS: dict[int, object] = {}


def shards_for(model, degree: int, rank: int):
    """The (degree, rank) view table; views are built once and reused."""
    key = (degree, rank)
    if key not in _SHARDS:
        _SHARDS[key] = build_shards(model, degree, rank)
    return _SHARDS[key]


def tp_pool_for(pool, degree: int):
    if degree not in _POOLS:
        _POOLS[degree] = kv_adaptor.view_pool(pool, degree)
    return _POOLS[degree]


def _components(root) -> list[object]:
    """``root`` and its direct ``sglang.*`` components, each once."""
    holders, seen = [], set()
    for value in [root, *_attrs(root).values()]:
        module = type(value).__module__ or ""
        if (value is root or module.startswith("sglang.")) and id(value) not in seen:
            seen.add(id(value))
            holders.append(value)
    return holders


def _references(root, targets: dict[int, object]) -> list[tuple[object, str, object]]:
    """(holder, attribute, replacement) for every attribute of ``root`` and of its direct
    components that refers to one of ``targets`` (keyed by ``id`` of the object to
    replace). SGLang hands the tree cache and allocator to several scheduler components
    at construction (result processor, output streamer, policy, ...); a TP session must
    swap every one of them, and listing them by hand would break silently on upgrades.
    """
    return [
        (holder, name, targets[id(value)])
        for holder in _components(root)
        for name, value in _attrs(holder).items()
        if id(value) in targets
    ]


def _pool_size_holders(root) -> list[object]:
    """``root`` and the components holding their own copy of ``max_total_num_tokens``
    (pool-usage observer, load inquirer, invariant checker, ...): in a session they must
    all see the session's pool, or usage = 1 - free/size goes negative and SGLang's
    metrics assert."""
    size = root.max_total_num_tokens
    return [h for h in _components(root) if _attrs(h).get("max_total_num_tokens") == size]


def _attrs(obj) -> dict[str, object]:
    out = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                out[name] = getattr(obj, name)
    return out


@dataclasses.dataclass
class Session:
    """A bound session's KV bookkeeping on one member.

    ``reservations`` are the DP slots lent to the session (one per admitted request);
    their TP sub-slots are the TP allocator's whole supply, and ``capacity`` (their
    count) is what the scheduler sees as its pool while the session runs. Invariant:
    ``capacity == sum(r.tp_slots.numel() for r in reservations)``.
    """

    scheduler: object  # gets the session's length limits; size_holders its pool size
    dp_allocator: object
    tp_allocator: object
    reservations: list
    capacity: int = 0
    admitting: bool = True  # False once an offered request could not be admitted
    dp_running: object = None  # the engine's paused DP batch (stashed, KV kept)
    dp_waiting: list = dataclasses.field(default_factory=list)  # its stashed DP queue
    size_holders: list = dataclasses.field(default_factory=list)  # see _pool_size_holders
    #: rid -> the request as it arrived (to re-run it in DP if the session fails early)
    tokenized: dict = dataclasses.field(default_factory=dict)
    handed: set = dataclasses.field(default_factory=set)  # rids handed to SGLang

    def hand(self, scheduler, req) -> None:
        """Give a joining request to SGLang (remembered for containment)."""
        self.tokenized[req.rid] = req
        self.handed.add(req.rid)
        scheduler.handle_generate_request(req)

    def has_dp_work(self, engine) -> bool:
        """Whether DP work waits for this session to end on this member."""
        running = getattr(self.dp_running, "reqs", None)
        return bool(running) or bool(self.dp_waiting) or bool(engine.deferred)

    def grow(self, reservation) -> None:
        """Add a reservation's sub-slots to the TP allocator (between steps only)."""
        self.reservations.append(reservation)
        self.tp_allocator.free(reservation.tp_slots)
        self._set_capacity(self.capacity + int(reservation.tp_slots.numel()))

    def _set_capacity(self, capacity: int) -> None:
        self.capacity = capacity
        for holder in self.size_holders:
            _set(holder, "max_total_num_tokens", capacity)
        for name in ("max_req_len", "max_req_input_len"):
            setattr(self.scheduler, name, capacity - 1)

    def release_all(self) -> None:
        """Give every reserved DP slot back to the engine (after the scope is left)."""
        for res in self.reservations:
            kv_adaptor.release(self.dp_allocator, res)
        self.reservations = []


def _token_sync(member, faults):
    """The sampler's per-step token sync, bound to the group: the leader's ids win.
    ``ids``: [bs] int tensor, overwritten in place (SGLang's contract)."""

    def sync(ids, sampling_info) -> None:
        if faults is not None:
            faults.check("sample")
        member.share_tokens_(ids)

    return sync


@contextlib.contextmanager
def session_scope(
    scheduler, member, reservation, is_leader: bool, faults=None
) -> Iterator[Session]:
    """TP mode for one bound session; yields its ``Session``. The caller releases the
    reservations (``Session.release_all``) after leaving the scope."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    runner = _runner(scheduler)
    degree = member.group.degree
    shards = shards_for(runner.model, degree, member.tp_rank)
    tp_pool = tp_pool_for(runner.token_to_kv_pool, degree)
    dp_allocator = scheduler.token_to_kv_pool_allocator
    allocator = kv_adaptor.make_tp_allocator(dp_allocator, tp_pool, reservation)
    cache = _disabled_cache(scheduler, allocator)
    capacity = int(reservation.tp_slots.numel())
    session = Session(
        scheduler, dp_allocator, allocator, [reservation], capacity,
        dp_running=scheduler.running_batch,
        dp_waiting=[*scheduler.waiting_queue, *scheduler.grammar_manager.grammar_queue],
        size_holders=_pool_size_holders(scheduler),
    )
    streamer = scheduler.output_streamer
    swaps = _references(
        scheduler,
        {id(scheduler.tree_cache): cache, id(dp_allocator): allocator},
    )
    swaps += [
        (runner, "token_to_kv_pool", tp_pool),
        (runner, "token_to_kv_pool_allocator", allocator),
        (scheduler, "waiting_queue", []),
        (scheduler, "running_batch", ScheduleBatch(reqs=[], batch_is_full=False)),
        (scheduler, "last_batch", None),
        (scheduler, "chunked_req", None),
        # DP requests waiting for their grammar: SGLang moves them into the waiting
        # queue when ready, which mid-session would put them into one member's batch.
        (scheduler.grammar_manager, "grammar_queue", []),
        *[(h, "max_total_num_tokens", capacity) for h in session.size_holders],
        (scheduler, "max_req_len", capacity - 1),
        (scheduler, "max_req_input_len", capacity - 1),
    ]
    swaps.append((runner.sampler, "_sync_token_ids_across_tp", _token_sync(member, faults)))
    if not is_leader:
        swaps.append((streamer, "send_to_detokenizer", _NullSender()))
        swaps.append((scheduler.ipc_channels, "send_to_tokenizer", _NullSender()))
    with _swap(swaps):
        # The backend reads the pool at construction, so it is built inside the swap.
        with _swap([(runner, "attn_backend", type(runner.attn_backend)(runner))]):
            with tp_layers(shards, member.all_reduce):
                yield session
