"""Holding a new request's prefill in a group while the group's running requests finish.

A TP group is one server: each arrival's prefill pauses every request it is decoding
(two DP engines split close arrivals and pause nobody). For a short request near its
end that pause is most of its TPOT: on the hidden-1024 model's three-peak trace a
9-token request that drew one 124-token prefill streamed at 46-58 ms a token against
~18 alone, past the TPOT SLO, in a quiet phase where static DP served every request
within it. Where every running request finishes (by length) within a few steps, the
group admits the arrival after them instead: it waits those steps (tens of ms, inside
any TTFT SLO) and the running requests end without the pause.

Pure (no torch, no sockets): the group's leader calls ``holds`` at each boundary
(``flying.session.lifecycle``), and the simulator calls the same function.

Invariants:
- an arrival is held at most ``max_steps`` boundaries in a row (``held`` counts them);
- a hold is never partial: it starts only if every running request's remaining tokens
  fit in the steps the hold has left, and each step takes one token off both, so the
  running requests finish (or stop earlier) before the bound and the arrival never
  waits only to pause them anyway;
- nothing is held behind a request that is still prefilling or waiting, nor behind an
  empty batch, and only for binds the policy made (adaptive or static-tp:
  ``HOLDABLE``): a priority, long-context or explicitly grouped request is admitted at
  once.
"""

from __future__ import annotations

from collections.abc import Sequence

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
