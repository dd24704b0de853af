"""The global scheduler's pure policy, on synthetic states."""

from __future__ import annotations

import itertools

import pytest

from scheduler.costs import Curve
from scheduler.policy import (
    Costs,
    Decision,
    EngineLoad,
    Node,
    Policy,
    PolicyConfig,
    Request,
)
from scheduler.priority import parse_priority
from scheduler.replay import record, replay

pytestmark = pytest.mark.unit

NODE = Node(num_engines=4, degrees=(2, 4), engine_capacity=1000)


def policy(kind="adaptive", **kw) -> Policy:
    return Policy(PolicyConfig(kind, **kw).validate(), NODE)


#: measured step costs where a group pays (TP-4 30 % faster) and where it does not
FAST = Costs({1: 10.0, 2: 8.0, 4: 7.0})
SLOW = Costs({1: 10.0, 2: 12.0, 4: 14.0})


def loads(*per_engine: int) -> list[EngineLoad]:
    return [EngineLoad(r, n, 0) for r, n in enumerate(per_engine)]


@pytest.mark.parametrize(
    "text,value", [("high", 1), ("normal", 0), ("low", -1), ("7", 7), (" HIGH ", 1), (None, 0)]
)
def test_parse_priority(text, value):
    assert parse_priority(text) == value


def test_parse_priority_rejects_garbage():
    with pytest.raises(ValueError, match="invalid priority"):
        parse_priority("urgent!")


@pytest.mark.parametrize(
    "tokens,degree", [(10, 1), (1000, 1), (1001, 2), (2000, 2), (2001, 4), (4000, 4), (4001, None)]
)
def test_fit_degree_is_smallest_that_holds(tokens, degree):
    assert policy().fit_degree(tokens) == degree


@pytest.mark.parametrize("kind", ["adaptive", "static-dp", "static-tp"])
def test_long_context_upgrades_to_smallest_fitting_degree(kind):
    p = policy(kind)
    assert p.decide(Request(1500, 100), loads(9, 9, 9, 9)) == Decision("tp", 2, "long context")
    assert p.decide(Request(3000, 100), loads(9, 9, 9, 9)).degree == 4


def test_beyond_node_is_rejected_with_limit_and_largest_degree():
    d = policy("static-dp").decide(Request(3990, 20))
    assert d.mode == "reject"
    assert "4000 tokens" in d.reason and "largest TP degree 4" in d.reason


def test_priority_goes_to_largest_group_even_under_load():
    d = policy("static-dp").decide(Request(10, 10, priority=1), loads(5, 5, 5, 5))
    assert d == Decision("tp", 4, "priority")
    assert policy(priority_threshold=5).decide(Request(10, 10, priority=1), loads(5, 5, 5, 5)).mode == "dp"


def test_manual_binds_only_explicit_headers():
    p = policy("manual")
    assert p.decide(Request(1500, 10, priority=9)).mode == "dp"
    assert p.decide(Request(10, 10, explicit_degree=2)) == Decision("tp", 2, "explicit")


def test_explicit_degree_validated():
    assert policy().decide(Request(10, 10, explicit_degree=8)).mode == "reject"
    assert policy().decide(Request(2500, 10, explicit_degree=2)).mode == "reject"


def test_static_policies():
    assert policy("static-dp").decide(Request(10, 10), loads(0, 0, 0, 0)).mode == "dp"
    assert policy("static-tp").decide(Request(10, 10), loads(9, 9, 9, 9)) == Decision(
        "tp", 4, "static-tp"
    )


def test_adaptive_hysteresis_does_not_flap():
    p = policy(light_load=0.5, heavy_load=1.5)
    assert p.decide(Request(10, 10), loads(0, 0, 0, 0), FAST).mode == "tp"
    assert p.decide(Request(10, 10), loads(1, 1, 1, 1), FAST).mode == "tp"  # between: stay
    assert p.decide(Request(10, 10), loads(2, 2, 2, 2), FAST).mode == "dp"  # above heavy
    assert p.decide(Request(10, 10), loads(1, 1, 1, 1), FAST).mode == "dp"  # between: stay
    assert p.decide(Request(10, 10), loads(0, 0, 0, 1), FAST).mode == "tp"  # below light


def test_adaptive_picks_tp_for_latency_only_where_a_group_pays():
    p = policy()
    assert p.decide(Request(10, 10), loads(0, 0, 0, 0), FAST) == Decision("tp", 4, "light load")
    d = p.decide(Request(10, 10), loads(0, 0, 0, 0), SLOW)
    assert d.mode == "dp" and "does not pay" in d.reason and "14.00 ms" in d.reason
    d = p.decide(Request(10, 10), loads(0, 0, 0, 0), None)  # not measured yet: DP
    assert d.mode == "dp" and "no measured" in d.reason
    d = p.decide(Request(10, 10), loads(0, 0, 0, 0), Costs({1: 10.0}))
    assert d.mode == "dp" and "no measured TP-4" in d.reason
    # 3 % faster is below the default 5 % gain; a config may ask for less (or allow slower)
    barely = Costs({1: 10.0, 4: 9.7})
    assert p.decide(Request(10, 10), loads(0, 0, 0, 0), barely).mode == "dp"
    assert policy(tp_gain=0.0).decide(Request(10, 10), loads(0, 0, 0, 0), barely).mode == "tp"
    assert policy(tp_gain=-1.0).decide(Request(10, 10), loads(0, 0, 0, 0), SLOW).mode == "tp"


def test_priority_keeps_its_group_only_where_it_pays():
    p = policy("static-dp")
    assert p.decide(Request(10, 10, priority=1), loads(0, 0, 0, 0), FAST).mode == "tp"
    d = p.decide(Request(10, 10, priority=1), loads(0, 0, 0, 0), SLOW)
    assert d.mode == "dp" and d.reason.startswith("priority:")
    # long context and explicit degrees do not depend on costs
    assert p.decide(Request(1500, 10), loads(0, 0, 0, 0), SLOW).mode == "tp"
    assert p.decide(Request(10, 10, explicit_degree=2), None, SLOW).mode == "tp"


def test_costs_roundtrip_json():
    assert Costs.from_json({"decode_ms": {"1": 10.0, "2": 8.0}}) == Costs({1: 10.0, 2: 8.0})
    assert Costs.from_json(None) is None
    assert FAST.gain(2) == pytest.approx(0.2) and SLOW.gain(3) is None


def test_no_degrees_means_dp_or_reject():
    p = Policy(PolicyConfig().validate(), Node(1, (), 1000))
    assert p.decide(Request(10, 10, priority=5), loads(0)).mode == "dp"
    assert p.decide(Request(1500, 10)).mode == "reject"


def test_exhaustive_small_states_are_well_formed():
    """Every decision on a grid of states is valid for the node."""
    for kind, prompt, prio, load in itertools.product(
        ["adaptive", "static-dp", "static-tp", "manual"],
        [1, 999, 1001, 2500, 5000],
        [-1, 0, 1],
        [0, 1, 3],
    ):
        d = policy(kind).decide(Request(prompt, 1, prio), loads(load, load, load, load))
        assert d.mode in ("dp", "tp", "reject")
        if d.mode == "tp":
            assert d.degree in NODE.degrees and prompt + 1 <= NODE.capacity(d.degree)
        if d.mode == "dp":
            assert d.degree == 1
        if d.mode == "reject":
            assert kind != "manual" and prompt + 1 > NODE.capacity(4)


def test_replay_reproduces_and_detects_changes():
    p = policy()
    events = []
    for i, per in enumerate([0, 0, 2, 2, 1, 0, 0]):
        req = Request(10 * (i + 1), 10, priority=i % 2)
        ld = loads(per, per, per, per)
        costs = FAST if i < 5 else SLOW
        events.append(record(req, ld, p.decide(req, ld, costs), costs, rid=f"r{i}"))
    assert replay(events, PolicyConfig(), NODE) == (7, [])
    n, diffs = replay(events, PolicyConfig(policy="static-dp"), NODE)
    assert n == 7 and diffs and all(got.mode == "dp" for _, _, got in diffs)
    assert any(want.mode == "tp" for _, want, _ in diffs)
    n, diffs = replay(events, PolicyConfig(tp_gain=0.5), NODE)  # a stricter gain: fewer groups
    assert diffs and all(got.mode == "dp" for _, _, got in diffs)


def test_invalid_config():
    with pytest.raises(ValueError):
        PolicyConfig(policy="fast").validate()
    with pytest.raises(ValueError):
        PolicyConfig(light_load=2, heavy_load=1).validate()


def test_group_capacity_pools_kv_slots_not_the_dp_input_limit():
    """A TP-m group holds m engines' KV slots (less the admission slack), which is more
    than m x SGLang's per-engine input limit; the context length caps every group."""
    node = Node(2, (2,), engine_capacity=2043, engine_slots=2048, group_slack=4)
    assert node.capacity(1) == 2043
    assert node.capacity(2) == 4092
    p = Policy(PolicyConfig("static-dp").validate(), node)
    assert p.decide(Request(4080, 8)) == Decision("tp", 2, "long context")
    assert p.decide(Request(4080, 16)).mode == "reject"
    capped = Node(2, (2,), engine_capacity=2043, engine_slots=2048, context_limit=3000)
    assert capped.capacity(2) == 3000
    assert Policy(PolicyConfig().validate(), capped).decide(Request(2990, 20)).mode == "reject"


def test_adaptive_without_loads_leaves_the_load_rule_to_the_controller():
    """The HTTP process sees no load: it must not mark light-load TP (the controller,
    which reads the engines' loads, decides); rules that need no load still apply."""
    p = policy()
    assert p.decide(Request(10, 10)) == Decision("dp", 1, "adaptive")
    assert p.decide(Request(10, 10, priority=1)).mode == "tp"
    assert p.decide(Request(1500, 10)).mode == "tp"
    assert p.light  # no load was observed


#: curves where a TP-2 step is 40 % faster than one engine's, and one engine's step
#: grows with its batch (ms per decode step: 10 at batch 1, 20 at batch 8)
CURVES = Costs(
    {1: 10.0, 2: 6.0},
    {1: Curve.of([(1, 10.0), (8, 20.0)], [(100, 20.0), (1000, 200.0)]),
     2: Curve.of([(1, 6.0), (8, 12.0)], [(100, 12.0), (1000, 120.0)])},
)


def test_a_request_slo_one_engine_misses_and_a_group_meets_runs_in_the_group():
    p = Policy(PolicyConfig("adaptive").validate(), Node(2, (2,), 4000))
    tight = Request(100, 32, slo_tpot_ms=8.0)
    d = p.decide(tight, loads(0, 0), CURVES)
    assert (d.mode, d.degree) == ("tp", 2) and d.reason.startswith("request SLO")
    # one engine meets it: the node's layout decides, not the request's SLO
    assert not p.decide(Request(100, 32, slo_tpot_ms=15.0), loads(0, 0),
                        CURVES).reason.startswith("request SLO")
    # ...until that engine is busy: at batch 8 its step is 20 ms
    assert p.decide(Request(100, 32, slo_tpot_ms=15.0), loads(7, 7), CURVES).degree == 2
    # no layout meets it: no group for it (busy engines: the load rule says DP too)
    assert p.decide(Request(100, 32, slo_tpot_ms=2.0), loads(7, 7), CURVES).mode == "dp"
    # a first-token target only the group's faster prefill meets
    assert p.decide(Request(1000, 8, slo_ttft_ms=150.0), loads(0, 0), CURVES).degree == 2
    # the HTTP process (no costs) leaves it to the controller; other policies ignore it
    assert p.decide(tight, None, None).mode == "dp"  # (the HTTP process's call)
    static = Policy(PolicyConfig("static-dp").validate(), Node(2, (2,), 4000))
    assert static.decide(tight, loads(0, 0), CURVES).mode == "dp"
    # a DP-only feature or a slower group never gets a group for its SLO
    assert p.decide(Request(100, 32, dp_only="x", slo_tpot_ms=8.0), loads(0, 0),
                    CURVES).mode == "dp"
    assert p.decide(tight, loads(0, 0), Costs({1: 10.0, 2: 12.0})).mode == "dp"
