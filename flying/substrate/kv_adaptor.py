"""KV Cache Adaptor: the engine's own KV pool, viewed for a TP-m group.

``MHATokenToKVPool`` keeps per-layer buffers ``[rows, H_kv, d]`` (NHD, contiguous; rows =
size + page). A TP-m member stores only its own KV heads per token
(``layout.KvSplit``), so the same memory is viewed as ``[rows*f, H_kv/f, d]`` with
``f = min(m, H_kv)`` tokens per DP slot:

- heads split (``H_kv % m == 0``, f = m): TP slot ``t = s*m + j`` addresses heads
  ``[j*H_kv/m, (j+1)*H_kv/m)`` of DP slot ``s``; bytes per slot are unchanged and tokens
  per slot are multiplied by m: the paper's "block size scales inversely with TP
  degree" at SGLang's page size 1;
- heads replicated (``m % H_kv == 0``, f = H_kv): a rank holds one head per token, so a
  DP slot (room for H_kv heads) holds H_kv tokens, not m: TP slot ``t = s*H_kv + j`` is
  head position ``j`` of DP slot ``s``. A group's pooled KV is then H_kv x one engine's,
  the price of replication (SGLang's TP pays it too: every replica stores its head).

DP and TP share one physical pool: the TP allocator takes whole DP slots from the
engine's own allocator (``reserve``) and hands out their f sub-slots; ``release`` gives
the DP slots back. A physical row is therefore never used by DP and TP at once.

Invariants: views share storage with the pool's buffers (no KV memory is allocated);
after ``release`` the engine allocator's free count is what it was before ``reserve``;
with ``H_kv % m == 0`` everything is as without replication (f = m).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from flying.substrate.layout import KvSplit


def tokens_per_slot(kv_heads: int, m: int) -> int:
    """Tokens one DP slot holds in a TP-m group's KV view (``KvSplit.shards``)."""
    return KvSplit(kv_heads, m).shards


def view_pool(pool, m: int):
    """A shallow copy of ``pool`` whose buffers are TP-m views of the same memory:
    ``[rows*f, H_kv/f, d]`` per layer, f = ``tokens_per_slot(H_kv, m)``."""
    if getattr(pool, "use_hnd", False) or getattr(pool, "is_quantized_kv_cache", False):
        raise ValueError("TP KV views need the NHD, unquantized MHA pool layout")
    f = tokens_per_slot(pool.head_num, m)  # raises if the heads neither split nor replicate
    tp = copy.copy(pool)
    h = pool.head_num // f

    def _view(buf: torch.Tensor) -> torch.Tensor:
        rows, heads, dim = buf.shape
        return buf.view(rows * f, heads // f, dim)

    tp.k_buffer = [_view(b) for b in pool.k_buffer]
    tp.v_buffer = [_view(b) for b in pool.v_buffer]
    tp.head_num = h
    # set_kv_buffer bounds-checks indices against size + page_size.
    tp.size = (pool.size + pool.page_size) * f - pool.page_size
    tp.row_dim = h * pool.head_dim
    if hasattr(pool, "v_row_dim"):
        tp.v_row_dim = h * pool.v_head_dim
    return tp


def sub_slots(dp_slots: torch.Tensor, m: int) -> torch.Tensor:
    """TP indices of the given DP slots, ``m`` tokens per slot (``tokens_per_slot``):
    s*m + j for j in [0, m), in order."""
    return (dp_slots.unsqueeze(1) * m + torch.arange(m, device=dp_slots.device)).reshape(-1)


@dataclass
class Reservation:
    """DP slots lent to a TP session; their sub-slots seed the TP allocator.

    ``tp_slots`` ([n * per_slot] int64) is computed once: a bind reads it on its
    critical path (the allocator's supply and the session's capacity)."""

    dp_slots: torch.Tensor
    per_slot: int  # tokens per DP slot in the group's KV view (``tokens_per_slot``)
    tp_slots: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.tp_slots = sub_slots(self.dp_slots, self.per_slot)


def reserve(engine_allocator, tokens: int, m: int) -> Reservation | None:
    """Take enough whole DP slots for ``tokens`` TP tokens at ``m`` tokens per DP slot
    (``tokens_per_slot``: the degree, or H_kv when heads are replicated), or None if
    they are not free."""
    need = -(-tokens // m)
    slots = engine_allocator.alloc(need)
    if slots is None:
        return None
    return Reservation(slots, m)


def release(engine_allocator, res: Reservation) -> None:
    engine_allocator.free(res.dp_slots)


def make_tp_allocator(engine_allocator, tp_pool, res: Reservation):
    """An SGLang ``TokenToKVPoolAllocator`` over exactly the reservation's sub-slots."""
    slots = res.tp_slots
    allocator = _reserved_class()(
        size=int(slots.numel()),
        dtype=engine_allocator.dtype,
        device=engine_allocator.device,
        kvcache=tp_pool,
        need_sort=True,
    )
    allocator.reserved = slots
    allocator.free_pages = slots.clone()
    return allocator


def reset_tp_allocator(allocator, res: Reservation) -> None:
    """Point an allocator made by ``make_tp_allocator`` at another reservation (a new
    session of the same degree reuses it: nothing is built on the bind path)."""
    allocator.reserved = res.tp_slots
    allocator.size = int(allocator.reserved.numel())
    allocator.clear()


_RESERVED: list[type] = []


def _reserved_class() -> type:
    """SGLang's allocator whose supply is the reserved sub-slots (``reserved``), also after
    a ``clear()``; the class is made once (SGLang is imported lazily)."""
    if not _RESERVED:
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        class ReservedSlotsAllocator(TokenToKVPoolAllocator):
            reserved: torch.Tensor

            def clear(self):
                super().clear()
                if hasattr(self, "reserved"):
                    self.free_pages = self.reserved.clone()

        _RESERVED.append(ReservedSlotsAllocator)
    return _RESERVED[0]
