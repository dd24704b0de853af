"""A group boundary where DP work reached a member during the last step
(``Lifecycle._tp_form``): the boundary's offer shares the arrival, so every member
admits none of the binds just offered and the session moves to DP at this boundary.

The collectives, admission, the move and SGLang's batch formation are test doubles
(the calls ``_tp_form`` makes, recorded); the decision and its order are the engine's
own code. A live group moving for DP work: ``tests/integration/test_move.py`` and
``tests/integration/test_adaptive.py``."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from flying.session import exchange, lifecycle
from flying.session.admission import bind_key
from flying.session.engine import FlyingEngine
from flying.session.group import GroupSession

pytestmark = pytest.mark.unit


def _bind(bind_id: str = "b1"):
    return SimpleNamespace(bind_id=bind_id, ranks=(0, 1), degree=2, upgrade=None,
                           reason="policy", issued_at=0.0, req=None)


def _session(dp_arrived: bool, shared_arrived: int = 0) -> GroupSession:
    scope = SimpleNamespace(admitting=True, reasons={"policy"}, entered=True)
    s = GroupSession(_bind("b0"), member=object(), scope=scope, is_leader=True)
    s.dp_arrived = dp_arrived
    s.shared = exchange.Shared([], [], 0, dp_arrived=shared_arrived)
    return s


def _engine():
    engine = FlyingEngine(dp_rank=0, pool=None, bind_timeout_s=1.0)
    engine.pending = deque([_bind("b1"), _bind("b2")])
    return engine


def _run(monkeypatch, engine, s, peers_arrived: int):
    """One ``_tp_form``; returns what it called: admitted binds, a move, a batch."""
    calls: dict = {"admitted": None, "moved": False, "formed": False}
    running = SimpleNamespace(reqs=[], is_empty=lambda: False)
    scheduler = SimpleNamespace(waiting_queue=[], running_batch=running, last_batch=None,
                                chunked_req=None)

    def offer(member, offers, arrived=False):
        return list(offers), int(arrived) + peers_arrived

    def admit(engine_, sched, member, scope, offers):
        calls["admitted"] = list(offers)
        return len(offers)

    def to_dp(*args, **kwargs):
        calls["moved"] = True
        return SimpleNamespace(requests=1)

    def form(sched, original):
        calls["formed"] = True
        return SimpleNamespace(batch_to_run=SimpleNamespace(), running_batch=sched.running_batch)

    monkeypatch.setattr(lifecycle.exchange, "offer", offer)
    monkeypatch.setattr(lifecycle.admission, "admit", admit)
    monkeypatch.setattr(lifecycle.move, "ready", lambda sched: True)
    monkeypatch.setattr(lifecycle.move, "to_dp", to_dp)
    monkeypatch.setattr(lifecycle, "_form", form)
    monkeypatch.setattr(lifecycle.regroup, "ask", lambda *a: None)
    monkeypatch.setattr(engine, "_holds", lambda sched, s_: False)
    monkeypatch.setattr(engine, "_moved", lambda sched, s_, moved: None)
    monkeypatch.setattr(engine, "publish", lambda *a, **k: None)
    monkeypatch.setattr(lifecycle.exchange, "exchange",
                        lambda *a, **k: exchange.Shared([], [], 0))
    engine._tp_form(scheduler, s, original=None)
    return calls


@pytest.mark.parametrize("mine, peers", [(True, 0), (False, 1)])
def test_dp_work_seen_at_the_offer_admits_nothing_and_moves_at_this_boundary(monkeypatch, mine, peers):
    """Whichever member saw the arrival, the offer's count tells both: the binds
    offered at this boundary stay out (stale: ``left_at`` is set, so they are voted
    down and served in DP) and the session moves to DP now."""
    engine, s = _engine(), _session(dp_arrived=mine)
    calls = _run(monkeypatch, engine, s, peers_arrived=peers)
    assert calls["admitted"] is None and calls["moved"] and not calls["formed"]
    assert engine.left_at > 0
    assert all(engine.left_at > b.issued_at for b in engine.pending)


def test_without_dp_arrivals_the_offered_binds_are_admitted(monkeypatch):
    engine, s = _engine(), _session(dp_arrived=False)
    calls = _run(monkeypatch, engine, s, peers_arrived=0)
    assert calls["admitted"] == [bind_key(b) for b in engine.pending]
    assert not calls["moved"] and calls["formed"] and engine.left_at == 0.0


def test_a_session_that_may_not_move_keeps_admitting(monkeypatch):
    """``--flying-move-to-dp off`` (or a session for a priority request): DP arrivals
    are served between group steps; the group goes on taking its binds."""
    engine, s = _engine(), _session(dp_arrived=True)
    engine.move_to_dp = "off"
    calls = _run(monkeypatch, engine, s, peers_arrived=1)
    assert calls["admitted"] == [bind_key(b) for b in engine.pending]
    assert not calls["moved"]
