"""DP <-> TP switching on real SGLang (2 engines of the demo model, CPU, float32)."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from tests.conftest import MAX_TOTAL_TOKENS
from tests.reference import greedy_tokens, prompts

pytestmark = pytest.mark.integration

TP2 = {"X-Flying-TP": "2"}


def _generate(server, ids, n, headers=None, timeout=300):
    payload = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    resp = server.post("/generate", payload, headers=headers or {}, timeout=timeout)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _status(server):
    return requests.get(server.url + "/flying/status", timeout=30).json()


def _settled_status(server, timeout=30):
    """Status once every session has been released and published (an HTTP answer can
    arrive before its session's release is published)."""
    deadline = time.monotonic() + timeout
    while True:
        doc = _status(server)
        engines = doc["engines"]
        if all(e["mode"] == "dp" for e in engines) and len({e["binds"] for e in engines}) == 1:
            if doc["totals"]["binds"] == doc["totals"]["releases"]:
                return doc
        assert time.monotonic() < deadline, f"sessions did not settle: {doc}"
        time.sleep(0.2)


def _wait_idle_status(server, timeout=30):
    """Wait until every engine reports all KV slots free."""
    deadline = time.monotonic() + timeout
    while True:
        doc = _status(server)
        engines = doc["engines"]
        if all(e.get("free_kv_slots") == e.get("total_kv_slots") for e in engines):
            return doc
        if time.monotonic() > deadline:
            return doc
        # status is published at binds and releases: poke with a 1-token TP request
        _generate(server, [7, 8, 9], 1, headers=TP2)
        time.sleep(0.5)


def test_tp2_tokens_equal_dp_and_transformers(dp2_server, demo_model_dir):
    for ids in prompts(3, 11, seed=3):
        tp = _generate(dp2_server, ids, 16, headers=TP2)
        dp = _generate(dp2_server, ids, 16)
        assert tp["meta_info"]["flying"] == {
            "mode": "tp", "degree": 2, "ranks": [0, 1], "node": f"127.0.0.1:{dp2_server.port}"
        }
        assert dp["meta_info"]["flying"]["mode"] == "dp"
        assert tp["output_ids"] == dp["output_ids"] == greedy_tokens(demo_model_dir, ids, 16)


def test_tp_on_openai_endpoints(dp2_server):
    body = dp2_server.post(
        "/v1/chat/completions",
        {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
         "ignore_eos": True},  # sampled: an early EOS would end it before max_tokens
        headers=TP2,
    ).json()
    assert body["usage"]["completion_tokens"] == 4


def test_bad_headers_are_400_and_change_nothing(dp2_server):
    before = _settled_status(dp2_server)["totals"]["binds"]
    bad = [("X-Flying-TP", "3"), ("X-Flying-TP", "8"), ("X-Flying-TP", "two"),
           ("X-Priority", "urgent!")]
    for header, value in bad:
        resp = dp2_server.post(
            "/generate",
            {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}},
            headers={header: value},
        )
        assert resp.status_code == 400, (value, resp.text)
        assert header in resp.text or "priority" in resp.text
    assert _settled_status(dp2_server)["totals"]["binds"] == before


def test_priority_request_preempts_and_dp_requests_resume_exactly(dp2_server, demo_model_dir):
    """A high-priority request arriving while both engines decode normal requests runs
    in a TP-2 group at once (hard preemption); the normal requests are paused with
    their KV kept and finish with exactly the tokens they produce alone."""
    dp_prompts = prompts(2, 20, seed=4)
    n_dp = 480  # long enough to still be decoding when the priority request comes
    results: dict[int, dict] = {}

    def run(i):
        results[i] = _generate(dp2_server, dp_prompts[i], n_dp)

    before = _status(dp2_server)["totals"]["preempted_dp_requests"]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # both DP requests are decoding now
    tp_ids = prompts(1, 13, seed=5)[0]
    tp = _generate(dp2_server, tp_ids, 24, headers={"X-Priority": "high"})
    assert tp["meta_info"]["flying"]["mode"] == "tp"
    for t in threads:
        t.join(timeout=300)
    assert tp["output_ids"] == greedy_tokens(demo_model_dir, tp_ids, 24)
    assert {results[0]["meta_info"]["dp_rank"], results[1]["meta_info"]["dp_rank"]} == {0, 1}
    for i in range(2):
        assert results[i]["output_ids"] == greedy_tokens(demo_model_dir, dp_prompts[i], n_dp)
        assert results[i]["meta_info"]["num_retractions"] == 0  # never recomputed
    assert _status(dp2_server)["totals"]["preempted_dp_requests"] > before


def test_long_prompt_is_upgraded_and_uses_two_engines_kv(dp2_server, demo_model_dir):
    """A prompt beyond one engine's KV pool runs in TP-2 with no header, using >= 99%
    of both pools, with the tokens transformers produces."""
    new = 48  # > SGLang's decode_log_interval (40): its pool-usage stats run in TP mode
    length = 2 * MAX_TOTAL_TOKENS - new - 8
    ids = prompts(1, length, seed=6)[0]
    body = _generate(dp2_server, ids, new)
    assert body["meta_info"]["flying"]["mode"] == "tp", body["meta_info"]
    used = body["meta_info"]["prompt_tokens"] + body["meta_info"]["completion_tokens"]
    assert body["meta_info"]["finish_reason"]["type"] == "length", body["meta_info"]
    assert used >= 0.99 * 2 * MAX_TOTAL_TOKENS
    assert body["output_ids"] == greedy_tokens(demo_model_dir, ids, new)


def test_kv_slots_return_to_initial_count(dp2_server):
    doc = _wait_idle_status(dp2_server)
    for e in doc["engines"]:
        assert e["mode"] == "dp"
        assert e["free_kv_slots"] == e["total_kv_slots"] == MAX_TOTAL_TOKENS, e
    assert doc["totals"]["binds"] == doc["totals"]["releases"] > 0
    # binds after the first found their reservation and scope made ready at idle
    assert doc["totals"]["standby_binds"] > 0, doc["totals"]


def test_prometheus_series_next_to_sglangs(dp2_server):
    _generate(dp2_server, [5, 6, 7], 2, headers=TP2)
    text = requests.get(dp2_server.url + "/metrics", timeout=30).text
    assert 'flying_engine_tp_degree{engine="0"}' in text
    assert "flying_binds_total" in text and "flying_switch_latency_seconds_bucket" in text
    assert 'flying_requests_total{mode="tp",priority="0"}' in text
