"""Ending a failed group session on one member without taking the engine down.

A fault inside a session (an exception in a step, a lockstep mismatch, a collective
that a peer abandoned, an injected fault) must end that session only. The member that
hits it poisons the group's shared-memory segment (peers waiting in a collective raise
at once) and every member then runs ``abandon`` inside the still-active mode scope:

- every request of the session leaves SGLang's session queues; its request row (in the
  ``req_to_token_pool`` that DP and TP share) is freed; its KV sub-slots need nothing:
  the session's reserved DP slots are returned whole when the session releases;
- on the leader, which alone talks to the client: a request that has sent the client
  nothing yet (any non-streaming one, a stream before its first chunk) is handed back
  to be re-run in DP after the scope is left (the client sees an ordinary answer); one
  that has streamed tokens ends with an explicit error (HTTP 500 in its final chunk).

Non-leaders send nothing: their sockets to the client are null senders in the scope.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: HTTP status carried in the abort of a request a failed group could not finish.
FAULT_STATUS = 500


def session_reqs(scheduler, batch=None) -> list:
    """The requests the session's queues (and ``batch``, the step's batch) hold, each
    once, in a stable order."""
    out, seen = [], set()
    last = scheduler.last_batch
    chunked = scheduler.chunked_req
    for req in [
        *scheduler.waiting_queue,
        *scheduler.running_batch.reqs,
        *(last.reqs if last is not None else ()),
        *(batch.reqs if batch is not None else ()),
        *((chunked,) if chunked is not None else ()),
    ]:
        if id(req) not in seen:
            seen.add(id(req))
            out.append(req)
    return out


def abandon(
    scheduler, is_leader: bool, message: str, tokenized: dict[str, object], handed: set[str],
    batch=None,
) -> list:
    """Take every request out of the failed session; returns (leader only) the tokenized
    requests to re-run in DP. ``tokenized`` maps rid -> the request as it arrived (for
    every request that joined the session), ``handed`` holds the rids already handed to
    SGLang: one that joined but was never handed is re-run too."""
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    rerun = [req for rid, req in tokenized.items() if rid not in handed] if is_leader else []
    for req in session_reqs(scheduler, batch):
        if req.kv.holds_kv:
            scheduler.req_to_token_pool.free(req)
        if not is_leader or req.finished_output:  # non-leaders never answer
            continue
        if req.send_token_offset == 0 and req.rid in tokenized:  # nothing sent yet
            rerun.append(tokenized[req.rid])
            continue
        reason = {"type": "abort", "message": message, "status_code": FAULT_STATUS,
                  "err_type": "FlyingGroupFault"}
        scheduler.send_abort_output(AbortReq(rid=req.rid, finished_reason=reason), req)
    scheduler.waiting_queue = []
    scheduler.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
    scheduler.last_batch = None
    scheduler.chunked_req = None
    logger.warning(
        "flying: group session abandoned (%s); %d request(s) re-run in DP", message, len(rerun)
    )
    return rerun
