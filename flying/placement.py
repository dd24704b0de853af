"""Build the scheduler policy from Flying's config, and turn a request into its inputs.

Used in the HTTP process (priority, long context, explicit degree: needs no load) and in
the DP controller (the adaptive load decision: needs the engines' load snapshots).
"""

from __future__ import annotations

from flying.config import get_config
from scheduler.policy import EngineLoad, Node, Policy, PolicyConfig, Request

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default


def make_policy(num_engines: int, engine_capacity: int) -> Policy:
    cfg = get_config()
    return Policy(
        PolicyConfig(cfg.policy, cfg.priority_threshold, cfg.light_load, cfg.heavy_load).validate(),
        Node(num_engines, tuple(cfg.degree_list() or ()), engine_capacity),
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
