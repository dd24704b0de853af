"""Long-context upgrade: a running DP request that outgrows its engine joins a group.

Each engine's KV pool here is far shorter than the demo model's context (``SLOTS`` of
8192), so a request without max_new_tokens of its own would end, in plain SGLang, at
one engine's limit (``max_req_len - prompt - 1``). Near that limit it asks the
controller for a group; the TP-2 group around its engine takes it with its KV (no
prompt prefilled again) and it goes on to the group's pooled limit: more tokens than one
engine's whole pool holds, every one equal to transformers' greedy continuation. From
engine 1 (not the group's leader) its KV comes from engine 1 and the leader streams the
rest. KV slots and request rows return to their initial counts. A fault while the
request moves leaves it in DP, where it ends at the engine's limit as in plain SGLang.
Every layout change the node made (upgrades, and a move to DP and a join under
``--flying-move-to-dp all``) is in its decision log, which replays with no difference.
"""

from __future__ import annotations

import json
import threading

import pytest

from scheduler import replay
from tests.conftest import SLOWER, demo_server
from tests.node import (
    delta,
    dp_then_tp,
    engine_counter,
    engine_deltas,
    generated,
    greedy_payload,
    settled,
    stream_ids,
    tp_then_dp,
    unbounded_payload,
    until,
    wait_idle,
)
from tests.reference import greedy_tokens, prompts

pytestmark = pytest.mark.integration

SLOTS = 400  # KV slots per engine: a 40-token prompt outgrows one engine after ~360 tokens


@pytest.fixture(scope="module")
def upgrade_server(demo_model_dir, tmp_path_factory):
    """Moves and joins for any group (``all``: explicit binds too), every decision and
    layout change logged."""
    log_dir = tmp_path_factory.mktemp("upgrade")
    servers = demo_server(
        demo_model_dir, log_dir / "server.log", "--max-total-tokens", str(SLOTS),
        "--flying-move-to-dp", "all", "--flying-decision-log", str(log_dir / "decisions.jsonl"),
        env={"FLYING_TEST_FAULTS": "1", **SLOWER},
    )
    server = next(servers)
    server.decisions = log_dir / "decisions.jsonl"
    yield server
    servers.close()


def test_a_request_without_a_bound_outgrows_its_engine_into_a_group(upgrade_server, demo_model_dir):
    before = wait_idle(upgrade_server)
    slots = engine_counter(before, "total_kv_slots")[0]
    (prompt,) = prompts(1, 40, seed=131)
    out = generated(upgrade_server, unbounded_payload(prompt, 0))
    ids = out["output_ids"]
    after = settled(upgrade_server, before)
    assert len(prompt) + len(ids) > slots, (len(ids), slots)  # more than one engine holds
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["flying"]["mode"] == "tp", out["meta_info"]["flying"]
    assert ids == greedy_tokens(demo_model_dir, prompt, len(ids))
    assert engine_deltas(after, before, "upgraded") == [1, 0]
    assert sum(engine_deltas(after, before, "prefill_tokens")) == len(prompt)  # prefilled once


def test_an_upgraded_stream_goes_on_from_the_groups_leader(upgrade_server, demo_model_dir):
    """The request runs on engine 1; the group [0, 1] takes its KV from engine 1 and
    the leader (engine 0) answers the rest of the stream: every token, once."""
    before = wait_idle(upgrade_server)
    slots = engine_counter(before, "total_kv_slots")[0]
    (prompt,) = prompts(1, 48, seed=137)
    ids, meta, chunks = stream_ids(upgrade_server, unbounded_payload(prompt, 1, stream=True))
    after = settled(upgrade_server, before)
    assert chunks > 1
    assert len(prompt) + len(ids) > slots, (len(ids), slots)
    assert meta["finish_reason"]["type"] == "length"
    assert ids == greedy_tokens(demo_model_dir, prompt, len(ids))
    assert engine_deltas(after, before, "upgraded") == [0, 1]
    assert sum(engine_deltas(after, before, "prefill_tokens")) == len(prompt)


def test_a_bounded_request_ends_at_its_bound_in_dp(upgrade_server, demo_model_dir):
    """A request with max_new_tokens of its own never asks for a group: it runs in DP
    and SGLang bounds it by the engine, as without Flying."""
    before = wait_idle(upgrade_server)
    slots = engine_counter(before, "total_kv_slots")[0]
    (prompt,) = prompts(1, 40, seed=139)
    payload = unbounded_payload(prompt, 0)
    payload["sampling_params"]["max_new_tokens"] = slots - len(prompt) - 8
    r = upgrade_server.post("/generate", payload, timeout=900)
    assert r.status_code == 200, r.text
    after = settled(upgrade_server, before)
    assert len(r.json()["output_ids"]) == slots - len(prompt) - 8
    assert engine_deltas(after, before, "upgrade_asks") == [0, 0]
    assert engine_deltas(after, before, "binds") == [0, 0]


def test_a_request_outgrowing_its_engine_joins_the_running_session_of_its_group(
    upgrade_server, demo_model_dir
):
    """Engine 1 serves request B (no bound of its own) in DP between the steps of a
    TP-2 session that serves A (an explicit group request). B nears its DP limit while
    A's session runs: its upgrade joins that session with its KV (no new bind, no wait
    for A to end) and B goes on past one engine's pool; A and B give transformers'
    tokens; KV slots and rows return."""
    before = wait_idle(upgrade_server)
    (prompt_b,) = prompts(1, 20, seed=181)
    (prompt_a,) = prompts(1, 8, seed=191)
    seen: list[int] = []
    out: dict = {}

    def run_b() -> None:
        ids, meta, _ = stream_ids(upgrade_server, unbounded_payload(prompt_b, 1, stream=True),
                                  on_ids=seen.append)
        out.update(ids=ids, meta=meta)

    b = threading.Thread(target=run_b, daemon=True)
    b.start()
    # A starts ~44 tokens before B asks and runs 80 tokens (B gets one DP step per
    # group step), reserving 46 slots per engine: B's KV keeps fitting beside it.
    until(lambda: seen and seen[-1] >= 270, "request B to near its engine's limit", 600)
    a = upgrade_server.post("/generate", greedy_payload(prompt_a, 80),
                            headers={"X-Flying-TP": "2"}, timeout=900)
    b.join(900)
    assert a.status_code == 200, a.text
    assert a.json()["output_ids"] == greedy_tokens(demo_model_dir, prompt_a, 80)
    assert a.json()["meta_info"]["flying"]["mode"] == "tp"
    after = settled(upgrade_server, before)
    ids = out["ids"]
    slots = engine_counter(before, "total_kv_slots")[0]
    assert len(prompt_b) + len(ids) > slots, len(ids)  # more than one engine holds
    assert out["meta"]["finish_reason"]["type"] == "length"
    assert ids == greedy_tokens(demo_model_dir, prompt_b, len(ids))
    assert engine_deltas(after, before, "upgraded") == [0, 1]
    assert engine_deltas(after, before, "binds") == [1, 1]  # A's: B joined its session


@pytest.mark.parametrize("rank", [1, 0])
def test_a_fault_while_upgrading_leaves_the_request_in_dp(upgrade_server, demo_model_dir, rank):
    """The holder (engine 1) or the other member fails while the KV moves: the session
    ends, the request goes on in DP with its DP bound back and ends at the engine's
    limit with SGLang's tokens; nothing leaks."""
    r = upgrade_server.post("/flying/test/fault", {"stage": "join", "rank": rank})
    assert r.status_code == 200, r.text
    before = wait_idle(upgrade_server)
    (prompt,) = prompts(1, 40, seed=149 + rank)
    ids = generated(upgrade_server, unbounded_payload(prompt, 1))["output_ids"]
    after = settled(upgrade_server, before)
    assert sum(engine_deltas(after, before, "faulted_sessions")) >= 1
    assert engine_deltas(after, before, "upgraded") == [0, 0]
    slots = engine_counter(before, "total_kv_slots")[0]
    assert len(prompt) + len(ids) < slots  # one engine's bound, as without Flying
    assert ids == greedy_tokens(demo_model_dir, prompt, len(ids))


def _logged(server) -> list[dict]:
    return [json.loads(x) for x in server.decisions.read_text().splitlines()]


def test_every_layout_change_is_in_the_decision_log_and_replays(upgrade_server, capsys):
    """An upgrade (the module's first tests made some; one more if this test runs
    alone), a group's request moved to DP and a DP request joining a group: each is
    logged with its inputs and each member's measured cost, and replaying the log
    reproduces every decision in it."""
    if not any(x.get("kind") == "upgrade_join" for x in _logged(upgrade_server)):
        (prompt,) = prompts(1, 40, seed=151)
        generated(upgrade_server, unbounded_payload(prompt, 0))
    before = wait_idle(upgrade_server)
    tp_then_dp(upgrade_server, *prompts(2, 40, seed=157), 2, 240, 8)
    dp_then_tp(upgrade_server, *prompts(2, 36, seed=163), 2, 240, 8)
    after = settled(upgrade_server, before)
    assert delta(after, before, "moved_to_dp") == 1 and delta(after, before, "moved_to_tp") == 1

    lines = _logged(upgrade_server)
    assert list(lines[0]) == ["config", "node"]  # the head, first
    by_kind: dict[str, list[dict]] = {}
    for line in lines[1:]:
        by_kind.setdefault(line.get("kind", "place"), []).append(line)
    assert {"upgrade", "upgrade_join", "move", "join"} <= set(by_kind), set(by_kind)
    assert all(x["decision"]["mode"] == "tp" for x in by_kind["upgrade"])
    for kind in ("upgrade_join", "move", "join"):  # every member's own line, with costs
        done = [x for x in by_kind[kind] if x.get("ms") is not None]
        assert {x["rank"] for x in done} == {0, 1}, (kind, done)
        assert all(x["ms"] > 0 for x in done) and sum(x["tokens"] for x in done) > 0, done
    move = [x for x in by_kind["move"] if x["owners"] is not None]
    assert sum(x["requests"] for x in move) == 1 and all(x["bytes_in"] > 0 for x in move)
    # a join the members could not reserve for (an earlier test's DP request on engine 1
    # when a group formed) is logged too, with what each member could reserve
    assert all(x["joined"] >= 1 and x["kv_bytes"] > 0 if x.get("ms") is not None
               else x["joined"] == 0 for x in by_kind["join"])
    assert any(x.get("ms") is not None for x in by_kind["join"])
    assert all(x["joined"] == 1 and x["total"] > SLOTS for x in by_kind["upgrade_join"]
               if "joined" in x)

    assert replay.main([str(upgrade_server.decisions)]) == 0
    report = capsys.readouterr().out.splitlines()
    for kind in ("upgrade", "upgrade_join", "move", "join"):
        assert f"{kind}: {len(by_kind[kind])} replayed, 0 differ" in report, report
