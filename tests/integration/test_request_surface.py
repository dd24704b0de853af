"""The request surface over real HTTP: what a client of an OpenAI-compatible server sends.

Requests without max_tokens, bad control inputs (400 with a reason, server alive),
streams in a group (constrained decoding: ``test_constrained``)."""

from __future__ import annotations

import json

import pytest
import requests

pytestmark = pytest.mark.integration

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}]}
TP2 = {"X-Flying-TP": "2"}
HIGH = {"X-Priority": "high"}


def _binds(server) -> int:
    return requests.get(server.url + "/flying/status", timeout=30).json()["totals"]["binds"]


def _alive(server) -> None:
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    body = server.post("/generate", {"text": "ok", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert body.status_code == 200, body.text
    assert body.json()["meta_info"]["completion_tokens"] == 2


def _error(resp) -> str:
    body = resp.json()
    err = body.get("error", body)
    return err["message"] if isinstance(err, dict) else str(err)


# -- max_new_tokens absent / None --------------------------------------------------------


@pytest.mark.parametrize("headers", [{}, TP2, HIGH], ids=["dp", "tp2", "priority"])
def test_chat_without_max_tokens(dp2_server, headers):
    before = _binds(dp2_server)
    resp = dp2_server.post("/v1/chat/completions", CHAT, headers=headers, timeout=300)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] >= 1
    if headers:
        assert _binds(dp2_server) > before, "the request should have run in a group"
    _alive(dp2_server)


@pytest.mark.parametrize("headers", [{}, TP2, HIGH], ids=["dp", "tp2", "priority"])
def test_generate_with_null_max_new_tokens(dp2_server, headers):
    payload = {"text": "Hello", "sampling_params": {"max_new_tokens": None, "temperature": 0}}
    resp = dp2_server.post("/generate", payload, headers=headers, timeout=300)
    assert resp.status_code == 200, resp.text
    meta = resp.json()["meta_info"]
    assert meta["completion_tokens"] >= 1
    assert meta["flying"]["mode"] == ("tp" if headers else "dp"), meta["flying"]


# -- control inputs ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,payload,headers,needle",
    [
        ("/generate", {"text": "x", "routing_key": "flying:tp=-2"}, {}, "reserved"),
        ("/generate", {"text": "x", "routing_key": "flying:tp=2;mine"}, {}, "reserved"),
        ("/generate", {"text": "x", "routing_key": "x" * 2000}, {}, "at most 1024"),
        ("/generate", {"text": "x", "routing_key": 12}, {}, "routing_key"),
        ("/generate", {"text": "x"}, {"x-smg-routing-key": "flying:tp=2"}, "reserved"),
        ("/v1/chat/completions", CHAT, {"x-smg-routing-key": "flying:tp=-2"}, "reserved"),
        ("/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": 2},
         {"x-smg-routing-key": "Flying:tp=2"}, "reserved"),
    ],
)
def test_bad_routing_keys_are_400(dp2_server, path, payload, headers, needle):
    resp = dp2_server.post(path, payload, headers=headers)
    assert resp.status_code == 400, resp.text
    assert needle in resp.text
    _alive(dp2_server)


@pytest.mark.parametrize(
    "path,payload,headers",
    [
        ("/generate", {"text": "", "sampling_params": {"max_new_tokens": 4}}, {}),
        ("/generate", {"input_ids": [], "sampling_params": {"max_new_tokens": 4}}, {}),
        ("/generate", {"text": "", "sampling_params": {"max_new_tokens": 4}}, TP2),
        ("/v1/completions", {"model": "demo", "prompt": "", "max_tokens": 4}, {}),
        ("/generate", {"input_ids": [1, 99999], "sampling_params": {"max_new_tokens": 4}}, {}),
        ("/generate", {"input_ids": [1, 99999], "sampling_params": {"max_new_tokens": 4}}, TP2),
        ("/generate", {"input_ids": [-5, 1], "sampling_params": {"max_new_tokens": 4}}, {}),
        ("/v1/completions", {"model": "demo", "prompt": [1, 99999], "max_tokens": 4}, {}),
    ],
)
def test_an_empty_prompt_or_an_unknown_token_is_400_and_the_node_serves_on(
        dp2_server, path, payload, headers):
    """SGLang's forward raises on a prompt of no tokens (the demo tokenizer adds no BOS,
    so ``"text": ""`` is 0 tokens) and on a token id outside the vocabulary, and the
    engine went down with it: in a group, then in DP where containment re-ran it."""
    resp = dp2_server.post(path, payload, headers=headers)
    assert resp.status_code == 400, resp.text
    assert "empty" in _error(resp) or "vocabulary" in _error(resp)
    _alive(dp2_server)


@pytest.mark.parametrize(
    "path,payload,headers,needle",
    [
        ("/generate", {"text": "x"}, {"X-Priority": "urgent"}, "X-Priority"),
        ("/generate", {"text": "x"}, {"X-Priority": "99999999999999999999"}, "X-Priority"),
        ("/generate", {"text": "x", "priority": "high"}, {}, "priority"),
        ("/generate", {"text": "x", "priority": 1.5}, {}, "priority"),
        ("/v1/chat/completions", {**CHAT, "priority": "high"}, {}, "priority"),
        ("/v1/chat/completions", CHAT, {"X-Priority": "hihg"}, "X-Priority"),
        ("/generate", {"text": "x"}, {"X-Flying-TP": "3"}, "X-Flying-TP"),
        ("/generate", {"text": "x"}, {"X-Flying-TP": "two"}, "X-Flying-TP"),
    ],
)
def test_bad_priority_and_degree_are_400(dp2_server, path, payload, headers, needle):
    resp = dp2_server.post(path, payload, headers=headers)
    assert resp.status_code == 400, resp.text
    assert needle in resp.text
    _alive(dp2_server)


def test_bad_header_on_a_stream_is_a_plain_400(dp2_server):
    resp = dp2_server.post(
        "/generate", {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 2}},
        headers={"X-Flying-TP": "banana"},
    )
    assert resp.status_code == 400 and "X-Flying-TP" in _error(resp)


def test_stream_in_a_group_reports_tp(dp2_server):
    chunks = []
    with requests.post(
        dp2_server.url + "/generate",
        json={"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 4}},
        headers=TP2, stream=True, timeout=120,
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[6:]))
    assert chunks and chunks[-1]["meta_info"]["flying"]["mode"] == "tp"


def test_parallel_samples_keep_the_requests_group(dp2_server):
    """``n`` > 1: SGLang splits the request into sub-requests; each keeps the batch's
    placement (``X-Flying-TP``) and reports it."""
    payload = {"text": "hi", "sampling_params": {"max_new_tokens": 6, "n": 2, "temperature": 0.8},
               "return_logprob": True, "top_logprobs_num": 2}
    resp = dp2_server.post("/generate", payload, headers=TP2, timeout=300)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert len(body) == 2
    assert [b["meta_info"]["flying"]["mode"] for b in body] == ["tp", "tp"], body
    assert all(len(b["meta_info"]["output_token_logprobs"]) == 6 for b in body)
    batch = {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    resp = dp2_server.post("/generate", batch, headers=TP2, timeout=300)
    assert resp.status_code == 200, resp.text
    assert [b["meta_info"]["flying"]["mode"] for b in resp.json()] == ["tp", "tp"]
    _alive(dp2_server)
