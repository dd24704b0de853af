"""Groups of more ranks than the model has KV heads: each head replicated on degree/H_kv
ranks (``flying.substrate.layout.KvSplit``), as SGLang's own TP serves such models.

Two servers, one after the other (a module-scoped parametrized fixture: never both on
the 2 cores): ``qwen2-kv2`` (8 query / 2 KV heads, Qwen2/2.5 0.5B-3B style, with QKV
bias) on 4 engines, whose TP-4 group replicates each head on 2 ranks (its TP-2 group
splits them); ``llama-kv1`` (8 query / 1 KV head) on 2 engines, whose TP-2 group holds
the one head on both. The start-up probe opened the replicated degree (a request in the
group reports it). Each server must give transformers' greedy tokens in DP and in its
groups, from a group that really ran (``meta_info.flying``, no faulted session, no DP
re-run); move a running group request into DP and a running DP request into a group
with their KV (exact tokens, nothing prefilled twice); and count a replicating group's
KV honestly: it pools H_kv engines' KV slots, not m (``Node.kv_heads``): a request
beyond that is refused at the door, one within it beyond one engine runs in the group.
KV slots and request rows return to their initial counts after every test.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from flying.node.placement import SLOTS_ABOVE_INPUT_LIMIT
from flying.session.budget import ADMISSION_SLACK
from flying.session.faults import DELAY_ENV
from tests.conftest import serve
from tests.models import ensure_model
from tests.node import (
    delta,
    dp_then_tp,
    greedy,
    greedy_payload,
    settled,
    tp_then_dp,
    wait_idle,
)
from tests.reference import greedy_tokens, prompts
from workloads.measure.server import Server

pytestmark = pytest.mark.integration

SLOTS = 1024  # KV slots per engine
LONG, SHORT = 600, 16  # tokens of the running request that changes layout / the other
#: prompt ids within these checkpoints' vocabulary (the demo tokenizer's entries, 483:
#: ``prompts``' default range reaches past it)
VOCAB = (3, 480)


@dataclass(frozen=True)
class Case:
    checkpoint: str
    engines: int
    kv_heads: int
    degrees: tuple[int, ...]  # the replicated one last

    @property
    def replicated(self) -> int:
        return self.degrees[-1]

    def group_capacity(self) -> int:
        """Tokens (prompt + max_new_tokens) the replicated group admits: H_kv engines'
        KV slots (a DP slot holds H_kv tokens of the group), less admission slack."""
        engine_slots = SLOTS - 1 - 5 + SLOTS_ABOVE_INPUT_LIMIT  # as make_policy counts
        return engine_slots * self.kv_heads - ADMISSION_SLACK


CASES = {
    "kv2-tp4": Case("qwen2-kv2", 4, 2, (2, 4)),
    "kv1-tp2": Case("llama-kv1", 2, 1, (2,)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request) -> Case:
    return CASES[request.param]


@pytest.fixture(scope="module")
def model_dir(case: Case) -> Path:
    return ensure_model(case.checkpoint)


@pytest.fixture(scope="module")
def server(case: Case, model_dir: Path, tmp_path_factory) -> Iterator[Server]:
    yield from serve(
        tmp_path_factory.mktemp(f"replicated-{case.checkpoint}") / "server.log",
        "--model-path", str(model_dir), "--dp-size", str(case.engines),
        "--max-total-tokens", str(SLOTS), "--flying-policy", "manual",
        "--flying-move-to-dp", "all",
        # These checkpoints decode ~1000 tokens/s: every step 4 ms slower keeps the
        # running request of the move and join tests decoding (600 tokens, >= 2.4 s)
        # until the other request arrives, on any machine.
        env={DELAY_ENV: "1:4,2:4,4:4"},
    )


def _ran_in(body: dict, degree: int) -> None:
    where = body["meta_info"]["flying"]
    if degree == 1:
        assert where["mode"] == "dp", where
    else:
        assert (where["mode"], where["degree"], len(where["ranks"])) == ("tp", degree, degree), where


def test_greedy_tokens_equal_transformers_in_dp_and_every_group(server, case, model_dir):
    ids = prompts(1, 17, seed=11, vocab=VOCAB)[0]
    want = greedy_tokens(model_dir, ids, 12)
    for degree in (1, *case.degrees):
        before = wait_idle(server)
        headers = {"X-Flying-TP": str(degree)} if degree > 1 else {}
        body = greedy(server, ids, 12, headers)
        _ran_in(body, degree)
        assert body["output_ids"] == want, (degree, body["meta_info"]["flying"])
        after = settled(server, before)
        assert delta(after, before, "faulted_sessions") == 0, after["totals"]
        assert delta(after, before, "rerun_in_dp") == 0, after["totals"]
        # every member of the group counts the request it served; none in DP
        assert delta(after, before, "tp_requests") == (degree if degree > 1 else 0)


def test_a_running_request_moves_from_the_replicated_group_to_dp(server, case, model_dir):
    long_prompt, short_prompt = prompts(2, 40, seed=73, vocab=VOCAB)
    before, long, short = tp_then_dp(server, long_prompt, short_prompt, case.replicated, LONG, SHORT)
    after = settled(server, before)
    flying = long["meta_info"]["flying"]
    assert flying["mode"] == "tp" and flying["degree"] == case.replicated, flying
    assert "moved" in flying, flying
    assert long["output_ids"] == greedy_tokens(model_dir, long_prompt, LONG)
    assert short["output_ids"] == greedy_tokens(model_dir, short_prompt, SHORT)
    assert delta(after, before, "moved_to_dp") == 1
    assert delta(after, before, "prefill_tokens") == len(long_prompt) + len(short_prompt)
    assert delta(after, before, "faulted_sessions") == 0


def test_a_running_dp_request_joins_the_replicated_group(server, case, model_dir):
    long_prompt, short_prompt = prompts(2, 36, seed=79, vocab=VOCAB)
    before, long, short = dp_then_tp(server, long_prompt, short_prompt, case.replicated, LONG, SHORT)
    after = settled(server, before)
    _ran_in(short, case.replicated)
    assert short["output_ids"] == greedy_tokens(model_dir, short_prompt, SHORT)
    assert long["output_ids"] == greedy_tokens(model_dir, long_prompt, LONG)
    assert delta(after, before, "moved_to_tp") == 1
    assert delta(after, before, "prefill_tokens") == len(long_prompt) + len(short_prompt)
    assert delta(after, before, "faulted_sessions") == 0


def test_a_replicating_group_admits_what_its_kv_holds_and_no_more(server, case, model_dir):
    """H_kv engines' KV, not m: beyond it a request is refused at the door (it would
    otherwise be accepted and find no room on the members); within it and beyond one
    engine (2 KV heads) it runs in the group with transformers' tokens."""
    capacity, m = case.group_capacity(), case.replicated
    before = wait_idle(server)
    over = prompts(1, capacity - SHORT + 1, seed=5, vocab=VOCAB)[0]
    r = server.post("/generate", greedy_payload(over, SHORT), headers={"X-Flying-TP": str(m)})
    assert r.status_code == 400, r.text
    assert f"{capacity} tokens with the largest TP degree {m}" in r.text, r.text
    if case.kv_heads > 1:
        within = prompts(1, SLOTS + 100, seed=6, vocab=VOCAB)[0]  # longer than one engine's pool
        body = greedy(server, within, SHORT, {"X-Flying-TP": str(m)})
        _ran_in(body, m)
        assert body["output_ids"] == greedy_tokens(model_dir, within, SHORT)
    after = settled(server, before)
    assert delta(after, before, "faulted_sessions") == 0

