"""Reading Flying's request headers and reporting where a request ran.

``X-Flying-TP: <m>`` runs the request in a TP group of degree m (manual control, kept
for operators). Invalid values are the client's error: a ``ValueError`` whose message
SGLang returns as HTTP 400, before anything is queued.
"""

from __future__ import annotations

from flying.config import get_config
from flying.messages import mark, unmark

TP_HEADER = "x-flying-tp"


def tag_request(obj, headers) -> None:
    """Mark ``obj`` (a GenerateReqInput) for TP if the request asks for it."""
    if headers is None:
        return
    value = headers.get(TP_HEADER)
    if value is None:
        return
    try:
        degree = int(value)
    except ValueError:
        raise ValueError(f"invalid X-Flying-TP header {value!r}: expected an integer") from None
    if degree == 1:
        return
    allowed = get_config().degree_list() or []
    if degree not in allowed:
        raise ValueError(
            f"X-Flying-TP: {degree} is not an allowed TP degree on this node "
            f"(allowed: {allowed or 'none; start with --dp-size >= 2'})"
        )
    obj.routing_key = mark(getattr(obj, "routing_key", None), degree)


def degree_of(obj) -> int:
    return unmark(getattr(obj, "routing_key", None))[0]


def placement(degree: int, dp_rank: int | None) -> dict | None:
    """``meta_info["flying"]``: the mode, the degree and the engine ranks."""
    if dp_rank is None:
        return None
    if degree <= 1:
        return {"mode": "dp", "degree": 1, "ranks": [dp_rank]}
    return {"mode": "tp", "degree": degree, "ranks": list(range(dp_rank, dp_rank + degree))}
