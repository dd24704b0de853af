"""Soft preemption (``--flying-preempt soft``) on real SGLang: 2 engines of the demo model.

A high-priority request arriving while both engines decode normal requests waits until
they finish (the members drain, admitting no new DP work), then runs in a TP-2 group.
Nothing is paused, every output equals transformers'.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import demo_server
from tests.node import status
from tests.reference import greedy_tokens, prompts

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def soft_server(demo_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("soft") / "server.log"
    yield from demo_server(demo_model_dir, log, "--flying-preempt", "soft")


def test_priority_request_waits_for_members_to_drain(soft_server, demo_model_dir):
    dp_prompts = prompts(2, 20, seed=7)
    n_dp = 480
    finished: dict[int, tuple[float, dict]] = {}

    def run(i):
        body = soft_server.generate_ids(dp_prompts[i], n_dp, timeout=300)
        finished[i] = (time.monotonic(), body)

    saw_draining = threading.Event()
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            if any(e.get("draining") for e in status(soft_server)["engines"]):
                saw_draining.set()
            time.sleep(0.05)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # both DP requests are decoding now
    watcher = threading.Thread(target=watch)
    watcher.start()
    tp_ids = prompts(1, 13, seed=8)[0]
    try:
        tp = soft_server.generate_ids(tp_ids, 16, headers={"X-Priority": "high"}, timeout=300)
        tp_done = time.monotonic()
    finally:
        stop.set()
        watcher.join()
    for t in threads:
        t.join(timeout=300)

    assert tp["meta_info"]["flying"]["mode"] == "tp"
    assert tp["output_ids"] == greedy_tokens(demo_model_dir, tp_ids, 16)
    assert saw_draining.is_set(), "no engine reported draining for the bind"
    assert {finished[i][1]["meta_info"]["dp_rank"] for i in range(2)} == {0, 1}
    for i in range(2):
        done_at, body = finished[i]
        assert done_at <= tp_done  # the DP requests were let finish first
        assert body["output_ids"] == greedy_tokens(demo_model_dir, dp_prompts[i], n_dp)
        assert body["meta_info"]["num_retractions"] == 0
    doc = status(soft_server)
    assert doc["totals"]["preempted_dp_requests"] == 0
    assert doc["totals"]["binds"] >= 2
