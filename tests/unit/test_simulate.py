"""The node simulator (``workloads.simulate``): what one request costs, what static
layouts serve, that the adaptive node's decisions are the real policy's, KV admission,
and that the paper preset on 8 engines serves every request."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from flying.node.config import FlyingConfig
from flying.node.placement import SLOTS_ABOVE_INPUT_LIMIT
from scheduler.costs import Costs, Curve
from scheduler.layout_choice import SwitchCosts
from scheduler.policy import Node, PolicyConfig
from scheduler.replay import main as replay_main
from scheduler.replay import replay_log
from workloads.load.presets import build_preset
from workloads.load.trace import TraceRequest
from workloads.sim.profile import Profile, load
from workloads.sim.run import policy_settings, simulate

pytestmark = pytest.mark.unit


def run(trace, profile, engines, policy, **flying):
    return simulate(trace, profile, engines, policy_settings(policy, FlyingConfig(**flying)),
                    name=policy)


def flat(dp_ms: float, tp_ms: float, kv: int = 200_000, context: int = 0,
         prefill_ms: float = 1.0) -> Profile:
    """Two engines whose decode step costs the same at every batch size (and a prefill
    ``prefill_ms`` at every length)."""
    costs = Costs({1: dp_ms, 2: tp_ms}, {
        1: Curve.of([(1, dp_ms), (512, dp_ms)], [(16, prefill_ms), (8192, prefill_ms)]),
        2: Curve.of([(1, tp_ms), (512, tp_ms)], [(16, prefill_ms), (8192, prefill_ms)]),
    })
    return Profile("flat", costs, SwitchCosts(2.0, 1.0), kv_tokens=kv, degrees=(2,),
                   max_engines=2, context_len=context)


# -- one request alone ------------------------------------------------------------------


def test_a_request_alone_costs_its_prefill_then_one_decode_step_per_token():
    profile = replace(load("cpu-demo"), overlap=False)  # SGLang's normal loop
    costs = profile.costs
    rec = run([TraceRequest(0, 1.0, 100, 20)], profile, 2, "static-dp").records[0]
    assert rec.success and rec.flying["mode"] == "dp"
    assert rec.ttft_s * 1000 == pytest.approx(costs.prefill(1, 100))
    assert rec.tpot_s * 1000 == pytest.approx(costs.decode(1, 1))
    assert rec.e2e_s * 1000 == pytest.approx(costs.prefill(1, 100) + 19 * costs.decode(1, 1))
    assert len(rec.itl_s) == 19 and rec.queue_time_s == 0.0


def test_the_overlap_loop_delays_each_token_one_step_not_the_time_between_them():
    """SGLang's overlap loop on a CPU engine: a step's tokens reach the client when the
    next step ends, so TTFT (and E2E) grow by one step and TPOT does not; alone, the
    last token comes with the one before (SGLang leaves a request finishing by length
    out of the next batch). The frontend adds to TTFT and E2E only."""
    dp_ms = 5.0
    busy = [TraceRequest(0, 0.0, 100, 200), TraceRequest(1, 0.0502, 100, 20)]
    normal = run(busy, replace(flat(dp_ms, 8.0), overlap=False), 1, "static-dp").records[1]
    overlap = run(busy, flat(dp_ms, 8.0), 1, "static-dp").records[1]
    assert overlap.ttft_s - normal.ttft_s == pytest.approx(dp_ms / 1000)
    assert overlap.e2e_s - normal.e2e_s == pytest.approx(dp_ms / 1000)
    assert overlap.tpot_s == pytest.approx(normal.tpot_s)
    assert overlap.itl_s == pytest.approx(normal.itl_s)
    alone = run([TraceRequest(0, 1.0, 100, 20)], flat(dp_ms, 8.0), 1, "static-dp").records[0]
    assert alone.ttft_s * 1000 == pytest.approx(1.0 + dp_ms)
    assert alone.e2e_s * 1000 == pytest.approx(1.0 + 19 * dp_ms)
    assert alone.itl_s == pytest.approx([dp_ms / 1000] * 18 + [0.0])
    front = run([TraceRequest(0, 1.0, 100, 20)], replace(flat(dp_ms, 8.0), frontend_ms=8.0),
                1, "static-dp").records[0]
    assert (front.ttft_s - alone.ttft_s, front.e2e_s - alone.e2e_s) == pytest.approx((8e-3,) * 2)
    assert front.tpot_s == pytest.approx(alone.tpot_s)


def test_a_groups_tokens_wait_for_its_next_step_but_a_last_token_goes_out_at_once():
    """A node's group (``group_loop="flying"``) holds a step's tokens to the next group
    step's end, as SGLang's overlap loop holds a DP step's, except a step holding a
    request's last token, sent when it ends; SGLang's own TP (``"sglang"``) holds that
    one too, here behind the next request's prefill; a node before session 50
    (``"normal"``) sent each step's tokens when it ended. Request 1 arrives while
    request 0 (4 tokens) decodes, so that its prefill runs right after request 0's last
    step."""
    tp_ms, prefill_ms = 8.0, 40.0
    profile = flat(5.0, tp_ms, prefill_ms=prefill_ms)
    trace = [TraceRequest(0, 0.0, 100, 4), TraceRequest(1, 0.060, 100, 4)]
    cfg = policy_settings("static-tp", FlyingConfig())
    got = {loop: simulate(trace, profile, 2, cfg, group_loop=loop).records
           for loop in ("normal", "flying", "sglang")}
    normal, flying, sglang = got["normal"], got["flying"], got["sglang"]
    assert all(r.flying["mode"] == "tp" for recs in got.values() for r in recs)
    # a first token waits for the next group step
    assert flying[0].ttft_s - normal[0].ttft_s == pytest.approx(tp_ms / 1000)
    assert flying[1].ttft_s - normal[1].ttft_s == pytest.approx(tp_ms / 1000)
    # request 0's last token: at its step's end in a node's group, behind the prefill in SGLang's
    assert flying[0].e2e_s == pytest.approx(normal[0].e2e_s)
    assert sglang[0].e2e_s - flying[0].e2e_s == pytest.approx(prefill_ms / 1000)
    assert flying[0].itl_s[-1] == 0.0  # it went out with the token held before it


def test_a_grouped_request_pays_the_bind_then_the_groups_steps():
    profile = load("cpu-demo")
    costs, bind = profile.costs, profile.switch.bind_ms
    rec = run([TraceRequest(0, 1.0, 100, 20)], profile, 2, "static-tp").records[0]
    assert rec.flying["mode"] == "tp" and rec.flying["ranks"] == [0, 1]
    # the first token waits for the next group step (the overlap loop)
    assert rec.ttft_s * 1000 == pytest.approx(bind + costs.prefill(2, 100) + costs.decode(2, 1))
    # one group step per token; the last goes out at once, with the one held before it
    assert rec.itl_s == pytest.approx([costs.decode(2, 1) / 1000] * 18 + [0.0])


def test_a_prompt_longer_than_the_chunk_is_prefilled_in_chunks():
    profile = replace(load("cpu-demo"), overlap=False)
    chunk = profile.chunk_tokens
    rec = run([TraceRequest(0, 0.0, chunk + 904, 4)], profile, 2, "static-dp").records[0]
    want = profile.costs.prefill(1, chunk) + profile.costs.prefill(1, 904)
    assert rec.ttft_s * 1000 == pytest.approx(want)


# -- static layouts -----------------------------------------------------------------------


def _burst(n: int, prompt: int, output: int) -> list[TraceRequest]:
    return [TraceRequest(i, 0.0, prompt, output) for i in range(n)]


@pytest.mark.parametrize("tp_ms", [4.0, 25.0])
def test_static_dp_and_static_tp_serve_in_the_order_the_profile_says(tp_ms):
    profile = flat(10.0, tp_ms)
    trace = _burst(64, 16, 200)
    dp = run(trace, profile, 2, "static-dp").records
    tp = run(trace, profile, 2, "static-tp").records
    span = {name: max(r.end_s for r in recs) for name, recs in (("dp", dp), ("tp", tp))}
    # 64 requests at once: two engines decode 32 each per DP step, one group all 64
    dp_rate = 64 / profile.costs.decode(1, 32)
    tp_rate = 64 / profile.costs.decode(2, 64)
    assert (span["tp"] < span["dp"]) == (tp_rate > dp_rate)


def test_on_the_h100_profile_a_saturating_burst_takes_what_the_profile_says():
    profile = load("h100-llama3-8b")
    c, chunk = profile.costs, profile.chunk_tokens
    trace = _burst(512, 512, 128)  # 64 per engine in DP; 16 prompts per 8192-token chunk
    spans = {p: max(r.end_s for r in run(trace, profile, 8, p).records)
             for p in ("static-dp", "static-tp8")}
    # prefill first (every prompt before the first decode step), then 127 decode steps
    # (within 1 %: each server's first step starts with the first request alone)
    dp = 64 * 512 // chunk * c.prefill(1, chunk) + 127 * c.decode(1, 64)
    tp = profile.switch.bind_ms + 512 * 512 // chunk * c.prefill(8, chunk) + 127 * c.decode(8, 512)
    assert spans["static-dp"] * 1000 == pytest.approx(dp, rel=0.01)
    # the group admits 32 binds a boundary (``exchange.MAX_ADMITS``), as Flying's
    # sessions do: a few decode steps run between the burst's prefills (within 2 %)
    assert tp <= spans["static-tp8"] * 1000 <= tp * 1.02
    assert (spans["static-tp8"] < spans["static-dp"]) == (tp < dp)


# -- the adaptive node calls the real policy -----------------------------------------------


def test_the_adaptive_nodes_decisions_replay_to_the_same_decisions(tmp_path):
    profile = load("h100-llama3-8b")
    trace = build_preset("paper", 0)[:600]
    res = run(trace, profile, 8, "adaptive", slo_ttft=400.0, slo_tpot=8.0)
    path = tmp_path / "decisions.jsonl"
    path.write_text("".join(line + "\n" for line in res.decisions))
    head = json.loads(res.decisions[0])
    config = PolicyConfig(**head["config"])
    node = Node(**{**head["node"], "degrees": tuple(head["node"]["degrees"])})
    replayed = replay_log(res.decisions, config, node)
    assert replayed.counts["place"] == res.counters["decisions"] == len(trace)
    assert replayed.diffs == []
    assert replay_main([str(path)]) == 0
    # each request ran where its logged decision put it
    placed = [json.loads(line) for line in res.decisions[1:] if '"kind"' not in line[:10]]
    by_rid = {f"sim-{r.index}": r for r in res.records}
    kinds = set()
    for ev in placed:
        rec, decision = by_rid[ev["rid"]], ev["decision"]
        kinds.add(decision["reason"].split(" (")[0])
        assert rec.flying["degree"] == (decision["degree"] if decision["mode"] == "tp" else 1)
    assert len(kinds) > 1, "the layout never changed: the test shows nothing"


def test_the_paper_preset_on_8_h200_engines_serves_every_request():
    # How fast it runs is a benchmark figure (docs/SIMULATOR.md), not a timed test.
    profile = load("h200-llama3-8b")
    trace = build_preset("paper", 0)
    res = run(trace, profile, 8, "adaptive")
    assert len(res.records) == 4000 and all(r.success for r in res.records)


# -- KV admission ---------------------------------------------------------------------------


def test_a_request_beyond_one_engines_kv_runs_in_a_group_or_is_rejected():
    profile = replace(load("cpu-demo"), kv_tokens=2048)  # the integration tests' pools
    node = profile.node(2, (2,), http=True)
    one, two = node.capacity(1), node.capacity(2)
    trace = [TraceRequest(0, 0.0, one + 100, 50), TraceRequest(1, 0.1, two + 10, 50),
             TraceRequest(2, 0.2, 200, 50)]
    for policy in ("static-dp", "adaptive"):
        recs = run(trace, profile, 2, policy).records
        assert recs[0].success and recs[0].flying["mode"] == "tp"
        assert recs[0].flying["degree"] == 2
        assert not recs[1].success and recs[1].http_status == 400
        assert "exceeds the node's KV capacity" in recs[1].error
        assert recs[2].success and recs[2].flying["mode"] == "dp"
    off = run(trace, profile, 2, "static-dp", tp_degrees="none").records
    assert not off[0].success and off[0].http_status == 400  # groups off: SGLang's limit


def test_dp_admission_waits_for_kv_in_arrival_order():
    profile = replace(flat(10.0, 10.0, kv=1000), overlap=False)  # end_s: the KV's release
    # round robin: 0, 2 and 4 on engine 0; 0 holds 800 of its 1000 tokens
    trace = [TraceRequest(0, 0.0, 400, 400), TraceRequest(1, 0.0, 400, 400),
             TraceRequest(2, 0.0, 150, 100), TraceRequest(3, 0.0, 10, 10),
             TraceRequest(4, 0.0, 10, 10)]
    recs = run(trace, profile, 2, "static-dp").records
    first_done = recs[0].end_s
    assert recs[2].queue_time_s == pytest.approx(first_done)  # 250 > 200 free: it waits
    assert recs[4].queue_time_s == pytest.approx(first_done)  # it fits, but nobody overtakes
    assert recs[3].queue_time_s < first_done  # engine 1 had room


# -- a group and DP work on its members --------------------------------------------------


def test_a_member_with_dp_work_runs_one_dp_step_between_two_group_steps():
    profile = flat(10.0, 4.0)
    trace = [TraceRequest(0, 0.0, 16, 400), TraceRequest(1, 0.5, 16, 50)]
    res = simulate(trace, profile, 2, policy_settings("static-dp", FlyingConfig(move_to_dp="off")),
                   explicit={0: 2})
    group, dp = res.records
    assert group.flying["mode"] == "tp" and dp.flying["mode"] == "dp"
    c = profile.costs
    alone, shared = c.decode(2, 1), c.decode(2, 1) + c.decode(1, 1)
    gaps = [round(g * 1000, 6) for g in group.itl_s]
    assert gaps[0] == pytest.approx(alone)
    assert shared in [pytest.approx(g) for g in gaps]  # while the DP request runs
    assert gaps[-2] == pytest.approx(alone)  # after it finished
    assert gaps[-1] == 0.0  # its last token goes out at once, with the one held before it
    assert all(g * 1000 == pytest.approx(shared) for g in dp.itl_s)


def _beside_running_dp(arrival: float | None):
    """Engine 1 runs a DP request when an explicit TP-2 request binds engines 0 and 1
    (its request joins the group); ``arrival``: a DP request reaches engine 0 then,
    while the session runs."""
    profile = flat(10.0, 4.0)
    trace = [TraceRequest(0, 0.0, 16, 5), TraceRequest(1, 0.0, 16, 400),
             TraceRequest(2, 0.5, 16, 200)]
    if arrival is not None:
        trace.append(TraceRequest(3, arrival, 16, 50))
    return simulate(trace, profile, 2, policy_settings("static-dp", FlyingConfig(move_to_dp="all")),
                    explicit={2: 2})


def test_a_members_running_dp_request_joins_and_only_an_arrival_moves_the_session():
    """``join.gather``: a session bound beside a member's running DP request takes it in
    with its KV (every member's, not only the leader's), so no DP step runs between the
    group's steps; ``GroupSession.dp_arrived``: a DP request dispatched to a member
    during the session moves the session's requests to DP, the running ones did not."""
    beside = _beside_running_dp(None)
    first, running, group = beside.records
    assert first.end_s < 0.5 and running.flying["ranks"] == [1]
    assert running.flying["moved"].startswith("joined a TP-2 group")
    assert group.flying["mode"] == "tp" and "moved" not in group.flying
    assert beside.counters["moves"] == 0 and beside.counters["joins"] == 1
    c = flat(10.0, 4.0).costs
    # no DP step between; the last token waits for the next group step (the joined
    # request runs on: the result is kept, as SGLang's loop keeps it)
    assert all(g * 1000 == pytest.approx(c.decode(2, 2)) for g in group.itl_s[:-1])
    assert group.itl_s[-1] * 1000 == pytest.approx(c.decode(2, 1))
    arrived = _beside_running_dp(0.6)
    group, new = arrived.records[2], arrived.records[3]
    assert arrived.counters["moves"] == 1 and arrived.counters["joins"] == 1
    assert group.flying["mode"] == "tp" and group.flying["moved"].startswith("moved to DP")
    assert new.flying["ranks"] == [0] and all(r.success for r in arrived.records)


def test_the_controllers_policy_knows_the_kv_pool_the_http_process_the_request_limit():
    """``placement.node_of`` as the node calls it: the DP controller passes SGLang's KV
    pool (what a server batches), the HTTP process does not know it (SGLang's request
    limit stands for it) but knows the context."""
    profile = load("h100-llama3-8b")  # a pool of ~396k tokens, a context of 8192
    trace = build_preset("paper", 0)[:50]
    res = simulate(trace, profile, 8, policy_settings("adaptive", FlyingConfig()))
    head = json.loads(res.decisions[0])["node"]
    assert head["engine_slots"] == profile.kv_tokens > profile.context_len
    assert head["num_engines"] == 8 and head["context_limit"] == 0
    input_limit = profile.max_req_len - 5  # SGLang's max_req_input_len
    assert head["engine_capacity"] == input_limit + 1
    http = profile.node(8, (2, 4, 8), http=True)
    assert http.engine_slots == input_limit + SLOTS_ABOVE_INPUT_LIMIT == profile.context_len
    assert http.num_engines == 8 and http.context_limit == profile.context_len - 1
    assert http.engine_capacity == head["engine_capacity"]
