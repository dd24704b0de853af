"""KV Cache Adaptor: the engine's own KV pool, viewed for a TP-m group.

``MHATokenToKVPool`` keeps per-layer buffers ``[rows, H_kv, d]`` (NHD, contiguous; rows =
size + page). A TP-m member stores only its H_kv/m heads per token, so the same memory
is viewed as ``[rows*m, H_kv/m, d]``: TP slot ``t = s*m + j`` addresses heads
``[j*H_kv/m, (j+1)*H_kv/m)`` of DP slot ``s``. Bytes per slot are unchanged; tokens per
slot are multiplied by m: the paper's "block size scales inversely with TP degree" at
SGLang's page size 1.

DP and TP share one physical pool: the TP allocator takes whole DP slots from the
engine's own allocator (``reserve``) and hands out their m sub-slots; ``release`` gives
the DP slots back. A physical row is therefore never used by DP and TP at once.

Invariants: views share storage with the pool's buffers (no KV memory is allocated);
after ``release`` the engine allocator's free count is what it was before ``reserve``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


def view_pool(pool, m: int):
    """A shallow copy of ``pool`` whose buffers are TP-m views of the same memory."""
    if getattr(pool, "use_hnd", False) or getattr(pool, "is_quantized_kv_cache", False):
        raise ValueError("TP KV views need the NHD, unquantized MHA pool layout")
    if pool.head_num % m:
        raise ValueError(f"KV heads ({pool.head_num}) not divisible by TP degree {m}")
    tp = copy.copy(pool)
    h = pool.head_num // m

    def _view(buf: torch.Tensor) -> torch.Tensor:
        rows, heads, dim = buf.shape
        return buf.view(rows * m, heads // m, dim)

    tp.k_buffer = [_view(b) for b in pool.k_buffer]
    tp.v_buffer = [_view(b) for b in pool.v_buffer]
    tp.head_num = h
    # set_kv_buffer bounds-checks indices against size + page_size.
    tp.size = (pool.size + pool.page_size) * m - pool.page_size
    tp.row_dim = h * pool.head_dim
    if hasattr(pool, "v_row_dim"):
        tp.v_row_dim = h * pool.v_head_dim
    return tp


def sub_slots(dp_slots: torch.Tensor, m: int) -> torch.Tensor:
    """TP-m indices of the given DP slots: s*m + j for j in [0, m), in order."""
    return (dp_slots.unsqueeze(1) * m + torch.arange(m, device=dp_slots.device)).reshape(-1)


@dataclass
class Reservation:
    """DP slots lent to a TP session; their sub-slots seed the TP allocator."""

    dp_slots: torch.Tensor
    degree: int

    @property
    def tp_slots(self) -> torch.Tensor:
        return sub_slots(self.dp_slots, self.degree)


def reserve(engine_allocator, tokens: int, m: int) -> Reservation | None:
    """Take enough whole DP slots for ``tokens`` TP tokens, or None if they are not free."""
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
