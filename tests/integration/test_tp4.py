"""Four engines of the demo model (8 query / 4 KV heads: degrees 2 and 4 allowed).

One server, 4 engines sharing the 2 cores: greedy tokens of the same prompt are equal
in DP mode, in a TP-2 group, in the TP-4 group and in transformers; TP-2 requests land
on both aligned pairs; every engine returns to DP with all its KV slots free.
"""

from __future__ import annotations

import time

import pytest
import requests

from tests.conftest import serve
from tests.reference import greedy_tokens, prompts

pytestmark = pytest.mark.integration

SLOTS = 1024


@pytest.fixture(scope="module")
def dp4_server(demo_model_dir, tmp_path_factory):
    yield from serve(
        tmp_path_factory.mktemp("dp4") / "server.log", "--model-path", str(demo_model_dir),
        "--dp-size", "4", "--max-total-tokens", str(SLOTS), "--flying-policy", "manual",
    )


def test_tp4_and_tp2_groups_equal_dp_and_transformers(dp4_server, demo_model_dir):
    ids = prompts(1, 17, seed=11)[0]
    want = greedy_tokens(demo_model_dir, ids, 12)
    # the start-up probe has bound groups already: count this test's binds only
    before = [e["binds"] for e in requests.get(dp4_server.url + "/flying/status", timeout=30).json()["engines"]]
    where = []
    for headers in ({}, {"X-Flying-TP": "2"}, {"X-Flying-TP": "2"}, {"X-Flying-TP": "4"}):
        body = dp4_server.generate_ids(ids, 12, headers=headers, timeout=300)
        assert body["output_ids"] == want, headers
        where.append(body["meta_info"]["flying"])
    assert where[0]["mode"] == "dp"
    assert {tuple(w["ranks"]) for w in where[1:3]} == {(0, 1), (2, 3)}  # round robin
    assert {k: where[3][k] for k in ("mode", "degree", "ranks")} == {"mode": "tp", "degree": 4, "ranks": [0, 1, 2, 3]}

    deadline = time.monotonic() + 60
    while True:
        doc = requests.get(dp4_server.url + "/flying/status", timeout=30).json()
        settled = all(
            e["mode"] == "dp" and e["free_kv_slots"] == e["total_kv_slots"] == SLOTS
            for e in doc["engines"]
        )
        if settled and doc["totals"]["binds"] == doc["totals"]["releases"]:
            break
        assert time.monotonic() < deadline, doc
        time.sleep(0.5)
    binds = [e["binds"] - b for e, b in zip(doc["engines"], before, strict=True)]
    assert binds == [2, 2, 2, 2]  # one TP-2 bind per pair, one TP-4 bind for all
