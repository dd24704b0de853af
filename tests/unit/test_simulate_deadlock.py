"""Deadlock freedom of the simulator's controller model at 8 engines.

Random binds of every degree (explicit ``X-Flying-TP``), releases, moves to DP (every
group may move: ``--flying-move-to-dp all``) and joins, long-context upgrades and
client aborts, all issued through the controller model in one total order. After every
event the node's invariants hold (``SimNode.check``: an engine in at most one session,
sessions on aligned groups, KV counts consistent, no two engines waiting on each
other's binds); at the end every request finished or was rejected or aborted, no
rendezvous timed out, and the node is idle with all its KV back.
"""

from __future__ import annotations

import json
import random

import pytest

from flying.node.config import FlyingConfig
from scheduler.costs import Costs, Curve
from scheduler.layout_choice import SwitchCosts
from scheduler.policy import Node, PolicyConfig
from scheduler.replay import replay_log
from workloads.load.trace import TraceRequest
from workloads.sim.node import SimNode
from workloads.sim.profile import Profile
from workloads.sim.run import simulate

pytestmark = pytest.mark.unit

ENGINES = 8


def profile() -> Profile:
    """8 engines, TP-2/4/8 faster per step than one engine, small KV pools so that
    reservations fail now and then (admission closes, binds rerun in DP)."""
    costs = Costs({1: 10.0, 2: 6.0, 4: 4.0, 8: 3.0}, {
        m: Curve.of([(1, ms), (64, ms * 2)], [(16, ms / 2), (2048, ms * 4)])
        for m, ms in ((1, 10.0), (2, 6.0), (4, 4.0), (8, 3.0))
    })
    return Profile("deadlock", costs, SwitchCosts(2.0, 5.0), kv_tokens=3000,
                   degrees=(2, 4, 8), max_engines=ENGINES, context_len=8192, kv_heads=8,
                   heads=32, chunk_tokens=512)


def workload(seed: int):
    rng = random.Random(seed)
    t, trace, explicit, events = 0.0, [], {}, []
    for i in range(1000):
        t += rng.expovariate(rng.choice((10.0, 80.0)))  # quiet spells and crowds
        trace.append(TraceRequest(i, t, rng.randint(16, 900), rng.randint(2, 80)))
        explicit[i] = rng.choice((0, 0, 2, 4, 8))
        roll = rng.random()
        if roll < 0.08:
            events.append((t + rng.uniform(0.0, 0.4), "abort", i))
        elif roll < 0.25:
            events.append((t + rng.uniform(0.01, 0.3), "upgrade", i))
    return trace, explicit, sorted(events)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_binds_moves_upgrades_and_aborts_never_deadlock(seed):
    trace, explicit, events = workload(seed)
    seen: list[SimNode] = []

    def check(node: SimNode) -> None:
        if not seen:
            seen.append(node)
        node.check()

    cfg = FlyingConfig(policy="static-dp", move_to_dp="all")
    res = simulate(trace, profile(), ENGINES, cfg, events=events, explicit=explicit,
                   after_event=check)
    node = seen[0]
    assert node.idle()
    assert all(e.dp_used == 0 and e.reserved == 0 for e in node.engines)
    assert node.counters["bind_timeouts"] == 0
    for rec in res.records:
        assert rec.success or rec.error in ("aborted by the client",) or rec.http_status == 400
        if rec.success:
            assert rec.output_tokens == rec.output_len
    # every kind of operation happened
    degrees = {d for _, layout in res.layout for d in layout}
    assert degrees == {1, 2, 4, 8}
    assert node.counters["moves"] > 0 and node.counters["joins"] > 0
    upgrades = [json.loads(line) for line in res.decisions if '"kind": "upgrade"' in line]
    assert any(u["decision"]["mode"] == "tp" for u in upgrades)
    assert node.counters["upgrades"] > 0
    assert any(r.error == "aborted by the client" for r in res.records)
    # the moves and joins it logged replay to the same decisions (scheduler.relayout)
    head = json.loads(res.decisions[0])
    replayed = replay_log(res.decisions, PolicyConfig(**head["config"]),
                          Node(**{**head["node"], "degrees": tuple(head["node"]["degrees"])}))
    assert replayed.diffs == []
    assert replayed.counts["move"] > 0 and replayed.counts["join"] > 0
