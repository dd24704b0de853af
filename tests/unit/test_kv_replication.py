"""Fewer KV heads than a group's degree: which heads each rank holds, which degrees a
node allows, and the KV a replicating group pools (pure arithmetic, no server).

SGLang's rule (``QKVParallelLinear.num_kv_head_replicas``, ``LlamaAttention``): at TP-m
with H_kv < m every KV head lives on m/H_kv consecutive ranks, rank r holds head
``r // (m/H_kv)``. A rank then stores 1 head per token, so one DP KV slot (room for H_kv
heads) holds H_kv tokens of the group, not m: a group pools H_kv engines' KV.
"""

from __future__ import annotations

import json

import pytest

from flying.node.placement import model_kv_heads
from flying.session.budget import ADMISSION_SLACK
from flying.session.upgrade import new_total
from flying.substrate.kv_adaptor import tokens_per_slot
from flying.substrate.layout import KvSplit, allowed_degrees, degree_fits, validate_degrees
from scheduler.policy import Node, Policy, PolicyConfig, Request

pytestmark = pytest.mark.unit


def _heads(kv_heads: int, degree: int) -> list[list[int]]:
    split = KvSplit(kv_heads, degree)
    return [list(split.heads(r)) for r in range(degree)]


def test_which_kv_heads_each_rank_holds():
    # split (H_kv % m == 0): as before, H_kv/m heads per rank, no replica
    assert _heads(4, 2) == [[0, 1], [2, 3]]
    assert _heads(8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _heads(4, 4) == [[0], [1], [2], [3]]
    # replicated (m % H_kv == 0): one head per rank, head r // (m / H_kv)
    assert _heads(2, 4) == [[0], [0], [1], [1]]
    assert _heads(1, 2) == [[0], [0]]
    assert _heads(2, 8) == [[0]] * 4 + [[1]] * 4
    split = KvSplit(2, 4)
    assert (split.shards, split.replicas, split.heads_per_rank) == (2, 2, 1)
    assert [list(split.ranks(j)) for j in range(split.shards)] == [[0, 1], [2, 3]]
    assert (KvSplit(4, 2).shards, KvSplit(4, 2).replicas) == (2, 1)
    for bad in ((6, 4), (3, 2), (2, 3), (0, 2)):
        with pytest.raises(ValueError):
            KvSplit(*bad)
    with pytest.raises(ValueError):
        KvSplit(2, 4).shard(4)


def test_tokens_per_dp_slot_are_the_distinct_head_groups():
    assert tokens_per_slot(4, 2) == 2 and tokens_per_slot(8, 4) == 4  # m, as before
    assert tokens_per_slot(2, 4) == 2 and tokens_per_slot(1, 2) == 1  # H_kv, not m
    assert tokens_per_slot(2, 8) == 2


def test_auto_degrees_replicate_kv_heads_but_still_split_query_heads():
    assert allowed_degrees(4, 4, 8) == [2, 4]  # unchanged where heads split
    assert allowed_degrees(4, 2, 8) == [2, 4]  # Qwen2-0.5B style: TP-4 replicates
    assert allowed_degrees(2, 1, 8) == [2]  # one KV head (MQA)
    assert allowed_degrees(8, 2, 14) == [2]  # 14 query heads do not split over 4
    assert allowed_degrees(8, 6, 24) == [2]  # 6 KV heads: not split nor replicated by 4
    assert not degree_fits(4, 3, 12) and degree_fits(4, 1, 4)
    assert validate_degrees([4, 2], 4, 2, 8) == [2, 4]
    with pytest.raises(ValueError, match="multiple of them"):
        validate_degrees([4], 4, 6, 24)


#: make_policy's numbers for --max-total-tokens 1024: SGLang's own bound for one DP
#: request (max_req_input_len + 1) and the engine's KV slots
ENGINE_CAPACITY, SLOTS = 1019, 1024


def test_a_replicating_group_reports_the_kv_it_really_pools():
    slack = ADMISSION_SLACK
    plain = Node(4, (2, 4), ENGINE_CAPACITY, SLOTS, slack)
    assert plain.capacity(4) == 4 * SLOTS - slack  # unknown heads: degree x, as before
    four = Node(4, (2, 4), ENGINE_CAPACITY, SLOTS, slack, kv_heads=4)
    assert (four.capacity(2), four.capacity(4)) == (2 * SLOTS - slack, 4 * SLOTS - slack)
    two = Node(4, (2, 4), ENGINE_CAPACITY, SLOTS, slack, kv_heads=2)
    assert two.capacity(2) == two.capacity(4) == 2 * SLOTS - slack == 2044  # H_kv x, not m x
    one = Node(2, (2,), ENGINE_CAPACITY, SLOTS, slack, kv_heads=1)
    assert one.capacity(2) == SLOTS - slack == 1020  # one engine's slots, not two
    # The engines' own bound on an upgraded request agrees with the policy's.
    assert new_total(SLOTS, tokens_per_slot(2, 4), SLOTS, 10**6) == two.capacity(4)
    assert new_total(SLOTS, tokens_per_slot(1, 2), SLOTS, 10**6) == one.capacity(2)


def test_the_policy_places_and_refuses_by_the_replicated_capacity():
    node = Node(4, (2, 4), ENGINE_CAPACITY, SLOTS, ADMISSION_SLACK, kv_heads=2)
    two = Policy(PolicyConfig(policy="manual"), node)
    fits = Request(prompt_len=1900, max_new_tokens=100, explicit_degree=4)
    assert two.decide(fits).mode == "tp"
    too_long = Request(prompt_len=2000, max_new_tokens=100, explicit_degree=4)
    decision = two.decide(too_long)
    assert decision.mode == "reject" and "2044 tokens" in decision.reason, decision
    # Long context picks the smallest degree that holds it: TP-2 holds as much as TP-4.
    assert Policy(PolicyConfig(), node).decide(Request(1500, 100)).degree == 2
    one = Policy(PolicyConfig(), Node(2, (2,), ENGINE_CAPACITY, SLOTS, ADMISSION_SLACK, kv_heads=1))
    assert one.decide(Request(prompt_len=1100, max_new_tokens=10)).mode == "reject"


def test_the_policy_reads_the_checkpoints_kv_heads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 8, "num_key_value_heads": 2}))
    assert model_kv_heads(str(tmp_path)) == 2
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 8}))
    assert model_kv_heads(str(tmp_path)) == 8  # MHA: as many KV heads as query heads
    assert model_kv_heads(str(tmp_path / "missing")) == 0 and model_kv_heads(None) == 0


def test_the_policy_knows_the_kv_pool_not_only_one_requests_limit():
    """Under an 8k context an 800k-token pool batches ~100 requests per engine; the
    node's shape carries the pool (what the adaptive policy's service model batches),
    while one request's limit and a group's capacity stay bounded by the context."""
    from flying.node.placement import SLOTS_ABOVE_INPUT_LIMIT, node_of

    node = node_of(8, (2, 4, 8), max_req_input_len=8186, context_len=8192, kv_pool=800_000)
    assert node.engine_slots == 800_000
    assert node.capacity(1) == 8187 and node.capacity(8) == 8191
    # the HTTP process does not know the pool: SGLang's request limit stands for it,
    # which is the pool where the pool is the tighter bound (the CPU tests' case)
    small = node_of(2, (2,), max_req_input_len=394, kv_pool=0)
    assert small.engine_slots == 394 + SLOTS_ABOVE_INPUT_LIMIT == 400
