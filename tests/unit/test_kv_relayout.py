"""KV relayout on tensors: a request's rows gathered from TP shards into DP rows and
scattered back give the same K and V, head by head (``flying.substrate.kv_relayout``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flying.session.move import allowed
from flying.substrate import kv_adaptor, kv_relayout
from flying.substrate.layout import KvSplit

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True, params=["runs", "index"])
def copy_path(request, monkeypatch):
    """Every test on both CPU copy paths: slices of runs of slots, and indexed copies."""
    if request.param == "index":
        monkeypatch.setattr(kv_relayout, "MAX_RUNS", 0)
    return request.param

LAYERS, ROWS, HEADS, DIM = 3, 32, 4, 8


def _pool(seed: int = 0, heads: int = HEADS) -> SimpleNamespace:
    """A stand-in with the MHA pool's buffer layout: per layer [rows, H_kv, d]."""
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        k_buffer=[torch.randn(ROWS, heads, DIM, generator=g) for _ in range(LAYERS)],
        v_buffer=[torch.randn(ROWS, heads, DIM, generator=g) for _ in range(LAYERS)],
        head_num=heads, head_dim=DIM, v_head_dim=DIM, size=ROWS - 1, page_size=1,
    )


def _tp_view(pool, m: int) -> SimpleNamespace:
    return SimpleNamespace(
        k_buffer=[b.view(ROWS * m, HEADS // m, DIM) for b in pool.k_buffer],
        v_buffer=[b.view(ROWS * m, HEADS // m, DIM) for b in pool.v_buffer],
    )


def test_gather_of_member_shards_is_the_full_row():
    m = 2
    members = [_pool(seed=r) for r in range(m)]  # each member's own pool
    tp_slots = [torch.tensor([5, 9, 2]), torch.tensor([7, 3, 11])]  # per member, token order
    shards = [
        kv_relayout.read_block(_tp_view(p, m), s) for p, s in zip(members, tp_slots, strict=True)
    ]
    assert shards[0].shape == (LAYERS, 2, 3, HEADS // m, DIM)
    dp = _pool(seed=9)
    dp_slots = torch.tensor([1, 4, 6])
    kv_relayout.write_block(dp, dp_slots, kv_relayout.join_shards(shards))
    for layer in range(LAYERS):
        for r in range(m):
            heads = slice(r * HEADS // m, (r + 1) * HEADS // m)
            mine = _tp_view(members[r], m)
            assert torch.equal(dp.k_buffer[layer][dp_slots][:, heads], mine.k_buffer[layer][tp_slots[r]])
            assert torch.equal(dp.v_buffer[layer][dp_slots][:, heads], mine.v_buffer[layer][tp_slots[r]])


def test_scatter_then_gather_round_trips():
    m = 2
    dp = _pool(seed=1)
    rows = torch.tensor([3, 0, 17, 8])
    block = kv_relayout.read_block(dp, rows)
    members = [_pool(seed=10 + r) for r in range(m)]
    slots = kv_adaptor.sub_slots(torch.tensor([2, 5]), m)  # 4 TP slots per member
    for r in range(m):
        kv_relayout.write_block(_tp_view(members[r], m), slots, kv_relayout.shard_of(block, r, m))
    back = kv_relayout.join_shards(
        [kv_relayout.read_block(_tp_view(members[r], m), slots) for r in range(m)]
    )
    assert torch.equal(back, block)


def test_write_shards_equals_writing_the_joined_block():
    m = 2
    members = [_pool(seed=20 + r) for r in range(m)]
    slots = torch.tensor([4, 1, 9, 6, 2])
    shards = [kv_relayout.read_block(_tp_view(p, m), slots) for p in members]
    tokens = torch.tensor([3, 0, 4])  # some tokens, in another order
    want, got = _pool(seed=30), _pool(seed=30)
    dp_slots = torch.tensor([7, 12, 5])
    kv_relayout.write_block(want, dp_slots, kv_relayout.join_shards(shards)[:, :, tokens])
    kv_relayout.write_shards(got, dp_slots, shards, tokens)
    for a, b in zip(want.k_buffer + want.v_buffer, got.k_buffer + got.v_buffer, strict=True):
        assert torch.equal(a, b)
    every, joined = _pool(seed=31), _pool(seed=31)
    kv_relayout.write_shards(every, torch.arange(20, 25), shards)
    kv_relayout.write_block(joined, torch.arange(20, 25), kv_relayout.join_shards(shards))
    for a, b in zip(every.k_buffer + every.v_buffer, joined.k_buffer + joined.v_buffer, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kv_heads,m", [(2, 4), (1, 2), (1, 4), (4, 2)])
def test_replicated_heads_scatter_to_every_replica_and_gather_once(kv_heads, m):
    """DP -> TP writes each rank's head group (a replicated head on each of its ranks)
    into the rank's own KV view; TP -> DP rebuilds whole rows from one copy of each
    distinct group (``distinct``): the request's K and V are unchanged both ways."""
    split = KvSplit(kv_heads, m)
    dp = _pool(seed=1, heads=kv_heads)
    block = kv_relayout.read_block(dp, torch.tensor([3, 0, 17, 8]))
    views = [kv_adaptor.view_pool(_pool(seed=10 + r, heads=kv_heads), m) for r in range(m)]
    slots = kv_adaptor.sub_slots(torch.tensor([2, 5, 7, 11]), split.shards)[:4]
    for r, view in enumerate(views):
        kv_relayout.write_block(view, slots, kv_relayout.shard_of(block, split.shard(r), split.shards))
    shards = [kv_relayout.read_block(view, slots) for view in views]
    for r in range(m):
        assert torch.equal(shards[r], block[:, :, :, list(split.heads(r))])
    mine = kv_relayout.distinct(shards, split)
    assert len(mine) == split.shards and torch.equal(kv_relayout.join_shards(mine), block)
    out, rows = _pool(seed=30, heads=kv_heads), torch.tensor([9, 1, 4, 12])
    kv_relayout.write_shards(out, rows, mine)
    assert torch.equal(kv_relayout.read_block(out, rows), block)
    if split.replicas > 1:  # every rank's block, replicas included, is not a row
        with pytest.raises(ValueError, match="do not make the pool's rows"):
            kv_relayout.write_shards(out, rows, shards)


def test_a_scatter_sends_each_head_group_other_members_hold_once():
    from flying.session.join_wire import needed

    assert needed(KvSplit(4, 2), 0) == [1] and needed(KvSplit(4, 2), 1) == [0]
    assert needed(KvSplit(8, 4), 2) == [0, 1, 3]  # no replication: every other rank's
    assert needed(KvSplit(2, 4), 0) == [0, 1]  # rank 1 replicates the source's head
    assert needed(KvSplit(2, 4), 3) == [0, 1]
    assert needed(KvSplit(1, 2), 1) == [0] and needed(KvSplit(1, 4), 0) == [0]


def test_block_bytes():
    assert kv_relayout.block_bytes(4, 1000, 2, 32, 4) == 4 * 2 * 1000 * 2 * 32 * 4


def test_which_sessions_move():
    assert allowed("policy", {"policy"})
    assert not allowed("policy", {"policy", "explicit"})
    assert not allowed("policy", {"priority"})
    assert not allowed("policy", set())
    assert allowed("all", {"explicit", "long"})
    assert not allowed("off", {"policy"})


def _req(prompt: int, out: int, max_new, **extra):
    """A stand-in with the fields of SGLang's Req that a join reads."""
    fields = dict(
        rid="r", origin_input_ids=[1] * prompt, output_ids=[2] * out,
        sampling_params=SimpleNamespace(max_new_tokens=max_new),
        kv=SimpleNamespace(kv_allocated_len=prompt + out - 1), grammar=None,
        finished=lambda: False,
    )
    fields.update(extra)
    return SimpleNamespace(**fields)


def test_a_join_budgets_what_the_request_holds_and_may_still_produce():
    from flying.session.budget import kv_tokens_needed
    from flying.session.join import _budget

    assert _budget(_req(10, 5, 20), 1000) == kv_tokens_needed(14, 15, 1000)
    # No max_new_tokens: SGLang's DP bound (limit - prompt - 1), made explicit.
    req = _req(10, 5, None)
    assert _budget(req, 1000) == kv_tokens_needed(14, 989 - 5, 1000)
    assert req.sampling_params.max_new_tokens == 989
    # Not joinable: constrained decoding, finished, or KV not matching its tokens.
    assert _budget(_req(10, 5, 20, grammar=object()), 1000) is None
    assert _budget(_req(10, 5, 20, finished=lambda: True), 1000) is None
    assert _budget(_req(10, 5, 20, kv=SimpleNamespace(kv_allocated_len=3)), 1000) is None
    assert _budget(_req(10, 5, 20, sampling_params=None), 1000) is None  # odd: stays in DP


def _engine(available: int, fits: bool, need: int, reserved: list[int], empty: bool = False):
    """A stand-in scheduler (DP state) and session scope for ``move.holds_dp``."""
    batch = SimpleNamespace(
        is_empty=lambda: empty, check_decode_mem=lambda: fits,
        new_tokens_required_next_decode=lambda: need,
    )
    scheduler = SimpleNamespace(
        running_batch=batch,
        token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: available),
    )
    scope = SimpleNamespace(reservations=[SimpleNamespace(dp_slots=torch.zeros(n)) for n in reserved])
    return scheduler, scope


def test_a_dp_step_is_held_only_for_the_kv_a_session_reserved():
    from flying.session.move import holds_dp

    assert not holds_dp(*_engine(0, True, 2, [100]))  # fits: SGLang runs it
    assert not holds_dp(*_engine(0, False, 2, [100], empty=True))  # no DP decode
    assert holds_dp(*_engine(1, False, 2, [1]))  # short by 1, and the session holds 1
    assert holds_dp(*_engine(0, False, 3, [2, 1]))
    # short even with the session's slots back: SGLang retracts, as without Flying
    assert not holds_dp(*_engine(0, False, 3, [2]))
    assert not holds_dp(*_engine(0, False, 1, []))


def test_rows_of_cuts_slots_into_runs_and_falls_back_to_an_index(monkeypatch):
    """Consecutive slots become slice pairs (pool rows, block rows); past MAX_RUNS runs,
    the index tensor; both paths write the same rows."""
    monkeypatch.setattr(kv_relayout, "MAX_RUNS", 16)
    rows = kv_relayout.rows_of(torch.tensor([4, 5, 6, 10, 11, 2]), torch.device("cpu"))
    assert rows == [(slice(4, 7), slice(0, 3)), (slice(10, 12), slice(3, 5)),
                    (slice(2, 3), slice(5, 6))]
    slots = torch.tensor([7, 8, 9, 1, 12])
    block = kv_relayout.read_block(_pool(seed=5), torch.tensor([3, 0, 17, 8, 9]))
    by_runs, by_index = _pool(seed=6), _pool(seed=6)
    kv_relayout.write_block(by_runs, slots, block)
    monkeypatch.setattr(kv_relayout, "MAX_RUNS", 0)
    assert isinstance(kv_relayout.rows_of(slots, torch.device("cpu")), torch.Tensor)
    kv_relayout.write_block(by_index, slots, block)
    assert torch.equal(kv_relayout.read_block(by_index, slots), block)
    for a, b in zip(by_runs.k_buffer + by_runs.v_buffer, by_index.k_buffer + by_index.v_buffer,
                    strict=True):
        assert torch.equal(a, b)


def test_copy_rows_writes_each_row_where_its_slot_says_on_either_side(copy_path):
    """``kv_stream.copy_rows``: a run is a run only where source and destination slots
    both step by one; here the source is one run and the destination three, so a copy
    cut by the source alone would land rows in the wrong slots."""
    from flying.substrate import kv_stream

    src = _pool(seed=7, heads=HEADS // 2)  # a TP-2 view's rows: half the heads
    dst = _pool(seed=8)
    src_slots = torch.tensor([3, 4, 5, 6, 7])
    dst_slots = torch.tensor([10, 11, 20, 2, 3])
    before = [b.clone() for b in dst.k_buffer + dst.v_buffer]
    kv_stream.copy_rows(src, src_slots, dst, dst_slots, slice(HEADS // 2, HEADS))
    for got, old, s in zip(dst.k_buffer + dst.v_buffer, before, src.k_buffer + src.v_buffer,
                           strict=True):
        want = old.clone()
        want[dst_slots, HEADS // 2:] = s[src_slots]
        assert torch.equal(got, want)
