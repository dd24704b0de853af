"""Long-context upgrade without a server: who asks, when, where to, how far it may grow,
and the KV scatter from a member other than the leader."""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from flying.session import join, join_wire, upgrade
from flying.session.admission import UPGRADE_OFFER, bind_key, candidates
from flying.session.budget import ADMISSION_SLACK
from flying.session.counters import EngineCounters
from flying.session.messages import Bind, Upgrade
from flying.substrate import kv_relayout
from flying.substrate.layout import KvSplit
from scheduler.policy import Node, Policy, PolicyConfig

pytestmark = pytest.mark.unit


class _Req:
    """The parts of SGLang's Req a watch reads (weak-referenceable, like a Req)."""

    def __init__(self, rid: str, prompt: int, out: int, bound: int, done: bool = False):
        self.rid = rid
        self.origin_input_ids = [1] * prompt
        self.output_ids = [2] * out
        self.sampling_params = SimpleNamespace(max_new_tokens=bound)
        self.kv = SimpleNamespace(kv_allocated_len=prompt + out - 1)
        self.grammar = None
        self._done = done

    def finished(self) -> bool:
        return self._done


def _watch(enabled=True):
    watch = upgrade.Watch(0, enabled, EngineCounters())
    asked: list[str] = []
    watch.ask = asked.append
    return watch, asked


def _scheduler(*reqs, limit=None):
    return SimpleNamespace(running_batch=SimpleNamespace(reqs=list(reqs)), max_new_tokens_limit=limit)


def test_a_request_without_a_bound_asks_once_near_its_engines_limit():
    watch, asked = _watch()
    far = _Req("far", 40, 10, 300)
    near = _Req("near", 40, 300 - upgrade.AHEAD, 300)
    bounded = _Req("bounded", 40, 299, 300)
    sched = _scheduler(far, near, bounded)
    watch.note(sched, far, True)
    watch.note(sched, near, True)
    watch.note(sched, bounded, False)  # came with max_new_tokens of its own
    watch.check(sched)
    watch.check(sched)
    assert asked == ["near"]
    far.output_ids = [2] * (300 - upgrade.AHEAD)  # decoded on: within AHEAD now too
    far.kv.kv_allocated_len = 40 + len(far.output_ids) - 1
    watch.check(sched)
    assert asked == ["near", "far"]


def test_no_ask_when_groups_cannot_help_an_operator_bound_or_the_request_ended():
    watch, asked = _watch(enabled=False)
    req = _Req("r", 40, 299, 300)
    watch.note(_scheduler(req), req, True)
    watch.check(_scheduler(req))
    watch, asked2 = _watch()
    limited = _scheduler(req, limit=300)  # SGLANG_MAX_NEW_TOKENS_LIMIT
    watch.note(limited, req, True)
    watch.check(limited)
    done = _Req("d", 40, 299, 300, done=True)
    watch.note(_scheduler(done), done, True)
    watch.check(_scheduler(done))
    assert asked == [] and asked2 == []


def test_the_policy_upgrades_to_the_smallest_degree_around_the_holder():
    node = Node(4, (2, 4), engine_capacity=395, engine_slots=400, group_slack=4)
    policy = Policy(PolicyConfig("static-dp"), node)
    assert (policy.upgrade(3).mode, policy.upgrade(3).degree) == ("tp", 2)
    assert Policy(PolicyConfig("manual"), node).upgrade(0).mode == "dp"
    assert Policy(PolicyConfig(), Node(2, (), 395)).upgrade(0).mode == "dp"
    capped = Node(2, (2,), engine_capacity=395, engine_slots=400, context_limit=395)
    assert Policy(PolicyConfig(), capped).upgrade(1).mode == "dp"  # the context bounds it


def test_a_group_s_request_goes_to_the_larger_group_around_it():
    """TP -> TP: a request outgrowing the TP-2 group engine 2 leads goes to the TP-4
    group around it; nothing larger than TP-4, or a context TP-2 already reaches, keeps
    it where it is (it ends at the group's limit)."""
    node = Node(4, (2, 4), engine_capacity=395, engine_slots=400, group_slack=4)
    policy = Policy(PolicyConfig(), node)
    grown = policy.upgrade(2, current=2)
    assert (grown.mode, grown.degree) == ("tp", 4)
    assert policy.upgrade(0, current=4).mode == "dp"
    assert "TP-4 group" in policy.upgrade(0, current=4).reason
    capped = Node(4, (2, 4), engine_capacity=395, engine_slots=400, group_slack=4,
                  context_limit=796)
    assert Policy(PolicyConfig(), capped).upgrade(0, current=2).mode == "dp"
    six = Node(6, (2, 4), engine_capacity=395, engine_slots=400, group_slack=4)
    assert Policy(PolicyConfig(), six).upgrade(4, current=2).mode == "dp"  # no aligned TP-4


def test_a_group_whose_engines_serve_another_group_is_not_asked_for():
    """Its members would wait in the bind for that other session to end (their DP work
    with them): the request stays where it is. Its own group and a session of the
    group asked for (which takes it in) do not block."""
    node = Node(4, (2, 4), engine_capacity=395, engine_slots=400, group_slack=4)
    policy = Policy(PolicyConfig(), node)
    other = policy.upgrade(0, current=2, busy={0: 2, 1: 2, 2: 2, 3: 2})
    assert other.mode == "dp" and "engine 2 serves another group" in other.reason
    own = policy.upgrade(0, current=2, busy={0: 2, 1: 2})
    assert (own.mode, own.degree) == ("tp", 4)
    assert policy.upgrade(1, busy={0: 2, 1: 2}).degree == 2  # its group's session takes it
    # engine 0 serves the TP-4 group: not TP-2 {0, 1}, but the TP-4 session takes it in
    into_tp4 = policy.upgrade(1, busy={0: 4, 1: 4, 2: 4, 3: 4})
    assert (into_tp4.mode, into_tp4.degree) == ("tp", 4)
    two = Node(4, (2,), engine_capacity=395, engine_slots=400, group_slack=4)
    blocked = Policy(PolicyConfig(), two).upgrade(1, busy={0: 4})
    assert blocked.mode == "dp" and "engine 0" in blocked.reason
    assert policy.upgrade(3, busy={0: 2, 1: 2}).degree == 2  # the other pair is free


def test_a_group_lets_it_grow_to_what_every_member_can_give():
    assert upgrade.new_total(400, 2, 400, 8191) == 800 - ADMISSION_SLACK
    assert upgrade.new_total(250, 2, 400, 8191) == 500 - ADMISSION_SLACK  # a busy member
    assert upgrade.new_total(900, 2, 400, 8191) == 800 - ADMISSION_SLACK  # no more than a pool
    assert upgrade.new_total(400, 4, 400, 1000) == 1000  # nor the model's context
    assert upgrade.new_total(0, 2, 400, 8191) == 0


def test_an_upgrade_bind_is_offered_alone_to_a_running_session_of_its_group():
    """A member's DP request that outgrows its engine while the group's session runs
    joins that session: its bind is offered alone, at the head of the queue, marked so
    that a member it has not reached yet knows the kind; never behind new requests, nor
    to a session of another group."""
    ask = Upgrade("long", 1, 0.0)
    session = Bind("a" * 12, 2, (0, 1), SimpleNamespace(rid="x"), 0.0)
    up = Bind("b" * 12, 2, (0, 1), None, 0.0, "long", ask)
    after = Bind("c" * 12, 2, (0, 1), SimpleNamespace(rid="y"), 0.0)
    assert candidates(deque([up, after]), session) == [bind_key(up) + UPGRADE_OFFER]
    assert candidates(deque([after, up]), session) == [bind_key(after)]
    other = Bind("d" * 12, 2, (2, 3), SimpleNamespace(rid="z"), 0.0)
    assert candidates(deque([up]), other) == []
    assert bind_key(up) < UPGRADE_OFFER
    assert up.rid == "long" and after.rid == "y"


class _Broadcast:
    """``kv_relayout.broadcast`` over threads: the source's block (or its piece)."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world)
        self.block = None

    def __call__(self, member, block, src, part=None):
        if member.tp_rank == src:
            self.block = block.clone()
        self.barrier.wait()
        out = (self.block if part is None else self.block[part]).clone()
        self.barrier.wait()
        return out


@pytest.mark.parametrize(("degree", "src", "heads"), [(2, 0, 8), (2, 1, 8), (4, 2, 8), (4, 3, 8), (4, 1, 2)])
def test_each_member_gets_its_heads_from_whichever_member_holds_the_request(monkeypatch, degree, src, heads):
    layers, tokens, dim = 2, 5, 3
    block = torch.randn(layers, 2, tokens, heads, dim)
    monkeypatch.setattr(kv_relayout, "broadcast", _Broadcast(degree))
    pool = SimpleNamespace(k_buffer=[torch.zeros(16, heads, dim)] * layers)
    sched = SimpleNamespace(tp_worker=SimpleNamespace(model_runner=SimpleNamespace(token_to_kv_pool=pool)))
    got: dict[int, torch.Tensor] = {}

    def run(rank: int) -> None:
        member = SimpleNamespace(tp_rank=rank, shm=None)  # no segment: the stacked broadcast
        got[rank] = join_wire.scatter(member, block if rank == src else None, sched, tokens, degree, src)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(degree)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(got) == degree, "a member's scatter failed (its thread died)"
    for rank in range(degree):
        split = KvSplit(heads, degree)  # with 2 heads on 4 ranks each head lives on 2
        assert torch.equal(got[rank], kv_relayout.shard_of(block, split.shard(rank), split.shards))


def test_a_join_that_cannot_go_back_to_dp_frees_its_slots_and_answers(monkeypatch):
    """The last resort of a failed join (``join.restore``): when even putting the
    requests back into DP fails after it took DP slots, the slots go back to the
    allocator (else SGLang's leak check stops the engine) and every request gets an
    explicit error."""
    freed, aborted = [], []
    slots = torch.arange(7)
    sched = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(free=lambda req: None),
        token_to_kv_pool_allocator=SimpleNamespace(free=freed.append),
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(token_to_kv_pool=None)),
    )
    monkeypatch.setattr(join.tp_scope, "take_dp_slots", lambda scheduler, tokens: slots)

    def broken(*args):
        raise RuntimeError("write failed")

    monkeypatch.setattr(join, "_place", broken)
    monkeypatch.setattr(join, "abort", lambda scheduler, reqs, message: aborted.append((reqs, message)))
    req = SimpleNamespace(kv=SimpleNamespace(holds_kv=False), sampling_params=SimpleNamespace(max_new_tokens=9))
    joining = join.Joining([req], [7], None, [], 0.0, torch.zeros(1), source=True)
    join.restore(sched, joining)
    assert len(freed) == 1 and freed[0] is slots
    assert aborted and aborted[0][0] == [req] and "write failed" in aborted[0][1]


def test_a_move_to_dp_whose_write_fails_frees_the_dp_slots_it_took(monkeypatch):
    """``move._land``: DP slots taken for moved requests go back to the allocator when
    writing their rows fails (the error then ends the session, as any fault does)."""
    from flying.session import move

    freed = []
    slots = torch.arange(5)
    sched = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(free=freed.append))
    scope = SimpleNamespace(release_all=lambda: None, dp_pool=None,
                            prepared=SimpleNamespace(split=KvSplit(8, 2)))
    monkeypatch.setattr(move.tp_scope, "take_dp_slots", lambda scheduler, tokens: slots)

    def broken(*args):
        raise RuntimeError("write failed")

    monkeypatch.setattr(kv_relayout, "write_shards", broken)
    with pytest.raises(RuntimeError, match="write failed"):
        move._land(sched, scope, None, [object()], [5], [torch.zeros(1), torch.zeros(1)], None)
    assert len(freed) == 1 and freed[0] is slots


def _session(ranks=(0, 1), leader=True, growable=("a",)):
    bind = Bind("e" * 12, len(ranks), ranks, SimpleNamespace(rid="s"), 0.0)
    return SimpleNamespace(bind=bind, is_leader=leader, growable=set(growable))


def test_a_group_s_lone_request_asks_for_a_larger_group_near_its_bound():
    """The leader asks once, for the session's only request, near its group bound, and
    only where a larger group exists (``regroup.ask``)."""
    from flying.session import regroup

    def engine(degrees=(2, 4)):
        asked: list = []
        watch = SimpleNamespace(ask=lambda rid, from_degree: asked.append((rid, from_degree)))
        return SimpleNamespace(watch=watch, prepared=dict.fromkeys(degrees)), asked

    near = _Req("a", 40, 700 - upgrade.AHEAD, 700)
    sched = SimpleNamespace(running_batch=SimpleNamespace(reqs=[near]), waiting_queue=[])
    eng, asked = engine()
    s = _session()
    regroup.ask(eng, sched, s)
    regroup.ask(eng, sched, s)
    assert asked == [("a", 2)]  # once
    for s, eng_sched in (
        (_session(leader=False), sched),  # the leader asks for the group
        (_session(growable=()), sched),  # it came with a bound of its own
        (_session(), SimpleNamespace(running_batch=SimpleNamespace(reqs=[near, _Req("b", 4, 1, 9)]),
                                     waiting_queue=[])),  # not alone
        (_session(), SimpleNamespace(running_batch=SimpleNamespace(reqs=[_Req("a", 40, 10, 700)]),
                                     waiting_queue=[])),  # far from its bound
    ):
        eng, asked = engine()
        regroup.ask(eng, eng_sched, s)
        assert asked == []
    eng, asked = engine(degrees=(2,))
    regroup.ask(eng, sched, _session())
    assert asked == []  # no larger group on this node


def test_a_member_parks_only_for_the_larger_group_around_its_own():
    from flying.session import regroup

    s = _session()
    up = Upgrade("a", 0, 0.0, from_degree=2)

    def parking(*pending):
        return regroup.parking(SimpleNamespace(pending=deque(pending)), s)

    tp4 = Bind("f" * 12, 4, (0, 1, 2, 3), None, 0.0, "long", up)
    assert parking(tp4)
    assert not parking()  # nothing pending
    assert not parking(Bind("1" * 12, 2, (0, 1), SimpleNamespace(rid="n"), 0.0), tp4)  # not the head
    assert not parking(Bind("f" * 12, 4, (4, 5, 6, 7), None, 0.0, "long", up))  # not around it
    dp_ask = Upgrade("a", 0, 0.0)
    assert not parking(Bind("f" * 12, 4, (0, 1, 2, 3), None, 0.0, "long", dp_ask))  # a DP ask


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets are Linux's")
def test_the_upgrade_socket_leaves_no_file_behind(monkeypatch):
    """The controller's ask socket is in Linux's abstract namespace: a server killed
    any way leaves nothing in the temp directory (one file per launch piled up)."""
    import tempfile

    import zmq

    from flying.session.messages import SECRET_ENV, upgrade_endpoint

    monkeypatch.setenv(SECRET_ENV, "0123456789abcdef0123456789abcdef")
    address = upgrade_endpoint()
    before = set(os.listdir(tempfile.gettempdir()))
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind(address)
        push.connect(address)
        push.send(b"ask")
        assert pull.recv() == b"ask"
        assert set(os.listdir(tempfile.gettempdir())) - before == set()
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


def test_sglang_does_not_sleep_on_idle_while_flying_holds_work(monkeypatch):
    """SGLang's idle sleep polls the engine's sockets for up to 1 s; a bind Flying took
    off the socket (or a parked request) is no longer there, so the engine must not
    sleep on it (measured: a TP-2 -> TP-4 upgrade waited 1006 ms, 3.9 ms without)."""
    from flying.session.engine import FlyingEngine
    from sglang_patches import scheduler as hooks

    engine = FlyingEngine(0, None, 1.0)
    monkeypatch.setattr(hooks, "get_engine", lambda: engine)
    slept: list[int] = []

    def sleep(_scheduler):
        slept.append(1)

    hooks.maybe_sleep_on_idle(sleep, None)
    assert slept == [1]  # nothing held: SGLang sleeps as without Flying
    for hold in ("pending", "deferred", "parked"):
        engine.pending.clear()
        engine.deferred, engine.parked = [], None
        if hold == "pending":
            engine.pending.append(Bind("a" * 12, 2, (0, 1), SimpleNamespace(rid="x"), 0.0))
        elif hold == "deferred":
            engine.deferred = [object()]
        else:
            engine.parked = object()
        assert engine.holds_work
        hooks.maybe_sleep_on_idle(sleep, None)
    assert slept == [1]
