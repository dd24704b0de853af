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
from scheduler.traffic import Traffic
from tests.unit.test_goodput import S35_COSTS, S35_TRAFFIC, TP_ALWAYS

pytestmark = pytest.mark.unit


def _calibrated(clock: StepClock) -> None:
    """The start-up probe's 15 single-request steps per degree, on a quiet machine."""
    for _ in range(15):
        clock.record(1, 37.0, now=0.0)
        clock.record(2, 30.0, now=0.0)


def test_live_steps_are_the_calibration_until_a_mode_serves():
    clock = StepClock()
    _calibrated(clock)
    assert clock.live_ms() == clock.live_low_ms() == {1: 37.0, 2: 30.0}
    assert clock.decode_ms() == {1: 37.0, 2: 30.0}


def test_live_steps_follow_what_a_mode_served_and_outlast_the_stretch():
    clock = StepClock()
    _calibrated(clock)
    for _ in range(LIVE_WINDOW):
        clock.record(2, 52.0, now=100.0)  # the group serving, stretched
    later = 100.0 + 10 * STRETCH_S
    assert clock.stretch(later) == {}  # the stretch forgot the group
    assert clock.live_ms() == {1: 37.0, 2: 52.0}  # the live memory did not
    assert clock.live_low_ms() == {1: 37.0, 2: 30.0}  # its quietest: the calibration
    assert clock.decode_ms() == {1: 37.0, 2: 30.0}  # nor moved the best point
    clock.record(2, 1e6, now=later)  # a stall counts at most MAX_STRETCH x the best
    assert clock.live_ms()[2] == pytest.approx((31 * 52.0 + 300.0) / 32, abs=1e-3)
    for _ in range(LIVE_WINDOW):
        clock.record(1, 60.0, now=later)  # DP stretched as a burst begins
    assert clock.live_ms()[1] == 60.0 and clock.live_low_ms()[1] == 37.0


def test_batches_and_prefills_are_not_live_steps():
    clock = StepClock()
    _calibrated(clock)
    for _ in range(40):
        clock.record(1, 90.0, "decode", 4)
        clock.record(1, 300.0, "prefill", 200)
    assert clock.live_ms()[1] == 37.0


def test_the_gain_is_the_lower_of_the_best_and_the_live_comparison():
    """The group's live steps against one engine's quietest live mean."""
    best = {1: 37.0, 2: 30.0}
    assert Costs(best).gain(2) == pytest.approx(1 - 30 / 37)
    # the group streamed slower; DP's steps now stretched by a burst (60 ms) do not
    # count, its quietest (40 ms) does
    slower = Costs(best, live_ms={1: 60.0, 2: 52.0}, live_low_ms={1: 40.0, 2: 30.0})
    assert slower.gain(2) == pytest.approx(1 - 52 / 40)
    assert "52.00 vs 40.00 ms while serving" in slower.describe(2)
    # DP stretched never makes the group look faster than calibrated
    assert Costs(best, live_ms={2: 31.0}, live_low_ms={1: 60.0}).gain(2) == \
        pytest.approx(1 - 30 / 37)
    # one mode without live steps: the best points alone
    assert Costs(best, live_ms={1: 40.0}, live_low_ms={1: 40.0}).gain(2) == \
        pytest.approx(1 - 30 / 37)
    doc = slower.to_json()
    assert doc["live_ms"] == {"1": 60.0, "2": 52.0} and doc["live_low_ms"]["1"] == 40.0
    assert Costs.from_json(doc) == slower
    assert slower.loaded().live_ms == slower.live_ms
    assert slower.loaded().live_low_ms == slower.live_low_ms


def test_the_controller_merges_the_engines_live_steps():
    engines = [{"decode_ms": {"1": 37.0, "2": 30.0}, "live_ms": {"1": 38.0, "2": 50.0},
                "live_low_ms": {"1": 36.0, "2": 30.0}},
               {"decode_ms": {"1": 37.0, "2": 30.0}, "live_ms": {"1": 40.0, "2": 54.0},
                "live_low_ms": {"1": 38.0, "2": 32.0}}]
    costs = merge(engines)
    assert costs is not None and costs.live_ms == {1: 39.0, 2: 52.0}
    assert costs.live_low_ms == {1: 37.0, 2: 31.0}


#: a group faster at every batch (25 vs 40 ms alone), at a light load both layouts serve
#: within a loose SLO: latency decides
LIGHT = Traffic(0, 0.3, 0.3, 128, 64, 100, 100)
LOOSE = Slo(5000.0, 200.0)


def _live(live_ms: dict[int, float], live_low_ms: dict[int, float]) -> Costs:
    return Costs(TP_ALWAYS.decode_ms, TP_ALWAYS.curves, {}, live_ms, live_low_ms)


def test_a_group_slower_while_serving_is_not_taken_for_latency_again():
    """With nothing running the node takes TP-2 for latency on the calibrated steps;
    once the group has streamed slower than one engine while serving (the hidden-1024
    node, cpu-three-peak, session 35: 41.3 ms a step against DP's 41.8 at its quietest),
    the same moment stays DP, and priority requests (``Policy.pays``) no longer bind a
    group either."""
    switch = SwitchCosts(3.716, 68.2)
    chooser = LayoutChooser(2, (2,), 10.0, 0.10, 16384)
    assert chooser.choose(0.0, TP_ALWAYS, LIGHT, 0, 0, LOOSE, switch).layout.name == "1xTP2"
    live = _live({1: 58.7, 2: 41.3}, {1: 41.8, 2: 32.6})
    chooser = LayoutChooser(2, (2,), 10.0, 0.10, 16384)
    got = chooser.choose(0.0, live, LIGHT, 0, 0, LOOSE, switch)
    assert got.layout.name == "2xDP", got.reason

    policy = Policy(PolicyConfig().validate(),
                    Node(num_engines=2, degrees=(2,), engine_capacity=16384))
    loads = [EngineLoad(0, 0, 0), EngineLoad(1, 0, 0)]
    assert policy.decide(Request(100, 32, priority=1), loads, TP_ALWAYS).mode == "tp"
    refused = policy.decide(Request(100, 32, priority=1), loads, live)
    assert refused.mode == "dp" and "while serving" in refused.reason, refused.reason


def test_at_the_logged_costs_of_a_latency_switch_that_streamed_slower_dp_is_kept():
    """The hidden-1024 node took TP-2 for latency at S35_COSTS (cpu-three-peak, session
    35) and its group streamed slower than one engine; a request decodes beside the
    others there, neither layout within the TPOT SLO at the rate, and DP is kept on
    the calibrated steps alone."""
    chooser = LayoutChooser(2, (2,), 10.0, 0.10, 16384)
    got = chooser.choose(0.0, S35_COSTS, S35_TRAFFIC, 0, 0, Slo(3264.5, 49.49),
                         SwitchCosts(3.716, 68.2))
    assert got.layout.name == "2xDP", got.reason


#: the decision the hidden-1024 node logged as the second burst of cpu-three-peak began
#: (session 36, run f): DP, 1 and 2 requests running, TP-2 taken for latency. The group
#: had served the first lull and burst: its single-request steps 41.3 ms while serving
#: against 28.7 calibrated; DP's were stretched to 58.7 ms then, 41.8 at their lowest.
S36F_COSTS = Costs.from_json({
    "decode_ms": {"1": 38.1722, "2": 28.7415}, "stretch": {"1": 1.382},
    "live_ms": {"1": 58.6562, "2": 41.293},
    "curves": {"1": {"decode": [[1.0, 38.1722], [2.0, 74.5264], [3.0, 116.2649],
                                [4.0, 94.8065], [6.21, 133.0603], [13.02, 163.1646]],
                     "prefill": [[6.17, 57.9433], [20.25, 179.9557], [50.84, 252.5746],
                                 [100.12, 325.9708], [162.62, 471.2592],
                                 [381.0, 1072.8865]]},
               "2": {"decode": [[1.0, 28.7415], [2.0, 55.1395], [3.0, 71.9103],
                                [4.0, 53.4391], [7.0, 77.6303], [11.0, 97.1285]],
                     "prefill": [[105.67, 204.6288], [193.5, 318.3992],
                                 [366.0, 539.361]]}}})
S36F_TRAFFIC = Traffic(now=1298.79, rate_short=2.0, rate_long=1.4667, prompt=105.27,
                       output=27.78, n_short=6, n_long=44, window_s=3.0)


@pytest.mark.parametrize("dp_low, want", [(None, "1xTP2"), (58.6562, "1xTP2"),
                                          (41.8, "2xDP")])
def test_a_latency_switch_is_refused_at_dps_quietest_live_steps(dp_low, want):
    """The hidden-1024 node (cpu-three-peak, session 36, run f) took TP-2 for latency on
    the calibrated steps alone, the group 25 % faster; it then held through two bursts
    ("gains less than its switch") and the run's goodput was 0.70x the better static
    layout. Its group's live steps were 41.3 ms: against DP's live steps as they ran
    then (stretched to 58.7 ms) the group still looks faster; against their quietest
    (41.8 ms) it does not, and the node stays DP. (At that run's logged costs,
    S36F_COSTS, a request decodes beside the others and DP is kept at any of them.)"""
    low = {1: dp_low} if dp_low else {}
    chooser = LayoutChooser(2, (2,), 10.0, 0.10, 16384)
    got = chooser.choose(0.0, _live({1: 58.6562, 2: 41.293}, low), LIGHT, 0, 0, LOOSE,
                         SwitchCosts(3.183, 224.6))
    assert got.layout.name == want, got.reason
    logged = Costs(S36F_COSTS.decode_ms, S36F_COSTS.curves, S36F_COSTS.stretch,
                   S36F_COSTS.live_ms, low)
    got = LayoutChooser(2, (2,), 10.0, 0.10, 16384).choose(
        0.0, logged, S36F_TRAFFIC, 3, 0, Slo(2990.4, 57.26), SwitchCosts(3.183, 224.6))
    assert got.layout.name == "2xDP", got.reason
