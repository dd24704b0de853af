"""Running DP requests join a group as it forms (DP -> TP relayout, no recompute).

When a session starts (``--flying-move-to-dp`` allows its bind: the adaptive policy's
light-load groups by default), the members' running DP requests join the session
instead of waiting for it (hard preemption) or making it wait (soft), and instead of
running their DP steps between the group's until they end (each such step delays every
request of the group): every member reaches ``gather`` right after the bind's
rendezvous, in its DP state, and

1. every member shares its candidates' context lengths and KV budgets (one small
   collective; nothing joins if a member other than the leader has DP requests
   waiting: the session would hand its requests straight back to DP, ``move``); the
   candidates are taken in TP-rank order, at most ``MAX_JOIN``; each member reserves TP
   room for them and the members agree (a MIN) on how many join;
2. each member holding some of them (a *source*, in TP-rank order) takes its requests
   out of its DP batch: it reads their KV rows (every head), hands the rows to its
   prefix cache the way SGLang releases any request (``release_kv_cache`` with a
   checkpoint: the tokens stay cached in DP), and sends the requests' state (the
   ``Req``, pickled without its tokenizer and locks) and the KV to the members;
3. in the session's TP state (``land``) every member takes a request row and TP slots,
   writes its own head shard of each token (``kv_relayout.shard_view``; a replicated
   head is written by each of its ranks), and adds the
   requests to the session's running batch as a decode batch whose next input is each
   request's last token (SGLang's ``FutureMap`` relay, as for any decode step).

A source's ``Req`` objects are the originals (their stream offsets, logprobs and
sampling state go on); the other members run identical copies. In the group only the
leader sends outputs, so a request that joined from another member is answered by the
leader's copy from then on (SGLang's detokenizer keys a stream by request id), as a
request moved to DP on another member is.
Nothing is prefilled again. If the session fails later, containment ends joined
requests like any session request that has streamed (an explicit error).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from flying.session import join_wire, layout_log, move, tp_scope
from flying.session.admission import agree
from flying.session.budget import resolved_max_new_tokens
from flying.session.move import kv_len, merge_into_running, rehome
from flying.substrate import kv_adaptor, kv_relayout
from scheduler.relayout import MAX_JOIN, running_budget

logger = logging.getLogger(__name__)


@dataclass
class Joining:
    """What one member carries from ``gather`` (DP state) to ``land`` (TP state)."""

    reqs: list  # the leader's own Reqs, or their copies on the other members
    lens: list[int]  # tokens of KV per request
    shard: torch.Tensor | None  # this member's heads: [layers, 2, sum(lens), H_kv/f, d]
    reservations: list = field(default_factory=list)
    t_agreed: float = 0.0  # perf_counter when the members agreed on the joining requests
    #: the source's copy of every head (``[layers, 2, sum(lens), H_kv, d]``): what a
    #: failed join puts back into DP; None on the other members
    full: torch.Tensor | None = None
    grown: bool = False  # the reservations belong to the session's scope
    #: this member held the requests in DP (the leader; an upgrade's holder): ``reqs``
    #: are the originals, and a failed join puts them back into its DP batch
    source: bool = False
    #: the requests' max_new_tokens in DP, restored if they go back there (an upgrade
    #: lifts it for the group); None: unchanged
    dp_bounds: list[int] | None = None
    #: the decision's line for the decision log (``layout_log``), written with the
    #: measured costs once the requests landed; None without a log
    log: dict | None = None
    #: the requests left a group for a larger one (``regroup``): no engine holds them,
    #: so a failed join ends them instead of putting them back into DP
    parked: bool = False
    #: an upgrade's request (it outgrew its engine or group: ``upgrade``, ``regroup``),
    #: not the members' DP requests joining a forming session
    upgrade: bool = False
    t_carried: float = 0.0  # perf_counter when this member held its shard (``carry``)
    #: a join from several members: this member's own requests among ``reqs`` (the
    #: originals it took out of DP) and their lengths; None: ``reqs`` on the source
    own: list | None = None
    own_lens: list[int] | None = None

    def originals(self) -> tuple[list, list[int]]:
        """The requests this member took out of DP (what a failed join puts back into
        its DP batch) and their KV lengths; none off a source."""
        if self.own is not None:
            return self.own, self.own_lens or []
        return (self.reqs, self.lens) if self.source else ([], [])


def eligible(req, seq_len: int) -> bool:
    """A running DP request that can continue in a group now: decoding, its KV what its
    tokens so far need (``seq_len``: no step of it in flight), nothing DP-only."""
    return joinable(req) and req.kv.kv_allocated_len == seq_len


def joinable(req) -> bool:
    """A running DP request whose features all run in a group (it may have a step in
    flight: under SGLang's overlap loop a boundary sees the last step's result pending)."""
    return (
        not req.finished()
        and len(req.output_ids) > 0
        and req.grammar is None
        and not getattr(req, "custom_logit_processor", None)
        and getattr(req, "lora_id", None) is None
        and getattr(req, "multimodal_inputs", None) is None
        and getattr(req, "session", None) is None
        and not getattr(req, "return_hidden_states", False)
    )


def _budget(req, dp_limit: int) -> int | None:
    """KV tokens a running DP request needs in a group (what it holds plus what it may
    still produce), or None if it cannot join. A request without max_new_tokens gets
    the bound SGLang gives it in DP, explicitly (a group's own limits differ)."""
    try:
        n = kv_len(req)
        if not eligible(req, n):
            return None
        params = req.sampling_params
        params.max_new_tokens = resolved_max_new_tokens(
            len(req.origin_input_ids), params.max_new_tokens, dp_limit
        )
        return running_budget(n, params.max_new_tokens, len(req.output_ids))
    except Exception:  # noqa: BLE001 - an odd request stays in DP; the collective must run
        logger.exception("flying: request %s cannot join a group", getattr(req, "rid", "?"))
        return None


def gather(engine, scheduler, bind, member, is_leader: bool, faults=None) -> Joining | None:
    """Every member of a forming session, DP state, after the rendezvous: agree on the
    members' running DP requests that join and carry their KV over. None if none join."""
    if not move.allowed(engine.move_to_dp, {bind.reason}):
        return None
    degree = bind.degree
    lens: list[int] = []
    budgets: list[int] = []
    picked: list = []
    for req in scheduler.running_batch.reqs:
        budget = _budget(req, engine.dp_limit) if len(picked) < MAX_JOIN else None
        if budget is not None:
            picked.append(req)
            lens.append(kv_len(req))
            budgets.append(budget)
    blocked = int(not is_leader and bool(scheduler.waiting_queue or scheduler.chunked_req))
    rows = member.gather_ints([blocked, len(picked), *_padded(lens), *_padded(budgets)])
    if any(row[0] for row in rows):
        return None
    candidates = _candidates(rows)  # (source rank, KV tokens, budget), TP-rank order
    if not candidates:
        return None
    room = tp_scope.dp_room(scheduler) if layout_log.enabled() else 0
    reservations = []
    for _, _, tokens in candidates:
        # evicts cached DP prefixes
        res = tp_scope.reserve_for(scheduler, tokens, engine.prepared[degree].per_slot)
        if res is None:
            break
        reservations.append(res)
    k = agree(member, scheduler.token_to_kv_pool_allocator, reservations)
    own = sum(1 for c in candidates if c[0] == member.tp_rank)
    log = _log(engine, bind, picked[:own], [c[1] for c in candidates],
               [c[2] for c in candidates], room, len(reservations), k)
    if k == 0:
        if log is not None:
            layout_log.write("join", log)
        return None
    joining = Joining([], [], None, reservations[:k], time.perf_counter(), log=log)
    _carry_all(member, scheduler, joining, picked, candidates[:k], degree, faults)
    return joining


def _candidates(rows: list[list[int]]) -> list[tuple[int, int, int]]:
    """The joining candidates of every member's row (``[blocked, n, lens..., budgets...]``,
    TP-rank order) as (source rank, KV tokens, budget), in TP-rank order and each
    member's batch order, at most ``MAX_JOIN``: the same list on every member."""
    out = []
    for rank, row in enumerate(rows):
        n = row[1]
        out += [(rank, row[2 + i], row[2 + MAX_JOIN + i]) for i in range(n)]
    return out[:MAX_JOIN]


def _carry_all(member, scheduler, joining: Joining, picked: list,
               joined: list[tuple[int, int, int]], degree: int, faults=None) -> None:
    """Every member, DP state, once the members agreed and reserved: each source in
    TP-rank order takes its joining requests (the first of ``picked``) out of DP and
    carries them to every member (``carry``); ``joining`` gets them all in ``joined``'s
    order, this member's shard of their tokens and, on a source, its originals. On
    failure the reservations are given back and this member's taken requests go on in
    DP (then the exception propagates)."""
    me = member.tp_rank
    carried: list[Joining] = []
    try:
        for src in sorted({c[0] for c in joined}):
            lens = [c[1] for c in joined if c[0] == src]
            block, payload = (_take_out(scheduler, picked[: len(lens)], faults) if src == me
                              else (None, b""))
            part = Joining(picked[: len(lens)] if src == me else [], lens, None, [],
                           joining.t_agreed, block, source=src == me)
            carry(member, scheduler, part, payload, degree, src, faults)
            carried.append(part)
    except BaseException:
        for res in joining.reservations:
            kv_adaptor.release(scheduler.token_to_kv_pool_allocator, res)
        for part in carried:  # a later source failed: this member's go on in DP
            if part.source:
                restore(scheduler, part)
        raise
    joining.reqs = [r for part in carried for r in part.reqs]
    joining.lens = [n for part in carried for n in part.lens]
    shards = [part.shard for part in carried]
    joining.shard = shards[0] if len(shards) == 1 else torch.cat(shards, dim=2)
    own = [part for part in carried if part.source]
    if own:
        joining.source, joining.full = True, own[0].full
        joining.own, joining.own_lens = own[0].reqs, own[0].lens
    joining.t_carried = time.perf_counter()


def _log(engine, bind, picked: list, lens: list[int], budgets: list[int], room: int,
         reserved: int, joined: int) -> dict | None:
    """A join's line for the decision log (None without a log): every member's
    candidates (``lens``, ``budgets``; this member's own with their inputs to
    ``running_budget``), this member's DP room before it reserved, how many it reserved,
    and how many joined (the MIN)."""
    if not layout_log.enabled():
        return None
    doc = {**layout_log.about(bind, engine.dp_rank), "lens": list(lens), "budgets": list(budgets),
           "per_slot": engine.prepared[bind.degree].per_slot, "room": int(room),
           "reserved": reserved, "joined": joined}
    if picked:
        doc["requests"] = [
            {"rid": r.rid, "kv": kv_len(r), "max_new_tokens": r.sampling_params.max_new_tokens,
             "outputs": len(r.output_ids)} for r in picked
        ]
    return doc


def carry(member, scheduler, joining: Joining, payload: bytes, degree: int, src: int,
          faults=None) -> None:
    """Every member, DP state, once the members agreed and reserved: the source (TP rank
    ``src``, holding ``joining.full`` and the pickled requests ``payload``) sends each
    member its head shard and the requests' state; ``joining`` gets this member's shard
    and, off the source, the copies. On failure the reservations are given back and the
    source's requests go on in DP (then the exception propagates)."""
    try:
        if faults is not None:
            faults.check("join")
        payload = join_wire.broadcast_bytes(member, payload, src)
        joining.shard = join_wire.scatter(member, joining.full, scheduler, sum(joining.lens),
                                         degree, src)
        if not joining.source:
            joining.reqs = join_wire.copies(scheduler, payload)
        joining.t_carried = time.perf_counter()
    except BaseException:
        for res in joining.reservations:
            kv_adaptor.release(scheduler.token_to_kv_pool_allocator, res)
        if joining.source:  # they left the DP batch: they go on there
            restore(scheduler, joining)
        raise


def abort(scheduler, reqs: list, message: str) -> None:
    """Leader: end requests taken out of DP that did not reach the session's batch
    (containment cannot see them) with an explicit error."""
    from sglang.srt.managers.io_struct import AbortReq

    from flying.session.containment import FAULT_STATUS

    reason = {"type": "abort", "message": message, "status_code": FAULT_STATUS,
              "err_type": "FlyingGroupFault"}
    for req in reqs:
        if req.kv.holds_kv:
            scheduler.req_to_token_pool.free(req)
        scheduler.send_abort_output(AbortReq(rid=req.rid, finished_reason=reason), req)


def land(scheduler, scope, joining: Joining) -> None:
    """Session TP state: the joining requests get rows and TP slots holding this
    member's shard, and join the session's running batch as decode requests."""
    for res in joining.reservations:
        scope.grow(res)
    joining.grown = True
    slots = scheduler.token_to_kv_pool_allocator.alloc(sum(joining.lens))  # the session's
    if slots is None:
        raise RuntimeError("flying: no TP slots for the requests joining the group")
    _place(scheduler, scope.prepared.tp_pool, joining.reqs, joining.lens, joining.shard, slots)


def recover(scheduler, joining: Joining) -> None:
    """After a session that was taking ``joining`` failed before the requests reached
    its batch (DP state again): give back reservations the scope does not own, and on
    the source let the requests go on in DP."""
    if not joining.grown:
        for res in joining.reservations:
            kv_adaptor.release(scheduler.token_to_kv_pool_allocator, res)
    if joining.source:
        restore(scheduler, joining)


def restore(scheduler, joining: Joining) -> None:
    """Source, DP state: requests taken out of DP for a join that failed go on in DP
    (their KV rewritten from the copy the source kept, their DP bound back); an explicit
    error if even that fails. Returns nothing: either way every request is answered."""
    reqs, lens = joining.originals()
    for req, bound in zip(reqs, joining.dp_bounds or (), strict=False):
        req.sampling_params.max_new_tokens = bound
    if joining.parked:  # they left a group and fit no engine: they end there
        from flying.session import regroup

        regroup.finish(scheduler, reqs)
        return
    slots = None
    try:
        for req in reqs:
            if req.kv.holds_kv:
                scheduler.req_to_token_pool.free(req)
        slots = tp_scope.take_dp_slots(scheduler, sum(lens))
        pool = scheduler.tp_worker.model_runner.token_to_kv_pool
        _place(scheduler, pool, reqs, lens, joining.full, slots)
        logger.warning("flying: a join failed; %d request(s) went on in DP", len(reqs))
    except Exception as exc:  # noqa: BLE001 - the last resort is an explicit answer
        logger.exception("flying: requests of a failed join could not go back to DP")
        if slots is not None:  # not merged: nothing else will free them (SGLang's leak check)
            scheduler.token_to_kv_pool_allocator.free(slots)
        abort(scheduler, reqs, f"moving into a TP group failed: {exc}")


def _place(scheduler, pool, reqs: list, lens: list[int], block: torch.Tensor, slots) -> None:
    """Give decoding requests rows pointing at ``slots`` (``block`` written there, in
    ``pool``: a DP pool or a TP view) and merge them into the running batch of the
    scheduler's current state as a decode batch whose next input is each request's last
    token. ``block``: [layers, 2, sum(lens), heads of ``pool``, d]."""
    from sglang.srt.managers.overlap_utils import RelayPayload
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    if scheduler.req_to_token_pool.alloc(reqs) is None:
        raise RuntimeError("flying: no request rows for the requests changing layout")
    kv_relayout.write_block(pool, slots, block)
    rehome(scheduler, reqs, lens, slots)
    batch = ScheduleBatch.init_new(
        reqs, scheduler.req_to_token_pool, scheduler.token_to_kv_pool_allocator, scheduler.tree_cache,
        scheduler.model_config, bool(getattr(scheduler, "enable_overlap", False)),
        scheduler.spec_algorithm,
    )
    rows = [r.kv.req_pool_idx for r in reqs]
    device = batch.device
    batch.forward_mode = ForwardMode.DECODE
    batch.req_pool_indices = torch.tensor(rows, dtype=torch.int64, device=device)
    batch.req_pool_indices_cpu = torch.tensor(rows, dtype=torch.int64)
    batch.seq_lens = torch.tensor(lens, dtype=torch.int64, device=device)
    batch.seq_lens_cpu = torch.tensor(lens, dtype=torch.int64)
    batch.orig_seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    batch.seq_lens_sum = sum(lens)
    batch.input_ids = None
    # Per-request lists SGLang's filter/merge keep aligned with ``reqs``.
    batch.multimodal_inputs = [r.multimodal_inputs for r in reqs]
    if batch.return_logprob:
        batch.top_logprobs_nums = [r.logprob.top_logprobs_num for r in reqs]
        batch.token_ids_logprobs = [r.logprob.token_ids_logprob for r in reqs]
    batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, scheduler.model_config.vocab_size)
    last = torch.tensor([r.output_ids[-1] for r in reqs], dtype=torch.int64, device=device)
    scheduler.future_map.stash(batch.req_pool_indices, RelayPayload(bonus_tokens=last))
    merge_into_running(scheduler, batch)


def _padded(values: list[int]) -> list[int]:
    return [*values, *[0] * (MAX_JOIN - len(values))]


def _take_out(scheduler, reqs: list, faults=None) -> tuple[torch.Tensor, bytes]:
    """Leader, DP state: the requests' KV (every head) and their pickled state; they
    leave the DP batch and their rows go back to the prefix cache (tokens kept). If
    that fails once they left, they go on in DP (``restore``) before it propagates."""
    from sglang.srt.mem_cache.common import release_kv_cache

    table = scheduler.req_to_token_pool.req_to_token
    batch = scheduler.running_batch
    idx = [batch.reqs.index(r) for r in reqs]
    lens = [kv_len(r) for r in reqs]
    slots = torch.cat([table[r.kv.req_pool_idx, :n] for r, n in zip(reqs, lens, strict=True)])
    block = kv_relayout.read_block(scheduler.tp_worker.model_runner.token_to_kv_pool, slots)
    keep = [i for i in range(len(batch.reqs)) if i not in set(idx)]
    batch.filter_batch(keep_indices=keep)
    for req in reqs:
        release_kv_cache(req, scheduler.tree_cache, checkpoint=True)
    try:
        if faults is not None:
            faults.check("take_out")
        return block, join_wire.pickled(reqs)
    except BaseException:  # out of DP and not yet carried: they go on in DP
        restore(scheduler, Joining(list(reqs), lens, None, full=block, source=True))
        raise
