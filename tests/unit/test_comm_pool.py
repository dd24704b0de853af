"""The bounded bind handshake and group collectives, across real processes (no SGLang)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from flying.substrate.comm_pool import CommPool, host_store

pytestmark = pytest.mark.unit


def _member(address, rank, engines, binds, delays, out):
    pool = CommPool.create(address, rank, engines, [2], prefix="t")
    t = torch.full((4,), float(rank + 1))
    pool.member(2).all_reduce(t)
    results = [t.tolist()]
    for bind_id, delay in zip(binds, delays[rank], strict=True):
        time.sleep(delay)
        results.append(pool.rendezvous(bind_id, 2, vote="", timeout_s=0.5).encode())
    time.sleep(2.5)  # the late member's read completes the cleanup
    results.append(sorted(k for k in ("flying/bind/a/decision", "flying/bind/a/read",
                                      "flying/bind/a/arrive/0", "flying/bind/b/decision",
                                      "flying/bind/b/why/0")
                          if pool.store.check([k])))
    out.put((rank, results))


def _two_engines(target, *args) -> dict:
    """Run ``target(address, rank, *args, out)`` in 2 spawned processes sharing a store;
    returns {rank: result} from what each put on ``out``."""
    store, address = host_store()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(address, r, *args, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    del store
    return results


def _run(delays, binds):
    return _two_engines(_member, 2, binds, delays)


def test_group_all_reduce_and_agreed_decisions():
    # bind a: both on time -> go; bind b: the non-leader is 2 s late -> both abort
    # (the leader decides after 0.5 s; the late member reads that decision)
    res = _run(delays={0: [0.0, 0.0], 1: [0.0, 2.0]}, binds=["a", "b"])
    assert res[0][0] == res[1][0] == [3.0] * 4
    assert res[0][1] == res[1][1] and res[0][1].startswith("go:")
    assert res[0][2] == res[1][2]
    assert res[0][2].startswith("abort:") and "did not arrive" in res[0][2]
    assert res[0][3] == res[1][3] == []  # the last reader deleted every key of both binds


def test_leader_late_means_member_aborts_and_leader_agrees():
    res = _run(delays={0: [2.5], 1: [0.0]}, binds=["c"])
    assert res[0][1] == res[1][1]
    assert res[1][1].startswith("abort:")


def _votes(address, rank, shm_on, out):
    """A "no" vote (rank 1's), then a go, announced and concluded with work between
    (the engine opens its scope there), on the shared segment or on the store alone."""
    import os

    os.environ["FLYING_SHM_ALLREDUCE"] = "1" if shm_on else "0"
    pool = CommPool.create(address, rank, 2, [2], prefix=f"votes{int(shm_on)}")
    got = {"shm": pool.member(2).shm is not None}
    for bind_id, vote in (("d1", "member lacks KV capacity" if rank == 1 else ""), ("d2", "")):
        ticket = pool.announce(bind_id, 2, vote)
        time.sleep(0.05 * rank)  # the non-leader prepares longer: the leader waits for it
        got[bind_id] = pool.conclude(ticket, timeout_s=5.0).encode()
        pool.settle(ticket)
    t = torch.full((2,), float(rank + 1))
    got["after"] = pool.member(2).all_reduce(t).tolist()  # the epoch agreed at d2
    time.sleep(1.0)  # both settled: no key of either bind is left
    got["left"] = [k for b in ("d1", "d2") for k in (f"flying/bind/{b}/decision",
                   f"flying/bind/{b}/arrive/1", f"flying/bind/{b}/read") if pool.store.check([k])]
    out.put((rank, got))


@pytest.mark.parametrize("shm_on", [True, False], ids=["shared-segment", "store-only"])
def test_no_vote_reason_reaches_every_member_and_keys_are_settled(shm_on):
    res = _two_engines(_votes, shm_on)
    for r in (0, 1):
        assert res[r]["shm"] is shm_on
        assert res[r]["d1"] == "abort:member lacks KV capacity"
        assert res[r]["d2"].startswith("go:")
        assert res[r]["after"] == [3.0, 3.0]
        assert res[r]["left"] == []
    assert res[0]["d2"] == res[1]["d2"]  # the same epoch base on both


def test_tokens_are_stable_and_distinct():
    from flying.substrate.bind_handshake import token

    ids = [f"{i:012x}" for i in range(2000)]
    tokens = [token(b) for b in ids]
    assert len(set(tokens)) == len(ids)
    assert all(0 < t < 2**62 for t in tokens)
    assert token("00000000abcd") == token("00000000abcd")


def _control(address, rank, out):
    pool = CommPool.create(address, rank, 2, [2], prefix="ctl")
    m = pool.member(2)
    big = [0, 1, 2**16 - 1, 2**16, 2**47 + 12345, 0xFFFFFFFFFFFF]
    mine = big if rank == 0 else [7] * len(big)
    out.put((rank, {
        "shm": m.shm is not None,
        "shared": m.share_ints(mine, len(big), own=rank + 1),
        # packed counts above float32's exact range (2**24): every bit kept
        "packed": m.share_ints([1], 1, own=(1 << 32) + (1 << 24) + (1 << 8) + 1)[1],
        "min": m.min_int(5 if rank == 0 else 3),
    }))


def test_share_ints_is_exact_and_min_agrees():
    """The per-step control exchange (leader's ints through shared memory) is exact for
    48-bit bind ids; the admission agreement is a MIN over members."""
    res = _two_engines(_control)
    want = [0, 1, 2**16 - 1, 2**16, 2**47 + 12345, 0xFFFFFFFFFFFF]
    for r in (0, 1):
        assert res[r]["shm"]
        assert res[r]["shared"] == (want, 3)  # leader's values; own: 1 + 2
        assert res[r]["packed"] == 2 * ((1 << 32) + (1 << 24) + (1 << 8) + 1)
        assert res[r]["min"] == 3


def test_admission_offers_only_the_head_of_the_queue_for_the_same_group():
    from collections import deque

    from flying.session.admission import MAX_PER_STEP, bind_key, candidates
    from flying.session.messages import Bind

    def b(i, ranks=(0, 1)):
        return Bind(f"{i:012x}", len(ranks), ranks, req=None, issued_at=0.0)

    session = b(0)
    q = deque([b(1), b(2), b(3, (0, 1, 2, 3)), b(4)])
    assert candidates(q, session) == [1, 2]  # stops at the bind for another group
    assert candidates(deque([b(9, (2, 3))]), session) == []
    many = deque(b(i) for i in range(1, MAX_PER_STEP + 20))
    assert candidates(many, session) == list(range(1, MAX_PER_STEP + 1))
    # a burst of 24 joins at one boundary, as SGLang's own scheduler prefills it at once
    burst = deque(b(i) for i in range(1, 25))
    assert candidates(burst, session) == list(range(1, 25))
    assert bind_key(b(0xABCDEF)) == 0xABCDEF


def _fault(address, rank, out):
    """Rank 1 leaves a collective its peer entered (a fault mid-step) and poisons the
    group; rank 0 must raise at once, and after the next rendezvous both must agree on
    the shared-memory epoch again."""
    from flying.substrate.shm_allreduce import ShmAllReduceError

    pool = CommPool.create(address, rank, 2, [2], prefix="fault")
    m = pool.member(2)
    m.all_reduce(torch.ones(8))
    woke = None
    if rank == 0:
        t0 = time.perf_counter()
        try:
            m.all_reduce(torch.ones(8))  # rank 1 never enters this one
        except ShmAllReduceError:
            woke = time.perf_counter() - t0
    else:
        time.sleep(0.3)
        m.poison()
    verdict = pool.rendezvous("f1", 2, vote="", timeout_s=5.0)
    after = m.all_reduce(torch.full((8,), float(rank + 1))).tolist()
    ids = torch.tensor([rank * 10 + 1, rank * 10 + 2])
    m.share_tokens_(ids)
    out.put((rank, {"woke": woke, "go": verdict.go, "after": after, "ids": ids.tolist()}))


def test_poisoned_group_wakes_peers_and_resyncs_at_the_next_bind():
    res = _two_engines(_fault)
    assert res[0]["woke"] is not None and res[0]["woke"] < 2.0
    assert res[0]["go"] and res[1]["go"]
    assert res[0]["after"] == res[1]["after"] == [3.0] * 8
    assert res[0]["ids"] == res[1]["ids"] == [1, 2]  # the leader's tokens everywhere


def test_wait_until_sees_a_flip_and_gives_up_after_its_timeout():
    from flying.substrate.bind_handshake import _wait_until

    calls = []

    def flips_on_the_fifth_poll() -> bool:
        calls.append(1)
        return len(calls) >= 5

    assert _wait_until(flips_on_the_fifth_poll, timeout_s=5.0)
    t0 = time.perf_counter()
    assert not _wait_until(lambda: False, timeout_s=0.02)  # past the patient phase too
    assert time.perf_counter() - t0 >= 0.02
