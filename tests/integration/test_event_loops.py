"""Groups under both of SGLang's event loops.

Flying's servers run SGLang's default loop (``event_loop_overlap``: a step's results are
processed while the next step runs); every other integration test runs there. A user's
own ``--disable-overlap-schedule`` (SGLang's normal loop) keeps working: this module
starts one such server and runs the group mechanics on it: greedy tokens equal
transformers' in DP and in a TP-2 group, a running group request moves to DP and a
running DP request joins a group with their KV, and a fault in a session ends it only.
Each engine reports the loop it runs in /flying/status (``overlap_loop``).
"""

from __future__ import annotations

import pytest

from tests.conftest import SLOWER, demo_server
from tests.node import delta, dp_then_tp, engine_counter, greedy, settled, tp_then_dp, wait_idle
from tests.reference import greedy_tokens, prompts

pytestmark = pytest.mark.integration

TP2 = {"X-Flying-TP": "2"}
LONG, SHORT = 400, 12


@pytest.fixture(scope="module")
def normal_loop_server(demo_model_dir, tmp_path_factory):
    yield from demo_server(
        demo_model_dir, tmp_path_factory.mktemp("normal-loop") / "server.log",
        "--disable-overlap-schedule", "--flying-move-to-dp", "all",
        env={"FLYING_TEST_FAULTS": "1", **SLOWER},
    )


def test_flying_runs_sglangs_default_overlap_loop(dp2_server, demo_model_dir):
    """A group's steps overlap there too (each result processed after the next group
    step is launched), with the group's tokens equal to transformers'."""
    before = wait_idle(dp2_server)
    assert engine_counter(before, "overlap_loop") == [True, True]
    ids = prompts(1, 14, seed=37)[0]
    tp = greedy(dp2_server, ids, SHORT, TP2)
    assert tp["meta_info"]["flying"]["mode"] == "tp"
    assert tp["output_ids"] == greedy_tokens(demo_model_dir, ids, SHORT)
    after = settled(dp2_server, before)
    steps = delta(after, before, "tp_steps")
    # every member keeps every step's result for the loop but the one holding the last
    # token; the prefill's too (its first token comes when the next step ends, as in
    # SGLang's TP), though nothing else ran and its request was handed in at the bind
    assert steps == 2 * SHORT and delta(after, before, "overlapped_tp_steps") == steps - 2


def test_a_users_normal_loop_is_kept_and_groups_run_in_it(normal_loop_server, demo_model_dir):
    before = wait_idle(normal_loop_server)
    assert engine_counter(before, "overlap_loop") == [False, False]
    ids = prompts(1, 14, seed=31)[0]
    want = greedy_tokens(demo_model_dir, ids, SHORT)
    dp = greedy(normal_loop_server, ids, SHORT)
    tp = greedy(normal_loop_server, ids, SHORT, TP2)
    assert dp["meta_info"]["flying"]["mode"] == "dp" and tp["meta_info"]["flying"]["mode"] == "tp"
    assert dp["output_ids"] == want and tp["output_ids"] == want
    after = settled(normal_loop_server, before)
    assert delta(after, before, "tp_steps") > 0 and delta(after, before, "overlapped_tp_steps") == 0


def test_requests_move_both_ways_in_the_normal_loop(normal_loop_server, demo_model_dir):
    long_prompt, short_prompt = prompts(2, 30, seed=33)
    before, long, short = tp_then_dp(normal_loop_server, long_prompt, short_prompt, 2, LONG, SHORT)
    assert "moved" in long["meta_info"]["flying"], long["meta_info"]
    assert long["output_ids"] == greedy_tokens(demo_model_dir, long_prompt, LONG)
    assert short["output_ids"] == greedy_tokens(demo_model_dir, short_prompt, SHORT)
    after = settled(normal_loop_server, before)
    assert delta(after, before, "moved_to_dp") == 1

    long_prompt, short_prompt = prompts(2, 30, seed=35)
    before, long, short = dp_then_tp(normal_loop_server, long_prompt, short_prompt, 2, LONG, SHORT)
    assert long["output_ids"] == greedy_tokens(demo_model_dir, long_prompt, LONG)
    assert short["output_ids"] == greedy_tokens(demo_model_dir, short_prompt, SHORT)
    after = settled(normal_loop_server, before)
    assert delta(after, before, "moved_to_tp") == 1
    assert delta(after, before, "prefill_tokens") == len(long_prompt) + len(short_prompt)


def test_a_fault_in_a_session_stays_in_it_in_the_normal_loop(normal_loop_server, demo_model_dir):
    before = wait_idle(normal_loop_server)
    r = normal_loop_server.post("/flying/test/fault", {"stage": "step", "rank": 1})
    assert r.status_code == 200, r.text
    ids = prompts(1, 10, seed=37)[0]
    body = greedy(normal_loop_server, ids, SHORT, TP2)
    assert body["output_ids"] == greedy_tokens(demo_model_dir, ids, SHORT)
    after = settled(normal_loop_server, before)
    assert delta(after, before, "faulted_sessions") >= 1
