"""Holding a new request's prefill in a group while the group's running requests finish.

A TP group is one server: each arrival's prefill pauses every request it is decoding
(two DP engines split close arrivals and pause nobody). For a short request near its
end that pause is most of its TPOT: on the hidden-1024 model's three-peak trace a
9-token request that drew one 124-token prefill streamed at 46-58 ms a token against
~18 alone, past the TPOT SLO, in a quiet phase where static DP served every request
within it. Where every running request finishes (by length) within a few steps, the
group admits the arrival after them instead: it waits those steps (tens of ms, inside
any TTFT SLO) and the running requests end without the pause.

A hold must pay: the arrival waits only where admitting it now would put a running
request past its TPOT SLO (``pause_breaks``: the arrival's prefill, the pause, spread
over the request's tokens). A long request shrugs off one prefill (a conversation turn
of 200 tokens at 30 ms a token gains 2 ms a token from a 400 ms prefill), so an arrival
behind it is admitted at once: on the hidden-1024 model's Azure conversation replay
47 of 80 arrivals waited behind such requests for nothing, and the quiet TTFT p50 ran
1.17x static TP's.

Pure (no torch, no sockets): the group's leader calls ``holds`` and ``pause_breaks`` at
each boundary (``flying.session.lifecycle``), and the simulator calls the same functions.

Invariants:
- an arrival is held at most ``max_steps`` boundaries in a row (``held`` counts them);
- a hold is never partial: it starts only if every running request's remaining tokens
  fit in the steps the hold has left, and each step takes one token off both, so the
  running requests finish (or stop earlier) before the bound and the arrival never
  waits only to pause them anyway;
- a hold starts only where the pause would leave a running request's TPOT past its
  SLO, or where what that needs is unknown (no SLO, no prefill cost:
  the step bound alone decides, as before SLOs existed);
- nothing is held behind a request that is still prefilling or waiting, nor behind an
  empty batch, and only for binds the policy made (adaptive or static-tp:
  ``HOLDABLE``): a priority, long-context or explicitly grouped request is admitted at
  once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Default bound on a hold, in group steps (``--flying-hold-steps``; 0: never hold).
HOLD_STEPS = 8
#: Bind reasons whose requests may wait for the running ones (``Bind.reason``).
HOLDABLE = frozenset({"policy"})


def holds(left: Sequence[int], held: int, max_steps: int) -> bool:
    """Whether to defer admitting the head arrival at this boundary.

    ``left``: each running request's remaining output tokens by length
    (``max_new_tokens`` - tokens out; empty when nothing decodes); ``held``: boundaries
    this arrival has already been held; ``max_steps``: the bound."""
    return max_steps > 0 and bool(left) and max(left) <= max_steps - held


@dataclass(frozen=True)
class Running:
    """One running request of the group, as the hold reads it."""

    #: output tokens still to come by its bound (``max_new_tokens`` - tokens out)
    left: int
    #: output tokens it has produced
    out: int
    #: ms per token between its tokens so far (0: fewer than two tokens yet)
    pace_ms: float
    #: its TPOT SLO in ms (its own or the node's; 0: none known)
    slo_tpot_ms: float


def tpot(r: Running, step_ms: float, pause_ms: float) -> float:
    """``r``'s TPOT at its end (ms): its pace so far over the tokens it has, ``step_ms``
    for each token to come and one pause of ``pause_ms``, over its n - 1 intervals."""
    done = max(r.out - 1, 0)
    pace = r.pace_ms if done and r.pace_ms > 0 else step_ms
    return (pace * done + step_ms * r.left + pause_ms) / max(done + r.left, 1)


def pause_breaks(running: Sequence[Running], pause_ms: float | None,
                 step_ms: float | None) -> bool:
    """Whether pausing the running requests for ``pause_ms`` (the arrivals' prefill) at
    steps of ``step_ms`` would leave one of them past its TPOT SLO. True where an SLO,
    the pause or the step is unknown (None / 0): the step bound of ``holds`` alone
    decides then. A request with one token in all has no TPOT. One past its SLO without
    the pause too is still spared it: the TPOT it streams at is what its client sees."""
    if pause_ms is None or step_ms is None or step_ms <= 0:
        return True
    for r in running:
        if r.out + r.left <= 1:
            continue
        if r.slo_tpot_ms <= 0:
            return True
        if tpot(r, step_ms, pause_ms) > r.slo_tpot_ms:
            return True
    return False
