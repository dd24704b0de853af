"""Mixed layouts (k groups of one degree beside DP engines): placed by the layout.

Under a mixed layout the controller sends the DP requests to the layout's DP engines
and the binds to its own groups (``Policy.engines_for``, ``BindIssuer``), so its groups
meet no DP arrival; the simulator does the same with the same calls.
"""

from __future__ import annotations

import json

import pytest

from flying.node import config
from flying.node import controller as flying_controller
from flying.node.bind_issuer import BindIssuer
from flying.session import messages
from scheduler.layout_choice import LayoutChooser
from scheduler.policy import Node, Policy, PolicyConfig
from scheduler.service import Layout
from tests.unit.test_request_surface import FakeController, _tok

pytestmark = pytest.mark.unit


@pytest.fixture
def cfg(monkeypatch):
    """Set this process's Flying config for one test."""

    def set_config(**kw):
        value = config.FlyingConfig(**kw).validate()
        monkeypatch.setattr(config, "_CONFIG", value)
        return value

    return set_config


def test_a_layouts_groups_take_the_lowest_aligned_ranks():
    assert Layout((2, 1, 1)).placement() == ((0, 1), (2, 3))
    assert Layout((2, 2, 1, 1, 1, 1)).placement() == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert Layout((4, 1, 1, 1, 1)).placement() == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert Layout((2, 2)).placement() == ((0, 1, 2, 3), ())
    assert Layout((1, 1)).placement() == ((), (0, 1))
    assert Layout((2, 1, 1)).mixed and not Layout((2, 2)).mixed and not Layout((1, 1)).mixed


def _policy(layout: Layout | None, engines: int = 4, mixed: bool = True) -> Policy:
    policy = Policy(PolicyConfig(mixed=mixed), Node(engines, (2, 4), 4000, 4096))
    if layout is not None:
        policy.chooser = LayoutChooser(engines, (2, 4), 10.0, 0.1, 4096.0, mixed=mixed)
        policy.chooser.current = layout
    return policy


def test_the_policy_names_a_mixed_layouts_engines_and_no_others():
    policy = _policy(Layout((2, 1, 1)))
    assert policy.engines_for(1) == (2, 3)
    assert policy.engines_for(2) == (0, 1)
    assert policy.engines_for(4) == ()  # another degree: any aligned group (long context)
    for uniform in (Layout((1, 1, 1, 1)), Layout((2, 2)), Layout((4,)), None):
        assert all(_policy(uniform).engines_for(d) == () for d in (1, 2, 4))


def test_binds_stay_in_the_layouts_groups_and_dp_requests_on_its_dp_engines():
    issuer = BindIssuer(8, [2, 4])
    picks = [issuer.choose(2, (0, 1, 2, 3)).ranks for _ in range(4)]
    assert picks == [(0, 1), (2, 3), (0, 1), (2, 3)]
    assert [issuer.choose(2).ranks for _ in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [issuer.dp_engine((4, 5, 6, 7)) for _ in range(5)] == [4, 5, 6, 7, 4]
    # an engine SGLang may not dispatch to now is skipped; none left: SGLang's dispatch
    assert {issuer.dp_engine((4, 5, 6, 7), {5, 7}) for _ in range(4)} == {5, 7}
    assert issuer.dp_engine((4, 5), set()) is None


def test_route_spreads_requests_as_the_prediction_spreads_the_rate():
    """``predict`` gives each server its capacity's share of the rate; the requests the
    layout routes follow the same shares (here a TP-2 group serving 3x one engine:
    of 1xTP2+2xDP's requests, 3/5 to the group)."""
    policy = _policy(Layout((2, 1, 1)))
    chooser = policy.chooser
    chooser._quiet_caps[1] = {1: 1.0, 2: 3.0}
    picks = [chooser.route() for _ in range(500)]
    assert picks.count(2) == 300 and picks.count(1) == 200
    chooser._quiet_caps[1] = {}  # no capacity yet: by the number of servers
    picks = [chooser.route() for _ in range(300)]
    assert picks.count(2) == 100


def _mixed_controller(cfg, loads=(0, 0, 0, 0)) -> FakeController:
    cfg(policy="adaptive", tp_degrees="2")
    ctl = FakeController(loads=loads)
    ctl._active_workers = list(range(len(loads)))
    ctl.status = [True] * len(loads)
    policy = flying_controller._policy(ctl)
    policy.chooser = LayoutChooser(len(loads), (2,), 10.0, 0.1, 4096.0, mixed=True)
    policy.chooser.current = Layout((2, 1, 1))
    return ctl


def test_the_controller_routes_a_mixed_layouts_dp_requests_to_its_dp_engines(cfg):
    """Requests that run in DP whatever the layout (LoRA adapters here) go to the
    DP engines in turn, never to the group's; a request naming its own engine keeps it."""
    ctl = _mixed_controller(cfg)
    ranks = []
    for _ in range(4):
        req = _tok(lora_path="adapter")
        assert flying_controller.binds_for(ctl, req) == []
        ranks.append(req.routed_dp_rank)
    assert ranks == [2, 3, 2, 3]
    own = _tok(lora_path="adapter")
    own.routed_dp_rank = 0
    flying_controller.binds_for(ctl, own)
    assert own.routed_dp_rank == 0
    # an engine marked down is skipped
    ctl.status[2] = False
    req = _tok(lora_path="adapter")
    flying_controller.binds_for(ctl, req)
    assert req.routed_dp_rank == 3


def test_the_controller_binds_a_mixed_layouts_requests_to_its_own_group(cfg):
    ctl = _mixed_controller(cfg)
    for _ in range(3):
        req = _tok(routing_key=messages.mark(None, 2, "explicit"))
        assert [r for r, _ in flying_controller.binds_for(ctl, req)] == [0, 1]
        assert getattr(req, "routed_dp_rank", None) is None


def test_under_a_uniform_layout_sglang_dispatches(cfg):
    ctl = _mixed_controller(cfg)
    flying_controller._policy(ctl).chooser.current = Layout((1, 1, 1, 1))
    req = _tok(lora_path="adapter")
    flying_controller.binds_for(ctl, req)
    assert getattr(req, "routed_dp_rank", None) is None
    flying_controller._policy(ctl).chooser.current = Layout((2, 2))
    binds = [[r for r, _ in flying_controller.binds_for(
        ctl, _tok(routing_key=messages.mark(None, 2, "explicit")))] for _ in range(2)]
    assert binds == [[0, 1], [2, 3]]


def test_a_simulated_mixed_layout_runs_its_dp_requests_on_its_dp_engines(monkeypatch):
    """The simulator places as the node does: on 8 simulated H100s at 50 req/s the
    chooser holds 1xTP4+4xDP for a while (simulated), and every request it then runs in
    DP starts on engines 4-7; every request is served and the decision log replays."""
    from flying.node.config import FlyingConfig
    from scheduler.replay import replay_log
    from workloads.load.arrivals import ArrivalProcess, retime
    from workloads.load.presets import build_preset
    from workloads.sim import control
    from workloads.sim.profile import load
    from workloads.sim.run import policy_settings, simulate

    placed: list[tuple[tuple[int, ...], int, tuple[int, ...]]] = []
    arrive = control.Controller.arrive

    def watched(self, req):
        within = self.policy.engines_for(1)
        arrive(self, req)
        placed.append((within, req.degree, req.ranks))

    monkeypatch.setattr(control.Controller, "arrive", watched)
    trace = retime(build_preset("paper", 0)[:400], ArrivalProcess("poisson", 50.0), 0)
    res = simulate(trace, load("h100-llama3-8b"), 8,
                   policy_settings("adaptive", FlyingConfig(layouts="mixed")))
    in_mixed = [(w, d, r) for w, d, r in placed if w]
    assert len(in_mixed) > 20
    dp = [r for w, d, r in in_mixed if d == 1 and r]
    assert dp and all(r[0] in (4, 5, 6, 7) for r in dp)
    assert all(r.error is None for r in res.records)
    head = json.loads(res.decisions[0])
    assert head["config"]["mixed"] is True
    node = Node(**{**head["node"], "degrees": tuple(head["node"]["degrees"])})
    assert replay_log(res.decisions, PolicyConfig(**head["config"]), node).diffs == []


def test_a_switch_that_keeps_a_layouts_groups_is_not_charged_their_drain():
    """1xTP4+4xDP -> 2xTP4 keeps the group on engines 0-3 and forms one on the DP
    engines 4-7: no group's requests must end first (the drain that 1xTP8 -> 2xTP4
    pays, about an output at the current TPOT), and only the DP engines' running
    requests are left beside the new group."""
    from scheduler.layout_choice import SwitchCosts
    from scheduler.service import Prediction, Slo
    from scheduler.traffic import Traffic

    chooser = LayoutChooser(8, (4, 8), 10.0, 0.1, 1e6, mixed=True)
    pred = Prediction("x", 50.0, 10.0, 20.0, 1000.0, False, (12.0, 12.0))
    traffic = Traffic(0.0, 20.0, 20.0, 2000.0, 300.0, 100, 100)
    switch = SwitchCosts(2.0, 0.0)
    chooser.current = Layout((4, 1, 1, 1, 1))
    cost, _, _, left = chooser._charge(Layout((4, 4)), pred, pred, 40, traffic, 300.0,
                                       Slo(220.0, 9.0), switch)
    assert cost == pytest.approx(2.0) and left == 20
    chooser.current = Layout((8,))
    cost, _, _, left = chooser._charge(Layout((4, 4)), pred, pred, 40, traffic, 300.0,
                                       Slo(220.0, 9.0), switch)
    assert cost == pytest.approx(2.0 + 300 * 10.0) and left == 0
    chooser.current = Layout((1,) * 8)
    assert chooser._charge(Layout((4, 4)), pred, pred, 40, traffic, 300.0,
                           Slo(220.0, 9.0), switch)[3] == 40
