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

from dataclasses import replace
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
#: ``BURST`` with one engine's long extend step measured, as the calibration now
#: measures it in every mode (``flying.node.probe.calibrate_long``): 2.3 ms a token,
#: what one engine's 2,300-4,096-token steps ran at in static DP on that trace. The log
#: had none: its curve ended at 128 tokens, read beyond on its last segment's slope.
BURST_LONG = replace(BURST, curves={
    1: Curve.of(BURST.curves[1].decode, (*BURST.curves[1].prefill, (4096.0, 2.3 * 4096.0))),
    2: BURST.curves[2],
})
#: the node's own SLOs then (derived from its quiet service)
NODE_SLO = Slo(3185.0, 58.27)
#: the arrival estimate at 10.4 s, 22 requests waiting in the group
BURST_TRAFFIC = Traffic(now=100.0, rate_short=7.6667, rate_long=6.7676, prompt=107.75,
                        output=63.12, n_short=23, n_long=24, window_s=3.0)
PROMPT, OUTPUT = 105.0, 63.0
SLO = Slo(8582.0, 460.0)  # the SLOs the trace's runs were graded at
KV = 16384.0  # one engine's KV slots


def saturated(layout: Layout, prefill_tokens: float, costs: Costs = BURST_LONG):
    """``layout`` at a burst's rate, far past what either layout serves."""
    return predict(layout, costs, 16.0, PROMPT, OUTPUT, 20.0, SLO, 10.0, KV,
                   prefill_tokens=prefill_tokens)


def test_one_prompt_a_step_where_the_extend_step_is_unknown():
    for degree in (1, 2):
        assert queue_prefill(BURST, degree, PROMPT, 98.0, 0.0) == BURST.prefill(degree, PROMPT)


def test_a_prompt_pays_its_share_of_a_full_step():
    # one engine: its measured 4096-token step
    share = BURST_LONG.prefill(1, 4096.0) * PROMPT / 4096.0
    assert queue_prefill(BURST_LONG, 1, PROMPT, 98.0, 4096.0) == pytest.approx(share)
    # a curve that spreads a fixed part is cheaper per prompt in a long step ...
    assert share < BURST_LONG.prefill(1, PROMPT)
    # ... one that grows dearer per token, dearer (the group: up to its 1152-token step)
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
    assert saturated(tp, 0.0, BURST).throughput > 1.2 * saturated(dp, 0.0, BURST).throughput
    # SGLang's 4096-token extend steps (its CPU default): level, the group's lead gone
    new_dp, new_tp = saturated(dp, 4096.0), saturated(tp, 4096.0)
    assert new_dp.saturated and new_tp.saturated
    assert new_tp.throughput < (1.0 + GOODPUT_MARGIN) * new_dp.throughput


@pytest.mark.parametrize(("prefill_tokens", "costs", "layout"), [
    (0, BURST_LONG, "1xTP2"), (4096, BURST, "1xTP2"), (4096, BURST_LONG, "2xDP")])
def test_the_burst_that_kept_the_group_now_leaves_it(prefill_tokens, costs, layout):
    """The node's decision at 10.4 s into the burst: the group kept where prompts were
    priced one a step, or where one engine's long step was not measured (it is priced
    no longer than measured: ``Costs.measured_prefill``); DP taken at SGLang's extend
    step with one engine's measured (``BURST_LONG``)."""
    chooser = LayoutChooser(2, (2,), 10.0, 0.1, 16384.0, prefill_tokens=prefill_tokens)
    chooser.current, chooser.since = Layout((2,)), 90.0
    choice = chooser.choose(100.0, costs, BURST_TRAFFIC, 1, 22, NODE_SLO, SwitchCosts(1.026))
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


#: The node's costs 10.24 s into cpu-burst's first burst (hidden-1024 model, session
#: 87, round 1): one engine's prefill measured to 134 tokens, its last segment 3.75 ms
#: a token between two noisy points; the group's to 3,904 (the calibration's batch).
NOISY = Costs(
    {1: 29.1705, 2: 20.0862},
    {
        1: Curve.of(
            [(1, 29.1705), (2, 32.6968), (3, 36.2879), (4, 59.1628), (8, 79.0104),
             (16, 79.2992), (30.82, 100.6406)],
            [(6.17, 54.1476), (59, 114.2257), (119.41, 152.4144), (134, 207.1621)],
        ),
        2: Curve.of(
            [(1, 20.0862), (2, 22.0441), (3, 23.148), (4, 35.9605), (8, 45.8854),
             (16, 48.246), (32, 60.5393)],
            [(12, 56.6772), (20, 44.1131), (116.83, 97.1325), (256, 259.5408),
             (3904, 2789.0782)],
        ),
    },
    stretch={1: 1.078, 2: 1.101}, live_ms={1: 32.2404, 2: 22.2212},
    live_low_ms={1: 29.8835, 2: 21.0343}, stretch_last={1: 1.078, 2: 1.101},
)
NOISY_TRAFFIC = Traffic(now=100.0, rate_short=7.0, rate_long=6.2101, prompt=113.1,
                        output=64.69, n_short=21, n_long=21, window_s=3.0)


def test_a_step_is_priced_no_longer_than_the_mode_has_measured():
    # one engine measured to 134 tokens: a deep queue's step read there, not at 4096
    # on the last segment's slope (15 s: a prompt's share 2.8x its own step)
    assert NOISY.measured_prefill(1) == 134.0 and NOISY.measured_prefill(2) == 3904.0
    at_134 = NOISY.prefill(1, 134.0) * 113.1 / 134.0
    assert queue_prefill(NOISY, 1, 113.1, 92.0, 4096.0) == pytest.approx(at_134)
    assert NOISY.prefill(1, 4096.0) * 113.1 / 4096.0 > 2.5 * NOISY.prefill(1, 113.1)
    # the group: its own long step, measured
    at_3904 = NOISY.prefill(2, 3904.0) * 113.1 / 3904.0
    assert queue_prefill(NOISY, 2, 113.1, 184.0, 4096.0) == pytest.approx(at_3904)
    # nothing measured: one prompt a step
    bare = Costs({1: 30.0, 2: 20.0})
    assert queue_prefill(bare, 1, 100.0, 50.0, 4096.0) == bare.prefill(1, 100.0)


def test_the_burst_an_extrapolated_step_kept_in_the_group_leaves_it():
    """The node's decision at 10.24 s on its logged inputs: the group kept (the node
    read DP's saturated output at half the group's); static DP served 2.4x static
    TP's goodput on that run."""
    chooser = LayoutChooser(2, (2,), 10.0, 0.1, 16384.0, prefill_tokens=4096.0)
    chooser.current, chooser.since = Layout((2,)), 90.0
    choice = chooser.choose(100.0, NOISY, NOISY_TRAFFIC, 3, 10, Slo(2718.2, 43.76),
                            SwitchCosts(2.53, 49.78))
    assert choice.layout.name == "2xDP", choice.reason
