"""Real SGLang on CPU through ``python -m flying.launch``: endpoints, equality, errors."""

from __future__ import annotations

import json
import re

import pytest
import requests

from sglang_patches import PATCHES
from tests.conftest import MAX_TOTAL_TOKENS
from tests.reference import greedy_tokens, prompts

pytestmark = pytest.mark.integration

NEW_TOKENS = 12


def test_generate_answers(dp2_server):
    body = dp2_server.post(
        "/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    ).json()
    assert body["meta_info"]["completion_tokens"] == 4  # sampled: EOS ignored, not hoped away
    assert isinstance(body["text"], str)


def test_openai_completions_plain_and_streaming(dp2_server):
    payload = {"model": "demo", "prompt": "The quick brown", "max_tokens": 5, "temperature": 0}
    plain = dp2_server.post("/v1/completions", payload).json()
    assert plain["usage"]["completion_tokens"] == 5
    chunks = []
    with requests.post(
        dp2_server.url + "/v1/completions", json={**payload, "stream": True}, stream=True,
        timeout=120,
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[6:]))
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert streamed == plain["choices"][0]["text"]


def test_chat_completions(dp2_server):
    """A chat with the model's default sampling: max_tokens bounds it; the random demo
    model may sample its EOS early (a run of CI ended one after 1 token), and then says
    so."""
    body = dp2_server.post(
        "/v1/chat/completions",
        {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6},
    ).json()
    choice, used = body["choices"][0], body["usage"]["completion_tokens"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("length", "stop"), choice
    assert used == 6 if choice["finish_reason"] == "length" else 1 <= used <= 6, body
    full = dp2_server.post(
        "/v1/chat/completions",
        {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
         "ignore_eos": True},
    ).json()
    assert full["usage"]["completion_tokens"] == 6, full


def test_greedy_equals_transformers_on_both_engines(dp2_server, demo_model_dir):
    ranks = set()
    for ids in prompts(4, 9, seed=1):
        body = dp2_server.generate_ids(ids, NEW_TOKENS)
        ranks.add(body["meta_info"]["dp_rank"])
        assert body["output_ids"] == greedy_tokens(demo_model_dir, ids, NEW_TOKENS)
    assert ranks == {0, 1}, "round-robin should have used both engines"


def test_too_long_prompt_is_http_400_and_server_keeps_serving(dp2_server):
    """Beyond the whole node's KV (2 engines): a clear 400 naming the limit."""
    too_long = prompts(1, 2 * MAX_TOTAL_TOKENS + 100, seed=2)[0]
    resp = dp2_server.post(
        "/generate", {"input_ids": too_long, "sampling_params": {"max_new_tokens": 2}}
    )
    assert resp.status_code == 400
    assert "exceeds the node's KV capacity" in resp.text
    assert "largest TP degree 2" in resp.text
    assert dp2_server.generate_ids([5, 6, 7], 2)["meta_info"]["completion_tokens"] == 2


def test_every_process_applied_every_hook(dp2_server):
    lines = re.findall(r"flying: applied (\d+)/(\d+) hooks in pid (\d+)", dp2_server.log())
    # main (HTTP + tokenizer), DP controller, 2 engines, detokenizer
    assert len({pid for _, _, pid in lines}) >= 5, lines
    assert all(int(a) == int(b) == len(PATCHES) for a, b, _ in lines)
