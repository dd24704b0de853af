"""Conversation turns: the index of placed prompts, the engine a turn goes to, and the
adaptive policy's rule that a turn runs in DP (``scheduler.conversations``)."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from scheduler.conversations import (
    AFFINITY_SLACK,
    BLOCK,
    CHAT_SHARE,
    FIRSTS,
    MIN_TURN_TOKENS,
    ConversationIndex,
    affinity_rank,
    chain,
    is_turn,
)
from scheduler.policy import (
    Costs,
    Decision,
    EngineLoad,
    Node,
    Policy,
    PolicyConfig,
    Request,
    SwitchCosts,
    Traffic,
)
from scheduler.replay import record, replay

pytestmark = pytest.mark.unit


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


def test_a_prompt_that_begins_with_an_earlier_prompt_is_its_turn():
    index = ConversationIndex()
    first = tokens(330, 1)  # 5 full blocks and 10 tokens
    index.remember(chain(first), 1)
    # the next turn: the whole first prompt, an answer, a new message
    turn = index.turn_of(chain(first + tokens(180, 2)))
    assert turn is not None and turn.rank == 1
    assert turn.tokens == 5 * BLOCK  # matched to the earlier prompt's last full block
    # the turn after it went to a group (-1) and continues the second prompt: the longest
    second = first + tokens(180, 2)
    index.remember(chain(second), -1)
    third = index.turn_of(chain(second + tokens(100, 3)))
    assert third is not None and third.rank == -1 and third.tokens == len(second) // BLOCK * BLOCK


def test_sharing_a_system_prompt_or_part_of_a_prompt_is_no_turn():
    index = ConversationIndex()
    system = tokens(256, 0)
    index.remember(chain(system + tokens(200, 1)), 0)
    assert index.turn_of(chain(system + tokens(200, 2))) is None  # same system prompt only
    assert index.turn_of(chain(system)) is None  # a prefix of an earlier prompt
    assert index.turn_of(chain(tokens(BLOCK - 1, 3))) is None  # no full block
    index.remember(chain(tokens(BLOCK - 1, 3)), 0)  # nothing to remember
    assert len(index) == 1


def test_the_index_keeps_the_latest_prompts():
    index = ConversationIndex(capacity=2)
    prompts = [tokens(128, s) for s in range(3)]
    for p in prompts:
        index.remember(chain(p), 0)
    assert len(index) == 2
    assert index.turn_of(chain(prompts[0] + [7])) is None  # dropped first
    assert index.turn_of(chain(prompts[2] + [7])) is not None


def test_the_index_counts_how_often_a_first_prompt_is_continued():
    """``continued_share``: over the latest long-enough first prompts, the share that a
    later turn continued; short prompts (never a turn's history) and turns themselves
    are not first prompts; a prompt continued twice counts once."""
    index = ConversationIndex()
    assert index.continued_share() == 0.0

    def send(ids):
        keys = chain(ids)
        index.count(keys, index.turn_of(keys), len(ids))
        index.remember(keys, 0)

    firsts = [tokens(300, 20 + i) for i in range(4)]
    for ids in firsts:
        send(ids)
    send(tokens(MIN_TURN_TOKENS - BLOCK, 40))  # too short to be continued: not counted
    assert index.continued_share() == 0.0
    send(firsts[0] + tokens(120, 50))  # a turn of the first two
    send(firsts[1] + tokens(120, 51))
    send(firsts[1] + tokens(120, 51) + tokens(120, 52))  # the second's third turn
    assert index.continued_share() == 2 / 4
    send(firsts[2] + tokens(BLOCK, 53) * 4)  # 256 of 556 tokens history: no turn (< half)
    assert index.continued_share() == 2 / 5  # ... but a first prompt itself
    for i in range(FIRSTS):  # document traffic pushes the conversations out
        send(tokens(300, 100 + i))
    assert index.continued_share() == 0.0


def test_a_turn_is_long_and_mostly_history():
    assert is_turn(MIN_TURN_TOKENS, MIN_TURN_TOKENS + 100)
    assert not is_turn(MIN_TURN_TOKENS - BLOCK, MIN_TURN_TOKENS)  # short history: a group redoes it cheaply
    assert not is_turn(MIN_TURN_TOKENS, 2 * MIN_TURN_TOKENS + 1)  # under half the prompt


def test_a_turn_stays_with_its_engine_unless_it_is_much_busier():
    assert affinity_rank(1, {0: 0, 1: AFFINITY_SLACK}) == 1
    assert affinity_rank(1, {0: 0, 1: AFFINITY_SLACK + 1}) == 0
    assert affinity_rank(-1, {0: 3, 1: 2}) == 1  # no engine holds it: the least loaded
    assert affinity_rank(2, {0: 1, 1: 1}) == 0  # its engine cannot take requests now


NODE = Node(num_engines=2, degrees=(2,), engine_capacity=4000, engine_slots=4096)
FAST = Costs({1: 10.0, 2: 7.0})  # a group that pays for latency
IDLE = [EngineLoad(0, 0, 0), EngineLoad(1, 0, 0)]


def test_the_adaptive_policy_runs_a_turn_in_dp_where_it_would_form_a_group():
    p = Policy(PolicyConfig("adaptive").validate(), NODE)
    assert p.decide(Request(600, 32), IDLE, FAST) == Decision("tp", 2, "light load")
    d = p.decide(Request(600, 32, turn_tokens=512), IDLE, FAST)
    assert d.mode == "dp" and d.turn and "a conversation's turn: 512 of its 600" in d.reason
    # too little history, or a turn the policy puts in DP anyway: unchanged
    assert p.decide(Request(600, 32, turn_tokens=192), IDLE, FAST).mode == "tp"
    assert p.decide(Request(600, 32, turn_tokens=512), IDLE, Costs({1: 10.0, 2: 12.0})).mode == "dp"


def test_a_turn_whose_history_ran_in_a_group_keeps_its_group_but_under_chat_traffic():
    """No engine holds a history that ran in a group (its cache ends with the session):
    in DP the turn would prefill it all beside the groups. It runs in DP only under chat
    traffic, where its next turn is likely and finds it cached there (session 58:
    SGLang's random-ids benchmark repeats a prompt now and then, and 2-6 repeats a
    round ran in DP beside a TP-2 group)."""
    p = Policy(PolicyConfig("adaptive", slo_ttft_ms=5000.0, slo_tpot_ms=30.0).validate(), NODE)
    req = Request(600, 32, turn_tokens=512, turn_held=False)
    calm = Traffic(100.0, 0.2, 0.2, 600, 32, n_short=3, n_long=3, continued=0.1)
    assert p.decide(req, IDLE, FAST, calm, SwitchCosts()).mode == "tp"
    chat = replace(calm, continued=CHAT_SHARE)
    d = p.decide(req, IDLE, FAST, chat, SwitchCosts())
    assert d.mode == "dp" and d.turn and "a conversation's turn" in d.reason, d.reason
    held = p.decide(Request(600, 32, turn_tokens=512), IDLE, FAST, calm, SwitchCosts())
    assert held.mode == "dp" and held.turn, held.reason
    lines = [record(req, IDLE, p.decide(req, IDLE, FAST, calm, SwitchCosts()), FAST, calm,
                    SwitchCosts())]
    assert json.loads(lines[0])["request"]["turn_held"] is False
    assert replay(lines, PolicyConfig("adaptive", slo_ttft_ms=5000.0, slo_tpot_ms=30.0),
                  NODE) == (1, [])


def test_under_chat_traffic_a_first_prompt_runs_in_dp_too():
    """``Traffic.continued`` at ``CHAT_SHARE``: a first prompt long enough to be
    continued runs in DP (left to SGLang's dispatch: no engine holds it yet); below,
    or a prompt too short to be continued, keeps the group; and a request that asked
    for a group keeps it."""
    p = Policy(PolicyConfig("adaptive", slo_ttft_ms=5000.0, slo_tpot_ms=30.0).validate(), NODE)
    chat = Traffic(100.0, 0.2, 0.2, 600, 32, n_short=3, n_long=3, continued=CHAT_SHARE)
    d = p.decide(Request(600, 32), IDLE, FAST, chat, SwitchCosts())
    assert d.mode == "dp" and not d.turn and d.reason.startswith("chat traffic: a later turn "
                                                                 "continued 50%"), d.reason
    assert p.decide(Request(MIN_TURN_TOKENS - 1, 32), IDLE, FAST, chat, SwitchCosts()).mode == "tp"
    assert p.decide(Request(600, 32, priority=1), IDLE, FAST, chat, SwitchCosts()).mode == "tp"
    fewer = Traffic(100.0, 0.2, 0.2, 600, 32, n_short=3, n_long=3, continued=CHAT_SHARE - 0.1)
    assert p.decide(Request(600, 32), IDLE, FAST, fewer, SwitchCosts()).mode == "tp"
    lines = [record(Request(600, 32), IDLE, d, FAST, chat, SwitchCosts())]
    assert replay(lines, PolicyConfig("adaptive", slo_ttft_ms=5000.0, slo_tpot_ms=30.0),
                  NODE) == (1, [])


@pytest.mark.parametrize("kw,mode", [
    ({"priority": 1}, "tp"),  # asked for a group
    ({"explicit_degree": 2}, "tp"),
    ({"max_new_tokens": 5000}, "tp"),  # needs one
])
def test_a_turn_that_asks_for_or_needs_a_group_keeps_it(kw, mode):
    p = Policy(PolicyConfig("adaptive").validate(), NODE)
    req = Request(**{"prompt_len": 600, "max_new_tokens": 32, "turn_tokens": 512, **kw})
    assert p.decide(req, IDLE, FAST).mode == mode


def test_static_tp_keeps_every_turn_in_its_group():
    p = Policy(PolicyConfig("static-tp").validate(), NODE)
    assert p.decide(Request(600, 32, turn_tokens=512), IDLE, FAST).mode == "tp"


def test_a_turn_under_the_goodput_rule_and_its_replay():
    """The goodput layout's group (the decision log records the turn: replay agrees)."""
    p = Policy(PolicyConfig("adaptive", slo_ttft_ms=5000.0, slo_tpot_ms=30.0).validate(), NODE)
    traffic = Traffic(100.0, 0.2, 0.2, 600, 32, n_short=3, n_long=3)
    lines = []
    for req in (Request(600, 32), Request(600, 32, turn_tokens=576)):
        d = p.decide(req, IDLE, FAST, traffic, SwitchCosts())
        lines.append(record(req, IDLE, d, FAST, traffic, SwitchCosts()))
        assert d.mode == ("dp" if req.turn_tokens else "tp"), d.reason
    config = PolicyConfig("adaptive", slo_ttft_ms=5000.0, slo_tpot_ms=30.0)
    assert replay(lines, config, NODE) == (2, [])


def _controller(counter: int = 0):
    from types import SimpleNamespace

    snaps = [SimpleNamespace(dp_rank=r, num_running_reqs=0, num_waiting_reqs=0) for r in (0, 1)]
    return SimpleNamespace(
        _active_workers=[0, 1], status=[True, True], workers=[object(), object()],
        load_snapshot_reader=SimpleNamespace(read_all=lambda: snaps),
        load_balance_method=SimpleNamespace(name="ROUND_ROBIN"), round_robin_counter=counter,
    )


def test_the_controller_learns_where_round_robin_sent_a_prompt_and_routes_its_next_turn():
    """``flying.node.turns``: a first prompt left to SGLang's round robin (which sent it
    to engine 1) is remembered there, and its next turn, which the policy ran in DP
    instead of a group, is routed to engine 1 although engine 0 is as idle (the least
    loaded rule alone would pick 0); a turn the layout ran in DP anyway is left to
    SGLang's dispatch."""
    from types import SimpleNamespace

    from flying.node import turns

    controller = _controller(counter=1)
    first = SimpleNamespace(rid="a", input_ids=tokens(400, 5), routed_dp_rank=None)
    found = turns.look_up(controller, first)
    assert found is not None and found.turn is None
    turns.place(controller, first, found, in_group=False, turn=False)
    mark = turns.round_robin_mark(controller)
    controller.round_robin_counter = 2  # SGLang's round robin took active[1]
    turns.learn(controller, first, mark)

    second = SimpleNamespace(rid="b", input_ids=first.input_ids + tokens(100, 6),
                             routed_dp_rank=None)
    found = turns.look_up(controller, second)
    assert found is not None and found.turn is not None and found.turn.rank == 1
    turns.place(controller, second, found, in_group=False, turn=False)
    assert second.routed_dp_rank is None  # the layout ran it in DP anyway: SGLang's
    turns.place(controller, second, found, in_group=False, turn=True)
    assert second.routed_dp_rank == 1
    # a turn placed in a group is not routed, and is remembered as no engine's
    third = SimpleNamespace(rid="c", input_ids=second.input_ids + tokens(80, 7),
                            routed_dp_rank=None)
    found = turns.look_up(controller, third)
    turns.place(controller, third, found, in_group=True, turn=False)
    assert third.routed_dp_rank is None
    assert controller._flying_turns.turn_of(found.keys + [0]).rank == -1


def test_a_turn_whose_history_ran_in_a_group_is_left_to_sglang():
    """No engine holds such a turn's history: the controller does not route it (the
    loads it reads lag the requests just sent, and turns arriving together would all go
    to the engine that looked least loaded), and learns where SGLang sent it."""
    from types import SimpleNamespace

    from flying.node import turns

    controller = _controller(counter=4)
    first = SimpleNamespace(rid="a", input_ids=tokens(400, 8), routed_dp_rank=None)
    found = turns.look_up(controller, first)
    turns.place(controller, first, found, in_group=True, turn=False)
    second = SimpleNamespace(rid="b", input_ids=first.input_ids + tokens(100, 9),
                             routed_dp_rank=None)
    found = turns.look_up(controller, second)
    assert found.turn is not None and found.turn.rank == -1
    turns.place(controller, second, found, in_group=False, turn=True)
    assert second.routed_dp_rank is None
    mark = turns.round_robin_mark(controller)
    controller.round_robin_counter = 5  # SGLang's round robin took active[0]
    turns.learn(controller, second, mark)
    third = second.input_ids + tokens(100, 10)
    assert controller._flying_turns.turn_of(chain(third)).rank == 0
    assert turns.continued_share(controller) == 1.0


def test_a_turn_counts_in_the_arrival_estimate_by_the_tokens_it_prefills():
    """The arrival estimate's prompt size is what the layouts' service is predicted
    from: a turn's is what follows its history (cached on the engine it is sent to),
    any other prompt's all of it."""
    import time
    from types import SimpleNamespace

    from flying.node import controller as flying_controller
    from flying.node import turns
    from scheduler.traffic import Arrivals

    controller = _controller()
    controller._flying_arrivals = Arrivals()
    first = SimpleNamespace(rid="a", input_ids=tokens(400, 11), routed_dp_rank=None,
                            sampling_params={"max_new_tokens": 8})
    found = turns.look_up(controller, first)
    assert turns.uncached(found) == 400
    flying_controller._note_arrival(controller, first, found)
    turns.place(controller, first, found, in_group=False, turn=False)
    mark = turns.round_robin_mark(controller)
    controller.round_robin_counter += 1  # SGLang's round robin sent it to an engine
    turns.learn(controller, first, mark)
    second = SimpleNamespace(rid="b", input_ids=first.input_ids + tokens(100, 12),
                             routed_dp_rank=None, sampling_params={"max_new_tokens": 8})
    found = turns.look_up(controller, second)
    assert turns.uncached(found) == 500 - 6 * BLOCK  # the history's whole blocks cached
    flying_controller._note_arrival(controller, second, found)
    assert controller._flying_arrivals.traffic(time.monotonic()).prompt == (400 + 500 - 6 * BLOCK) / 2
    short = SimpleNamespace(rid="c", input_ids=tokens(3 * BLOCK, 13))  # under a turn's least
    turns.place(controller, short, turns.look_up(controller, short), in_group=False, turn=False)
    found = turns.look_up(controller, SimpleNamespace(input_ids=short.input_ids + [5] * 200))
    assert found.turn is not None and turns.uncached(found) == 3 * BLOCK + 200  # no turn
    # a history that ran in a group (no engine holds it) is prefilled whole
    grouped = SimpleNamespace(rid="d", input_ids=tokens(400, 14))
    turns.place(controller, grouped, turns.look_up(controller, grouped), in_group=True,
                turn=False)
    found = turns.look_up(controller, SimpleNamespace(input_ids=grouped.input_ids + [5] * 100))
    assert found.turn is not None and found.turn.rank < 0 and turns.uncached(found) == 500
