"""A TP group never takes the node down: sampling, aborts, health and faults in a group.

On the shared 2-engine server (``dp2_server``, with the test-only fault switch mounted):
- a sampled request in a group, after DP traffic has advanced the engines' generators
  differently, is a true sample of the model (every token inside the model's top-k);
- a chat request without max_tokens runs in a group and equals its DP answer;
- a client that disconnects from a group's stream ends the session within steps;
- /health_generate answers while a session runs;
- a fault injected at each stage of a session ends that session only: the request is
  answered (re-run in DP when nothing was sent yet, resumed there from its tokens so
  far when it had, an explicit error when only a group holds it), the
  engines return to DP with their KV slots and request rows, no store key or /dev/shm
  segment is left, and the next group request works.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import requests

from tests.conftest import MAX_TOTAL_TOKENS
from tests.node import engine_counter, status, wait_idle
from tests.reference import greedy_tokens, prompts

pytestmark = pytest.mark.integration

TP2 = {"X-Flying-TP": "2"}
SHM = Path("/dev/shm")


def _greedy(server, ids, n, headers=None, stream=False):
    payload = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    return server.post("/generate", payload, headers=headers or {}, timeout=300)


def _top_k_sets(model_dir, prompt: list[int], out: list[int], k: int) -> list[set[int]]:
    """The model's top-k next tokens at every output position (transformers)."""
    import torch

    from tests.reference import _model

    model = _model(str(model_dir))
    ids = torch.tensor([prompt + out[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    start = len(prompt) - 1
    return [set(logits[start + i].topk(k).indices.tolist()) for i in range(len(out))]


def test_sampled_request_in_a_group_is_a_sample_of_the_model(dp2_server, demo_model_dir):
    for i in range(3):  # advance the engines' generators differently (round robin: 0, 1, 0)
        r = dp2_server.post("/generate", {
            "text": f"warm {i}", "sampling_params": {"max_new_tokens": 8 + i, "temperature": 1.0},
        })
        assert r.status_code == 200, r.text
    ids = prompts(1, 12, seed=21)[0]
    resp = dp2_server.post("/generate", {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 64, "temperature": 1.0, "top_k": 2,
                            "ignore_eos": True},
    }, headers=TP2)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["meta_info"]["flying"]["mode"] == "tp"
    out = body["output_ids"]
    assert len(out) == 64
    allowed = _top_k_sets(demo_model_dir, ids, out, 2)
    outside = [i for i, (t, s) in enumerate(zip(out, allowed, strict=True)) if t not in s]
    assert not outside, f"{len(outside)} of {len(out)} tokens outside the model's top 2"
    wait_idle(dp2_server)


def test_chat_without_max_tokens_in_a_group_equals_dp(dp2_server):
    payload = {"model": "demo", "messages": [{"role": "user", "content": "tell me more"}],
               "temperature": 0}
    tp = dp2_server.post("/v1/chat/completions", payload, headers=TP2)
    dp = dp2_server.post("/v1/chat/completions", payload)
    assert tp.status_code == dp.status_code == 200, (tp.text, dp.text)
    tp, dp = tp.json(), dp.json()
    assert tp["choices"][0]["message"]["content"] == dp["choices"][0]["message"]["content"]
    assert tp["usage"]["completion_tokens"] == dp["usage"]["completion_tokens"] > 0
    wait_idle(dp2_server)


def test_disconnect_from_a_group_stream_ends_the_session(dp2_server):
    before = wait_idle(dp2_server)["totals"]
    payload = {"input_ids": prompts(1, 8, seed=7)[0], "stream": True,
               "sampling_params": {"max_new_tokens": 1800, "temperature": 0, "ignore_eos": True}}
    with requests.post(dp2_server.url + "/generate", json=payload, headers=TP2, stream=True,
                       timeout=120) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith(b"data:") for line in got)
    t0 = time.monotonic()
    doc = wait_idle(dp2_server, timeout=30)
    took = time.monotonic() - t0
    assert doc["totals"]["client_aborts"] > before["client_aborts"]
    # 1800 tokens take well over 5 s on this machine; the abort ends it within steps
    assert took < 5.0, f"group kept decoding {took:.1f} s after the disconnect"


def test_health_answers_while_a_session_runs(dp2_server):
    payload = {"input_ids": prompts(1, 8, seed=8)[0],
               "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.update(r=dp2_server.post("/generate", payload, headers=TP2))
    )
    worker.start()
    deadline = time.monotonic() + 30
    while not any(e["mode"] == "tp2" for e in status(dp2_server)["engines"]):
        assert time.monotonic() < deadline, "the session never showed in /flying/status"
        time.sleep(0.1)
    t0 = time.monotonic()
    health = requests.get(dp2_server.url + "/health_generate", timeout=30)
    assert health.status_code == 200
    assert time.monotonic() - t0 < 20.0  # SGLang's HEALTH_CHECK_TIMEOUT
    worker.join(timeout=300)
    assert result["r"].status_code == 200
    wait_idle(dp2_server)


def _arm(server, stage: str, rank: int, after: int = 0) -> None:
    r = server.post("/flying/test/fault", {"stage": stage, "rank": rank, "after": after})
    assert r.status_code == 200, r.text


def _segments() -> set[str]:
    return {p.name for p in SHM.iterdir() if p.name.startswith("flying")} if SHM.is_dir() else set()


@pytest.mark.parametrize(
    ("stage", "rank"),
    [("bind", 1), ("scope", 0), ("step", 1), ("sample", 1), ("sample", 0), ("release", 0)],
)
def test_a_fault_in_a_session_stays_in_it(dp2_server, demo_model_dir, stage, rank):
    before = wait_idle(dp2_server)
    segments = _segments()
    ids = prompts(1, 10, seed=5)[0]
    want = greedy_tokens(demo_model_dir, ids, 12)
    _arm(dp2_server, stage, rank)
    resp = _greedy(dp2_server, ids, 12, headers=TP2)
    assert resp.status_code == 200, resp.text  # nothing was sent yet: re-run in DP
    assert resp.json()["output_ids"] == want
    after = wait_idle(dp2_server)
    failed = after["totals"]["faulted_sessions"] + after["totals"]["aborted_binds"]
    assert failed > before["totals"]["faulted_sessions"] + before["totals"]["aborted_binds"]
    assert after["store_keys"] == before["store_keys"]
    assert _segments() == segments
    again = _greedy(dp2_server, ids, 12, headers=TP2).json()  # the group works again
    assert again["meta_info"]["flying"]["mode"] == "tp"
    assert again["output_ids"] == want
    assert wait_idle(dp2_server)["store_keys"] == before["store_keys"]


def _stream_with_fault(server, ids: list[int], n: int) -> list[dict]:
    """Stream a greedy TP-2 request of ``n`` tokens whose session faults (member 1)
    after 20 group steps; returns its chunks."""
    wait_idle(server)
    _arm(server, "step", 1, after=20)
    payload = {"input_ids": ids, "stream": True,
               "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    chunks = []
    with requests.post(server.url + "/generate", json=payload, headers=TP2, stream=True,
                       timeout=300) as resp:
        assert resp.status_code == 200, resp.text
        for line in resp.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert len(chunks) > 1, chunks
    return chunks


def test_a_fault_after_tokens_were_streamed_resumes_the_stream_in_dp(dp2_server, demo_model_dir):
    """The stream goes on in DP from its tokens so far (SGLang's retraction: prompt and
    output prefilled again): the client sees every token once, transformers' greedy
    tokens, and one normal end."""
    before = wait_idle(dp2_server)
    ids = prompts(1, 9, seed=9)[0]
    chunks = _stream_with_fault(dp2_server, ids, 200)
    # SGLang's chunks are cumulative: each extends the one before (nothing sent twice,
    # nothing dropped across the fault), the last one is the whole answer
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert chunks[-1]["output_ids"] == greedy_tokens(demo_model_dir, ids, 200)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length", chunks[-1]
    after = wait_idle(dp2_server)
    assert after["totals"]["faulted_sessions"] > before["totals"]["faulted_sessions"]
    assert after["totals"]["resumed_in_dp"] == before["totals"]["resumed_in_dp"] + 1
    for key in ("free_kv_slots", "free_req_rows"):
        assert engine_counter(after, key) == engine_counter(before, key)


def test_a_fault_after_tokens_were_streamed_beyond_one_engine_ends_with_an_error(dp2_server):
    """A request only a group holds (prompt + bound beyond one engine's KV) cannot go on
    in DP: its stream ends with an explicit error, and the node serves on."""
    before = wait_idle(dp2_server)
    ids = prompts(1, MAX_TOTAL_TOKENS, seed=10)[0]  # with its bound: more than one engine
    last = _stream_with_fault(dp2_server, ids, 100)[-1]
    finish = (last.get("meta_info") or {}).get("finish_reason") or last.get("error") or {}
    assert "group failed" in json.dumps(finish), last
    after = wait_idle(dp2_server)
    assert after["totals"]["resumed_in_dp"] == before["totals"]["resumed_in_dp"]
    assert dp2_server.generate_ids([5, 6, 7], 3)["meta_info"]["completion_tokens"] == 3
