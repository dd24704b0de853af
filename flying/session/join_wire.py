"""What a join sends between a group's members: the requests' state and their KV.

A source (the member holding running requests in DP) sends every member the requests'
state, pickled without what a copy must not share (``pickled``; each member runs its own
copy, ``copies``), and each member its head shard of their KV (``scatter``: one
broadcast of the shards other members hold). Used by joins (``flying.session.join``),
upgrades (``flying.session.upgrade``) and regroups (``flying.session.regroup``).
"""

from __future__ import annotations

import pickle

import torch

from flying.substrate import kv_relayout, kv_stream
from flying.substrate.layout import KvSplit

#: What a request's copy must not share with the leader's: its tokenizer, tree locks,
#: timing state and, under ``--enable-metrics``, the leader's Prometheus collector
#: (its metrics hold thread locks, which do not pickle: a join then failed the group).
NOT_COPIED = ("tokenizer", "lock", "last_node", "time_stats", "metrics_collector")


def pickled(reqs: list) -> bytes:
    """The requests' state without what a copy must not share (``NOT_COPIED``; a copy
    gets its member's tokenizer and fresh timing state in ``copies``)."""
    saved = [[getattr(r, name, None) for name in NOT_COPIED] for r in reqs]
    try:
        for r in reqs:
            for name in NOT_COPIED:
                setattr(r, name, None)
        return pickle.dumps(reqs, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        for r, values in zip(reqs, saved, strict=True):
            for name, value in zip(NOT_COPIED, values, strict=True):
                setattr(r, name, value)


def copies(scheduler, payload: bytes) -> list:
    """The leader's requests as this member runs them (it sends nothing for them)."""
    from sglang.srt.observability.req_time_stats import SchedulerReqTimeStats

    reqs = pickle.loads(payload)
    for r in reqs:  # no metrics collector: the source's request reports its metrics once
        r.tokenizer = scheduler.tokenizer
        r.time_stats = SchedulerReqTimeStats()
    return reqs


def broadcast_bytes(member, data: bytes, src: int = 0) -> bytes:
    """TP rank ``src``'s ``data`` on every member (its length first, then the bytes)."""
    size = member.gather_ints([len(data)])[src][0]
    if member.tp_rank == src:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    else:
        buf = torch.empty(size, dtype=torch.uint8, device="meta")
    return kv_relayout.broadcast(member, buf, src).numpy().tobytes()


def scatter(member, block, scheduler, tokens: int, degree: int, src: int = 0) -> torch.Tensor:
    """This member's head shard of the source's full block ``[layers, 2, tokens, H_kv, d]``
    (``block`` is None off the source, TP rank ``src``). The source keeps its own shard (a
    view of ``block``) and broadcasts, stacked, one copy of each shard another member
    holds (``needed``: every other rank's without replication; with H_kv < degree each
    head once, even if it lives on several ranks); each member copies out only its own."""
    if member.tp_rank == src:
        split = KvSplit(block.shape[3], degree)
        kv_stream.broadcast_heads(member, block, needed(split, src), split.shards, src)
        return kv_relayout.shard_view(block, split.shard(src), split.shards)
    pool = scheduler.tp_worker.model_runner.token_to_kv_pool  # the DP pool (DP state)
    heads, dim = pool.k_buffer[0].shape[1:]
    split = KvSplit(heads, degree)
    held = needed(split, src)
    shape = (len(held), len(pool.k_buffer), 2, tokens, split.heads_per_rank, dim)
    sent = torch.empty(shape, dtype=pool.k_buffer[0].dtype, device="meta")
    return kv_relayout.broadcast(member, sent, src, part=held.index(split.shard(member.tp_rank)))


def needed(split: KvSplit, src: int) -> list[int]:
    """The head groups (``KvSplit.shard``) held by some member other than ``src``, in
    order: what the source sends in a scatter."""
    return sorted({split.shard(r) for r in range(split.degree) if r != src})
