"""Reading Flying's request controls, placing a request, and reporting where it ran.

Control inputs are validated where they enter, before anything is queued; an invalid one
is the client's error: a ``ValueError`` whose message SGLang returns as HTTP 400.

- ``X-Flying-TP: <m>`` runs the request in a TP group of degree m (manual control, kept
  for operators; ignored under ``--flying-client-tp ignore``).
- ``X-Priority: high|normal|low|<int>`` and SGLang's body ``priority`` (an integer) set
  the request's priority; the header wins. Under ``--flying-client-priority ignore``
  both are dropped (SGLang's default priority applies; SGLang's own
  ``x-override-priority``, only read when SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES is set
  for a trusted router, is kept).
- A request's own SLOs (``X-Flying-SLO-TTFT-Ms`` / ``X-Flying-SLO-TPOT-Ms``, or the
  body's ``custom_params``: ``flying.node.request_slo``) follow the priority setting:
  kept under ``trust`` (the header wins), dropped under ``ignore``.
- Routing keys (the body ``routing_key`` on /generate, SGLang's ``x-smg-routing-key``
  header on the OpenAI endpoints): strings of at most 1024 characters without control
  characters, and never with Flying's reserved prefix ``flying:``.

``check_headers`` runs twice: in an HTTP middleware (``launch.add_routes``), so a bad
header is a plain 400 on every endpoint, streaming ones included; and in the tokenizer
manager hook (``tag_request``), for requests that enter without that middleware.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field

from flying.node import probe, request_slo
from flying.node.config import get_config
from flying.session.messages import check_routing_key, mark, read_mark
from flying.session.report import REPORT_KEY
from flying.substrate.layout import group_containing

logger = logging.getLogger(__name__)

TP_HEADER = "x-flying-tp"
PRIORITY_HEADER = "x-priority"
ROUTING_KEY_HEADER = "x-smg-routing-key"  # SGLang 0.5.23: OpenAIServingBase.extract_routing_key
OVERRIDE_PRIORITY_HEADER = "x-override-priority"  # SGLang's trusted-router override
_DEGREE = re.compile(r"[0-9]{1,4}")

#: Attribute on a GenerateReqInput: why it runs in DP although something asked for more.
_NOTE = "_flying_note"


@dataclass(frozen=True)
class Controls:
    """The validated Flying headers of one request."""

    degree: int = 0  # from X-Flying-TP; 0 = none (1 = "DP", the same)
    priority: int | None = None  # from X-Priority; None = not given
    #: from X-Flying-SLO-TTFT-Ms / -TPOT-Ms, as custom_params entries (request_slo)
    slo: dict[str, float] = field(default_factory=dict)


def _values(headers, name: str) -> list[str]:
    getlist = getattr(headers, "getlist", None)
    if getlist is not None:
        return list(getlist(name))
    value = headers.get(name)
    return [] if value is None else [value]


def _one(headers, name: str) -> str | None:
    values = _values(headers, name)
    if len(set(v.strip() for v in values)) > 1:
        raise ValueError(f"conflicting {name} headers: {values}")
    return values[0] if values else None


def check_headers(headers) -> Controls:
    """Validate Flying's headers and SGLang's routing-key header (ValueError: HTTP 400)."""
    if headers is None:
        return Controls()
    from scheduler.priority import parse_priority

    cfg = get_config()
    check_routing_key(_one(headers, ROUTING_KEY_HEADER), "x-smg-routing-key header")
    priority, slo = None, {}
    if cfg.client_priority == "trust":
        slo = request_slo.from_headers(lambda name: _one(headers, name))
        value = _one(headers, PRIORITY_HEADER)
        if value is not None:
            try:
                priority = parse_priority(value)
            except ValueError as exc:
                raise ValueError(f"invalid X-Priority header: {exc}") from None
    degree = 0
    if cfg.client_tp == "trust":
        value = _one(headers, TP_HEADER)
        if value is not None:
            degree = _parse_degree(value, cfg.degree_list() or [])
    return Controls(degree, priority, slo)


_CHECKED_HEADERS = (TP_HEADER, PRIORITY_HEADER, ROUTING_KEY_HEADER, *request_slo.HEADERS)


class HeaderCheck:
    """ASGI middleware: ``check_headers`` before any endpoint runs, so a bad header is a
    plain HTTP 400 with a reason, also for streaming requests (whose errors SGLang
    otherwise reports inside a 200 event stream)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") == "http" and scope.get("method") in ("POST", "PUT"):
            names = {k.lower() for k, _ in scope.get("headers", ())}
            if any(h.encode() in names for h in _CHECKED_HEADERS):
                from starlette.datastructures import Headers

                try:
                    check_headers(Headers(scope=scope))
                except ValueError as exc:
                    await _bad_request(scope, receive, send, str(exc))
                    return
        await self.app(scope, receive, send)


async def _bad_request(scope, receive, send, message: str) -> None:
    from starlette.responses import JSONResponse

    if scope.get("path", "").startswith("/v1/"):  # OpenAI's error shape, as SGLang's
        body = {"object": "error", "message": message, "type": "BadRequestError",
                "param": None, "code": 400}
    else:
        body = {"error": {"message": message, "type": "invalid_request_error", "code": 400}}
    await JSONResponse(body, status_code=400)(scope, receive, send)


#: Why a node may allow no degree at all (the launcher logs which at start-up).
_NO_GROUPS = ("none: TP groups are off on this node, its start-up log says why (they "
              "need --dp-size >= 2, --tp-size 1, --page-size 1 and a local checkpoint)")


def _parse_degree(value: str, allowed: list[int]) -> int:
    text = value.strip()
    if not _DEGREE.fullmatch(text):
        raise ValueError(f"invalid X-Flying-TP header {value!r}: expected a positive integer")
    degree = int(text)
    if degree == 1:
        return 0
    if degree not in allowed:
        raise ValueError(
            f"X-Flying-TP: {degree} is not an allowed TP degree on this node "
            f"(allowed: {allowed or _NO_GROUPS})"
        )
    return degree


def _check_body_priority(value) -> None:
    from scheduler.priority import PRIORITY_MAX, PRIORITY_MIN

    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"invalid priority {value!r}: expected an integer")
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ValueError(f"invalid priority {value}: outside the signed 64-bit range")


def tag_request(obj, headers) -> None:
    """Validate and apply the request's controls to ``obj`` (a GenerateReqInput or an
    EmbeddingReqInput, before SGLang normalizes it): priority, routing key, explicit TP.
    """
    controls = check_headers(headers)
    cfg = get_config()
    if cfg.client_priority == "ignore":
        if not _trusted_override(headers):
            obj.priority = None
        request_slo.strip(getattr(obj, "sampling_params", None))
    else:
        _check_body_priority(getattr(obj, "priority", None))
        if controls.priority is not None:
            obj.priority = controls.priority
        if _is_generation(obj):
            request_slo.check(obj.sampling_params)
            obj.sampling_params = request_slo.apply(obj.sampling_params, controls.slo)
    key = getattr(obj, "routing_key", None)
    check_routing_key(key, "routing_key")
    if controls.degree:
        if not _is_generation(obj):
            raise ValueError(
                "X-Flying-TP: embedding and scoring requests do not run in a TP group; "
                "send the request without X-Flying-TP"
            )
        if not probe.groups_open() and not probe.is_probe(headers):
            raise ValueError(f"X-Flying-TP: {probe.closed_reason()}")
        obj.routing_key = mark(key, controls.degree, "explicit")


def _trusted_override(headers) -> bool:
    """SGLang applied its own ``x-override-priority`` (a trusted router's, opt-in)."""
    if headers is None or headers.get(OVERRIDE_PRIORITY_HEADER) is None:
        return False
    flag = os.environ.get("SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES", "")
    return flag.strip().lower() in ("1", "true", "yes", "on")


def _is_generation(obj) -> bool:
    from sglang.srt.managers.io_struct import GenerateReqInput

    return isinstance(obj, GenerateReqInput)


def refuse_bad_prompt(obj, input_ids, vocab_size: int | None) -> None:
    """HTTP 400 for a prompt SGLang 0.5.23 passes to its scheduler whose forward then
    raises and takes the engine down with every request on it: one of no tokens
    (``"text": ""`` where the tokenizer adds no BOS, ``"input_ids": []``, a completion's
    empty prompt: a reshape of 0 tokens) or a token id outside the model's vocabulary
    (``"input_ids": [1, 99999]``: the embedding's index error, in a group and then in
    DP where the request was re-run). Requests carrying embeddings or media are SGLang's
    to check."""
    if input_ids is None or any(
            getattr(obj, name, None) is not None
            for name in ("input_embeds", "image_data", "video_data", "audio_data")):
        return
    if len(input_ids) == 0:
        raise ValueError("the prompt is empty (0 tokens): send at least one token")
    if vocab_size:
        low, high = min(input_ids), max(input_ids)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"input_ids holds token id {bad}, outside the model's "
                             f"vocabulary [0, {vocab_size})")


def place(obj, input_ids, manager) -> None:
    """Decide TP/DP for one (sub-)request: explicit degree, long context, priority,
    static-tp; features that run in DP only. Rejects (ValueError: HTTP 400) what not even
    the whole node holds, and a forced group the request's features cannot run in.
    Leaves the adaptive load decision to the controller."""
    from flying.node import placement
    from scheduler.policy import Request

    marker = read_mark(getattr(obj, "routing_key", None))
    explicit = marker.degree if marker.reason == "explicit" else 0
    feature = placement.dp_only_feature(obj)
    new = placement.max_new_tokens(obj.sampling_params)
    if explicit and feature:
        raise ValueError(
            f"X-Flying-TP: {feature} does not run in a TP group; send the request without "
            "X-Flying-TP to run it in DP"
        )
    cfg = get_config()
    if manager.max_req_input_len is None or not cfg.degree_list():
        return
    policy = _policy(manager)
    ttft, tpot = request_slo.of(obj.sampling_params)
    req = Request(len(input_ids), new, int(obj.priority or 0), explicit, feature, ttft, tpot)
    decision = policy.decide(req, loads=None)
    if decision.mode == "reject":
        raise ValueError(decision.reason)
    if decision.mode == "tp" and not explicit and not probe.groups_open():
        if decision.reason == "long context":  # only a group holds it, and none may form
            raise ValueError(f"{probe.closed_reason()}; this prompt needs a TP group")
        setattr(obj, _NOTE, probe.closed_reason())
        return
    if decision.mode == "tp":
        if (
            new is None
            and len(input_ids) + 1 > policy.node.capacity(1)
            and isinstance(obj.sampling_params, dict)
        ):
            # Only a group holds the prompt: None ("up to the limit") means up to the
            # group's capacity, stated so that the group reserves exactly that.
            obj.sampling_params["max_new_tokens"] = max(
                1, policy.node.capacity(decision.degree) - len(input_ids)
            )
        if not explicit:
            why = {"long context": "long", "priority": "priority"}.get(decision.reason, "policy")
            obj.routing_key = mark(marker.user_key, decision.degree, why)
        if decision.reason == "priority":
            # the controller may keep it in DP (a group that does not pay, members busy)
            expect_controller(obj)
        return
    if feature:
        setattr(obj, _NOTE, decision.reason)
        if int(obj.priority or 0) >= cfg.priority_threshold or cfg.policy == "static-tp":
            logger.info("flying: request %s runs in DP: %s", obj.rid, decision.reason)
        return


def expect_controller(obj) -> None:
    """The controller may record where ``obj`` runs (adaptive TP, priority kept in DP)."""
    from flying.node import placement_log

    rid = getattr(obj, "rid", None)
    if isinstance(rid, str):
        placement_log.expect(rid)


_POLICY = None


def _policy(manager):
    """The HTTP process's policy instance (its load decisions are the controller's)."""
    global _POLICY
    if _POLICY is None:
        from flying.node.placement import make_policy

        engines = max(get_config().degree_list() or [1])
        _POLICY = make_policy(
            engines, manager.max_req_input_len, getattr(manager, "context_len", 0) or 0,
            getattr(getattr(manager, "server_args", None), "model_path", None),
            server_args=getattr(manager, "server_args", None),
        )
    return _POLICY


def degree_of(obj) -> int:
    return read_mark(getattr(obj, "routing_key", None)).degree


def where_it_ran(obj, meta: dict) -> tuple[int, str]:
    """(TP degree, reason) of a request: degree 0 or 1 is DP; the reason says why a
    request ran in DP although it asked for more ("" otherwise). The engine's own report
    wins (``engine_report``: a group's leader, or a group that failed or did not form);
    otherwise from its mark, or the controller's record for a priority request the
    controller kept in DP."""
    marker = read_mark(getattr(obj, "routing_key", None))
    note = getattr(obj, _NOTE, "") or ""
    if marker.reason != "priority":
        return marker.degree, note
    from flying.node import placement_log
    from flying.substrate.comm_pool import hosted_store

    store = hosted_store()
    if store is None:
        return marker.degree, note
    rid = meta.get("id") or obj.rid
    found = placement_log.lookup(store, rid, meta.get("finish_reason") is not None)
    if found is None:
        return marker.degree, note
    return found


def request_ended(obj) -> None:
    """The handler of ``obj`` ended (answered, failed or closed): drop placement state
    kept for its requests and any store key the controller wrote but nobody read."""
    from flying.node import placement_log
    from flying.substrate.comm_pool import hosted_store

    try:
        rids = obj.rid if isinstance(obj.rid, list) else [obj.rid]
    except AttributeError:
        return
    store = hosted_store()
    for rid in rids:
        if isinstance(rid, str):
            try:
                placement_log.forget(store, rid)
            except Exception:  # noqa: BLE001 - cleanup must not turn an answer into an error
                logger.exception("flying: could not drop the placement record of %s", rid)


def placement(degree: int, dp_rank: int | None, reason: str = "") -> dict | None:
    """``meta_info["flying"]``: the mode, the degree, the engine ranks (and why a request
    ran in DP when something asked for a group), and the node's name (behind a router)."""
    if dp_rank is None:
        return None
    if degree <= 1:
        info = {"mode": "dp", "degree": 1, "ranks": [dp_rank]}
        if reason:
            info["reason"] = reason
    else:
        # the aligned group holding the engine that answered (a member, not always the leader)
        info = {"mode": "tp", "degree": degree, "ranks": list(group_containing(degree, dp_rank).ranks)}
        if reason:  # the group handed the request to DP mid-request
            info["moved"] = reason
    if node := get_config().node_name:
        info["node"] = node
    return info


def engine_report(state) -> tuple[int, str] | None:
    """(degree, reason) an engine reported for this request (``customized_info``,
    delivered by SGLang with the request's output), or None."""
    reported = (getattr(state, "customized_info_accumulated", None) or {}).get(REPORT_KEY)
    if not reported or not isinstance(reported[-1], dict):
        return None
    last = reported[-1]
    return int(last.get("degree", 1)), str(last.get("reason", ""))
