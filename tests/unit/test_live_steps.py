"""The live memory of each mode's steps: a group that streamed slower than its
calibration promised is not formed for latency again."""

from __future__ import annotations

import pytest

from flying.node.costs_reader import merge
from flying.session.step_costs import LIVE_WINDOW, STRETCH_S, StepClock
from scheduler.costs import Costs
from scheduler.layout_choice import LayoutChooser, SwitchCosts
from scheduler.policy import EngineLoad, Node, Policy, PolicyConfig, Request
from scheduler.service import Slo
from tests.unit.test_goodput import S35_COSTS, S35_TRAFFIC

pytestmark = pytest.mark.unit


def _calibrated(clock: StepClock) -> None:
    """The start-up probe's 15 single-request steps per degree, on a quiet machine."""
    for _ in range(15):
        clock.record(1, 37.0, now=0.0)
        clock.record(2, 30.0, now=0.0)


def test_live_steps_are_the_calibration_until_a_mode_serves():
    clock = StepClock()
    _calibrated(clock)
    assert clock.live_ms() == {1: 37.0, 2: 30.0}
    assert clock.decode_ms() == {1: 37.0, 2: 30.0}


def test_live_steps_follow_what_a_mode_served_and_outlast_the_stretch():
    clock = StepClock()
    _calibrated(clock)
    for _ in range(LIVE_WINDOW):
        clock.record(2, 52.0, now=100.0)  # the group serving, stretched
    later = 100.0 + 10 * STRETCH_S
    assert clock.stretch(later) == {}  # the stretch forgot the group
    assert clock.live_ms() == {1: 37.0, 2: 52.0}  # the live memory did not
    assert clock.decode_ms() == {1: 37.0, 2: 30.0}  # nor moved the best point
    clock.record(2, 1e6, now=later)  # a stall counts at most MAX_STRETCH x the best
    assert clock.live_ms()[2] == pytest.approx((31 * 52.0 + 300.0) / 32, abs=1e-3)


def test_batches_and_prefills_are_not_live_steps():
    clock = StepClock()
    _calibrated(clock)
    for _ in range(40):
        clock.record(1, 90.0, "decode", 4)
        clock.record(1, 300.0, "prefill", 200)
    assert clock.live_ms()[1] == 37.0


def test_the_gain_is_the_lower_of_the_best_and_the_live_comparison():
    best = {1: 37.0, 2: 30.0}
    assert Costs(best).gain(2) == pytest.approx(1 - 30 / 37)
    slower = Costs(best, live_ms={1: 40.0, 2: 52.0})  # the group streamed slower
    assert slower.gain(2) == pytest.approx(1 - 52 / 40)
    assert "52.00 vs 40.00 ms while serving" in slower.describe(2)
    # DP stretched by a burst never makes the group look faster than calibrated
    assert Costs(best, live_ms={1: 60.0, 2: 31.0}).gain(2) == pytest.approx(1 - 30 / 37)
    # one mode without live steps: the best points alone
    assert Costs(best, live_ms={1: 40.0}).gain(2) == pytest.approx(1 - 30 / 37)
    doc = slower.to_json()
    assert doc["live_ms"] == {"1": 40.0, "2": 52.0}
    assert Costs.from_json(doc) == slower
    assert slower.loaded().live_ms == slower.live_ms


def test_the_controller_merges_the_engines_live_steps():
    engines = [{"decode_ms": {"1": 37.0, "2": 30.0}, "live_ms": {"1": 38.0, "2": 50.0}},
               {"decode_ms": {"1": 37.0, "2": 30.0}, "live_ms": {"1": 40.0, "2": 54.0}}]
    costs = merge(engines)
    assert costs is not None and costs.live_ms == {1: 39.0, 2: 52.0}


def test_a_group_slower_while_serving_is_not_taken_for_latency_again():
    """The hidden-1024 node's logged decision (cpu-three-peak, session 35) with nothing
    running takes TP-2 for latency on the calibrated steps (29.5 vs 33.0 ms); once the
    group has streamed slower than one engine while serving, the same moment stays DP,
    and priority requests (``Policy.pays``) no longer bind a group either."""
    chooser = LayoutChooser(2, (2,), 10.0, 0.10, 16384)
    slo, switch = Slo(3264.5, 49.49), SwitchCosts(3.716, 68.2)
    assert chooser.choose(0.0, S35_COSTS, S35_TRAFFIC, 0, 0, slo, switch).layout.name == "1xTP2"
    live = Costs(S35_COSTS.decode_ms, S35_COSTS.curves, S35_COSTS.stretch,
                 {1: 36.0, 2: 45.0})
    chooser = LayoutChooser(2, (2,), 10.0, 0.10, 16384)
    got = chooser.choose(0.0, live, S35_TRAFFIC, 0, 0, slo, switch)
    assert got.layout.name == "2xDP", got.reason

    policy = Policy(PolicyConfig().validate(),
                    Node(num_engines=2, degrees=(2,), engine_capacity=16384))
    loads = [EngineLoad(0, 0, 0), EngineLoad(1, 0, 0)]
    assert policy.decide(Request(100, 32, priority=1), loads, S35_COSTS).mode == "tp"
    refused = policy.decide(Request(100, 32, priority=1), loads, live)
    assert refused.mode == "dp" and "while serving" in refused.reason, refused.reason
