"""Build the scheduler policy from Flying's config, and turn a request into its inputs.

Used in the HTTP process (priority, long context, explicit degree: needs no load) and in
the DP controller (the adaptive load decision: needs the engines' load snapshots).
"""

from __future__ import annotations

from flying.config import get_config
from scheduler.policy import EngineLoad, Node, Policy, PolicyConfig, Request

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default
#: SGLang 0.5.23 (``TpModelWorker``): max_req_len = kv_slots - 1, and
#: max_req_input_len = max_req_len - 5, so an engine's KV slots are the input limit + 6
#: (when the context length is not the tighter bound).
SLOTS_ABOVE_INPUT_LIMIT = 6
#: Tokens a TP session reserves beyond prompt + max_new_tokens: SGLang's admission keeps
#: one page per request and one slot of headroom (strict ``<``) free.
ADMISSION_SLACK = 4


def make_policy(num_engines: int, max_req_input_len: int, context_len: int = 0) -> Policy:
    """The policy for this node, from the limits SGLang's engines report at startup."""
    cfg = get_config()
    node = Node(
        num_engines,
        tuple(cfg.degree_list() or ()),
        engine_capacity=max_req_input_len + 1,
        engine_slots=max_req_input_len + SLOTS_ABOVE_INPUT_LIMIT,
        group_slack=ADMISSION_SLACK,
        context_limit=max(0, context_len - 1),
    )
    return Policy(
        PolicyConfig(cfg.policy, cfg.priority_threshold, cfg.light_load, cfg.heavy_load).validate(),
        node,
    )


def max_new_tokens(sampling_params) -> int:
    if isinstance(sampling_params, dict):
        value = sampling_params.get("max_new_tokens")
    else:
        value = getattr(sampling_params, "max_new_tokens", None)
    return int(value) if value is not None else DEFAULT_MAX_NEW_TOKENS


def request_of(prompt_len: int, sampling_params, priority, explicit_degree: int) -> Request:
    return Request(
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens(sampling_params),
        priority=int(priority or 0),
        explicit_degree=explicit_degree,
    )


def loads_of(snapshots) -> list[EngineLoad]:
    return [EngineLoad(s.dp_rank, s.num_running_reqs, s.num_waiting_reqs) for s in snapshots]
