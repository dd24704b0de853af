"""A saturated server's prefill is priced as SGLang runs a deep queue's: in extend
steps of up to its chunked prefill size, each prompt paying its share of one.

``BURST`` is what the node had measured of the hidden-1024 model on this project's
2-core machine when the first burst of cpu-burst arrived (session 85, its decision log
at 10.4 s): a TP-2 group's prefill grows dearer per token with the step (1.2 ms a
token at 113 tokens, 1.7 at 315-1,152), one engine's carries a fixed part a long step
spreads. The node kept the group through the burst; measured side by side on that
trace, static DP served 13 % more output than SGLang's TP-2 and 6x its goodput.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flying.node.placement import extend_tokens, node_of
from scheduler.costs import Costs, Curve
from scheduler.layout_choice import LayoutChooser
from scheduler.layout_rank import GOODPUT_MARGIN
from scheduler.policy import EngineLoad, Node, Policy, PolicyConfig
from scheduler.service import Layout, Slo, _cap, predict, queue_prefill
from scheduler.switch_charge import SwitchCosts
from scheduler.traffic import Traffic

pytestmark = pytest.mark.unit

BURST = Costs(
    {1: 38.8456, 2: 26.6225},
    {
        1: Curve.of(
            [(1, 38.8456), (2, 69.3706), (3, 96.4541), (4, 69.2476), (8, 85.7291),
             (16, 123.237), (30, 196.8483)],
            [(4.56, 72.7233), (127.75, 417.6876)],
        ),
        2: Curve.of(
            [(1, 26.6225), (2, 42.4457), (3, 46.7548), (4, 37.9873), (6.63, 46.7974),
             (16, 63.5995), (32, 92.2625)],
            [(12, 66.2124), (24.5, 63.5418), (59, 107.5267), (113.38, 140.5231),
             (134, 189.5091), (315, 537.8448), (1152, 1930.8898)],
        ),
    },
    stretch={2: 1.33}, live_ms={1: 43.4887, 2: 31.3907},
    live_low_ms={1: 41.9263, 2: 27.9675}, stretch_last={2: 1.33},
)
#: the node's own SLOs then (derived from its quiet service)
NODE_SLO = Slo(3185.0, 58.27)
#: the arrival estimate at 10.4 s, 22 requests waiting in the group
BURST_TRAFFIC = Traffic(now=100.0, rate_short=7.6667, rate_long=6.7676, prompt=107.75,
                        output=63.12, n_short=23, n_long=24, window_s=3.0)
PROMPT, OUTPUT = 105.0, 63.0
SLO = Slo(8582.0, 460.0)  # the SLOs the trace's runs were graded at
KV = 16384.0  # one engine's KV slots


def saturated(layout: Layout, prefill_tokens: float):
    """``layout`` at a burst's rate, far past what either layout serves."""
    return predict(layout, BURST, 16.0, PROMPT, OUTPUT, 20.0, SLO, 10.0, KV,
                   prefill_tokens=prefill_tokens)


def test_one_prompt_a_step_where_the_extend_step_is_unknown():
    for degree in (1, 2):
        assert queue_prefill(BURST, degree, PROMPT, 98.0, 0.0) == BURST.prefill(degree, PROMPT)


def test_a_prompt_pays_its_share_of_a_full_step():
    # one engine: 4096 tokens on its last segment's slope (past 128 tokens)
    share = BURST.prefill(1, 4096.0) * PROMPT / 4096.0
    assert queue_prefill(BURST, 1, PROMPT, 98.0, 4096.0) == pytest.approx(share)
    # a curve that spreads a fixed part is cheaper per prompt in a long step ...
    assert share < BURST.prefill(1, PROMPT)
    # ... one that grows dearer per token, dearer
    assert queue_prefill(BURST, 2, PROMPT, 195.0, 4096.0) > BURST.prefill(2, PROMPT)


def test_the_step_holds_no_more_prompts_than_the_server_runs():
    # room for 3 requests: a step of 3 prompts, not 4096 tokens
    three = BURST.prefill(2, 3 * PROMPT) / 3
    assert queue_prefill(BURST, 2, PROMPT, 3.0, 4096.0) == pytest.approx(three)
    # a step shorter than one prompt: the prompt's own
    assert queue_prefill(BURST, 2, 5000.0, 98.0, 4096.0) == BURST.prefill(2, 5000.0)


def test_past_saturation_the_group_no_longer_reads_ahead_of_dp():
    dp, tp = Layout((1, 1)), Layout((2,))
    # one prompt a step: the group reads 23 % more output than DP, as the node did
    assert saturated(tp, 0.0).throughput > 1.2 * saturated(dp, 0.0).throughput
    # SGLang's 4096-token extend steps (its CPU default): level, the group's lead gone
    new_dp, new_tp = saturated(dp, 4096.0), saturated(tp, 4096.0)
    assert new_dp.saturated and new_tp.saturated
    assert new_tp.throughput < (1.0 + GOODPUT_MARGIN) * new_dp.throughput


@pytest.mark.parametrize(("prefill_tokens", "layout"), [(0, "1xTP2"), (4096, "2xDP")])
def test_the_burst_that_kept_the_group_now_leaves_it(prefill_tokens, layout):
    """The node's decision at 10.4 s into the burst, on its logged inputs: the group
    kept where prompts were priced one a step, DP taken at SGLang's extend step."""
    chooser = LayoutChooser(2, (2,), 10.0, 0.1, 16384.0, prefill_tokens=prefill_tokens)
    chooser.current, chooser.since = Layout((2,)), 90.0
    choice = chooser.choose(100.0, BURST, BURST_TRAFFIC, 1, 22, NODE_SLO, SwitchCosts(1.026))
    assert choice.layout.name == layout, choice.reason


def test_a_server_below_its_capacity_is_priced_as_before():
    # light load: a prompt meets an idle server, so its own step is its price
    for layout in (Layout((1, 1)), Layout((2,))):
        quiet = predict(layout, BURST, 0.3, PROMPT, OUTPUT, 0.0, SLO, 10.0, KV)
        batched = predict(layout, BURST, 0.3, PROMPT, OUTPUT, 0.0, SLO, 10.0, KV,
                          prefill_tokens=4096.0)
        assert not batched.saturated
        assert (batched.ttft_ms, batched.tpot_ms) == (quiet.ttft_ms, quiet.tpot_ms)


def test_requests_waiting_below_capacity_drain_at_their_shares():
    """Requests already queued are taken into extend steps together at any rate, not
    only past saturation: 10 waiting on DP-2 are 5 per engine, one step of 5 prompts."""
    for layout, degree, each in ((Layout((1, 1)), 1, 5.0), (Layout((2,)), 2, 10.0)):
        def ttft(queued: float, tokens: float, layout=layout) -> float:
            p = predict(layout, BURST, 0.3, PROMPT, OUTPUT, queued, SLO, 10.0, KV,
                        prefill_tokens=tokens)
            assert not p.saturated
            return p.ttft_ms

        shares = queue_prefill(BURST, degree, PROMPT, each, 4096.0)
        assert ttft(10.0, 4096.0) - ttft(0.0, 4096.0) == pytest.approx(each * shares)
        # the extend step unknown: one prompt a step, as before
        single = BURST.prefill(degree, PROMPT)
        assert ttft(10.0, 0.0) - ttft(0.0, 0.0) == pytest.approx(each * single)
        assert shares != pytest.approx(single)


def test_a_saturated_request_waits_its_own_step_and_the_queue_shares():
    # the first token: its own prompt's step, the queue ahead at its shares
    layout = Layout((2,))
    one, share = BURST.prefill(2, PROMPT), queue_prefill(
        BURST, 2, PROMPT, _cap(2, KV, PROMPT, OUTPUT), 4096.0)
    at_rest = predict(layout, BURST, 16.0, PROMPT, OUTPUT, 0.0, SLO, 10.0, KV,
                      prefill_tokens=4096.0)
    queued = predict(layout, BURST, 16.0, PROMPT, OUTPUT, 10.0, SLO, 10.0, KV,
                     prefill_tokens=4096.0)
    assert queued.ttft_ms - at_rest.ttft_ms == pytest.approx(10.0 * share)
    assert at_rest.itl_tails_ms[1] > one  # a gap holds its own step at least


def test_the_node_reads_sglangs_extend_step():
    assert extend_tokens(SimpleNamespace(chunked_prefill_size=4096, max_prefill_tokens=16384)) == 4096
    # chunking off: the most one extend step admits
    assert extend_tokens(SimpleNamespace(chunked_prefill_size=-1, max_prefill_tokens=16384)) == 16384
    # unset: SGLang resolves it elsewhere; not known here
    assert extend_tokens(SimpleNamespace(chunked_prefill_size=None, max_prefill_tokens=16384)) == 0
    assert extend_tokens(None) == 0
    node = node_of(2, (2,), 16378, kv_pool=16384, prefill_tokens=4096)
    assert node.prefill_tokens == 4096
    assert Node(2, (2,), 4000).prefill_tokens == 0  # older decision logs replay as before


def test_the_policy_prices_with_its_nodes_step():
    node = node_of(2, (2,), 16378, kv_pool=16384, prefill_tokens=4096)
    policy = Policy(PolicyConfig(), node)
    loads = [EngineLoad(0, 1, 22), EngineLoad(1, 0, 0)]
    policy._by_goodput(loads, BURST, BURST_TRAFFIC, SwitchCosts())
    assert policy.chooser.prefill_tokens == 4096
