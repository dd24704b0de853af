"""Hooks on ``sglang.srt.managers.io_struct`` (HTTP process).

- ``GenerateReqInput.__getitem__`` (after): a batched request's sub-request (``n`` > 1
  parallel samples, a list of prompts) keeps the batch's ``routing_key``. SGLang 0.5.23
  builds each sub-request without it, and Flying's per-request placement travels in that
  key (``flying.session.messages.mark``): without this an ``X-Flying-TP`` request with
  ``n: 2`` ran in DP with no reason given. Unnecessary once SGLang copies the key.
"""

from __future__ import annotations


def generate_req_input_getitem(result, batch, *args, **kwargs):
    key = getattr(batch, "routing_key", None)
    if isinstance(key, str) and getattr(result, "routing_key", None) is None:
        result.routing_key = key
    return result
