"""Hooks on ``sglang.srt.managers.tokenizer_manager.TokenizerManager`` (HTTP process).

- ``generate_request`` (around): validate and apply Flying's request controls (every
  endpoint — /generate and the OpenAI ones — passes through here with its raw request);
  when the request's handler ends, however it ends, drop its placement state.
- ``_validate_one_request`` (around): an empty prompt or a token id outside the
  vocabulary -> 400 (SGLang's forward raises on them); the policy's per-request
  placement (priority, long context, DP-only features; too long for the node or a
  forced group the request cannot run in -> 400), and a TP-m request may use m
  engines' KV.
- ``_handle_batch_output`` (around): add ``meta_info["flying"]`` (where it ran) to each
  output as SGLang adds it, before its consumer can send it; when a request finishes,
  count it and record its TTFT / TPOT by mode (``flying.node.metrics``).
"""

from __future__ import annotations

import logging

from flying.node.metrics import count_finished, observe_finished
from flying.node.request_tags import (
    degree_of,
    engine_report,
    place,
    placement,
    refuse_bad_prompt,
    request_ended,
    tag_request,
    where_it_ran,
)

logger = logging.getLogger(__name__)


async def generate_request(original, manager, obj, request=None):
    tag_request(obj, getattr(request, "headers", None))
    try:
        async for out in original(manager, obj, request):
            yield out
    finally:
        request_ended(obj)


def validate_one_request(original, manager, obj, input_ids):
    refuse_bad_prompt(obj, input_ids, getattr(manager.model_config, "vocab_size", None))
    if getattr(obj, "sampling_params", None) is not None:  # generation, not embedding
        place(obj, input_ids, manager)
    degree = degree_of(obj)
    if degree <= 1 or manager.max_req_input_len is None:
        return original(manager, obj, input_ids)
    single = manager.max_req_input_len
    manager.max_req_input_len = (single + 1) * degree - 1
    try:
        return original(manager, obj, input_ids)
    finally:
        manager.max_req_input_len = single


async def handle_batch_output(original, manager, recv_obj):
    """Each output gets its report as SGLang adds it (``_Reporting``); the pass after
    the original catches one added to a list a consumer swapped in meanwhile."""
    states = [manager.rid_to_state.get(rid) for rid in recv_obj.rids]
    for state in states:
        if state is not None and type(state.out_list) is list:
            state.out_list = _Reporting(state.out_list, state)
    await original(manager, recv_obj)
    for state in states:
        if state is not None and state.out_list:
            _report_safely(state)


class _Reporting(list):
    """A request's pending outputs, each reported (``meta_info["flying"]``) as SGLang
    appends it, before its consumer can take it. SGLang's ``_handle_batch_output``
    wakes a batch's consumers in groups and yields to them between groups (``await
    asyncio.sleep(0)``), so a report added after the original returns missed every
    output a consumer had already sent: under a burst (h1024, 160 requests, session 85)
    3 streamed requests answered without it. A consumer takes the list and leaves a
    plain ``[]`` (``_wait_one_response``); the next batch output wraps that one."""

    __slots__ = ("state",)

    def __init__(self, items: list, state) -> None:
        super().__init__(items)
        self.state = state

    def append(self, out) -> None:
        super().append(out)
        _report_safely(self.state)


def _report_safely(state) -> None:
    try:
        _report(state)
    except Exception:  # noqa: BLE001 - reporting must never lose an answer
        logger.exception("flying: could not report where request %s ran", state.obj.rid)


def _report(state) -> None:
    meta = state.out_list[-1].get("meta_info")
    if isinstance(meta, dict) and not isinstance(meta.get("flying"), dict):
        degree, reason = engine_report(state) or where_it_ran(state.obj, meta)
        info = placement(degree, meta.get("dp_rank"), reason)
        if info is not None:
            meta["flying"] = info
            if meta.get("finish_reason") is not None:
                count_finished(info["mode"], getattr(state.obj, "priority", None))
                observe_finished(info["degree"], state.time_stats, meta)
