"""Ending a failed group session on one member without taking the engine down.

A fault inside a session (an exception in a step, a lockstep mismatch, a collective
that a peer abandoned, an injected fault) must end that session only. The member that
hits it poisons the group's shared-memory segment (peers waiting in a collective raise
at once) and every member then runs ``abandon`` inside the still-active mode scope:

- every request of the session leaves SGLang's session queues; its request row (in the
  ``req_to_token_pool`` that DP and TP share) is freed; its KV sub-slots need nothing:
  the session's reserved DP slots are returned whole when the session releases;
- on the leader, which alone talks to the client: a request that has sent nothing yet
  is handed back to be re-run in DP after the scope is left (the client sees an
  ordinary answer); one that has sent output (a stream's chunks, or SGLang's periodic
  partial outputs of a non-streamed request, every ``SGLANG_FORCE_STREAM_INTERVAL``
  tokens) resumes in DP the way SGLang resumes a retracted request: its row and KV
  are dropped, its tokens so far kept, and DP prefills prompt + output and goes on from
  there (the client sees one uninterrupted answer); one whose bound exceeds what one
  engine holds (long context, an upgrade) ends with an explicit error (HTTP 500 in its
  final chunk).

Non-leaders send nothing: their sockets to the client are null senders in the scope.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: HTTP status carried in the abort of a request a failed group could not finish.
FAULT_STATUS = 500


def session_reqs(scheduler, batch=None) -> list:
    """The requests the session's queues (and ``batch``, the step's batch) hold, each
    once, in a stable order. The grammar queue too: empty at step boundaries, it holds
    a request only where its compile failed to finish as it was handed in
    (``flying.session.grammar``), and that request is re-run in DP like any other."""
    out, seen = [], set()
    last = scheduler.last_batch
    chunked = scheduler.chunked_req
    grammar_queue = getattr(getattr(scheduler, "grammar_manager", None), "grammar_queue", ())
    for req in [
        *grammar_queue,
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
    batch=None, dp_limit: int = 0,
) -> tuple[list, list]:
    """Take every request out of the failed session; returns (leader only) the tokenized
    requests to re-run in DP and the requests (SGLang ``Req``) to resume there.
    ``tokenized`` maps rid -> the request as it arrived (for every request that joined
    the session), ``handed`` holds the rids already handed to SGLang: one that joined
    but was never handed is re-run too. ``dp_limit``: the longest request (prompt +
    max_new_tokens) one engine holds in DP (0: none resumes)."""
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    rerun = [req for rid, req in tokenized.items() if rid not in handed] if is_leader else []
    resume = []
    for req in session_reqs(scheduler, batch):
        if req.kv.holds_kv:
            scheduler.req_to_token_pool.free(req)
        if not is_leader or req.finished_output:  # non-leaders never answer
            continue
        if req.send_token_offset == 0 and req.rid in tokenized:  # nothing sent yet
            rerun.append(tokenized[req.rid])
            continue
        if _fits(req, dp_limit):
            _retract(req)
            resume.append(req)
            continue
        reason = {"type": "abort", "message": message, "status_code": FAULT_STATUS,
                  "err_type": "FlyingGroupFault"}
        scheduler.send_abort_output(AbortReq(rid=req.rid, finished_reason=reason), req)
    scheduler.waiting_queue = []
    if getattr(scheduler, "grammar_manager", None) is not None:
        scheduler.grammar_manager.grammar_queue = []  # the session's (the TP state's)
    scheduler.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
    scheduler.last_batch = None
    scheduler.chunked_req = None
    logger.warning(
        "flying: group session abandoned (%s); %d request(s) re-run and %d resumed in DP",
        message, len(rerun), len(resume),
    )
    return rerun, resume


def _fits(req, dp_limit: int) -> bool:
    """Whether ``req`` (prompt + its bound) fits what one engine holds in DP."""
    bound = req.sampling_params.max_new_tokens
    return bound is not None and len(req.origin_input_ids) + bound <= dp_limit


def _retract(req) -> None:
    """Make ``req`` (its row already freed; its KV was the session's, returned whole
    with the reservation) what SGLang makes a request it retracts: no KV, its output
    kept, waiting to be prefilled again (``Req.reset_for_retract``)."""
    req.kv.kv_allocated_len = 0
    req.reset_for_retract()
