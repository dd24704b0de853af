"""Running requests move between layouts with their KV (``--flying-move-to-dp all``).

A long TP-2 request runs in a group; a DP request arrives. At the next group step the
session ends: the group's request moves into DP on the leader with its KV gathered from
the other member (no recompute), and the DP request runs beside it. Both produce
exactly transformers' greedy tokens, every prompt is prefilled once (the engines'
prefill counters), and KV slots and request rows return to their initial counts.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import demo_server
from tests.node import engine_counter, greedy, status, wait_idle
from tests.reference import greedy_tokens, prompts

pytestmark = pytest.mark.integration

TP2 = {"X-Flying-TP": "2"}
LONG = 600  # tokens the group's request generates: it is still running when DP work arrives
SHORT = 16


@pytest.fixture(scope="module")
def move_server(demo_model_dir, tmp_path_factory):
    yield from demo_server(
        demo_model_dir, tmp_path_factory.mktemp("move") / "server.log",
        "--flying-move-to-dp", "all",
    )


def _total(doc: dict, key: str) -> int:
    return sum(engine_counter(doc, key))


def _wait_group_running(server, before: dict, steps: int = 20) -> None:
    deadline = time.monotonic() + 120
    while True:
        doc = status(server)
        if all(m == "tp2" for m in engine_counter(doc, "mode")) and (
            doc["totals"]["tp_steps"] > before["totals"]["tp_steps"] + steps
        ):
            return
        assert time.monotonic() < deadline, "the TP-2 session did not start"
        time.sleep(0.05)


def test_a_running_group_request_moves_to_dp_when_dp_work_arrives(move_server, demo_model_dir):
    before = wait_idle(move_server)
    long_prompt, short_prompt = prompts(2, 40, seed=73)
    result: dict = {}
    group = threading.Thread(
        target=lambda: result.update(greedy(move_server, long_prompt, LONG, TP2)), daemon=True
    )
    group.start()
    _wait_group_running(move_server, before)
    short = greedy(move_server, short_prompt, SHORT)
    group.join(timeout=600)
    after = wait_idle(move_server)

    assert short["meta_info"]["flying"]["mode"] == "dp"
    assert short["output_ids"] == greedy_tokens(demo_model_dir, short_prompt, SHORT)
    flying = result["meta_info"]["flying"]
    assert flying["mode"] == "tp" and "moved" in flying, flying
    assert result["output_ids"] == greedy_tokens(demo_model_dir, long_prompt, LONG)
    assert _total(after, "moved_to_dp") - _total(before, "moved_to_dp") == 1
    moved_tokens = _total(after, "moved_tokens") - _total(before, "moved_tokens")
    assert len(long_prompt) < moved_tokens < len(long_prompt) + LONG, moved_tokens
    # Nothing prefilled twice: the two prompts, once each (distinct prompts: no cache hit).
    prefilled = _total(after, "prefill_tokens") - _total(before, "prefill_tokens")
    assert prefilled == len(long_prompt) + len(short_prompt), prefilled
    # The session ended at the move, long before its request finished.
    assert after["totals"]["tp_steps"] - before["totals"]["tp_steps"] < 2 * LONG
    for key in ("free_kv_slots", "free_req_rows"):
        assert engine_counter(after, key) == engine_counter(before, key)


def test_a_running_dp_request_joins_a_forming_group(move_server, demo_model_dir):
    before = wait_idle(move_server)
    dp_prompt, tp_prompt = prompts(2, 36, seed=79)
    result: dict = {}

    def run_dp():  # pinned to engine 0, the TP-2 group's leader
        payload = {
            "input_ids": dp_prompt, "routed_dp_rank": 0,
            "sampling_params": {"max_new_tokens": LONG, "temperature": 0, "ignore_eos": True},
        }
        r = move_server.post("/generate", payload, timeout=600)
        assert r.status_code == 200, r.text
        result.update(r.json())

    dp = threading.Thread(target=run_dp, daemon=True)
    dp.start()
    deadline = time.monotonic() + 120
    while _total(status(move_server), "prefill_tokens") - _total(before, "prefill_tokens") < len(dp_prompt):
        assert time.monotonic() < deadline, "the DP request did not start"
        time.sleep(0.05)
    time.sleep(0.5)  # some DP decode steps
    tp = greedy(move_server, tp_prompt, SHORT, TP2)
    dp.join(timeout=600)
    after = wait_idle(move_server)

    assert tp["meta_info"]["flying"]["mode"] == "tp"
    assert tp["output_ids"] == greedy_tokens(demo_model_dir, tp_prompt, SHORT)
    assert result["output_ids"] == greedy_tokens(demo_model_dir, dp_prompt, LONG)
    assert _total(after, "moved_to_tp") - _total(before, "moved_to_tp") == 1
    prefilled = _total(after, "prefill_tokens") - _total(before, "prefill_tokens")
    assert prefilled == len(dp_prompt) + len(tp_prompt), prefilled
    for key in ("free_kv_slots", "free_req_rows"):
        assert engine_counter(after, key) == engine_counter(before, key)
