"""Constrained decoding in a TP group on real SGLang: each member's copy of a request gets
its grammar at the same step (``flying.session.grammar``), masks the same logits and
accepts the same token, so the group answers as one engine does."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

pytestmark = pytest.mark.integration

TP2 = {"X-Flying-TP": "2"}
DP = {"X-Flying-TP": "1"}
HIGH = {"X-Priority": "high"}

#: (sampling fields, how to check the text): regexes of fixed length (the output ends
#: where the grammar does), an EBNF choice and a JSON schema of one enum field
CASES = {
    "regex": ({"regex": "[ab]{6}"}, lambda t: re.fullmatch("[ab]{6}", t)),
    "regex-json": ({"regex": r'\{"k": "[xyz]{3}"\}'},
                   lambda t: re.fullmatch(r'\{"k": "[xyz]{3}"\}', t)),
    "ebnf": ({"ebnf": 'root ::= "yes" | "no" | "maybe"'}, lambda t: t in ("yes", "no", "maybe")),
    "json_schema": ({"json_schema": json.dumps({
        "type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"],
        "additionalProperties": False})}, None),
}


def _gen(server, name: str, headers: dict, prompt: str = "pick:") -> dict:
    fields, _ = CASES[name]
    payload = {"text": prompt, "sampling_params": {"max_new_tokens": 48, "temperature": 0, **fields}}
    resp = server.post("/generate", payload, headers=headers, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _valid(name: str, body: dict) -> None:
    text, check = body["text"], CASES[name][1]
    if check is not None:
        assert check(text), (name, text)
    elif body["meta_info"]["finish_reason"]["type"] == "stop":  # JSON, whitespace and all
        assert json.loads(text)["k"] in ("x", "y"), text


@pytest.mark.parametrize("name", list(CASES))
def test_a_constrained_request_in_a_group_equals_one_engine(dp2_server, name):
    """Greedy: the group's tokens are one engine's, and within the grammar."""
    dp = _gen(dp2_server, name, DP)
    tp = _gen(dp2_server, name, TP2)
    assert dp["meta_info"]["flying"]["mode"] == "dp"
    assert tp["meta_info"]["flying"]["mode"] == "tp", tp["meta_info"]["flying"]
    _valid(name, tp)
    assert tp["output_ids"] == dp["output_ids"], (dp["text"], tp["text"])


def test_constrained_and_plain_requests_share_a_group_step(dp2_server):
    """Several grammars (compiled or cached on each member) admitted into one running
    group beside a plain request: every answer within its grammar, the group intact."""
    names = [*CASES, "regex", "ebnf"]
    faulted = requests.get(dp2_server.url + "/flying/status", timeout=30).json()["totals"][
        "faulted_sessions"]
    with ThreadPoolExecutor(len(names) + 1) as pool:
        plain = pool.submit(dp2_server.post, "/generate", {
            "text": "go", "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}},
            headers=TP2, timeout=300)
        done = [pool.submit(_gen, dp2_server, n, TP2, f"pick {i}:") for i, n in enumerate(names)]
        bodies = [f.result() for f in done]
        assert plain.result().status_code == 200
    for name, body in zip(names, bodies, strict=True):
        assert body["meta_info"]["flying"]["mode"] == "tp", body["meta_info"]["flying"]
        _valid(name, body)
    status = requests.get(dp2_server.url + "/flying/status", timeout=30).json()
    assert status["totals"]["faulted_sessions"] == faulted, status["totals"]


def test_a_grammar_that_does_not_compile_is_refused_in_a_group_as_in_dp(dp2_server):
    bad = {"text": "x", "sampling_params": {"max_new_tokens": 4, "json_schema": "{not json"}}
    dp, tp = (dp2_server.post("/generate", bad, headers=h, timeout=120) for h in (DP, TP2))
    assert dp.status_code == tp.status_code, (dp.text, tp.text)
    assert "Failed to compile" in dp.text and "Failed to compile" in tp.text, (dp.text, tp.text)
    ok = _gen(dp2_server, "regex", TP2)  # the group serves on
    _valid("regex", ok)


def test_chat_response_format_and_priority_take_a_group(dp2_server):
    """What OpenAI clients send (``response_format``), with a priority: placed as an
    unconstrained priority request is."""
    chat = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
            "response_format": {"type": "json_object"}}
    resp = dp2_server.post("/v1/chat/completions", chat, headers=TP2, timeout=300)
    assert resp.status_code == 200, resp.text
    plain = _gen(dp2_server, "regex", HIGH)
    plain_mode = plain["meta_info"]["flying"]["mode"]
    payload = {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                 "ignore_eos": True}}
    unconstrained = dp2_server.post("/generate", payload, headers=HIGH, timeout=300).json()
    assert plain_mode == unconstrained["meta_info"]["flying"]["mode"]
    _valid("regex", plain)


def _totals(server) -> dict:
    return requests.get(server.url + "/flying/status", timeout=30).json()["totals"]


#: A schema that takes ~150 ms to compile on this vocabulary (400 fields of 30 values
#: each): much longer than a group step and than SGLang's 5 ms grammar poll, so two
#: members' compiles finish at different steps.
SLOW_SCHEMA = json.dumps({
    "type": "object", "required": ["k0"],
    "properties": {f"k{i}": {"type": "string", "enum": [f"v{i}x{j}" for j in range(30)]}
                   for i in range(400)}})


def test_a_grammar_slow_to_compile_joins_a_running_group_in_step(dp2_server):
    """Admitted into a group that is decoding: without every member waiting for its own
    compile, one member's next step would be the new request's prefill and the other's
    the running decode (lockstep broken: a faulted session). With it, the group goes on,
    the running request is undisturbed and the new one answers as one engine does."""
    payload = {"text": "fill:", "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                                    "json_schema": SLOW_SCHEMA}}
    dp = dp2_server.post("/generate", payload, headers=DP, timeout=300)
    assert dp.status_code == 200, dp.text
    before = _totals(dp2_server)
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(dp2_server.post, "/generate", {
            "text": "go", "sampling_params": {"max_new_tokens": 160, "ignore_eos": True}},
            headers=TP2, timeout=300)
        time.sleep(1.5)  # the group is decoding
        tp = pool.submit(dp2_server.post, "/generate", payload, headers=TP2, timeout=300).result()
        long = running.result()
    assert long.status_code == 200 and tp.status_code == 200, (long.text, tp.text)
    assert long.json()["meta_info"]["completion_tokens"] == 160
    after = _totals(dp2_server)
    assert after["faulted_sessions"] == before["faulted_sessions"], after
    assert tp.json()["meta_info"]["flying"]["mode"] == "tp", tp.json()["meta_info"]["flying"]
    assert tp.json()["output_ids"] == dp.json()["output_ids"], (dp.json()["text"], tp.json()["text"])
