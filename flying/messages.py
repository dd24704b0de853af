"""What travels between Flying's processes, and how a request is marked for TP.

A request that must run in a TP group carries a marker in SGLang's ``routing_key``
field, the one per-request string that SGLang already carries from the HTTP layer to
the DP controller: ``flying:tp=<m>`` (a user's own routing key is kept after a ``;``).
The controller strips the marker before the request reaches an engine.

``Bind`` goes from the controller to every member of a group, in the controller's one
total order; it is pickled by SGLang's IPC (not a msgspec type).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MARK = "flying:tp="


def mark(routing_key: str | None, degree: int) -> str:
    return f"{MARK}{degree}" + (f";{routing_key}" if routing_key else "")


def unmark(routing_key: str | None) -> tuple[int, str | None]:
    """(requested TP degree or 0, the user's own routing key)."""
    if not routing_key or not routing_key.startswith(MARK):
        return 0, routing_key
    head, _, rest = routing_key.partition(";")
    return int(head[len(MARK) :]), (rest or None)


@dataclass
class Bind:
    """Run ``req`` as one TP session on the group ``ranks`` (leader = ranks[0])."""

    bind_id: str
    degree: int
    ranks: tuple[int, ...]
    req: Any  # TokenizedGenerateReqInput, routing key already unmarked
    issued_at: float  # controller's time.time(), for switch-latency accounting
