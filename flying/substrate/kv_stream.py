"""KV relayout without blocks: token rows streamed between pools and a group's segment.

``flying.substrate.kv_relayout`` moves shard blocks (``[layers, 2, n, H_kv/f, d]``)
between members; where the group shares a memory segment on one host, these functions
skip the block: a sender reads its pool rows straight into its slot of the segment
(``send_rows``), the member taking every row writes whole DP rows straight from its own
TP view and from the segment's chunks (``gather_rows``), and a join's source fills the
segment with the head groups it scatters straight from its full block
(``broadcast_heads``). Each byte is copied once in and once out, as a block's transfer
copies it, without the block's own copies. Chunks hold whole token rows
(``kv_relayout.chunk_elems``), so a chunk maps onto pool rows; where a row does not fit a
slot, or there is no segment, each function falls back to the block path (``streams``).
"""

from __future__ import annotations

import torch

from flying.substrate import kv_relayout
from flying.substrate.layout import KvSplit


def streams(member, pool) -> bool:
    """Whether a relayout over ``member``'s group can stream rows between ``pool`` and
    the shared segment (``send_rows``, ``gather_rows``): a segment, a CPU pool, and a
    whole token row (every head) within one slot."""
    k0 = pool.k_buffer[0]
    return (member.shm is not None and k0.device.type == "cpu"
            and k0[0].numel() * k0.element_size() <= member.shm.slot_bytes)


def _buffers(pool) -> list[torch.Tensor]:
    """The pool's per-layer buffers in a block's plane order: K0, V0, K1, V1, ..."""
    return [b for kv in zip(pool.k_buffer, pool.v_buffer, strict=True) for b in kv]


def _block_shape(pool, n: int) -> tuple[int, ...]:
    """A block of ``n`` tokens of ``pool``: ``[layers, 2, n, heads, d]``."""
    return (len(pool.k_buffer), 2, n, *pool.k_buffer[0].shape[1:])


def _pieces(shape: tuple[int, ...], start: int, count: int):
    """The flat range ``[start, start + count)`` of a ``[layers, 2, n, h, d]`` block as
    ``(plane, token_from, token_to, offset)`` pieces: plane ``layer * 2 + kv``, tokens
    ``[a, b)`` of it, at ``offset`` in the range. Both ends must fall on token rows."""
    _, _, n, h, d = shape
    row, plane = h * d, n * h * d
    assert start % row == 0 and count % row == 0, "a chunk must hold whole token rows"
    pos, end = start, start + count
    while pos < end:
        p, off = divmod(pos, plane)
        take = min(end, (p + 1) * plane) - pos
        yield p, off // row, (off + take) // row, pos - start
        pos += take


def _token_rows(flat: torch.Tensor, offset: int, n: int, shape: tuple[int, ...]) -> torch.Tensor:
    """``n`` token rows of a ``[..., n, h, d]`` block (``shape``) at element ``offset`` of
    the flat chunk ``flat`` (a piece of ``_pieces``): ``[n, h, d]``, a view."""
    h, d = shape[-2:]
    return flat[offset : offset + n * h * d].view(n, h, d)


def _sub(rows: kv_relayout.Rows, a: int, b: int) -> kv_relayout.Rows:
    """Block rows ``[a, b)`` of ``rows`` (``rows_of``), renumbered from 0."""
    if isinstance(rows, torch.Tensor):
        return rows[a:b]
    out = []
    for pool_rows, block_rows in rows:
        lo, hi = max(a, block_rows.start), min(b, block_rows.stop)
        if lo < hi:
            shift = pool_rows.start - block_rows.start
            out.append((slice(lo + shift, hi + shift), slice(lo - a, hi - a)))
    return out


def send_rows(member, pool, slots: torch.Tensor, dst: int) -> None:
    """``gather_to(member, read_block(pool, slots), dst)`` (``kv_relayout``) on a member other than
    ``dst``, with the rows read straight into the shared segment (one copy of each byte
    where the block took two)."""
    if not streams(member, pool):
        kv_relayout.gather_to(member, kv_relayout.read_block(pool, slots), dst)
        return
    shape, bufs = _block_shape(pool, slots.numel()), _buffers(pool)
    rows = kv_relayout.rows_of(slots, pool.k_buffer[0].device)

    def fill(start: int, slot: torch.Tensor) -> None:
        for p, a, b, off in _pieces(shape, start, slot.numel()):
            kv_relayout.get_rows(bufs[p], _sub(rows, a, b), _token_rows(slot, off, b - a, shape))

    kv_relayout.transfer(member, torch.empty(shape, dtype=bufs[0].dtype, device="meta"), dst, fill=fill)


def gather_rows(member, split: KvSplit, tp_pool, tp_slots: torch.Tensor, pool,
                slots: torch.Tensor) -> None:
    """``gather_to`` on its ``dst`` (this member) written straight into whole rows:
    ``slots`` of the DP ``pool`` get every KV head of the tokens ``tp_slots`` hold in the
    members' TP views (``tp_pool`` is this member's), in token order. This member's own
    head group is copied row to row (where heads are replicated, its own copy: replicas
    compute the same heads from the same inputs, so they hold the same bytes); each other
    distinct head group is written from the segment as its chunks arrive, from the first
    rank of the group as ``distinct`` picks. Peers
    call ``send_rows`` (or ``gather_to``) with the same ``dst``.

    Invariant: ``slots`` do not overlap the DP rows behind ``tp_slots`` (they are read
    while ``slots`` are written): take them before the session's reserved rows go back."""
    me, h = member.tp_rank, split.heads_per_rank
    own = split.shard(me)
    if not streams(member, pool):
        shards = kv_relayout.gather_to(member, kv_relayout.read_block(tp_pool, tp_slots), me)
        kv_relayout.write_shards(pool, slots, [shards[me if j == own else split.ranks(j)[0]]
                                   for j in range(split.shards)])
        return
    copy_rows(tp_pool, tp_slots, pool, slots, slice(own * h, (own + 1) * h))
    shape, rows = _block_shape(tp_pool, tp_slots.numel()), kv_relayout.rows_of(slots, pool.k_buffer[0].device)
    bufs = _buffers(pool)

    def sink(rank: int, start: int, view: torch.Tensor) -> None:
        j = split.shard(rank)
        if j == own or rank != split.ranks(j)[0]:
            return  # this member's own group, or a replica of one already written
        heads = slice(j * h, (j + 1) * h)
        for p, a, b, off in _pieces(shape, start, view.numel()):
            kv_relayout.put_rows(bufs[p][:, heads], _sub(rows, a, b), _token_rows(view, off, b - a, shape))

    kv_relayout.transfer(member, torch.empty(shape, dtype=bufs[0].dtype, device="meta"), me, sink=sink)


def copy_rows(src_pool, src_slots: torch.Tensor, pool, slots: torch.Tensor,
              heads: slice) -> None:
    """Heads ``heads`` of rows ``slots`` of ``pool`` = rows ``src_slots`` of ``src_pool``
    (every head of a TP view's rows), token by token: no block in between. Slices per
    run where both sides are consecutive, else indexed copies."""
    src, dst = src_slots.to(torch.int64), slots.to(torch.int64)
    bounds = kv_relayout.run_bounds(src, dst) if src.numel() else None
    runs = None
    if bounds is not None:
        starts, ends = bounds
        s0, d0 = src[starts].tolist(), dst[starts].tolist()
        runs = [(slice(s, s + e - b), slice(t, t + e - b))
                for s, t, b, e in zip(s0, d0, starts, ends, strict=True)]
    for a, b in zip(_buffers(src_pool), _buffers(pool), strict=True):
        out = b[:, heads]
        if runs is None:
            out[dst] = a[src]
            continue
        for s, t in runs:
            out[t].copy_(a[s])


def broadcast_heads(member, full: torch.Tensor, groups: list[int], shards: int, src: int) -> None:
    """The source's side of a scatter (the others call ``kv_relayout.broadcast(member, stack, src,
    part)``): head groups ``groups`` of the full block ``full`` (``[layers, 2, n, H_kv,
    d]``; group j of ``shards`` equal groups, as ``shard_view``), broadcast stacked as
    ``[len(groups), layers, 2, n, H_kv/shards, d]``. On the shared path the groups are
    copied from ``full`` straight into the segment, without building the stack."""
    layers, _, n, heads, d = full.shape
    h = heads // shards
    stack = torch.empty((len(groups), layers, 2, n, h, d), dtype=full.dtype, device="meta")
    shm = member.shm
    if shm is None or full.device.type != "cpu" or h * d * full.element_size() > shm.slot_bytes:
        stacked = torch.stack([kv_relayout.shard_view(full, j, shards) for j in groups])
        kv_relayout.broadcast(member, stacked, src)
        return
    planes = (len(groups) * layers, 2, n, h, d)  # the stack, its first two dims as one

    def fill(start: int, slot: torch.Tensor) -> None:
        for p, a, b, off in _pieces(planes, start, slot.numel()):
            g, layer = divmod(p // 2, layers)
            j = groups[g]
            _token_rows(slot, off, b - a, planes).copy_(full[layer, p % 2, a:b, j * h : (j + 1) * h])

    flat, per = stack.view(-1), kv_relayout.chunk_elems(shm.slot_bytes, stack)
    for start in range(0, flat.numel(), per):
        shm.broadcast(flat[start : start + per], src, fill=lambda slot, at=start: fill(at, slot))
