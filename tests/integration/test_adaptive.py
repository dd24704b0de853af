"""The default adaptive policy on real SGLang (2 engines of the demo model).

The DP controller places a request from the engines' load snapshots, their measured
step-cost curves and its arrival estimate (the HTTP process sees none of them and leaves
it unmarked): in the layout predicted to serve the most requests within the node's SLOs.
Two nodes pin which layout pays with the test-only step delay
(``flying.session.faults.step_delays``), which the engines measure like any other step
cost: one whose group step is 10 ms slower than one engine's (it never forms a group
for latency), one whose DP step is 25 ms slower (its group is faster at every batch
size, so it stays in TP through a burst). The tokens equal transformers', and the
decision logs replay to the same decisions.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from flying.node.probe import CALIBRATE_SIZES, calibration_sizes
from flying.session.step_costs import DECODE, bucket
from scheduler import replay
from scheduler.policy import Costs
from tests.conftest import MAX_TOTAL_TOKENS, serve
from tests.node import delta, greedy_on, settled, status, until, wait_idle
from tests.reference import greedy_tokens, prompts

pytestmark = pytest.mark.integration


#: Requests sent at once in the burst, and tokens each generates.
BURST, NEW_TOKENS = 10, 12


#: KV slots per engine of the slower-group node: enough for the calibration's every
#: size (``flying.node.probe.calibration_sizes``); the other node has the tests' usual.
CALIBRATED_TOKENS = 12288


def _adaptive(model_dir, log_dir, delay: str, kv_tokens: int = MAX_TOTAL_TOKENS):
    server_gen = serve(  # --flying-policy adaptive: the default
        log_dir / "server.log", "--model-path", str(model_dir),
        "--dp-size", "2", "--max-total-tokens", str(kv_tokens),
        "--flying-decision-log", str(log_dir / "decisions.jsonl"),
        env={"FLYING_TEST_STEP_DELAY_MS": delay},
    )
    server = next(server_gen)
    server.decisions = log_dir / "decisions.jsonl"
    return server, server_gen


@pytest.fixture(scope="module")
def adaptive_server(demo_model_dir, tmp_path_factory):
    """A node whose TP-2 group step is 10 ms slower than one engine's."""
    server, gen = _adaptive(demo_model_dir, tmp_path_factory.mktemp("adaptive"), "2:10",
                            CALIBRATED_TOKENS)
    yield server
    gen.close()


@pytest.fixture(scope="module")
def fast_group_server(demo_model_dir, tmp_path_factory):
    """A node whose DP step is 25 ms slower than a TP-2 group's."""
    server, gen = _adaptive(demo_model_dir, tmp_path_factory.mktemp("fastgroup"), "1:25")
    yield server
    gen.close()


def _decisions(server) -> list[dict]:
    return [json.loads(x) for x in server.decisions.read_text().splitlines()[1:]]


def test_engines_measure_step_cost_curves_per_mode(adaptive_server):
    """The start-up probe and its calibration ran requests in a TP-2 group and in DP:
    every engine has a measured single-request decode step for both, a decode point at
    every batch size of the calibration's staggered batch (1-4, 8, 16 and 32 on this
    node's KV: a point in each size's bucket) and a prefill point (its 128-token
    prompt). The calibration is no serving: no engine reports a stretch of it, now or
    last."""
    doc = requests.get(adaptive_server.url + "/flying/status", timeout=30).json()
    for engine in doc["engines"]:
        assert engine["stretch"] == {} == engine["stretch_last"], engine
        assert calibration_sizes(engine["total_kv_slots"]) == CALIBRATE_SIZES, engine
        assert set(engine["decode_ms"]) == {"1", "2"}, engine
        assert all(ms > 0 for ms in engine["decode_ms"].values())
        for degree in ("1", "2"):
            curve = engine["curves"][degree]
            measured = {bucket(DECODE, round(b)) for b, _ in curve["decode"]}
            assert {bucket(DECODE, n) for n in CALIBRATE_SIZES} <= measured, curve
            assert max(t for t, _ in curve["prefill"]) >= 100, curve


def test_a_slower_group_is_never_formed_for_latency(adaptive_server, demo_model_dir):
    """A TP-2 step slower than one engine's at every measured batch size: every
    decision is DP, each with its inputs (traffic, SLOs, costs with curves) and the
    layouts' predictions in the log, and the log replays offline to the same
    decisions."""
    for ids in prompts(3, 9, seed=21):
        body = adaptive_server.generate_ids(ids, 10)
        assert body["output_ids"] == greedy_tokens(demo_model_dir, ids, 10)
        assert body["meta_info"]["flying"]["mode"] == "dp", body["meta_info"]
    lines = _decisions(adaptive_server)
    assert len(lines) >= 3
    for line in lines:
        costs = Costs.from_json(line["costs"])
        assert costs is not None and costs.gain(2) < 0, line["costs"]  # the group is slower
        assert line["decision"]["mode"] == "dp", line
        assert line["traffic"]["rate_long"] > 0 and line["slo"]["ttft_ms"] > 0
        dp, tp = line["predictions"]["2xDP"], line["predictions"]["1xTP2"]
        assert dp["goodput"] >= tp["goodput"] and dp["tpot_ms"] < tp["tpot_ms"], line
    assert replay.main([str(adaptive_server.decisions)]) == 0
    # The same log under another policy (every request in a group): the decisions differ.
    other = '{"policy": "static-tp"}'
    assert replay.main([str(adaptive_server.decisions), "--config", other]) == 1


def test_a_faster_group_is_kept_through_a_burst(fast_group_server, demo_model_dir):
    """A group faster at every batch size: quiet requests and then a burst of
    concurrent ones all run in the TP-2 group (the burst seen in the short window, the
    predictions saying the group serves at least as much within SLO)."""
    quiet = prompts(2, 24, seed=3)
    for ids in quiet:
        body = fast_group_server.generate_ids(ids, NEW_TOKENS)
        assert body["output_ids"] == greedy_tokens(demo_model_dir, ids, NEW_TOKENS)
    burst = prompts(BURST, 24, seed=4)
    with ThreadPoolExecutor(BURST) as pool:
        bodies = list(pool.map(lambda ids: fast_group_server.generate_ids(ids, NEW_TOKENS),
                               burst))
    for ids, body in zip(burst, bodies, strict=True):
        assert body["output_ids"] == greedy_tokens(demo_model_dir, ids, NEW_TOKENS)
    assert [b["meta_info"]["flying"]["mode"] for b in bodies] == ["tp"] * BURST

    lines = _decisions(fast_group_server)
    assert len(lines) == len(quiet) + BURST
    assert [line["decision"]["mode"] for line in lines] == ["tp"] * len(lines), lines
    peak = max(lines, key=lambda line: line["traffic"]["rate_short"])
    assert peak["traffic"]["rate_short"] >= 2.0  # the burst was seen as one
    preds = peak["predictions"]
    assert preds["1xTP2"]["goodput"] >= preds["2xDP"]["goodput"], peak
    # The calibrated single-request step (15 probe samples per mode) shows the pinned
    # delay; the burst's bigger batches have a sample or two each, which one stall on
    # this 2-core machine can stretch past DP's (CI: 49 ms at batch 3 between 10 and 12).
    costs = Costs.from_json(peak["costs"])
    assert costs.decode(2, 1) < costs.decode(1, 1), peak["costs"]
    # The loads the policy read counted the burst it was placing (the requests sent
    # since each engine's snapshot: ``flying.node.in_flight``) ...
    placed = [sum(e["running"] + e["waiting"] for e in line["loads"]) for line in lines]
    assert max(placed[len(quiet):]) >= BURST // 2, placed
    # ... and nothing once it was served: a request sent to an idle node reads none.
    ids = prompts(1, 24, seed=5)[0]
    assert fast_group_server.generate_ids(ids, 4)["output_ids"] == greedy_tokens(
        demo_model_dir, ids, 4)
    last = _decisions(fast_group_server)[-1]
    assert all(e["running"] == e["waiting"] == 0 for e in last["loads"]), last["loads"]
    assert replay.main([str(fast_group_server.decisions)]) == 0


def _decode_ms(server, degree: str) -> float:
    doc = requests.get(server.url + "/flying/status", timeout=30).json()
    return max(e["decode_ms"][degree] for e in doc["engines"])


def test_a_request_slo_only_a_group_meets_runs_in_the_group(
    fast_group_server, adaptive_server, demo_model_dir
):
    """A request's own TPOT SLO (header on /generate, ``custom_params`` on the OpenAI
    endpoint, as a router forwards it) between the group's step and one engine's runs in
    the TP-2 group for that reason; where the group is the slower one it runs in DP.
    Tokens equal transformers'; the decision log holds the request's SLO."""
    slo = (_decode_ms(fast_group_server, "1") + _decode_ms(fast_group_server, "2")) / 2
    ids = prompts(1, 16, seed=31)[0]
    before = len(_decisions(fast_group_server))
    body = fast_group_server.generate_ids(
        ids, NEW_TOKENS, headers={"X-Flying-SLO-TPOT-Ms": f"{slo:.1f}"})
    assert body["output_ids"] == greedy_tokens(demo_model_dir, ids, NEW_TOKENS)
    assert body["meta_info"]["flying"]["mode"] == "tp", body["meta_info"]
    resp = fast_group_server.post("/v1/completions", {
        "prompt": ids, "max_tokens": 4, "temperature": 0,
        "custom_params": {"flying_slo_tpot_ms": slo}})
    assert resp.status_code == 200, resp.text
    lines = _decisions(fast_group_server)[before:]
    assert len(lines) == 2
    for line in lines:
        assert line["request"]["slo_tpot_ms"] == pytest.approx(slo, abs=0.05), line
        assert line["decision"]["mode"] == "tp", line
        assert line["decision"]["reason"].startswith("request SLO"), line["decision"]
    assert replay.main([str(fast_group_server.decisions)]) == 0

    slow = adaptive_server.generate_ids(ids, NEW_TOKENS, headers={"X-Flying-SLO-TPOT-Ms": "0.5"})
    assert slow["meta_info"]["flying"]["mode"] == "dp"
    assert slow["output_ids"] == greedy_tokens(demo_model_dir, ids, NEW_TOKENS)
    bad = adaptive_server.post("/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 2, "custom_params": {"flying_slo_ttft_ms": "soon"}}})
    assert bad.status_code == 400 and "flying_slo_ttft_ms" in bad.text, bad.text
    bad = adaptive_server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2},
                               headers={"X-Flying-SLO-TTFT-Ms": "-1"})
    assert bad.status_code == 400 and "x-flying-slo-ttft-ms" in bad.text, bad.text


def test_a_conversation_s_turns_run_on_the_engine_that_holds_it(fast_group_server,
                                                                 demo_model_dir):
    """A chat sends each turn as the whole history plus a new message. Where the group
    is faster, the first turn runs in it (nothing is cached anywhere), and so does the
    second: its history ran in a group, whose cache ends with its session, so no engine
    holds it, and one conversation is no chat traffic yet. From then on a prompt long
    enough to be continued has been continued every time (chat traffic): the third turn
    runs in DP (SGLang's dispatch places it) and the fourth on the same engine
    (``scheduler.conversations``), finding the whole third turn in its prefix cache
    (SGLang's round robin would have sent it to the other engine). Then a new
    conversation's first prompt runs in DP as chat traffic. Tokens equal
    transformers'."""
    history = prompts(1, 300, seed=41)[0]
    before = len(_decisions(fast_group_server))
    placed, cached, previous = [], [], 0
    for turn in range(4):
        ids = history + prompts(1, 40, seed=50 + turn)[0]
        body = fast_group_server.generate_ids(ids, 8)
        assert body["output_ids"] == greedy_tokens(demo_model_dir, ids, 8)
        placed.append(body["meta_info"]["flying"])
        cached.append((body["meta_info"]["cached_tokens"], previous))
        previous = len(ids) + 8 - 1  # the previous turn's prompt and answer, cached
        history = ids + body["output_ids"]
    assert [p["mode"] for p in placed] == ["tp", "tp", "dp", "dp"], placed
    assert len({p["ranks"][0] for p in placed[2:]}) == 1, placed  # one engine
    got, prev = cached[3]
    assert got >= prev, cached
    lines = _decisions(fast_group_server)[before:]
    reasons = [line["decision"]["reason"] for line in lines]
    assert "a conversation's turn" not in reasons[1], reasons
    assert all("a conversation's turn" in r for r in reasons[2:]), reasons
    assert [line["request"]["turn_held"] for line in lines[1:]] == [False, False, True], lines
    assert all(line["request"]["turn_tokens"] >= 320 for line in lines[1:]), lines
    # chat traffic (every long first prompt so far was continued): a new conversation's
    # first prompt runs in DP too, where its next turn will find it cached
    ids = prompts(1, 300, seed=42)[0]
    body = fast_group_server.generate_ids(ids, 8)
    assert body["output_ids"] == greedy_tokens(demo_model_dir, ids, 8)
    assert body["meta_info"]["flying"]["mode"] == "dp", body["meta_info"]["flying"]
    line = _decisions(fast_group_server)[-1]
    assert line["traffic"]["continued"] == 1.0, line
    assert line["decision"]["reason"].startswith("chat traffic"), line
    assert replay.main([str(fast_group_server.decisions)]) == 0


def test_a_group_ending_for_dp_work_starts_what_it_had_not_started_in_dp(fast_group_server,
                                                                          demo_model_dir):
    """Where the group is faster, a burst runs in it; then, while it decodes, a second
    burst is placed in it and a request pinned to one engine (``routed_dp_rank``: DP
    work on a member) arrives with it. The group ends for the DP work: its decoding
    requests move to DP with their KV, and what it had not started (waiting requests,
    binds it had not admitted) starts in DP as it arrived (``flying.session.hand_back``)
    instead of being prefilled in the group and moved, or forming a new group beside
    the DP work. Every request's tokens equal transformers', whichever way it went, no
    session faults, and every KV slot and request row comes back."""
    before = wait_idle(fast_group_server)
    # long enough that the group still decodes when the second burst comes: a group
    # step takes about 10 ms here, and 64 tokens were done before it came in one run
    long_tokens = 192
    first, second = prompts(6, 24, seed=61), prompts(6, 24, seed=62)
    pinned_ids = prompts(1, 24, seed=63)[0]
    with ThreadPoolExecutor(len(first) + len(second)) as pool:
        long = [pool.submit(fast_group_server.generate_ids, ids, long_tokens) for ids in first]
        until(lambda: delta(status(fast_group_server), before, "tp_steps") >= 8,
              "the first burst's group did not run")
        short = [pool.submit(fast_group_server.generate_ids, ids, NEW_TOKENS) for ids in second]
        thread, pinned = greedy_on(fast_group_server, pinned_ids, NEW_TOKENS, 1)
        thread.join(timeout=600)
        bodies = [f.result(timeout=600) for f in long + short]
    assert pinned.pop("status_code") == 200, pinned
    assert pinned["output_ids"] == greedy_tokens(demo_model_dir, pinned_ids, NEW_TOKENS)
    assert pinned["meta_info"]["flying"]["mode"] == "dp", pinned["meta_info"]
    for ids, n, body in zip(first + second, [long_tokens] * 6 + [NEW_TOKENS] * 6, bodies, strict=True):
        assert body["output_ids"] == greedy_tokens(demo_model_dir, ids, n), body["meta_info"]
    after = settled(fast_group_server, before)
    ended = {k: delta(after, before, k) for k in ("moved_to_dp", "handed_back", "rerun_in_dp")}
    assert sum(ended.values()) >= 1, ended  # the group gave its work to DP
    assert delta(after, before, "faulted_sessions") == 0
    assert replay.main([str(fast_group_server.decisions)]) == 0
