"""The shared-memory all-reduce under server conditions, with real processes.

Each test spawns 2 or 4 processes that form a gloo group on 127.0.0.1 and build
``flying.substrate.shm_allreduce.ShmAllReduce`` on it: sums against a float32 rank-order reference
(fp32/bf16/fp16), many sizes in sequence, non-contiguous inputs, all-gather, hundreds of
back-to-back calls with jittered timing (buffer reuse hazards), a straggler that joins
late (and the waiting rank must not burn its core meanwhile), the gloo fallback above
the slot size interleaved with shared calls, members that cannot share a segment, a
timeout and a dead peer that raise clear errors; and no segment left in /dev/shm.
"""

from __future__ import annotations

import os
import random
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flying.substrate import shm_allreduce as sar
from flying.substrate import shm_config
from flying.substrate import shm_segment as seg
from workloads.measure.server import free_port

pytestmark = pytest.mark.unit

SLOT = 64 << 10  # bytes per rank slot in these tests


def _context():
    """A forkserver that imports torch once: 4 fresh interpreters would take ~10 s here."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "numpy", "flying.substrate.shm_allreduce"])
    return ctx


def _segments() -> set[str]:
    return {p.name for p in seg.SHM_DIR.glob(seg.PREFIX + "*")}


def _entry(rank, world, port, scenario, q) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        scenario(rank, world, dist.group.WORLD, lambda value: q.put((rank, value)))
        dist.destroy_process_group()
    except BaseException:
        q.put((rank, "ERROR " + traceback.format_exc()))
        raise


def _spawn(world: int, scenario, messages: int, timeout_s: float = 90.0) -> dict[int, list]:
    """Run ``scenario(rank, world, pg, emit)`` on ``world`` processes.

    Returns rank -> the values it emitted, after ``messages`` values in all.
    """
    before = _segments()
    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, scenario, q)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, list] = {r: [] for r in range(world)}
    try:
        for _ in range(messages):
            rank, value = q.get(timeout=timeout_s)
            assert not (isinstance(value, str) and value.startswith("ERROR")), f"rank {rank}: {value}"
            results[rank].append(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    assert _segments() <= before, f"leaked segments: {_segments() - before}"
    return results


def _data(rank: int, step: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _reference(world: int, step: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    acc = _data(0, step, numel, dtype).float()
    for r in range(1, world):
        acc += _data(r, step, numel, dtype).float()
    return acc.to(dtype)


def _policy(**kw) -> shm_config.WaitPolicy:
    return shm_config.WaitPolicy(**{"timeout_s": 20.0, **kw})


# -- scenarios (run inside the spawned processes) ----------------------------------------


def _sums_and_sequence(rank: int, world: int, pg) -> dict:
    comm = sar.ShmAllReduce.create(pg, rank, world, label="test", slot_bytes=SLOT, policy=_policy())
    assert comm is not None
    step = 0
    checked = 0
    # Many sizes and dtypes in sequence, each checked exactly against the reference.
    for dtype in sar.REDUCE_DTYPES:
        for numel in (1, 7, 256, 1000, 4099, SLOT // torch.tensor([], dtype=dtype).element_size()):
            step += 1
            t = _data(rank, step, numel, dtype)
            assert comm.can_reduce(t)
            comm.all_reduce_(t)
            assert torch.equal(t, _reference(world, step, numel, dtype)), (dtype, numel)
            mine = t.float()
            everyone = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(everyone, mine, group=pg)  # bit-identical on every member
            assert all(torch.equal(mine, e) for e in everyone)
            checked += 1
    # Non-contiguous input, reduced in place.
    step += 1
    base = _data(rank, step, 12 * 8, torch.float32).view(12, 8)
    t = base.t()
    comm.all_reduce_(t)
    assert torch.equal(base, _reference(world, step, 96, torch.float32).view(12, 8))
    # All-gather along the last and the first dim.
    for dim in (-1, 0):
        x = torch.full((3, 5), float(rank)) + torch.arange(15.0).view(3, 5)
        out = comm.all_gather(x, dim)
        want = torch.cat([torch.full((3, 5), float(r)) + torch.arange(15.0).view(3, 5)
                          for r in range(world)], dim=dim)
        assert torch.equal(out, want)
    # The KV relayout's exchange: a block of three slots and a bit goes in chunks, each
    # peer's straight into its own block; this member's entry is its block, not a copy.
    from types import SimpleNamespace

    from flying.substrate import kv_relayout

    member = SimpleNamespace(group=SimpleNamespace(degree=world), tp_rank=rank, shm=comm, pg=pg)
    n = 3 * SLOT // 4 + 5
    block = torch.arange(n, dtype=torch.float32).view(1, n) + 1000 * rank
    blocks = kv_relayout.exchange(member, block)
    assert blocks[rank].data_ptr() == block.data_ptr()
    for r, got in enumerate(blocks):
        assert got.shape == block.shape
        assert torch.equal(got, torch.arange(n, dtype=torch.float32).view(1, n) + 1000 * r)
    # A gather to one member (a move whose requests all land there): it alone gets
    # every block, its own entry its block; on the shared path and over gloo.
    for shm in (comm, None):
        member = SimpleNamespace(group=SimpleNamespace(degree=world), tp_rank=rank, shm=shm, pg=pg)
        for dst in range(world):
            got = kv_relayout.gather_to(member, block, dst)
            if rank != dst:
                assert got is None
                continue
            assert shm is None or got[rank].data_ptr() == block.data_ptr()
            for r, one in enumerate(got):
                assert torch.equal(one, torch.arange(n, dtype=torch.float32).view(1, n) + 1000 * r)
    # A move's rows streamed to one member: the others read their TP rows straight into
    # the segment, the taker writes whole DP rows from its own TP view and the segment
    # (chunks that cross layers and K/V); on the shared path and over gloo, slots in
    # runs and scattered, heads split and replicated: the rows of the joined block.
    rows_checked = _streamed_rows(rank, world, comm, pg)
    # A broadcast: only the source copies in; every member gets the source's bytes.
    src = world - 1
    t = torch.arange(10.0) + 100 * rank if rank == src else torch.empty(10, device="meta")
    assert torch.equal(comm.broadcast(t, src), torch.arange(10.0) + 100 * src)
    # The KV relayout's broadcast and scatter: several chunks, a piece per member, on
    # the shared path and over gloo (no segment), the source's result its own block.
    for shm in (comm, None):
        member = SimpleNamespace(group=SimpleNamespace(degree=world), tp_rank=rank, shm=shm, pg=pg)
        whole = torch.arange(world * n, dtype=torch.float32).view(world, 1, n)
        sent = whole if rank == src else torch.empty(whole.shape, device="meta")
        got = kv_relayout.broadcast(member, sent, src)
        assert torch.equal(got, whole) and (rank != src or got.data_ptr() == whole.data_ptr())
        piece = kv_relayout.broadcast(member, sent, src, part=rank)
        assert piece.shape == (1, n) and torch.equal(piece, whole[rank])
    # Hundreds of back-to-back calls with jitter: a reused slot must never be read stale.
    rng = random.Random(rank)
    for i in range(400):
        t = torch.full((64,), float(i * world + rank))
        if rng.random() < 0.05:
            time.sleep(rng.random() * 2e-3)
        comm.all_reduce_(t)
        assert torch.all(t == sum(i * world + r for r in range(world))), i
    # Above the slot: the caller falls back to gloo; shared calls interleave fine.
    big = torch.ones(SLOT // 4 + 1)
    assert not comm.can_reduce(big) and not comm.fits(big)
    calls = comm.calls
    for i in range(3):
        dist.all_reduce(big, group=pg)
        small = torch.full((10,), float(rank + i))
        comm.all_reduce_(small)
        assert torch.all(small == sum(r + i for r in range(world)))
    assert comm.calls == calls + 3 and torch.all(big == world**3)
    # A straggler: rank 1 arrives 0.4 s late; rank 0 must wait without burning its core.
    if rank == 1:
        time.sleep(0.4)
    wall, cpu = time.perf_counter(), time.process_time()
    t = torch.full((16,), 1.0)
    comm.all_reduce_(t)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert torch.all(t == world)
    comm.close()
    return {"checked": checked, "rows_checked": rows_checked, "wait_wall": wall, "wait_cpu": cpu}


def _streamed_rows(rank: int, world: int, comm, pg) -> int:
    from types import SimpleNamespace

    from flying.substrate import kv_adaptor, kv_relayout, kv_stream
    from flying.substrate.layout import KvSplit

    layers, rows, dim, n = 3, 1200, 16, 400

    def pool(seed: int, heads: int) -> SimpleNamespace:
        g = torch.Generator().manual_seed(seed)
        bufs = [torch.randn(rows, heads, dim, generator=g) for _ in range(2 * layers)]
        return SimpleNamespace(k_buffer=bufs[:layers], v_buffer=bufs[layers:], head_num=heads,
                               head_dim=dim, v_head_dim=dim, size=rows - 1, page_size=1)

    checked, runs = 0, kv_relayout.MAX_RUNS
    g = torch.Generator().manual_seed(7)  # the same slots on every member (lockstep)
    for kv_heads in (4, max(1, world // 2)):
        split = KvSplit(kv_heads, world)
        f = split.shards
        # TP slots in DP rows [0, 500), the taker's new DP slots in [500, 1200)
        by_runs = (torch.cat([torch.arange(200, 500), torch.arange(0, 100)]), torch.arange(500, 900))
        scattered = (torch.randperm(500 * f, generator=g)[:n],
                     500 + torch.randperm(700, generator=g)[:n])
        for shm in (comm, None):
            member = SimpleNamespace(group=SimpleNamespace(degree=world), tp_rank=rank, shm=shm, pg=pg)
            for tp_slots, dp_slots in (by_runs, scattered):
                kv_relayout.MAX_RUNS = runs if tp_slots is by_runs[0] else 0
                for dst in range(world):
                    mine = pool(rank, kv_heads)
                    view = kv_adaptor.view_pool(mine, world)
                    before = kv_relayout.read_block(view, tp_slots)
                    if rank != dst:
                        kv_stream.send_rows(member, view, tp_slots, dst)
                    else:
                        kv_stream.gather_rows(member, split, view, tp_slots, mine, dp_slots)
                        shards = [kv_relayout.read_block(kv_adaptor.view_pool(pool(r, kv_heads), world),
                                                         tp_slots) for r in range(world)]
                        # one copy of each head group: the taker's own for its group (in a
                        # server replicas hold equal bytes; here they differ, to tell them apart)
                        want = kv_relayout.join_shards([
                            shards[dst if split.shard(dst) == j else split.ranks(j)[0]]
                            for j in range(split.shards)])
                        assert torch.equal(kv_relayout.read_block(mine, dp_slots), want), (kv_heads, dst)
                        checked += 1
                    assert torch.equal(kv_relayout.read_block(view, tp_slots), before)
            # A join's scatter: the source sends the head groups others hold, each
            # member takes its own (the source's straight from its full block).
            from flying.session.join_wire import needed

            for src in range(world):
                full = kv_relayout.read_block(pool(src, kv_heads), by_runs[1])
                groups = needed(split, src)
                if rank == src:
                    kv_stream.broadcast_heads(member, full, groups, f, src)
                    continue
                stack = torch.empty((len(groups), *full.shape[:3], kv_heads // f, dim), device="meta")
                mine = kv_relayout.broadcast(member, stack, src, part=groups.index(split.shard(rank)))
                assert torch.equal(mine, kv_relayout.shard_view(full, split.shard(rank), f))
                checked += 1
    kv_relayout.MAX_RUNS = runs
    return checked


def _dead_and_late(rank: int, world: int, pg, emit) -> dict:
    """Rank 1 never reaches the collectives and then exits; rank 0 must get clear errors."""
    short = sar.ShmAllReduce.create(pg, rank, world, label="short", slot_bytes=SLOT,
                                    policy=_policy(timeout_s=0.5))
    long = sar.ShmAllReduce.create(pg, rank, world, label="long", slot_bytes=SLOT,
                                   policy=_policy(timeout_s=60.0))
    assert short is not None and long is not None
    if rank == 1:
        emit({"exiting": True})
        time.sleep(1.0)
        os._exit(0)  # dies without calling; rank 0 sees it exit
    out: dict = {}
    for name, comm in (("timeout", short), ("broken", short), ("dead", long)):
        start = time.perf_counter()
        with pytest.raises(sar.ShmAllReduceError) as info:
            comm.all_reduce_(torch.ones(4))
        out[name] = (str(info.value), time.perf_counter() - start)
    return out


def _not_one_host(rank: int, world: int, pg) -> bool:
    real = seg.SHM_DIR
    if rank == 1:  # a member whose /dev/shm is another filesystem
        seg.SHM_DIR = Path(os.environ["FLYING_TEST_OTHER_SHM"])
    comm = sar.ShmAllReduce.create(pg, rank, world, label="split", slot_bytes=SLOT)
    seg.SHM_DIR = real
    return comm is None


def _hook_glue(rank: int, world: int, pg) -> dict:
    """sglang_patches.parallel_state's hooks on a stand-in GroupCoordinator."""
    from types import SimpleNamespace

    from sglang_patches import parallel_state as hooks

    group = SimpleNamespace(world_size=world, cpu_group=pg, rank_in_group=rank,
                            unique_name="tp:0", ranks=list(range(world)))
    originals: list[str] = []

    def original(g, t):  # stands in for GroupCoordinator.all_reduce (gloo)
        originals.append(f"{t.dtype}:{t.numel()}")
        dist.all_reduce(t, group=pg)
        return t

    small = hooks.all_reduce(original, group, torch.full((2, 8), float(rank + 1)))
    big = hooks.all_reduce(original, group, torch.ones(shm_config.slot_bytes_from_env() // 4 + 1))
    ints = hooks.all_reduce(original, group, torch.ones(4, dtype=torch.int64))
    gathered = hooks.all_gather(original, group, torch.full((1, 3), float(rank)), -1)
    comm = group._flying_shm
    hooks.destroy(None, group)
    return {
        "small": bool(torch.all(small == world * (world + 1) / 2)),
        "fallbacks": originals,
        "big": bool(torch.all(big == world)) and bool(torch.all(ints == world)),
        "gathered": gathered.tolist(),
        "calls": comm.calls,
        "closed": comm.broken == "closed" and not hasattr(group, "_flying_shm"),
    }


def _two_ranks(rank: int, world: int, pg, emit) -> None:
    emit({"split": _not_one_host(rank, world, pg), "hooks": _hook_glue(rank, world, pg),
          **_sums_and_sequence(rank, world, pg)})
    dead = _dead_and_late(rank, world, pg, emit)  # rank 1 emits first, then exits
    emit(dead)


def _four_ranks(rank: int, world: int, pg, emit) -> None:
    emit(_sums_and_sequence(rank, world, pg))


# -- tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[int, list]:
    """One 2-process run of every scenario (process start-up dominates the cost)."""
    other = tmp_path_factory.mktemp("other_shm")
    os.environ["FLYING_TEST_OTHER_SHM"] = str(other)
    try:
        res = _spawn(2, _two_ranks, messages=4)
    finally:
        del os.environ["FLYING_TEST_OTHER_SHM"]
    assert not list(other.iterdir())
    return res


def test_two_ranks_sums_sizes_reuse_fallback(two_ranks):
    assert two_ranks[0][0]["checked"] == two_ranks[1][0]["checked"] == 18
    # every (heads, transport, slots) case once per rank as the taker (8), and every
    # (heads, transport) scatter from the other rank (4)
    assert two_ranks[0][0]["rows_checked"] == two_ranks[1][0]["rows_checked"] == 12


def test_straggler_is_awaited_without_burning_a_core(two_ranks):
    waiter = two_ranks[0][0]
    assert waiter["wait_wall"] > 0.3
    # spin + yield phases are bounded (a few ms); the rest of the wait is sleeping
    assert waiter["wait_cpu"] < 0.5 * waiter["wait_wall"], waiter


def test_members_not_sharing_shm_fall_back_together(two_ranks):
    assert two_ranks[0][0]["split"] is True and two_ranks[1][0]["split"] is True


def test_timeout_and_dead_peer_raise_clear_errors(two_ranks):
    out = two_ranks[0][1]
    msg, waited = out["timeout"]
    assert "rank 1 of 2 did not reach collective" in msg and "timed out" in msg
    assert 0.4 < waited < 3.0
    assert "unusable" in out["broken"][0] and out["broken"][1] < 0.1
    msg, waited = out["dead"]
    assert "exited" in msg and waited < 5.0


def test_sglang_hooks_route_cpu_collectives(two_ranks):
    for rank in (0, 1):
        h = two_ranks[rank][0]["hooks"]
        assert h["small"] and h["big"] and h["closed"]
        # only the tensor above the slot and the int64 tensor went to the original (gloo)
        assert len(h["fallbacks"]) == 2 and h["fallbacks"][1] == "torch.int64:4"
        assert h["gathered"] == [[0.0, 0.0, 0.0, 1.0, 1.0, 1.0]]
        assert h["calls"] == 2  # the small all-reduce and the all-gather


def test_sweep_removes_segments_of_dead_creators(tmp_path):
    dead = tmp_path / f"{seg.PREFIX}999999999_dead"
    alive = tmp_path / f"{seg.PREFIX}{os.getpid()}_alive"
    dead.write_bytes(b"x")
    alive.write_bytes(b"x")
    assert seg.sweep_stale(tmp_path) == [dead.name]
    assert alive.exists() and not dead.exists()


def test_four_ranks_on_two_cores():
    res = _spawn(4, _four_ranks, messages=4, timeout_s=120.0)
    assert all(r[0]["checked"] == 18 and r[0]["rows_checked"] == 8 + 12 for r in res.values())


def test_no_segment_left_in_dev_shm():
    assert not _segments()


def test_wait_policy_env(monkeypatch):
    monkeypatch.setenv(shm_config.ENV_TIMEOUT, "3")
    monkeypatch.setenv(shm_config.ENV_SPIN_US, "10")
    p = shm_config.WaitPolicy.from_env()
    assert p.timeout_s == 3.0 and p.spin_s == pytest.approx(10e-6)
