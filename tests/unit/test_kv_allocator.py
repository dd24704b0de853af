"""The TP allocator hands out exactly a reservation's sub-slots, also after a clear()."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.unit


def test_tp_allocator_supply_is_the_reservation():
    import torch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    from flying.substrate import kv_adaptor

    engine = TokenToKVPoolAllocator(
        size=64, dtype=torch.float32, device="cpu", kvcache=SimpleNamespace(), need_sort=True
    )
    free = engine.available_size()
    res = kv_adaptor.reserve(engine, 10, 2)  # 5 DP slots -> 10 TP sub-slots
    assert engine.available_size() == free - 5
    tp = kv_adaptor.make_tp_allocator(engine, SimpleNamespace(), res)
    want = sorted(res.tp_slots.tolist())
    assert tp.available_size() == 10 and sorted(tp.free_pages.tolist()) == want
    got = tp.alloc(4)
    assert set(got.tolist()) <= set(want) and tp.available_size() == 6
    tp.clear()
    assert sorted(tp.free_pages.tolist()) == want
    kv_adaptor.release(engine, res)
    assert engine.available_size() == free


def test_tp_allocator_is_reused_for_the_next_reservation():
    import torch
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    from flying.substrate import kv_adaptor

    engine = TokenToKVPoolAllocator(
        size=64, dtype=torch.float32, device="cpu", kvcache=SimpleNamespace(), need_sort=True
    )
    first = kv_adaptor.reserve(engine, 10, 2)
    tp = kv_adaptor.make_tp_allocator(engine, SimpleNamespace(), first)
    tp.alloc(3)
    kv_adaptor.release(engine, first)
    second = kv_adaptor.reserve(engine, 30, 2)
    kv_adaptor.reset_tp_allocator(tp, second)
    assert tp.size == 30 and tp.available_size() == 30
    assert sorted(tp.free_pages.tolist()) == sorted(second.tp_slots.tolist())
    tp.free(tp.alloc(5))  # released slots return (need_sort: via release_pages)
    assert tp.available_size() == 30
