"""KV relayout: move a request's KV between the DP layout and a TP-m group's layout.

One engine in DP holds every KV head of a token in one slot of its pool
(``k_buffer[l]``: ``[rows, H_kv, d]``). In a TP-m group member ``r`` holds the heads
``KvSplit(H_kv, m).heads(r)`` (``flying.substrate.layout``) of the token in one TP slot
of its own pool's TP view (``flying.substrate.kv_adaptor``): heads
``[r*H_kv/m, (r+1)*H_kv/m)`` when they split, or the one head ``r // (m/H_kv)`` when
there are fewer heads than ranks (each head then lives on ``m/H_kv`` ranks). Relayout
is a gather of head shards (TP -> DP: every member sends its shard, one engine writes
whole rows from one copy of each distinct shard) or a scatter (DP -> TP: one engine's
rows are cut into shards, each member writes its own; a replicated shard goes to each
of its ranks). Nothing is recomputed; the request's ``req_to_token`` row is rewritten
by the caller to the slots written here.

Shapes: a *shard block* is ``[layers, 2, n, H_kv/f, d]`` (K then V, n tokens in the
request's token order; ``f = KvSplit.shards``: m, or H_kv when replicated); a *full
block* is ``[layers, 2, n, H_kv, d]``. Members transfer
shard blocks (``exchange``): over the group's shared-memory segment in chunks of its
slot size on one host, over gloo otherwise. The transfer is collective: every member
calls it with a block of the same shape (lockstep gives every member the same tokens).
"""

from __future__ import annotations

import torch

from flying.substrate.layout import KvSplit


def read_block(pool, slots: torch.Tensor) -> torch.Tensor:
    """The K and V rows of ``slots`` in ``pool`` (a DP pool or a TP view of one):
    ``[layers, 2, n, heads, d]``, a copy. One gather per buffer, straight into the block
    (SGLang keeps one buffer per layer, so no single gather spans the layers)."""
    k0 = pool.k_buffer[0]
    idx = slots.to(k0.device, torch.int64)
    out = torch.empty(len(pool.k_buffer), 2, idx.numel(), *k0.shape[1:], dtype=k0.dtype,
                      device=k0.device)
    for layer, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer, strict=True)):
        torch.index_select(k, 0, idx, out=out[layer, 0])
        torch.index_select(v, 0, idx, out=out[layer, 1])
    return out


def write_block(pool, slots: torch.Tensor, block: torch.Tensor) -> None:
    """Write ``block`` (``[layers, 2, n, heads, d]``, heads = the pool's) into ``slots``."""
    idx = slots.to(pool.k_buffer[0].device, torch.int64)
    for layer, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer, strict=True)):
        k[idx] = block[layer, 0].to(k.dtype)
        v[idx] = block[layer, 1].to(v.dtype)


def write_shards(pool, slots: torch.Tensor, shards: list[torch.Tensor],
                 tokens: torch.Tensor | None = None) -> None:
    """Write whole rows into ``slots`` of a DP ``pool`` straight from the distinct shard
    blocks (shard order, each ``[layers, 2, n, H_kv/f, d]``; ``distinct`` picks them
    from the members' blocks): shard j's heads go to heads ``[j*H_kv/f, (j+1)*H_kv/f)``,
    and together they must cover the pool's heads. ``tokens`` (indices into the n tokens) picks
    the tokens to write, in ``slots`` order; None writes all. Same result as
    ``write_block(pool, slots, join_shards(shards)[:, :, tokens])`` without building
    the joined block (two copies of every byte fewer: ~10 ms per 16 MiB on this CPU).
    On CUDA it builds it: one concatenation and two writes a layer launch fewer kernels
    than ``2 x shards`` strided writes a layer, and the extra copy runs at HBM speed."""
    idx = slots.to(pool.k_buffer[0].device, torch.int64)
    if idx.is_cuda:
        block = join_shards(shards)
        write_block(pool, idx, block if tokens is None else block[:, :, tokens])
        return
    h = shards[0].shape[3]
    if h * len(shards) != pool.k_buffer[0].shape[1]:
        raise ValueError(f"{len(shards)} shards of {h} heads do not make the pool's rows")
    for layer, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer, strict=True)):
        for r, shard in enumerate(shards):
            heads = slice(r * h, (r + 1) * h)
            kv = shard[layer] if tokens is None else shard[layer][:, tokens]
            k[idx, heads] = kv[0].to(k.dtype)
            v[idx, heads] = kv[1].to(v.dtype)


def distinct(shards: list[torch.Tensor], split: KvSplit) -> list[torch.Tensor]:
    """The members' shard blocks (TP-rank order, one per rank) -> one block per distinct
    head group, in shard order: the first rank of each group (``split.ranks(j)[0]``).
    Without replication that is every block."""
    return [shards[split.ranks(j)[0]] for j in range(split.shards)]


def join_shards(shards: list[torch.Tensor]) -> torch.Tensor:
    """Distinct shard blocks in shard order -> the full block (heads concatenated)."""
    return torch.cat(shards, dim=3)


def shard_of(block: torch.Tensor, shard: int, shards: int) -> torch.Tensor:
    """Head group ``shard`` of ``shards`` equal groups of a full block:
    ``[layers, 2, n, H_kv/shards, d]`` (a rank's is ``KvSplit.shard(rank)`` of
    ``KvSplit.shards``; without replication, rank r's is group r of m)."""
    h = block.shape[3] // shards
    return block[:, :, :, shard * h : (shard + 1) * h].contiguous()


def exchange(member, block: torch.Tensor) -> list[torch.Tensor]:
    """Every member's ``block`` (same shape and dtype on all), in TP-rank order.

    Over shared memory the block goes in chunks of at most the segment's slot size
    (one all-gather each); over gloo, one all-gather.
    """
    flat = block.contiguous().view(-1)
    world = member.group.degree
    shm = member.shm
    if shm is not None and flat.is_cpu:
        per = max(1, shm.slot_bytes // flat.element_size())
        parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for start in range(0, flat.numel(), per):
            chunk = flat[start : start + per]
            got = shm.all_gather(chunk.unsqueeze(0), dim=0)  # [world, c]
            for r in range(world):
                parts[r].append(got[r])
        return [torch.cat(p).view(block.shape) for p in parts]
    outs = [torch.empty_like(flat) for _ in range(world)]
    member.pg.allgather([outs], [flat]).wait()
    return [o.view(block.shape) for o in outs]


def block_bytes(layers: int, tokens: int, heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of one block: what one member sends per relayout of ``tokens`` tokens."""
    return layers * 2 * tokens * heads * head_dim * itemsize
