"""The bounded bind handshake and group collectives, across real processes (no SGLang)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from flying.comm_pool import CommPool, host_store

pytestmark = pytest.mark.unit


def _member(address, rank, engines, binds, delays, out):
    pool = CommPool.create(address, rank, engines, [2], prefix="t")
    t = torch.full((4,), float(rank + 1))
    pool.member(2).all_reduce(t)
    results = [t.tolist()]
    for bind_id, delay in zip(binds, delays[rank], strict=True):
        time.sleep(delay)
        results.append(pool.rendezvous(bind_id, 2, ok=True, timeout_s=0.5))
    out.put((rank, results))


def _run(delays, binds):
    store, address = host_store()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_member, args=(address, r, 2, binds, delays, out)) for r in range(2)
    ]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    del store
    return results


def test_group_all_reduce_and_agreed_decisions():
    # bind a: both on time -> go; bind b: the non-leader is 2 s late -> both abort
    # (the leader decides after 0.5 s; the late member reads that decision)
    res = _run(delays={0: [0.0, 0.0], 1: [0.0, 2.0]}, binds=["a", "b"])
    assert res[0][0] == res[1][0] == [3.0] * 4
    assert res[0][1] == res[1][1] == "go"
    assert res[0][2] == res[1][2]
    assert res[0][2].startswith("abort:") and "did not arrive" in res[0][2]


def test_leader_late_means_member_aborts_and_leader_agrees():
    res = _run(delays={0: [2.5], 1: [0.0]}, binds=["c"])
    assert res[0][1] == res[1][1]
    assert res[1][1].startswith("abort:")
