"""KV relayout on CUDA pools (bf16): the CUDA branch of ``write_shards`` (joined block,
whole-row writes) writes exactly what the CPU path writes, and a DP -> TP -> DP round
trip returns every row bit for bit. Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from flying.substrate import kv_relayout
from tests.unit.test_kv_relayout import _pool, _tp_view

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _cuda(pool):
    pool.k_buffer = [b.to("cuda", torch.bfloat16) for b in pool.k_buffer]
    pool.v_buffer = [b.to("cuda", torch.bfloat16) for b in pool.v_buffer]
    return pool


def _cpu(pool):
    pool.k_buffer = [b.to(torch.bfloat16) for b in pool.k_buffer]
    pool.v_buffer = [b.to(torch.bfloat16) for b in pool.v_buffer]
    return pool


def test_cuda_write_shards_writes_what_the_cpu_path_writes():
    m, slots = 2, torch.tensor([4, 1, 9, 6, 2])
    tokens, dp_slots = torch.tensor([3, 0, 4]), torch.tensor([7, 12, 5])
    cpu_members = [_cpu(_pool(seed=20 + r)) for r in range(m)]
    gpu_members = [_cuda(_pool(seed=20 + r)) for r in range(m)]
    want, got = _cpu(_pool(seed=30)), _cuda(_pool(seed=30))
    kv_relayout.write_shards(
        want, dp_slots, [kv_relayout.read_block(_tp_view(p, m), slots) for p in cpu_members], tokens)
    kv_relayout.write_shards(
        got, dp_slots, [kv_relayout.read_block(_tp_view(p, m), slots) for p in gpu_members], tokens)
    for a, b in zip(want.k_buffer + want.v_buffer, got.k_buffer + got.v_buffer, strict=True):
        assert b.is_cuda and torch.equal(a, b.cpu())


def test_cuda_round_trip_through_the_tp_views_is_exact():
    m = 2
    dp = _cuda(_pool(seed=1))
    members = [_cuda(_pool(seed=2 + r)) for r in range(m)]
    rows, slots = torch.tensor([3, 0, 17, 8]), torch.tensor([5, 9, 2, 30])
    block = kv_relayout.read_block(dp, rows)
    assert block.is_cuda and block.shape == (len(dp.k_buffer), 2, 4, 4, 8)
    for r in range(m):
        kv_relayout.write_block(_tp_view(members[r], m), slots, kv_relayout.shard_of(block, r, m))
    shards = [kv_relayout.read_block(_tp_view(p, m), slots) for p in members]
    back = _cuda(_pool(seed=40))
    kv_relayout.write_shards(back, rows, shards)
    for a, b in zip(dp.k_buffer + dp.v_buffer, back.k_buffer + back.v_buffer, strict=True):
        assert torch.equal(a[rows], b[rows])
