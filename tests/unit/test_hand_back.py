"""``flying.session.hand_back``: where a group session is to end, its waiting requests
that have produced nothing and hold no KV leave it to start in DP, each on one member,
the same split on every member.

The scheduler, scope and engine here are test doubles of SGLang's and Flying's (their
queues, maps and the calls the function makes); a live group hands requests back in
``tests/integration/test_move.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flying.session import hand_back

pytestmark = pytest.mark.unit


def req(rid: str, prompt: int = 10, bound: int | None = 8, out: int = 0, kv: bool = False):
    return SimpleNamespace(
        rid=rid, origin_input_ids=[1] * prompt, output_ids=[2] * out,
        sampling_params=SimpleNamespace(max_new_tokens=bound),
        kv=SimpleNamespace(holds_kv=kv), customized_info=None,
    )


class Scheduler:
    """The TP state's queue while entered; what DP started, where."""

    def __init__(self, waiting: list):
        self.tp_waiting = waiting
        self.dp_waiting: list = []
        self.entered = True
        self.started: list[str] = []
        self.aborted: list[str] = []

    @property
    def waiting_queue(self) -> list:
        return self.tp_waiting if self.entered else self.dp_waiting

    @waiting_queue.setter
    def waiting_queue(self, value: list) -> None:
        if self.entered:
            self.tp_waiting = value
        else:
            self.dp_waiting = value

    def handle_generate_request(self, tokenized) -> None:
        assert not self.entered, "a handed-back request must start in the DP state"
        self.started.append(tokenized.rid)
        self.dp_waiting.append(req(tokenized.rid))

    def abort_request(self, abort) -> None:
        assert not self.entered
        self.aborted.append(abort.rid)


class Scope:
    def __init__(self, scheduler: Scheduler, rids: list[str]):
        self.scheduler = scheduler
        self.tokenized = {rid: SimpleNamespace(rid=rid) for rid in rids}
        self.handed = set(rids)

    def leave(self) -> None:
        self.scheduler.entered = False

    def enter(self) -> None:
        self.scheduler.entered = True


def engine(rank: int, aborted: tuple[str, ...] = (), kept: bool = False):
    processed = []
    result = SimpleNamespace(kept=kept, process=lambda scheduler: processed.append(
        scheduler.entered))
    return SimpleNamespace(
        dp_rank=rank, dp_limit=100, result=result, processed=processed,
        aborts=SimpleNamespace(hits=lambda rid: rid in aborted),
        counters=SimpleNamespace(handed_back=0),
    )


def session(scheduler: Scheduler, ranks=(0, 1)):
    rids = [r.rid for r in scheduler.tp_waiting]
    return SimpleNamespace(scope=Scope(scheduler, rids), bind=SimpleNamespace(
        ranks=ranks, bind_id="b"))


def test_only_requests_that_have_not_started_and_fit_one_engine_are_startable():
    waiting = [
        req("fresh"),
        req("retracted", out=3),  # produced tokens: resumes in the group
        req("holds-kv", kv=True),
        req("long", prompt=95, bound=8),  # prompt + bound beyond one engine (100)
        req("unbounded", prompt=60, bound=None),
        req("unbounded-long", prompt=100, bound=None),
    ]
    got = [r.rid for r in hand_back.startable(SimpleNamespace(waiting_queue=waiting), 100)]
    assert got == ["fresh", "unbounded"]


def test_the_split_is_the_same_on_every_member_and_covers_each_request_once():
    rids = [f"r{i}" for i in range(7)]
    ranks = (4, 5, 6, 7)
    shares = [hand_back.share(rids, ranks, r) for r in ranks]
    assert sorted(sum(shares, [])) == sorted(rids)
    assert shares[0] == ["r0", "r4"] and shares[3] == ["r3"]


def test_each_member_takes_all_out_of_the_group_and_starts_its_share_in_dp():
    results = []
    for rank in (0, 1):
        scheduler = Scheduler([req("a"), req("b", out=2), req("c"), req("d")])
        s = session(scheduler)
        eng = engine(rank, kept=True)
        started = hand_back.hand_back(eng, scheduler, s)
        assert scheduler.entered  # back in the TP state
        assert [r.rid for r in scheduler.tp_waiting] == ["b"]  # it stays in the group
        assert set(s.scope.tokenized) == {"b"} and s.scope.handed == {"b"}
        assert eng.processed == [True]  # the kept result, in the TP state, before leaving
        assert started == eng.counters.handed_back == len(scheduler.started)
        for r in scheduler.dp_waiting:
            assert r.customized_info["flying"][0]["degree"] == 1
        results.append(scheduler.started)
    assert results == [["a", "d"], ["c"]]


def test_a_request_the_member_saw_aborted_is_started_and_aborted_through_sglang():
    scheduler = Scheduler([req("a"), req("gone")])
    hand_back.hand_back(engine(0, aborted=("gone",)), scheduler, session(scheduler, (0,)))
    assert scheduler.started == ["a", "gone"] and scheduler.aborted == ["gone"]


def test_nothing_startable_changes_nothing():
    scheduler = Scheduler([req("running-again", out=1)])
    s = session(scheduler)
    eng = engine(0, kept=True)
    assert hand_back.hand_back(eng, scheduler, s) == 0
    assert eng.processed == [] and scheduler.entered and len(scheduler.tp_waiting) == 1


def bind(reason: str = "policy", issued_at: float = 10.0, bind_id: str = "00a1", upgrade=None):
    return SimpleNamespace(reason=reason, issued_at=issued_at, bind_id=bind_id,
                           upgrade=upgrade, ranks=(2, 3))


def test_a_policy_bind_issued_before_the_member_last_wanted_to_move_is_stale():
    eng = SimpleNamespace(move_to_dp="policy", left_at=20.0)
    assert hand_back.stale(eng, bind(issued_at=19.9))
    assert not hand_back.stale(eng, bind(issued_at=20.1))  # placed after: a new layout
    assert not hand_back.stale(eng, bind(reason="explicit", issued_at=1.0))  # the client's
    assert not hand_back.stale(eng, bind(upgrade=object(), issued_at=1.0))
    assert not hand_back.stale(SimpleNamespace(move_to_dp="off", left_at=20.0), bind())
    assert not hand_back.stale(SimpleNamespace(move_to_dp="policy", left_at=0.0), bind())


def test_stale_binds_run_in_dp_spread_over_their_members_and_others_on_the_leader():
    runners = {hand_back.runner(bind(bind_id=f"{i:04x}"), hand_back.STALE_VOTE) for i in range(8)}
    assert runners == {2, 3}
    assert hand_back.runner(bind(bind_id="0001"), "member lacks KV capacity") == 2
