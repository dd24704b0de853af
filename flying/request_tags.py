"""Reading Flying's request headers and reporting where a request ran.

``X-Flying-TP: <m>`` runs the request in a TP group of degree m (manual control, kept
for operators). Invalid values are the client's error: a ``ValueError`` whose message
SGLang returns as HTTP 400, before anything is queued.
"""

from __future__ import annotations

from flying.config import get_config
from flying.messages import mark, unmark

TP_HEADER = "x-flying-tp"
PRIORITY_HEADER = "x-priority"


def tag_request(obj, headers) -> None:
    """Apply Flying's headers to ``obj`` (a GenerateReqInput): priority and explicit TP."""
    if headers is None:
        return
    priority = headers.get(PRIORITY_HEADER)
    if priority is not None:
        from scheduler.policy import parse_priority

        obj.priority = parse_priority(priority)
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


def place(obj, input_ids, manager) -> None:
    """Decide TP/DP for requests without an explicit degree (priority, long context,
    static-tp); reject what not even the whole node can hold (a ValueError: HTTP 400)."""
    from flying.placement import request_of

    degrees = get_config().degree_list() or []
    if manager.max_req_input_len is None:
        return
    policy = _policy(manager)
    req = request_of(len(input_ids), obj.sampling_params, obj.priority, degree_of(obj))
    decision = policy.decide(req, loads=None)
    if decision.mode == "reject":
        raise ValueError(decision.reason)
    if decision.mode == "tp" and not req.explicit_degree and degrees:
        obj.routing_key = mark(getattr(obj, "routing_key", None), decision.degree)


_POLICY = None


def _policy(manager):
    """The HTTP process's policy instance (its load decisions are the controller's)."""
    global _POLICY
    if _POLICY is None:
        from flying.placement import make_policy

        engines = max(get_config().degree_list() or [1])
        _POLICY = make_policy(
            engines, manager.max_req_input_len, getattr(manager, "context_len", 0) or 0
        )
    return _POLICY


def degree_of(obj) -> int:
    return unmark(getattr(obj, "routing_key", None))[0]


def where_it_ran(obj, meta: dict) -> int:
    """The TP degree a request ran at (1 or 0: DP): its mark, or the controller's
    adaptive placement when it had none."""
    degree = degree_of(obj)
    if degree or get_config().policy != "adaptive":
        return degree
    from flying import placement_log
    from flying.comm_pool import hosted_store

    store = hosted_store()
    if store is None:
        return 0
    rid = meta.get("id") or obj.rid
    return placement_log.degree_for(store, rid, meta.get("finish_reason") is not None)


def placement(degree: int, dp_rank: int | None) -> dict | None:
    """``meta_info["flying"]``: the mode, the degree and the engine ranks."""
    if dp_rank is None:
        return None
    if degree <= 1:
        return {"mode": "dp", "degree": 1, "ranks": [dp_rank]}
    return {"mode": "tp", "degree": degree, "ranks": list(range(dp_rank, dp_rank + degree))}
