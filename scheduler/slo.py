"""SLOs: the node's (derived from measured quiet service unless configured) and a
request's own (``X-Flying-SLO-*`` / ``custom_params``: which group, if any, meets them
where one engine does not). Pure: no torch, no sockets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from scheduler.costs import Costs
from scheduler.service import Slo, quiet


class _Configured(Protocol):
    slo_ttft_ms: float
    slo_tpot_ms: float


#: Derived SLOs: this many times one engine's quiet service (the benchmarks'
#: definition: TTFT <= 4x the quiet TTFT, TPOT <= 1.5x the quiet TPOT), for the traffic's
#: mean prompt, at least SLO_PROMPT tokens. One engine's, not the fastest mode's: what
#: a plain SGLang DP replica gives a request alone is a target every layout can meet
#: below saturation, so goodput tells layouts apart under load (a target from a faster
#: group's batch-1 step is one nothing meets under load: every goodput 0, the choice
#: left to tie-breaks); and a TTFT target for short prompts no layout meets for long
#: ones, hence the traffic's prompt.
SLO_TTFT_X, SLO_TPOT_X, SLO_PROMPT = 4.0, 1.5, 256


def derive_slo(
    config: _Configured, costs: Costs | None, degrees: tuple[int, ...], prompt: float = 0.0
) -> Slo | None:
    """The node's SLOs: the configured ones, each unset one derived from the quiet
    service (one request alone, of ``prompt`` tokens, at least ``SLO_PROMPT``) of one
    engine (of the fastest mode measured while one engine's is not); None if a needed
    one cannot be derived yet (no costs)."""
    size = max(float(SLO_PROMPT), prompt)
    q = None
    if costs is not None:
        q = quiet(costs, 1, size)
        if q is None:
            quiets = [x for d in degrees if (x := quiet(costs, d, size)) is not None]
            q = (min(x[0] for x in quiets), min(x[1] for x in quiets)) if quiets else None
    if q is not None:
        ttft = config.slo_ttft_ms or SLO_TTFT_X * q[0]
        tpot = config.slo_tpot_ms or SLO_TPOT_X * q[1]
        return Slo(round(ttft, 1), round(tpot, 2))
    if config.slo_ttft_ms and config.slo_tpot_ms:
        return Slo(config.slo_ttft_ms, config.slo_tpot_ms)
    return None

def group_for_own_slo(
    ttft_ms: float, tpot_ms: float, prompt_len: int, costs: Costs, degrees: Iterable[int],
    fits: Callable[[int], bool], dp_batch: int = 1,
) -> tuple[int, str] | None:
    """(degree, reason) of the smallest group whose quiet service meets a request's own
    SLOs (``ttft_ms`` / ``tpot_ms``, 0 = none) where one engine, at ``dp_batch`` running
    requests with this one, would miss them; None where one engine meets them, no group
    does (``fits(degree)``: the request's KV fits that group), or DP is unmeasured.

    One engine's service is predicted at its current batch: a DP request shares its
    engine's steps. A group's is its quiet service (a request alone): the group is formed
    for this request, and a TP step on 2 cores or 8 GPUs grows with batch the way one
    engine's does, so an SLO a quiet group misses is missed under load too."""

    def meets(ttft: float, tpot: float) -> bool:
        return (not ttft_ms or ttft <= ttft_ms) and (not tpot_ms or tpot <= tpot_ms)

    alone = quiet(costs, 1, prompt_len)
    if alone is None:
        return None
    dp_tpot = costs.decode(1, dp_batch) or alone[1]
    if meets(alone[0] + (dp_tpot - alone[1]) / 2.0, dp_tpot):
        return None
    for degree in degrees:
        group = quiet(costs, degree, prompt_len)
        if group is not None and fits(degree) and meets(*group):
            return degree, (f"request SLO: one engine {dp_tpot:.1f} ms/token, TP-{degree} "
                            f"{group[1]:.1f} ms/token, first token {group[0]:.0f} ms")
    return None
