"""Controller side of binding: turn a TP-marked request into one Bind per member.

Runs inside SGLang's DataParallelController process (the one place every request passes
through), which gives the one total order of binds the deadlock argument rests on: each
engine receives its binds in the order they were issued and runs them in that order.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid

from flying import placement_log
from flying.config import get_config
from flying.layout import Group, groups_of
from flying.messages import Bind, unmark

logger = logging.getLogger(__name__)


class BindIssuer:
    """Chooses the group for a degree (round robin over its aligned groups) and sends."""

    def __init__(self, num_engines: int, degrees: list[int]):
        self.num_engines = num_engines
        self._next = {m: itertools.cycle(groups_of(m, num_engines)) for m in degrees}
        self.issued = 0

    def choose(self, degree: int) -> Group:
        if degree not in self._next:
            raise ValueError(f"TP degree {degree} not available; allowed {sorted(self._next)}")
        return next(self._next[degree])

    def make_binds(self, req, degree: int) -> list[tuple[int, Bind]]:
        """(engine rank, Bind) for every member; the request's marker is removed."""
        _, user_key = unmark(req.routing_key)
        req.routing_key = user_key
        group = self.choose(degree)
        bind = Bind(
            bind_id=uuid.uuid4().hex[:12],
            degree=degree,
            ranks=group.ranks,
            req=req,
            issued_at=time.time(),
        )
        self.issued += 1
        return [(rank, bind) for rank in group.ranks]


def attach(controller) -> None:
    degrees = get_config().degree_list() or []
    controller._flying_issuer = (
        BindIssuer(controller.server_args.dp_size, degrees) if degrees else None
    )
    controller._flying_policy = None


def _policy(controller):
    if controller._flying_policy is None and getattr(controller, "max_req_input_len", None):
        from flying.placement import make_policy

        controller._flying_policy = make_policy(
            controller.server_args.dp_size, controller.max_req_input_len
        )
    return controller._flying_policy


def binds_for(controller, req) -> list[tuple[int, Bind]]:
    """The binds that carry ``req`` in a TP group, or [] to dispatch it as DP."""
    issuer = getattr(controller, "_flying_issuer", None)
    if issuer is None:
        return []
    from sglang.srt.managers.utils import is_health_check_generate_req

    if is_health_check_generate_req(req):
        return []
    degree, _ = unmark(getattr(req, "routing_key", None))
    if not degree and get_config().policy == "adaptive":
        degree = _adaptive_degree(controller, req)
        if degree:  # tell the HTTP process, for meta_info["flying"]
            placement_log.record(_store(controller), req.rid, degree)
    return issuer.make_binds(req, degree) if degree else []


def _store(controller):
    if getattr(controller, "_flying_store", None) is None:
        from flying.comm_pool import connect_store, store_address

        controller._flying_store = connect_store(store_address())
    return controller._flying_store


def _adaptive_degree(controller, req) -> int:
    policy = _policy(controller)
    if policy is None or not hasattr(req, "sampling_params"):
        return 0
    from flying.placement import loads_of, request_of

    loads = loads_of(controller.load_snapshot_reader.read_all())
    was_light = policy.light
    decision = policy.decide(
        request_of(len(req.input_ids or ()), req.sampling_params, req.priority, 0), loads
    )
    if policy.light != was_light:
        logger.info(
            "flying: adaptive policy -> %s (%d requests on %d engines)",
            "TP (light load)" if policy.light else "DP (heavy load)",
            sum(e.requests for e in loads),
            len(loads),
        )
    return decision.degree if decision.mode == "tp" else 0
