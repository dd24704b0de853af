"""Holding a group's arrival while its running requests finish (``scheduler.hold``), and
the simulator's group doing the same."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from flying.node.config import FlyingConfig
from flying.session.hold_view import note_slos, pace_ms
from scheduler.hold import HOLD_STEPS, Running, holds, pause_breaks, tpot
from tests.unit.test_simulate import flat
from workloads.load.trace import TraceRequest
from workloads.sim.run import policy_settings, simulate

pytestmark = pytest.mark.unit


def test_holds_only_while_every_running_request_fits_in_the_steps_left():
    assert holds([3, 8], 0, 8)
    assert not holds([3, 9], 0, 8)  # one would still run past the bound
    assert holds([2], 5, 8) and not holds([4], 5, 8)  # 3 of 8 steps left
    assert not holds([], 0, 8)  # nothing decodes: nothing to protect
    assert not holds([1], 0, 0)  # --flying-hold-steps 0


def test_a_hold_is_bounded_and_never_partial():
    """Stepping a group as a session does (one token a step off every running request,
    ``held`` counting the boundaries): once an arrival is held, it stays held until
    every running request has finished, and never longer than the bound."""
    rng = random.Random(7)
    for _ in range(2000):
        bound = rng.randint(0, 12)
        left = [rng.randint(1, 20) for _ in range(rng.randint(1, 5))]
        held = 0
        while holds(left, held, bound):
            held += 1
            left = [n - 1 for n in left if n > 1]
        assert held <= bound
        assert held == 0 or not left  # a hold that started ran until they were done


def test_a_request_s_tpot_is_its_pace_so_far_the_steps_to_come_and_the_pause():
    r = Running(left=4, out=5, pace_ms=10.0, slo_tpot_ms=20.0)
    assert tpot(r, 8.0, 0.0) == pytest.approx((10 * 4 + 8 * 4) / 8)
    assert tpot(r, 8.0, 80.0) == pytest.approx((10 * 4 + 8 * 4 + 80) / 8)
    fresh = Running(left=8, out=1, pace_ms=0.0, slo_tpot_ms=20.0)  # one token: the step's
    assert tpot(fresh, 8.0, 0.0) == pytest.approx(8.0)


def test_a_hold_pays_only_where_the_pause_leaves_a_request_past_its_tpot_slo():
    near = Running(left=3, out=6, pace_ms=10.0, slo_tpot_ms=20.0)  # 8 intervals
    assert not pause_breaks([near], 40.0, 10.0)  # 10 + 40 / 8 = 15 ms a token
    assert pause_breaks([near], 120.0, 10.0)  # 10 + 120 / 8 = 25
    long = Running(left=3, out=197, pace_ms=10.0, slo_tpot_ms=20.0)
    assert not pause_breaks([long], 1000.0, 10.0)  # one second over 199 tokens: +5 ms
    assert pause_breaks([long, near], 120.0, 10.0)  # any one of them
    slow = Running(left=3, out=6, pace_ms=30.0, slo_tpot_ms=20.0)  # past it already
    assert pause_breaks([slow], 1.0, 30.0)  # still spared the pause
    assert not pause_breaks([Running(1, 0, 0.0, 1.0)], 1e6, 10.0)  # one token: no TPOT


def test_what_the_hold_cannot_price_leaves_the_step_bound_to_decide():
    near = Running(left=3, out=6, pace_ms=10.0, slo_tpot_ms=20.0)
    assert pause_breaks([near], None, 10.0)  # no prefill measured
    assert pause_breaks([near], 40.0, None)  # no step measured
    assert pause_breaks([replace(near, slo_tpot_ms=0.0)], 40.0, 10.0)  # no SLO known


def _pair(first_tokens: int, hold_steps: int, slo_tpot: float = 0.0):
    """Two requests in one TP-2 group (static-tp): B arrives one step after A's first
    token. Steps of 8 ms, prefills of 40; ``slo_tpot``: the node's (0: none)."""
    profile = flat(5.0, 8.0, prefill_ms=40.0)
    trace = [TraceRequest(0, 0.0, 100, first_tokens), TraceRequest(1, 0.052, 100, 8)]
    cfg = policy_settings("static-tp", replace(FlyingConfig(), hold_steps=hold_steps,
                                               slo_tpot=slo_tpot))
    return simulate(trace, profile, 2, cfg).records


def test_the_simulated_group_holds_an_arrival_behind_a_request_near_its_end():
    a, b = _pair(6, HOLD_STEPS)
    a0, b0 = _pair(6, 0)
    assert all(r.flying["mode"] == "tp" for r in (a, b, a0, b0))
    assert max(a0.itl_s) >= 0.040  # without the hold, B's prefill pauses A
    assert max(a.itl_s) < 0.040  # with it, A streams on to its end
    assert b.ttft_s > b0.ttft_s  # what B pays: the steps it waited
    assert b.ttft_s - b0.ttft_s <= HOLD_STEPS * 0.008 + 1e-9
    # A request with more left than the bound is paused as before
    long, _ = _pair(40, HOLD_STEPS)
    assert max(long.itl_s) >= 0.040


def test_the_simulated_group_admits_at_once_where_the_pause_leaves_the_slo_met():
    """A 6-token request at 8 ms a token and one 40-ms prefill: 8 + 40 / 5 = 16 ms a
    token. Under a 20 ms TPOT SLO the pause is harmless and B is admitted at once; under
    a 12 ms one B waits for A as without SLOs."""
    loose, _ = _pair(6, HOLD_STEPS, slo_tpot=20.0)
    tight, _ = _pair(6, HOLD_STEPS, slo_tpot=12.0)
    assert max(loose.itl_s) >= 0.040  # B's prefill paused A
    assert max(tight.itl_s) < 0.040  # held: A streamed on


def test_a_request_s_pace_is_read_from_sglang_s_timestamps():
    def req(n, first, last):
        stats = SimpleNamespace(prefill_finished_time=first, last_decode_finish_time=last)
        return SimpleNamespace(output_ids=[0] * n, time_stats=stats)

    assert pace_ms(req(5, 10.0, 10.2)) == pytest.approx(50.0)  # 4 intervals in 200 ms
    assert pace_ms(req(1, 10.0, 10.0)) == 0.0  # one token: no interval yet
    assert pace_ms(req(5, 0.0, 10.2)) == 0.0  # no first-token time
    assert pace_ms(SimpleNamespace(output_ids=[0, 0])) == 0.0  # no timestamps at all


def test_the_leader_keeps_the_slos_of_its_live_requests_only():
    """A session may serve thousands of requests: the map keeps the running, waiting,
    chunk-prefilled and arriving ones, and forgets the finished."""
    slos = {"done": 5.0, "run": 7.0, "wait": 3.0, "chunk": 4.0}
    sched = SimpleNamespace(chunked_req=SimpleNamespace(rid="chunk"),
                            waiting_queue=[SimpleNamespace(rid="wait")])
    binds = [SimpleNamespace(req=SimpleNamespace(rid="new"), slo_tpot_ms=9.0),
             SimpleNamespace(req=SimpleNamespace(rid="none"), slo_tpot_ms=0.0),
             SimpleNamespace(req=None, slo_tpot_ms=0.0)]  # an upgrade bind
    note_slos(slos, binds, sched, [SimpleNamespace(rid="run")])
    assert slos == {"run": 7.0, "wait": 3.0, "chunk": 4.0, "new": 9.0}
