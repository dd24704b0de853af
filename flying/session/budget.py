"""A grouped request's KV budget: how many tokens it may use, and its output bound.

Shared by placement (the HTTP process and controller decide where a request fits) and
admission (members reserve exactly that much), so both agree on every request.
"""

from __future__ import annotations

#: Tokens a TP session reserves beyond prompt + max_new_tokens (defined with the pure
#: relayout decisions, which replay re-runs offline).
from scheduler.relayout import ADMISSION_SLACK


def resolved_max_new_tokens(prompt_len: int, max_new_tokens: int | None, limit: int) -> int:
    """Output tokens a request may produce: ``max_new_tokens``, or for None SGLang's
    bound ``limit - prompt - 1`` (``init_req_max_new_tokens``), never below 0."""
    if max_new_tokens is None:
        return max(0, int(limit) - int(prompt_len) - 1)
    return max(0, int(max_new_tokens))


def kv_tokens_needed(
    prompt_len: int, max_new_tokens: int | None, limit: int, slack: int = ADMISSION_SLACK
) -> int:
    """KV tokens a grouped request may use: prompt + its output bound + admission slack.

    ``limit`` is the longest request (prompt + output) SGLang admits on one engine in DP
    mode (its ``max_req_len``): a request without max_new_tokens in a group may grow
    exactly as far as it would in DP. A request whose prompt only a group holds never
    arrives with None: the HTTP process gives it an explicit bound (the group's capacity
    less the prompt, ``place``), so this never resolves a long prompt to 0 new tokens.
    """
    return int(prompt_len) + resolved_max_new_tokens(prompt_len, max_new_tokens, limit) + slack
