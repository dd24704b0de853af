"""Holding a group's arrival while its running requests finish (``scheduler.hold``), and
the simulator's group doing the same."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from flying.node.config import FlyingConfig
from scheduler.hold import HOLD_STEPS, holds
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


def _pair(first_tokens: int, hold_steps: int):
    """Two requests in one TP-2 group (static-tp): B arrives one step after A's first
    token. Steps of 8 ms, prefills of 40."""
    profile = flat(5.0, 8.0, prefill_ms=40.0)
    trace = [TraceRequest(0, 0.0, 100, first_tokens), TraceRequest(1, 0.052, 100, 8)]
    cfg = policy_settings("static-tp", replace(FlyingConfig(), hold_steps=hold_steps))
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
