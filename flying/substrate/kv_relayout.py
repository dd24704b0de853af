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
shard blocks (``exchange``, or ``gather_to`` where one member takes every row): over the
group's shared-memory segment in chunks of its slot size (whole token rows) on one host,
over gloo otherwise. Where one member takes every row, the shared path needs no block at
all: the senders read their rows straight into the segment and the taker writes whole
rows straight from its own TP view and the segment (``flying.substrate.kv_stream``). The
transfer is collective: every member calls it with a block of the same shape (lockstep
gives every member the same tokens).
"""

from __future__ import annotations

import torch

from flying.substrate import scratch
from flying.substrate.layout import KvSplit

#: A CPU copy of at most this many runs of consecutive slots goes as slice copies: a
#: slice copies whole rows at memory speed, an indexed copy costs ~0.5 us a row on the
#: CPU host (a move of 1k tokens on an 8-layer model: ~16k rows). SGLang's allocator
#: hands out sorted free slots, so a request's rows are usually a few runs.
MAX_RUNS = 16

Rows = torch.Tensor | list[tuple[slice, slice]]


def run_bounds(*index: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """The runs where every one of ``index`` (1-D int64 tensors of one length, at least
    one element) steps by one, as (starts, ends) positions; None past ``MAX_RUNS`` runs."""
    steps = index[0][1:] - index[0][:-1] != 1
    for other in index[1:]:
        steps |= other[1:] - other[:-1] != 1
    breaks = torch.nonzero(steps).view(-1)
    if breaks.numel() >= MAX_RUNS:
        return None
    starts = [0, *(breaks + 1).tolist()]
    return starts, [*starts[1:], index[0].numel()]


def rows_of(slots: torch.Tensor, device: torch.device) -> Rows:
    """``slots`` as (pool rows, block rows) slice pairs, one per run of consecutive
    slots, on a CPU with at most ``MAX_RUNS`` runs; otherwise the int64 index tensor."""
    idx = slots.to(device, torch.int64)
    if idx.is_cuda or idx.numel() == 0:
        return idx
    bounds = run_bounds(idx)
    if bounds is None:
        return idx
    starts, ends = bounds
    firsts = idx[starts].tolist()
    return [(slice(f, f + e - b), slice(b, e)) for f, b, e in zip(firsts, starts, ends, strict=True)]


def get_rows(buf: torch.Tensor, rows: Rows, out: torch.Tensor) -> None:
    """``out`` (contiguous) = the rows of ``buf``."""
    if isinstance(rows, torch.Tensor):
        torch.index_select(buf, 0, rows, out=out)
        return
    for pool_rows, block_rows in rows:
        out[block_rows].copy_(buf[pool_rows])


def put_rows(buf: torch.Tensor, rows: Rows, src: torch.Tensor) -> None:
    """The rows of ``buf`` (a view of a pool buffer: written through) = ``src``."""
    src = src.to(buf.dtype)
    if isinstance(rows, torch.Tensor):
        buf[rows] = src
        return
    for pool_rows, block_rows in rows:
        buf[pool_rows].copy_(src[block_rows])


def read_block(pool, slots: torch.Tensor) -> torch.Tensor:
    """The K and V rows of ``slots`` in ``pool`` (a DP pool or a TP view of one):
    ``[layers, 2, n, heads, d]``, a copy, written straight into the block (SGLang keeps
    one buffer per layer, so no single gather spans the layers)."""
    k0 = pool.k_buffer[0]
    rows = rows_of(slots, k0.device)
    out = scratch.empty((len(pool.k_buffer), 2, slots.numel(), *k0.shape[1:]), k0.dtype,
                        k0.device)
    for layer, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer, strict=True)):
        get_rows(k, rows, out[layer, 0])
        get_rows(v, rows, out[layer, 1])
    return out


def write_block(pool, slots: torch.Tensor, block: torch.Tensor) -> None:
    """Write ``block`` (``[layers, 2, n, heads, d]``, heads = the pool's) into ``slots``."""
    rows = rows_of(slots, pool.k_buffer[0].device)
    for layer, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer, strict=True)):
        put_rows(k, rows, block[layer, 0])
        put_rows(v, rows, block[layer, 1])


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
    device = pool.k_buffer[0].device
    if device.type == "cuda":
        block = join_shards(shards)
        write_block(pool, slots, block if tokens is None else block[:, :, tokens])
        return
    h = shards[0].shape[3]
    if h * len(shards) != pool.k_buffer[0].shape[1]:
        raise ValueError(f"{len(shards)} shards of {h} heads do not make the pool's rows")
    rows = rows_of(slots, device)
    for layer, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer, strict=True)):
        for r, shard in enumerate(shards):
            heads = slice(r * h, (r + 1) * h)
            kv = shard[layer] if tokens is None else shard[layer][:, tokens]
            put_rows(k[:, heads], rows, kv[0])
            put_rows(v[:, heads], rows, kv[1])


def distinct(shards: list[torch.Tensor], split: KvSplit) -> list[torch.Tensor]:
    """The members' shard blocks (TP-rank order, one per rank) -> one block per distinct
    head group, in shard order: the first rank of each group (``split.ranks(j)[0]``).
    Without replication that is every block."""
    return [shards[split.ranks(j)[0]] for j in range(split.shards)]


def join_shards(shards: list[torch.Tensor]) -> torch.Tensor:
    """Distinct shard blocks in shard order -> the full block (heads concatenated)."""
    return torch.cat(shards, dim=3)


def shard_view(block: torch.Tensor, shard: int, shards: int) -> torch.Tensor:
    """Head group ``shard`` of ``shards`` equal groups of a full block:
    ``[layers, 2, n, H_kv/shards, d]``, a view (a rank's is ``KvSplit.shard(rank)`` of
    ``KvSplit.shards``; without replication, rank r's is group r of m)."""
    h = block.shape[3] // shards
    return block[:, :, :, shard * h : (shard + 1) * h]


def shard_of(block: torch.Tensor, shard: int, shards: int) -> torch.Tensor:
    """``shard_view`` as a contiguous copy."""
    return shard_view(block, shard, shards).contiguous()


def exchange(member, block: torch.Tensor) -> list[torch.Tensor]:
    """Every member's ``block`` (same shape and dtype on all), in TP-rank order; this
    member's own entry is ``block`` itself.

    Over shared memory the block goes in chunks of at most the segment's slot size, each
    peer's chunk copied out of the segment straight into its block (one copy in, one
    out per peer); over gloo, one all-gather.
    """
    return transfer(member, block, None)


def gather_to(member, block: torch.Tensor, dst: int) -> list[torch.Tensor] | None:
    """Every member's ``block`` on TP rank ``dst`` (TP-rank order, its own entry
    ``block`` itself); None on the other members.

    For a relayout whose rows all land on one member (a move whose requests all go to
    one engine): over shared memory only the others copy in and only ``dst`` copies
    out, where ``exchange`` has every member do both (a 1k-token move on the hidden-1024
    model: 8 MiB that ``dst`` copied in for nobody, 8 MiB each other member copied out
    and dropped). Over gloo, the all-gather of ``exchange``. Collective: every member
    calls it with the same ``dst`` and a block of the same shape."""
    return transfer(member, block, dst)


def transfer(member, block: torch.Tensor, dst: int | None, sink=None,
            fill=None) -> list[torch.Tensor] | None:
    """``exchange`` (``dst`` None: every member gets every block) or ``gather_to``.

    On the shared path two hooks let a relayout skip its own copies (``send_rows``,
    ``gather_rows``; ``block`` is then a ``meta`` tensor, only its shape is read):
    ``fill(start, slot)`` writes this member's flat elements ``[start, start + n)``
    straight into its slot; on ``dst``, ``sink(rank, start, view)`` takes each peer's
    chunk instead of a copy into a block (and nothing is returned)."""
    flat = block.contiguous().view(-1)
    world, me, shm = member.group.degree, member.tp_rank, member.shm
    if shm is None or flat.device.type not in ("cpu", "meta"):
        assert sink is None and fill is None, "rows stream over the shared segment only"
        outs = [scratch.empty(flat.shape, flat.dtype, flat.device) for _ in range(world)]
        member.pg.allgather([outs], [flat]).wait()
        return None if dst not in (None, me) else [o.view(block.shape) for o in outs]
    reads = dst is None or dst == me
    outs = ([flat if r == me else scratch.empty(flat.shape, flat.dtype) for r in range(world)]
            if reads and sink is None else [])
    per = chunk_elems(shm.slot_bytes, block)
    for start in range(0, flat.numel(), per):
        piece = flat[start : start + per]
        put = None if fill is None or dst == me else (lambda slot, at=start: fill(at, slot))
        views = shm.exchange(piece, write=dst != me, fill=put)
        for r in range(world) if reads else ():
            if r == me:
                continue
            if sink is not None:
                sink(r, start, views[r])
            else:
                outs[r][start : start + views[r].numel()].copy_(views[r])
    return [o.view(block.shape) for o in outs] if reads and sink is None else None


def chunk_elems(slot_bytes: int, block: torch.Tensor) -> int:
    """Elements per shared-memory chunk: as many as a slot holds, cut to whole token
    rows of a ``[..., heads, d]`` block (so a chunk maps onto pool rows) when a row
    fits; the same on every member (it depends on the shape only)."""
    per = max(1, slot_bytes // block.element_size())
    row = block.shape[-2] * block.shape[-1] if block.dim() >= 2 else 1
    return per - per % row if 0 < row <= per else per


def broadcast(member, block: torch.Tensor, src: int, part: int | None = None) -> torch.Tensor:
    """TP rank ``src``'s ``block`` on every member (same shape and dtype on all; off
    ``src`` it may be a ``meta`` tensor: only its shape and dtype are used). With
    ``part``, only ``block[part]`` (a piece along the first dim) is copied out on this
    member and returned. On ``src`` the result is ``block`` (or its piece) itself when
    ``block`` is contiguous.

    Over shared memory the block goes in chunks of the segment's slot size; only the
    source copies in, and each member copies out only the bytes of its piece (a scatter
    moves each byte once in and once out). Over gloo, one broadcast of the whole block.
    """
    piece = (lambda t: t) if part is None else (lambda t: t[part])
    shm, numel = member.shm, block.numel()
    if member.tp_rank == src:
        flat = block.contiguous().view(-1)
        if shm is None:  # decided alike on every member: off the source, the block is meta
            member.pg.broadcast(flat, src).wait()
        else:
            per = chunk_elems(shm.slot_bytes, block)
            for start in range(0, numel, per):
                shm.broadcast(flat[start : start + per], src)
        return piece(flat.view(block.shape))
    if shm is None:
        flat = torch.empty(numel, dtype=block.dtype)
        member.pg.broadcast(flat, src).wait()
        return piece(flat.view(block.shape))
    out = scratch.empty(block.shape if part is None else block.shape[1:], block.dtype)
    lo = 0 if part is None else part * out.numel()
    hi, flat_out = lo + out.numel(), out.view(-1)
    per = chunk_elems(shm.slot_bytes, block)
    for start in range(0, numel, per):
        n = min(per, numel - start)
        view = shm.broadcast(torch.empty(n, dtype=block.dtype, device="meta"), src)
        a, b = max(start, lo), min(start + n, hi)
        if a < b:
            flat_out[a - lo : b - lo].copy_(view[a - start : b - start])
    return out


def block_bytes(layers: int, tokens: int, heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of one block: what one member sends per relayout of ``tokens`` tokens."""
    return layers * 2 * tokens * heads * head_dim * itemsize
