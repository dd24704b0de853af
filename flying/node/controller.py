"""Controller side of binding: turn a TP-marked request into one Bind per member.

Runs inside SGLang's DataParallelController process (the one place every request passes
through), which gives the one total order of binds the deadlock argument rests on: each
engine receives its binds in the order they were issued and runs them in that order.

What the controller decides itself, from the engines' load snapshots: the adaptive
policy's placement of unmarked requests, and whether a priority request may pause its
group's DP work (``--flying-priority-max-paused``). A request with a feature that runs in
DP only is never bound, whatever its marker says. Nothing here may take the controller
down: the hook (``sglang_patches.data_parallel_controller``) dispatches a request as
plain DP when deciding fails.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace

from flying.node import costs_reader, placement_log, turns
from flying.node.bind_issuer import BindIssuer
from flying.node.config import get_config
from flying.node.in_flight import InFlight, watch
from flying.session.messages import Bind, Upgrade, read_mark
from flying.substrate import status_board
from flying.substrate.layout import Group
from scheduler.traffic import Arrivals

logger = logging.getLogger(__name__)


def attach(controller) -> None:
    degrees = get_config().degree_list() or []
    controller._flying_issuer = (
        BindIssuer(controller.server_args.dp_size, degrees) if degrees else None
    )
    controller._flying_policy = None
    controller._flying_recorded = placement_log.Recorded()
    controller._flying_arrivals = Arrivals()
    controller._flying_in_flight = InFlight(controller.server_args.dp_size)
    workers = getattr(controller, "workers", None)
    if workers:  # none on node_rank > 0
        watch(workers, controller._flying_in_flight)
    board = status_board.attached() if degrees else None
    if board is not None:  # mapped now: the launcher then removes the board's file
        board.mark_reader()
    if get_config().decision_log:  # the log starts before any bind: engines append to it
        try:
            if _policy(controller) is not None:
                _decision_log(controller)
        except Exception:  # noqa: BLE001 - no policy yet: the log starts at its first use
            logger.exception("flying: could not start the decision log")


def _policy(controller):
    if controller._flying_policy is None and getattr(controller, "max_req_input_len", None):
        from flying.node.placement import make_policy

        controller._flying_policy = make_policy(
            controller.server_args.dp_size, controller.max_req_input_len,
            model_path=getattr(controller.server_args, "model_path", None),
            kv_pool=int(getattr(controller, "max_total_num_tokens", 0) or 0),
            server_args=controller.server_args,
        )
    return controller._flying_policy


def strip_marker(req) -> None:
    """Remove Flying's marker (or a forged one) from ``req``'s routing key; never raises."""
    try:
        if hasattr(req, "routing_key"):
            req.routing_key = read_mark(req.routing_key).user_key
    except Exception:  # noqa: BLE001
        logger.exception("flying: could not clear the routing key of a request")


def binds_for(controller, req) -> list[tuple[int, Bind]]:
    """The binds that carry ``req`` in a TP group, or [] to dispatch it as DP. Strips
    Flying's marker from the request either way."""
    marker = read_mark(getattr(req, "routing_key", None))
    if hasattr(req, "routing_key"):
        req.routing_key = marker.user_key
    if marker.forged:
        logger.warning(
            "flying: request %s carried a routing key with Flying's prefix but not this "
            "launch's secret; dropped it and dispatching in DP", getattr(req, "rid", "?")
        )
        return []
    issuer = getattr(controller, "_flying_issuer", None)
    if issuer is None or not hasattr(req, "sampling_params"):
        return []
    from sglang.srt.managers.utils import is_health_check_generate_req

    if is_health_check_generate_req(req):
        return []
    found = None
    if _groups_open(controller):  # not the probe's and calibration's requests
        if get_config().policy == "adaptive":
            found = turns.look_up(controller, req)
        _note_arrival(controller, req, found)
    binds, turn = _binds(controller, req, issuer, marker, found)
    if not binds and not turn:
        _route_dp(controller, req, issuer)
    turns.place(controller, req, found, bool(binds), turn, _within(controller, 1))
    return binds


def _within(controller, degree: int) -> tuple[int, ...]:
    """``Policy.engines_for``: the engines a request of ``degree`` runs on under a mixed
    layout, () under any other (or before the policy exists)."""
    policy = getattr(controller, "_flying_policy", None)
    return policy.engines_for(degree) if policy is not None else ()


def _route_dp(controller, req, issuer: BindIssuer) -> None:
    """A DP request under a mixed layout goes to one of its DP engines (SGLang's own
    ``routed_dp_rank``, which its dispatch honours before its load balancing), so that
    the layout's groups meet no DP arrival; under any other layout, or for a request
    that names its engine, SGLang dispatches it. Never raises: advice only."""
    try:
        within = _within(controller, 1)
        if not within or getattr(req, "routed_dp_rank", None) is not None:
            return
        rank = issuer.dp_engine(within, set(turns.dispatchable_loads(controller)))
        if rank is not None:
            req.routed_dp_rank = rank
    except Exception:  # noqa: BLE001 - SGLang's dispatch places it
        logger.exception("flying: could not route request %s to a DP engine",
                         getattr(req, "rid", "?"))


def round_robin_mark(controller) -> int | None:
    """Before SGLang dispatches a request in DP (``turns.round_robin_mark``); never raises."""
    try:
        return turns.round_robin_mark(controller)
    except Exception:  # noqa: BLE001 - advice only
        return None


def dispatching(controller):
    """While SGLang dispatches one request in DP: the engine it sends to counts it in
    flight (``flying.node.in_flight``) until that engine's snapshot shows it."""
    ledger = getattr(controller, "_flying_in_flight", None)
    return ledger.dispatching() if ledger is not None else contextlib.nullcontext()


def sent(controller, binds: list[tuple[int, Bind]]) -> None:
    """A request's binds went out: its group's leader counts it in flight."""
    ledger = getattr(controller, "_flying_in_flight", None)
    if ledger is not None and binds:
        ledger.note(binds[0][1].ranks[0])


def _loads(controller) -> list:
    """The engines' loads for the policy: their snapshots, and the requests sent to
    each since its snapshot (``flying.node.in_flight``)."""
    from flying.node.placement import loads_of

    snapshots = controller.load_snapshot_reader.read_all()
    loads = loads_of(snapshots)
    ledger = getattr(controller, "_flying_in_flight", None)
    if ledger is None:
        return loads
    return ledger.add(loads, {s.dp_rank: getattr(s, "timestamp", 0.0) for s in snapshots})


def dispatched(controller, req, mark: int | None) -> None:
    """After SGLang dispatched a request in DP: where it went, for the conversation index."""
    turns.learn(controller, req, mark)


def _binds(controller, req, issuer, marker, found) -> tuple[list[tuple[int, Bind]], bool]:
    """``binds_for``'s decision for a request Flying places (``found``: its
    conversation lookup, None if not looked up), and whether the adaptive policy ran it
    in DP as a conversation's turn (``Decision.turn``)."""
    from flying.node.placement import dp_only_feature

    feature = dp_only_feature(req)
    degree, group = marker.degree, None
    if degree and feature:  # the HTTP process refuses or demotes these; never bind one
        logger.warning("flying: request %s marked TP-%d but %s runs in DP; dispatching in DP",
                       req.rid, degree, feature)
        return [], False
    if degree and degree not in issuer.degrees:
        logger.warning("flying: request %s marked TP-%d, not a degree of this node (%s); "
                       "dispatching in DP", req.rid, degree, issuer.degrees)
        return [], False
    cfg = get_config()
    reason = marker.reason or "explicit"
    if degree and marker.reason == "priority" and not _priority_pays(controller, req):
        return [], False
    if degree and marker.reason == "priority" and cfg.priority_max_paused >= 0:
        group = _priority_group(controller, req, degree, cfg.priority_max_paused)
        if group is None:
            return [], False
    elif not degree and not feature and cfg.policy == "adaptive":
        # the group's leader reports it
        decision = _adaptive(controller, req, found)
        if decision is not None and decision.turn:
            return [], True
        degree = decision.degree if decision is not None and decision.mode == "tp" else 0
        reason = "policy"
    if degree and group is None:
        group = issuer.choose(degree, _within(controller, degree))
    if not degree:
        return [], False
    return issuer.make_binds(req, degree, group, reason, _slo_tpot(controller, req)), False


def _slo_tpot(controller, req) -> float:
    """The request's TPOT SLO (ms): its own, else the node's (derived by the adaptive
    policy, else ``--flying-slo-tpot``; 0: none known yet)."""
    from flying.node import request_slo

    try:
        own = request_slo.of(req.sampling_params)[1]
    except ValueError:  # refused with a 400 in the HTTP process; none here
        own = 0.0
    policy = getattr(controller, "_flying_policy", None)
    slo = policy.slo if policy is not None else None
    return own or (slo.tpot_ms if slo is not None else get_config().slo_tpot or 0.0)


def upgrade_binds_for(controller, ask: Upgrade) -> list[tuple[int, Bind]]:
    """The binds for an engine's ask to take a running request into a group, or []
    (the request ends at its engine's limit, as in plain SGLang)."""
    issuer = getattr(controller, "_flying_issuer", None)
    policy = _policy(controller)
    if issuer is None or policy is None or not _groups_open(controller):
        return []
    busy = _serving(controller)
    decision = policy.upgrade(ask.holder, ask.from_degree, busy)
    _decision_log(controller).upgrade(ask.rid, ask.holder, decision, ask.from_degree, busy)
    if decision.mode != "tp":
        logger.info("flying: request %s stays on engine %d: %s", ask.rid, ask.holder, decision.reason)
        return []
    return issuer.upgrade_binds(ask, decision.degree)


def _serving(controller) -> dict[int, int]:
    """Engine rank -> degree of the group it serves now (engines in DP left out), from
    the statuses engines publish at every bind and release; {} if unreadable."""
    from flying.session import status

    try:
        doc = status.read_all(_store(controller), controller.server_args.dp_size)
        return {int(e["rank"]): int(e["degree"]) for e in doc["engines"]
                if int(e.get("degree") or 1) > 1}
    except Exception:  # noqa: BLE001 - advice only: the bind waits as before
        logger.exception("flying: could not read the engines' modes")
        return {}


def _note_arrival(controller, req, found: turns.Lookup | None = None) -> None:
    """Count ``req`` in the arrival estimate (``scheduler.traffic``), a conversation's
    turn by the tokens it prefills (``turns.uncached``); never raises."""
    try:
        from flying.node.placement import max_new_tokens

        try:
            out = max_new_tokens(req.sampling_params)
        except ValueError:
            out = None
        prompt = turns.uncached(found) if found is not None else len(req.input_ids or ())
        controller._flying_arrivals.note(time.monotonic(), prompt, out)
    except Exception:  # noqa: BLE001 - the estimate is advice; placement goes on
        logger.exception("flying: could not count request %s in the arrival rate", req.rid)


def _priority_group(controller, req, degree: int, bound: int) -> Group | None:
    """The least loaded group of ``degree`` if its members hold at most ``bound`` DP
    requests; otherwise None (the request runs in DP; recorded for meta_info)."""
    from flying.node.placement import loads_of
    from scheduler.policy import least_loaded_group

    loads = loads_of(controller.load_snapshot_reader.read_all())
    ranks, paused = least_loaded_group(loads, degree, controller.server_args.dp_size)
    if paused <= bound:
        return Group(degree, ranks[0] // degree)
    reason = (
        f"priority: a TP-{degree} group would pause {paused} DP requests "
        f"(--flying-priority-max-paused {bound}); ran in DP"
    )
    logger.info("flying: request %s: %s", req.rid, reason)
    _record(controller, req.rid, 0, reason)
    return None


def _record(controller, rid: str, degree: int, reason: str = "") -> None:
    placement_log.record(_store(controller), rid, degree, reason)
    recorded = getattr(controller, "_flying_recorded", None)
    if recorded is not None:
        recorded.add(rid)


def on_abort(controller, abort_req) -> None:
    """An AbortReq passed the controller: delete the placement records of the requests
    it names (their HTTP handlers may already have ended without reading them)."""
    recorded = getattr(controller, "_flying_recorded", None)
    if not recorded:
        return
    rid = getattr(abort_req, "rid", "") or ""
    recorded.aborted(_store(controller), rid, bool(getattr(abort_req, "abort_all", False)))


def _store(controller):
    if getattr(controller, "_flying_store", None) is None:
        from flying.substrate.comm_pool import connect_store, store_address

        controller._flying_store = connect_store(store_address())
    return controller._flying_store


def _groups_open(controller) -> bool:
    """The start-up probe's gate (``flying.node.probe``): no adaptive group before it opens."""
    if getattr(controller, "_flying_gate", None) is None:
        from flying.node.probe import GateReader

        controller._flying_gate = GateReader(_store(controller))
    return controller._flying_gate.open()


def _decide(controller, req, priority: int, turn_tokens: int = 0, turn_held: bool = True):
    """The policy's decision for ``req`` from the engines' loads and measured step
    costs, appended to the decision log when one is configured."""
    from flying.node.placement import request_of

    policy = _policy(controller)
    loads = _loads(controller)
    reader = _costs(controller)
    costs, switch = reader.read(), reader.switch()
    traffic = replace(controller._flying_arrivals.traffic(time.monotonic()),
                      continued=turns.continued_share(controller))
    request = request_of(len(req.input_ids or ()), req.sampling_params, priority, 0,
                         turn_tokens=turn_tokens, turn_held=turn_held)
    had_slo, was = policy.slo, policy.chooser.current if policy.chooser else None
    decision = policy.decide(request, loads, costs, traffic, switch)
    if policy.slo is not None and had_slo is None:
        logger.info("flying: node SLOs TTFT %.0f ms, TPOT %.1f ms", policy.slo.ttft_ms,
                    policy.slo.tpot_ms)
    now = policy.chooser.current if policy.chooser else None
    if now is not None and now != was:
        logger.info("flying: adaptive layout -> %s (%s)", now.name, decision.reason)
    choice = policy.last_choice
    _decision_log(controller).write(
        req.rid, request, loads, costs, decision, traffic=traffic, switch=switch,
        slo=policy.slo, predictions=choice.predictions if choice else None,
    )
    return decision


def _priority_pays(controller, req) -> bool:
    """A priority request keeps its group only where a group is faster per step than
    one engine (measured); otherwise it runs in DP and the reason is recorded."""
    policy = _policy(controller)
    if policy is None:
        return True
    decision = _decide(controller, req, max(int(req.priority or 0), policy.config.priority_threshold))
    if decision.mode == "tp":
        return True
    logger.info("flying: request %s: %s", req.rid, decision.reason)
    _record(controller, req.rid, 0, decision.reason)
    return False


def _adaptive(controller, req, found):
    """The adaptive policy's decision for ``req`` (``found``: its conversation lookup,
    None if not looked up); None before the start-up probe opens the groups (SGLang's
    dispatch then places it)."""
    if _policy(controller) is None or not _groups_open(controller):
        return None
    turn = found.turn if found is not None else None
    return _decide(controller, req, int(req.priority or 0), turn.tokens if turn else 0,
                   turn is None or turn.rank >= 0)


def _costs(controller) -> costs_reader.CostsReader:
    if getattr(controller, "_flying_costs", None) is None:
        from flying.substrate.comm_pool import connect_store, store_address

        address = store_address()
        controller._flying_costs = costs_reader.CostsReader(
            lambda: connect_store(address), controller.server_args.dp_size
        )
    return controller._flying_costs


def _decision_log(controller) -> costs_reader.DecisionLog:
    if getattr(controller, "_flying_decisions", None) is None:
        controller._flying_decisions = costs_reader.DecisionLog(
            get_config().decision_log, _policy(controller)
        )
    return controller._flying_decisions
