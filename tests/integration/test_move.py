"""Running requests move between layouts with their KV (``--flying-move-to-dp all``).

- TP -> DP: a long TP-2 request runs in a group; a DP request arrives. At the next group
  step the session ends: the group's request moves into DP on the member with fewer DP
  requests (the leader here) with its KV
  gathered from the other member (no recompute), and the DP request runs beside it.
- DP -> TP: a long DP request runs on engine 0; a TP-2 request binds the group [0, 1]
  and the running request joins it with its KV scattered into both members' shards.

Both requests produce exactly transformers' greedy tokens, every prompt is prefilled
once (the engines' prefill counters), and KV slots and request rows return to their
initial counts. A fault injected while requests move (either member) ends that session
only: a request taken out of DP for a join goes on in DP, a group request that sent
nothing yet is re-run in DP, and the node keeps serving.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from flying.session.faults import ADOPT_DELAY_ENV
from flying.substrate import kv_publish
from tests.conftest import SLOWER, demo_server
from tests.node import (
    delta,
    dp_then_tp,
    engine_counter,
    greedy,
    greedy_on,
    settled,
    status,
    stream_ids,
    tp_then_dp,
    until,
    wait_idle,
)
from tests.reference import greedy_tokens, prompts

pytestmark = pytest.mark.integration

TP2 = {"X-Flying-TP": "2"}
ADOPT_DELAY_MS = 300
LONG = 600  # tokens the long request generates: it is still running when the other arrives
SHORT = 16


@pytest.fixture(scope="module")
def move_server(demo_model_dir, tmp_path_factory):
    # --enable-metrics: a request's Prometheus collector (thread locks) must not travel
    # with its KV (a join failed its group on pickling it); the other SGLang flags put
    # their state on requests and schedulers too, and every move here must keep working
    # under them (docs/FLAGS.md lists what was checked)
    tmp = tmp_path_factory.mktemp("move")
    yield from demo_server(
        demo_model_dir, tmp / "server.log", "--flying-move-to-dp", "all",
        "--enable-metrics", "--enable-request-time-stats-logging", "--log-requests",
        "--schedule-policy", "lof", "--enable-cache-report", "--enable-priority-scheduling",
        "--crash-dump-folder", str(tmp / "crash"),
        # the taker of a move pauses before it adopts its peer's rows: the sender's DP
        # work must step meanwhile (every move here still lands, exact)
        env={"FLYING_TEST_FAULTS": "1", **SLOWER, ADOPT_DELAY_ENV: str(ADOPT_DELAY_MS)},
    )


_delta = delta


def _outboxes() -> set[str]:
    """The engines' outboxes in /dev/shm (``kv_publish``): one per engine process."""
    return {p.name for p in Path("/dev/shm").glob(kv_publish.PREFIX + "*")}


def _tp_then_dp(server, seed: int, short_rank: int | None = None) -> tuple[dict, dict, dict, list, list]:
    """A long TP-2 request, then (once its group runs) a short DP request (on engine
    ``short_rank`` if given: the move's sender); returns (status before, long answer,
    short answer, long prompt, short prompt)."""
    long_prompt, short_prompt = prompts(2, 40, seed=seed)
    before, long, short = tp_then_dp(server, long_prompt, short_prompt, 2, LONG, SHORT, short_rank)
    return before, long, short, long_prompt, short_prompt


def _dp_then_tp(server, seed: int) -> tuple[dict, dict, dict, list, list]:
    """A long DP request on engine 0, then (once it decodes) a short TP-2 request;
    returns (status before, long answer, short answer, long prompt, short prompt)."""
    long_prompt, short_prompt = prompts(2, 36, seed=seed)
    before, long, short = dp_then_tp(server, long_prompt, short_prompt, 2, LONG, SHORT)
    return before, long, short, long_prompt, short_prompt


def test_a_running_group_request_moves_to_dp_when_dp_work_arrives(move_server, demo_model_dir):
    before, long, short, long_prompt, short_prompt = _tp_then_dp(move_server, seed=73)
    after = settled(move_server, before)
    assert short["meta_info"]["flying"]["mode"] == "dp"
    assert short["output_ids"] == greedy_tokens(demo_model_dir, short_prompt, SHORT)
    flying = long["meta_info"]["flying"]
    assert flying["mode"] == "tp" and "moved" in flying, flying
    assert long["output_ids"] == greedy_tokens(demo_model_dir, long_prompt, LONG)
    assert _delta(after, before, "moved_to_dp") == 1
    moved_tokens = _delta(after, before, "moved_tokens")
    assert len(long_prompt) < moved_tokens < len(long_prompt) + LONG, moved_tokens
    # Nothing prefilled twice: the two prompts, once each (distinct prompts: no cache hit).
    assert _delta(after, before, "prefill_tokens") == len(long_prompt) + len(short_prompt)
    # The session ended at the move, long before its request finished.
    assert after["totals"]["tp_steps"] - before["totals"]["tp_steps"] < 2 * LONG


def test_a_members_dp_request_keeps_stepping_while_a_move_runs(move_server, demo_model_dir):
    """The move's sender publishes its rows and goes back to its own DP work: the DP
    request that arrived on it (what moves the group) is prefilled and decodes while
    the taker, paused before it adopts (``ADOPT_DELAY_MS``), has not landed the moved
    request yet. Asserted from step counters: the sender writes SGLang's step counter
    into its published file at each of its boundaries, and the taker reads how far it
    advanced when it takes the rows (``moved_peer_steps``). A sender that waited for
    the taker, as a rendezvous makes it, would read 0."""
    outboxes = _outboxes()
    before, long, short, long_prompt, short_prompt = _tp_then_dp(move_server, seed=127)
    after = settled(move_server, before)
    assert _delta(after, before, "moved_to_dp") == 1
    steps = _delta(after, before, "moved_peer_steps")
    assert steps >= 2, steps  # its prefill and at least one decode step
    assert _outboxes() <= outboxes  # the senders' outboxes are reused, not one per move
    assert short["output_ids"] == greedy_tokens(demo_model_dir, short_prompt, SHORT)
    assert long["output_ids"] == greedy_tokens(demo_model_dir, long_prompt, LONG)
    assert _delta(after, before, "prefill_tokens") == len(long_prompt) + len(short_prompt)


def _stream_ids(server, ids: list[int], n: int, headers: dict) -> tuple[list[int], dict, int]:
    """A streamed greedy /generate: (its output ids, the last chunk's meta_info, chunks)."""
    payload = {"input_ids": ids, "stream": True,
               "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    return stream_ids(server, payload, headers)


def test_a_moved_request_goes_on_streaming_from_the_less_loaded_member(move_server, demo_model_dir):
    """DP work arrives on the leader: the group's streamed request moves to the other
    member (fewer DP requests), which answers the rest of the stream: every token,
    once, equal to transformers'."""
    before = wait_idle(move_server)
    long_prompt, dp_prompt = prompts(2, 40, seed=109)
    result: dict = {}
    group = threading.Thread(
        target=lambda: result.update(zip(("ids", "meta", "chunks"),
                                         _stream_ids(move_server, long_prompt, LONG, TP2), strict=True)),
        daemon=True,
    )
    group.start()
    until(lambda: all(m == "tp2" for m in engine_counter(status(move_server), "mode"))
          and status(move_server)["totals"]["tp_steps"] > before["totals"]["tp_steps"] + 20,
          "the TP-2 session did not start")
    dp, dp_result = greedy_on(move_server, dp_prompt, SHORT, 0)  # DP work on the leader
    dp.join(timeout=600)
    group.join(timeout=600)
    after = settled(move_server, before)
    moved = [a - b for a, b in zip(engine_counter(after, "moved_to_dp"),
                                   engine_counter(before, "moved_to_dp"), strict=True)]
    assert moved == [0, 1], moved  # landed on engine 1, not on the leader
    assert dp_result.pop("status_code") == 200, dp_result
    assert dp_result["output_ids"] == greedy_tokens(demo_model_dir, dp_prompt, SHORT)
    assert result["meta"]["flying"]["mode"] == "tp"  # a stream reports its first placement
    assert result["chunks"] > 1
    assert result["ids"] == greedy_tokens(demo_model_dir, long_prompt, LONG)
    assert _delta(after, before, "prefill_tokens") == len(long_prompt) + len(dp_prompt)


def test_a_running_dp_request_joins_a_forming_group(move_server, demo_model_dir):
    before, long, short, long_prompt, short_prompt = _dp_then_tp(move_server, seed=79)
    after = settled(move_server, before)
    assert short["meta_info"]["flying"]["mode"] == "tp"
    assert short["output_ids"] == greedy_tokens(demo_model_dir, short_prompt, SHORT)
    assert long["output_ids"] == greedy_tokens(demo_model_dir, long_prompt, LONG)
    assert _delta(after, before, "moved_to_tp") == 1
    assert _delta(after, before, "prefill_tokens") == len(long_prompt) + len(short_prompt)


def test_a_request_that_joined_a_group_moves_back_to_dp(move_server, demo_model_dir):
    """DP -> TP -> DP: the joined request's batch (built by Flying, not by a prefill)
    merges back into the leader's DP running batch, which still holds a request that
    could not join (constrained decoding), with every request's tokens intact."""
    before = wait_idle(move_server)
    long_prompt, tp_prompt, dp_prompt = prompts(3, 30, seed=101)
    constrained: dict = {}

    def run_constrained():  # stays in DP on engine 0 throughout
        payload = {
            "text": "pick:", "routed_dp_rank": 0,
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "regex": "[a-z]{400}"},
        }
        r = move_server.post("/generate", payload, timeout=600)
        constrained.update(r.json(), status_code=r.status_code)

    held = threading.Thread(target=run_constrained, daemon=True)
    held.start()

    long, result = greedy_on(move_server, long_prompt, LONG, 0)  # the group's leader
    until(lambda: _delta(status(move_server), before, "prefill_tokens") >= len(long_prompt),
           "the DP request did not start")
    time.sleep(0.5)
    tp = greedy(move_server, tp_prompt, SHORT, TP2)  # binds [0, 1]: the long request joins
    until(lambda: _delta(status(move_server), before, "moved_to_tp") == 1, "no join")
    payload = {  # DP work on engine 1: the group hands its requests back to engine 0
        "input_ids": dp_prompt, "routed_dp_rank": 1,
        "sampling_params": {"max_new_tokens": SHORT, "temperature": 0, "ignore_eos": True},
    }
    dp = move_server.post("/generate", payload, timeout=600).json()
    long.join(timeout=600)
    held.join(timeout=600)
    after = settled(move_server, before)
    assert constrained["status_code"] == 200, constrained
    assert len(constrained["text"]) > 0 and constrained["text"].isalpha(), constrained["text"]
    assert _delta(after, before, "moved_to_dp") >= 1
    assert result["output_ids"] == greedy_tokens(demo_model_dir, long_prompt, LONG)
    assert tp["output_ids"] == greedy_tokens(demo_model_dir, tp_prompt, SHORT)
    assert dp["output_ids"] == greedy_tokens(demo_model_dir, dp_prompt, SHORT)
    prompts_len = len(long_prompt) + len(tp_prompt) + len(dp_prompt)
    prompts_len += constrained["meta_info"]["prompt_tokens"]
    assert _delta(after, before, "prefill_tokens") == prompts_len


def _arm(server, stage: str, rank: int) -> None:
    r = server.post("/flying/test/fault", {"stage": stage, "rank": rank})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("rank", "sender"), [(0, 0), (1, 1), (0, 1), (1, 0)])
def test_a_fault_while_moving_to_dp_ends_that_session_only(move_server, demo_model_dir, rank,
                                                           sender):
    """The fault on the move's sender (the member the DP request arrived at: it has
    published nothing) or on its taker (the sender publishes and disowns the request:
    the taker answers it, leader or not)."""
    outboxes = _outboxes()
    _arm(move_server, "move", rank)
    before, long, short, long_prompt, short_prompt = _tp_then_dp(
        move_server, seed=83 + 2 * rank + sender, short_rank=sender)
    after = settled(move_server, before)
    assert _delta(after, before, "faulted_sessions") >= 1
    assert _delta(after, before, "moved_to_dp") == 0
    # The leader re-ran the group's request in DP (nothing sent yet) or resumed it there
    # from its tokens so far (SGLang's partial outputs every 50 tokens): one answer.
    assert _delta(after, before, "rerun_in_dp") + _delta(after, before, "resumed_in_dp") == 1
    assert _outboxes() <= outboxes
    assert long["output_ids"] == greedy_tokens(demo_model_dir, long_prompt, LONG)
    assert short["output_ids"] == greedy_tokens(demo_model_dir, short_prompt, SHORT)


@pytest.mark.parametrize(("stage", "rank", "seed"),
                         [("join", 0, 89), ("join", 1, 90), ("take_out", 0, 91)])
def test_a_fault_while_joining_leaves_the_request_in_dp(move_server, demo_model_dir, stage,
                                                        rank, seed):
    """``take_out``: the source (engine 0, which runs the DP request) has taken it out of
    its batch and released its KV row, before carrying it (where pickling the request
    once failed under ``--enable-metrics``, and nobody answered it)."""
    _arm(move_server, stage, rank)
    before, long, short, long_prompt, short_prompt = _dp_then_tp(move_server, seed=seed)
    after = settled(move_server, before)
    assert _delta(after, before, "faulted_sessions") >= 1
    assert _delta(after, before, "moved_to_tp") == 0
    assert long["output_ids"] == greedy_tokens(demo_model_dir, long_prompt, LONG)
    assert short["output_ids"] == greedy_tokens(demo_model_dir, short_prompt, SHORT)
    # The node still moves requests after the fault.
    before, long, short, long_prompt, short_prompt = _dp_then_tp(move_server, seed=seed + 8)
    after = settled(move_server, before)
    assert _delta(after, before, "moved_to_tp") == 1
    assert long["output_ids"] == greedy_tokens(demo_model_dir, long_prompt, LONG)


def test_dp_work_a_group_found_at_its_bind_is_served_beside_it_not_moved_into(
    move_server, demo_model_dir
):
    """A DP request that cannot join (constrained decoding) running on engine 1 when a
    TP-2 request binds the group: the group's request stays in the group to its end, the
    DP request runs between group steps. Only DP work that arrives during a session moves
    its requests; otherwise every session formed beside running DP requests (those an
    earlier session moved to DP among them) would hand its requests to DP at once."""
    (short_prompt,) = prompts(1, 36, seed=211)
    before = wait_idle(move_server)
    result: dict = {}

    def run_constrained() -> None:  # stays in DP on engine 1 throughout
        payload = {"text": "pick:", "routed_dp_rank": 1, "sampling_params": {
            "max_new_tokens": LONG, "temperature": 0, "regex": "[a-z]{2000}"}}
        r = move_server.post("/generate", payload, timeout=600)
        result.update(r.json(), status_code=r.status_code)

    dp = threading.Thread(target=run_constrained, daemon=True)
    dp.start()
    until(lambda: delta(status(move_server), before, "prefill_tokens") > 0,
          "the DP request did not start")
    time.sleep(0.5)
    short = greedy(move_server, short_prompt, SHORT, TP2)
    dp.join(timeout=600)
    assert result.pop("status_code") == 200, result
    after = settled(move_server, before)
    flying = short["meta_info"]["flying"]
    assert flying["mode"] == "tp" and "moved" not in flying, flying
    assert _delta(after, before, "moved_to_dp") == 0 and _delta(after, before, "moved_to_tp") == 0
    assert _delta(after, before, "dp_steps_in_session") > 0
    assert short["output_ids"] == greedy_tokens(demo_model_dir, short_prompt, SHORT)
    assert result["text"].isalpha(), result["text"]
    assert result["meta_info"]["completion_tokens"] == LONG, result["meta_info"]


def _both_then_tp(server, seed: int) -> tuple[dict, list, list, dict, list]:
    """A long DP request on each engine, then (once both decode) a short TP-2 request
    binding the group [0, 1]; returns (status before, the long prompts, their answers,
    the short answer, the short prompt)."""
    before = wait_idle(server)
    *longs, short_prompt = prompts(3, 34, seed=seed)
    runs = [greedy_on(server, p, LONG, rank) for rank, p in enumerate(longs)]
    until(lambda: delta(status(server), before, "prefill_tokens") >= sum(map(len, longs)),
          "the DP requests did not start")
    time.sleep(0.5)  # some DP decode steps on both
    short = greedy(server, short_prompt, SHORT, TP2)
    answers = []
    for thread, result in runs:
        thread.join(timeout=600)
        assert result.pop("status_code") == 200, result
        answers.append(result)
    return before, longs, answers, short, short_prompt


def test_running_dp_requests_of_every_member_join_a_forming_group(move_server, demo_model_dir):
    """A long DP request on each engine when a TP-2 request binds the group: both join it
    with their KV (each counted by the engine it came from; engine 1's is answered by
    the leader from then on) instead of running their DP steps between the group's:
    every answer is transformers' greedy tokens, every prompt prefilled once."""
    before, longs, answers, short, short_prompt = _both_then_tp(move_server, seed=223)
    after = settled(move_server, before)
    joined = [a - b for a, b in zip(engine_counter(after, "moved_to_tp"),
                                    engine_counter(before, "moved_to_tp"), strict=True)]
    assert joined == [1, 1], joined
    assert _delta(after, before, "dp_steps_in_session") == 0
    assert short["output_ids"] == greedy_tokens(demo_model_dir, short_prompt, SHORT)
    for prompt, answer in zip(longs, answers, strict=True):
        assert answer["output_ids"] == greedy_tokens(demo_model_dir, prompt, LONG)
    assert _delta(after, before, "prefill_tokens") == sum(map(len, longs)) + len(short_prompt)


def test_a_fault_at_the_second_source_puts_the_first_sources_request_back(
    move_server, demo_model_dir
):
    """Two members join their requests; engine 1 fails as its own request is carried,
    after engine 0's was (the fault's second check there): the session ends, engine 0
    puts its carried request back into its DP batch, engine 1's never left, and both go
    on in DP to transformers' tokens with every slot and row back."""
    r = move_server.post("/flying/test/fault", {"stage": "join", "rank": 1, "after": 1})
    assert r.status_code == 200, r.text
    before, longs, answers, short, short_prompt = _both_then_tp(move_server, seed=227)
    after = settled(move_server, before)
    assert _delta(after, before, "faulted_sessions") >= 1
    assert _delta(after, before, "moved_to_tp") == 0
    for prompt, answer in zip(longs, answers, strict=True):
        assert answer["output_ids"] == greedy_tokens(demo_model_dir, prompt, LONG)
    assert short["output_ids"] == greedy_tokens(demo_model_dir, short_prompt, SHORT)
