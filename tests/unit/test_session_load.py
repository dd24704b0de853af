"""Load snapshots count a group session's requests once, on its leader, in either state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flying.session.engine import FlyingEngine
from flying.substrate.toggle import Toggle

pytestmark = pytest.mark.unit


def _engine(is_leader: bool, entered: bool) -> FlyingEngine:
    """An engine with 3 DP requests (2 running, 1 waiting) and a session of 2 (1 + 1)."""
    scheduler = SimpleNamespace(
        running_batch=SimpleNamespace(reqs=["d1", "d2"]), waiting_queue=["d3"]
    )
    state = Toggle([
        (scheduler, "running_batch", SimpleNamespace(reqs=["t1"])),
        (scheduler, "waiting_queue", ["t2"]),
    ])
    if entered:
        state.enter()
    scope = SimpleNamespace(scheduler=scheduler, state=state, entered=state.entered)
    engine = FlyingEngine(dp_rank=0 if is_leader else 1, pool=None, bind_timeout_s=1.0)
    engine.session = SimpleNamespace(scope=scope, is_leader=is_leader)
    return engine


def _sglang_snapshot(engine):
    """What SGLang's inquirer reports: the current state's batch and queue only."""
    sched = engine.session.scope.scheduler
    return SimpleNamespace(
        num_running_reqs=len(sched.running_batch.reqs), num_waiting_reqs=len(sched.waiting_queue)
    )


@pytest.mark.parametrize("entered", [False, True])
def test_leader_counts_its_dp_work_and_the_session(entered):
    engine = _engine(is_leader=True, entered=entered)
    snap = engine.count_session(_sglang_snapshot(engine))
    assert (snap.num_running_reqs, snap.num_waiting_reqs) == (3, 2)


@pytest.mark.parametrize("entered", [False, True])
def test_member_counts_only_its_dp_work(entered):
    engine = _engine(is_leader=False, entered=entered)
    snap = engine.count_session(_sglang_snapshot(engine))
    assert (snap.num_running_reqs, snap.num_waiting_reqs) == (2, 1)


def test_no_session_leaves_the_snapshot_alone():
    engine = FlyingEngine(dp_rank=0, pool=None, bind_timeout_s=1.0)
    snap = SimpleNamespace(num_running_reqs=4, num_waiting_reqs=1)
    assert engine.count_session(snap) is snap and snap.num_running_reqs == 4


def _bind(ranks: tuple[int, ...], req: object = "req"):
    return SimpleNamespace(ranks=ranks, req=req)


def test_waiting_binds_count_on_their_leader_and_the_stamp_is_the_last_input():
    engine = FlyingEngine(dp_rank=0, pool=None, bind_timeout_s=1.0)
    engine.pending.extend([_bind((0, 1)), _bind((0, 1)), _bind((2, 3)), _bind((0, 1), req=None)])
    snap = SimpleNamespace(num_running_reqs=1, num_waiting_reqs=1, timestamp=99.0)
    assert engine.count_load(snap).timestamp == 99.0  # no input taken yet: SGLang's own
    engine.before_input(SimpleNamespace(), [])
    snap = engine.count_load(SimpleNamespace(num_running_reqs=1, num_waiting_reqs=1, timestamp=99.0))
    # two placement binds led here (an upgrade's bind, req None, runs already)
    assert (snap.num_running_reqs, snap.num_waiting_reqs) == (1, 3)
    assert snap.timestamp == engine.received_at > 0
