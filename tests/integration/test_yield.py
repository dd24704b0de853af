"""A running group yields to DP work within one step (no request waits for a release).

On the shared 2-engine server: while a long TP-2 request runs in a group, a burst of DP
requests arrives. Each engine runs one DP step between two TP steps whenever it has DP
work, so the burst starts within two group steps (asserted from the engines' step
counters) and finishes while the group is still running; the group's request goes on
with its KV kept (nothing recomputed) and both produce exactly transformers' tokens.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.node import engine_counter, greedy, status, until, wait_idle
from tests.reference import greedy_tokens, prompts

pytestmark = pytest.mark.integration

TP2 = {"X-Flying-TP": "2"}
LONG = 1200  # tokens the group's request generates: long enough to outlast the burst
BURST = 6  # DP requests
BURST_TOKENS = 12


def test_dp_burst_during_a_long_session_starts_within_two_group_steps(dp2_server, demo_model_dir):
    before = wait_idle(dp2_server)
    long_prompt, *burst = prompts(1 + BURST, 24, seed=41)
    result: dict = {}
    group = threading.Thread(
        target=lambda: result.update(greedy(dp2_server, long_prompt, LONG, TP2)), daemon=True
    )
    group.start()
    deadline = time.monotonic() + 120
    while True:  # the group's session is running: some TP steps done, nothing released
        doc = status(dp2_server)
        if all(m == "tp2" for m in engine_counter(doc, "mode")) and doc["totals"].get("tp_steps", 0) > (
            before["totals"].get("tp_steps", 0) + 20
        ):
            break
        assert time.monotonic() < deadline, "the TP-2 session did not start"
        time.sleep(0.05)
    releases = doc["totals"]["releases"]

    answers: list = [None] * BURST
    threads = [
        threading.Thread(
            target=lambda i=i: answers.__setitem__(i, greedy(dp2_server, burst[i], BURST_TOKENS)),
            daemon=True,
        )
        for i in range(BURST)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    during = status(dp2_server)
    assert group.is_alive(), (
        "the burst finished only after the group request ended: DP work waited for the "
        "release (or LONG is too short for this machine)"
    )
    # The burst finished while the session ran: nothing waited for its release.
    assert during["totals"]["releases"] == releases
    assert all(a is not None and a["meta_info"]["flying"]["mode"] == "dp" for a in answers)
    # Each engine ran DP steps between the group's steps, and no engine ran more than
    # one TP step in a row while it had DP work waiting. A busy engine publishes its
    # counters every 100 ms, and the burst may take less: read them once they show it
    # (the release counted above is published at once: it is a forced update).
    def dp_steps(doc: dict) -> list[int]:
        return [d - b for d, b in zip(engine_counter(doc, "dp_steps_in_session"),
                                      engine_counter(before, "dp_steps_in_session"), strict=True)]

    until(lambda: sum(dp_steps(status(dp2_server))) >= BURST_TOKENS,
          f"fewer than {BURST_TOKENS} DP steps ran in the session", timeout=10)
    during = status(dp2_server)
    assert max(engine_counter(during, "max_dp_wait_steps")) <= 2, during

    group.join(timeout=600)
    assert result["meta_info"]["flying"]["mode"] == "tp"
    assert result["output_ids"] == greedy_tokens(demo_model_dir, long_prompt, LONG)
    for prompt, answer in zip(burst, answers, strict=True):
        assert answer["output_ids"] == greedy_tokens(demo_model_dir, prompt, BURST_TOKENS)
    after = wait_idle(dp2_server)
    assert after["totals"]["releases"] == releases + 2  # this session, on both members
    for key in ("free_kv_slots", "free_req_rows"):
        assert engine_counter(after, key) == engine_counter(before, key)
