"""A group never takes KV a running DP request needs (the shared server: default
``--flying-move-to-dp policy``, so an explicit TP-2 session keeps its request when DP
work merely arrives).

A long DP request decodes on engine 1; an explicit TP-2 request then binds the group
[0, 1], which reserves part of engine 1's KV pool. The DP request grows until its next
decode step needs slots the session holds: plain SGLang would have had them, and
without Flying's hold SGLang aborts the request ("Out of memory even after retracting
all other requests", found by the fuzz storm with chat requests without max_tokens).
Instead that DP step is held, the session yields (its request moves into DP on the
leader with its KV), and both requests finish with transformers' greedy tokens.
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import MAX_TOTAL_TOKENS
from tests.node import engine_counter, greedy, greedy_on, status, total, until, wait_idle
from tests.reference import greedy_tokens, prompts

pytestmark = pytest.mark.integration

PROMPT = 40
#: the DP request alone nearly fills engine 1's pool (SGLang admits it: it fits)
DP_NEW = MAX_TOTAL_TOKENS - PROMPT - 150
#: the group reserves (prompt + this) / 2 slots per member: the DP request reaches them
#: while the group's request still has hundreds of tokens to go
TP_NEW = 1600


def test_a_dp_request_outgrowing_into_a_groups_reservation_is_held_not_aborted(
    dp2_server, demo_model_dir
):
    server = dp2_server
    before = wait_idle(server)
    dp_prompt, tp_prompt = prompts(2, PROMPT, seed=91)
    dp, result = greedy_on(server, dp_prompt, DP_NEW, 1)  # engine 1: a member, not the leader
    until(lambda: total(status(server), "prefill_tokens") - total(before, "prefill_tokens") >= PROMPT,
          "the DP request did not start")
    time.sleep(0.5)
    tp = greedy(server, tp_prompt, TP_NEW, {"X-Flying-TP": "2"})
    dp.join(timeout=900)
    assert result.pop("status_code") == 200, result
    after = wait_idle(server)
    for key in ("free_kv_slots", "free_req_rows"):
        assert engine_counter(after, key) == engine_counter(before, key)

    assert total(after, "dp_held_for_kv") > total(before, "dp_held_for_kv")
    assert total(after, "moved_to_dp") == total(before, "moved_to_dp") + 1
    assert "moved" in tp["meta_info"]["flying"], tp["meta_info"]["flying"]
    assert result["meta_info"]["completion_tokens"] == DP_NEW
    assert result["output_ids"] == greedy_tokens(demo_model_dir, dp_prompt, DP_NEW)
    assert tp["output_ids"] == greedy_tokens(demo_model_dir, tp_prompt, TP_NEW)
