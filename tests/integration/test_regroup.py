"""TP -> TP upgrade: a request that outgrows its TP-2 group goes on in the TP-4 group.

Four engines of the demo model (4 KV heads: TP-2 and TP-4 split them), each with a KV
pool far shorter than the model's context. A greedy request without a bound of its own
outgrows its engine (DP -> TP-2 with its KV), then the TP-2 group's pool (TP-2 -> TP-4:
its KV re-sharded from 2 to 4 ranks), and ends at the TP-4 group's limit: more tokens
than two engines' pools hold, every one equal to transformers' greedy continuation,
prompt prefilled once. KV slots and request rows return to their initial counts, and
the decision log replays with no difference. If the TP-4 group fails while taking it,
the request ends with finish reason "length" and the tokens it produced, nothing lost.
"""

from __future__ import annotations

import json

import pytest

from scheduler import replay
from tests.conftest import SLOWER, serve
from tests.node import engine_deltas, generated, settled, unbounded_payload, wait_idle
from tests.reference import greedy_tokens, prompts

pytestmark = pytest.mark.integration

SLOTS = 256  # KV slots per engine: a 40-token prompt outgrows one engine after ~215 tokens


@pytest.fixture(scope="module")
def regroup_server(demo_model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("regroup")
    servers = serve(
        log_dir / "server.log", "--model-path", str(demo_model_dir), "--dp-size", "4",
        "--max-total-tokens", str(SLOTS), "--flying-policy", "static-dp",
        "--flying-decision-log", str(log_dir / "decisions.jsonl"),
        env={"FLYING_TEST_FAULTS": "1", **SLOWER},
    )
    server = next(servers)
    server.decisions = log_dir / "decisions.jsonl"
    yield server
    servers.close()


def test_a_request_outgrows_its_tp2_group_into_the_tp4_group(regroup_server, demo_model_dir):
    before = wait_idle(regroup_server)
    (prompt,) = prompts(1, 40, seed=171)
    out = generated(regroup_server, unbounded_payload(prompt, 1))
    ids = out["output_ids"]
    after = settled(regroup_server, before)
    assert len(prompt) + len(ids) > 2 * SLOTS, len(ids)  # more than a TP-2 group pools
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    flying = out["meta_info"]["flying"]
    assert (flying["mode"], flying["degree"]) == ("tp", 4), flying
    assert ids == greedy_tokens(demo_model_dir, prompt, len(ids))
    assert engine_deltas(after, before, "upgraded") == [1, 1, 0, 0]  # from engine 1, then group 0-1
    assert engine_deltas(after, before, "regrouped") == [1, 0, 0, 0]
    assert sum(engine_deltas(after, before, "prefill_tokens")) == len(prompt)  # prefilled once

    lines = [json.loads(x) for x in regroup_server.decisions.read_text().splitlines()]
    ups = [x for x in lines if x.get("kind") == "upgrade"]
    assert [(x["from_degree"], x["decision"]["degree"]) for x in ups[-2:]] == [(1, 2), (2, 4)]
    joins = [x for x in lines if x.get("kind") == "upgrade_join" and x.get("from_degree") == 2]
    assert {x["rank"] for x in joins if x.get("ms") is not None} == {0, 1, 2, 3}


def test_a_fault_in_the_tp4_group_ends_the_request_with_what_it_produced(
    regroup_server, demo_model_dir
):
    """Engine 3 fails while the request's KV goes from the TP-2 group to the TP-4 group:
    that session ends, and the request (which no engine can hold) ends with finish
    reason "length" after the tokens it produced in DP and TP-2, all transformers'."""
    r = regroup_server.post("/flying/test/fault", {"stage": "join", "rank": 3})
    assert r.status_code == 200, r.text
    before = wait_idle(regroup_server)
    (prompt,) = prompts(1, 40, seed=173)
    out = generated(regroup_server, unbounded_payload(prompt, 0))
    ids = out["output_ids"]
    after = settled(regroup_server, before)
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert SLOTS < len(prompt) + len(ids) <= 2 * SLOTS  # past one engine, not past TP-2
    assert ids == greedy_tokens(demo_model_dir, prompt, len(ids))
    assert sum(engine_deltas(after, before, "faulted_sessions")) >= 1
    assert engine_deltas(after, before, "regrouped") == [0, 0, 0, 0]


def test_the_log_of_every_regroup_replays(regroup_server, capsys):
    assert replay.main([str(regroup_server.decisions)]) == 0
    report = capsys.readouterr().out.splitlines()
    assert any(line.startswith("upgrade: ") and line.endswith(" 0 differ") for line in report), report
    assert any(line.startswith("upgrade_join: ") and line.endswith(" 0 differ") for line in report), report
