"""Deadlock freedom under a randomized storm of binds, releases, aborts and disconnects.

Seeded mix, sent concurrently: normal (DP) requests, high-priority requests and explicit
``X-Flying-TP`` requests (each a bind and a release), long prompts that are upgraded to
TP, prompts beyond the node (400), and clients that disconnect mid-request (SGLang
aborts them). Afterwards the server must return to idle within a timeout: every engine
in DP mode, binds == releases, every KV slot free, and every request that was not
abandoned answered (200 with its full length, or 400).
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.conftest import MAX_TOTAL_TOKENS

pytestmark = pytest.mark.integration

N_REQUESTS = 36
SEED = 20261122


def _one(url: str, kind: str, rng: random.Random) -> tuple[str, int | None, int, int]:
    """(kind, HTTP status or None after a disconnect, tokens received, tokens asked)."""
    n_new = rng.randint(2, 24)
    prompt_len = {
        "long": MAX_TOTAL_TOKENS + rng.randint(50, 500),
        "too_long": 2 * MAX_TOTAL_TOKENS + 50,
    }.get(kind, rng.randint(4, 64))
    ids = [rng.randrange(3, 500) for _ in range(prompt_len)]
    headers = {"priority": {"X-Priority": "high"}, "tp": {"X-Flying-TP": "2"}}.get(kind, {})
    payload = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n_new, "temperature": 0, "ignore_eos": True},
    }
    timeout = rng.uniform(0.05, 0.4) if kind == "disconnect" else 300
    try:
        resp = requests.post(url + "/generate", json=payload, headers=headers, timeout=timeout)
    except requests.exceptions.Timeout:
        return kind, None, 0, n_new
    got = resp.json()["meta_info"]["completion_tokens"] if resp.status_code == 200 else -1
    return kind, resp.status_code, got, n_new


def test_storm_returns_to_idle(dp2_server):
    rng = random.Random(SEED)
    kinds = rng.choices(
        ["dp", "priority", "tp", "long", "too_long", "disconnect"],
        weights=[8, 3, 3, 2, 1, 3],
        k=N_REQUESTS,
    )
    before = requests.get(dp2_server.url + "/flying/status", timeout=30).json()["totals"]
    seeds = [rng.random() for _ in kinds]
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(
            pool.map(
                lambda ks: _one(dp2_server.url, ks[0], random.Random(ks[1])),
                zip(kinds, seeds, strict=True),
            )
        )
    for kind, status, got, asked in results:
        if kind == "disconnect" and status is None:
            continue
        if kind == "too_long":
            assert status == 400
        else:
            assert status == 200 and got == asked, (kind, status, got, asked)  # complete

    deadline = time.monotonic() + 180
    while True:
        doc = requests.get(dp2_server.url + "/flying/status", timeout=30).json()
        idle = all(
            e["mode"] == "dp"
            and e["pending_binds"] == 0
            and e.get("free_kv_slots") == e.get("total_kv_slots")
            for e in doc["engines"]
        )
        if idle and doc["totals"]["binds"] == doc["totals"]["releases"]:
            break
        assert time.monotonic() < deadline, f"not idle after storm: {doc}"
        # status is refreshed at binds/releases: a 1-token TP request refreshes it
        requests.post(
            dp2_server.url + "/generate",
            json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}},
            headers={"X-Flying-TP": "2"},
            timeout=120,
        )
        time.sleep(1.0)
    binds = doc["totals"]["binds"] - before["binds"]
    served = doc["totals"]["tp_requests"] - before["tp_requests"]
    print(
        f"storm: {N_REQUESTS} requests, {binds} bind/release pairs and {served} TP requests "
        f"served (per engine summed), {kinds.count('disconnect')} disconnects, "
        f"{kinds.count('too_long')} rejected"
    )
    # every priority, explicit-TP and long request ran in a TP-2 session (both engines
    # count it); several may have shared one session
    assert 0 < binds <= served
    assert served >= 2 * (kinds.count("priority") + kinds.count("tp") + kinds.count("long"))
