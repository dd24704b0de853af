"""How a group session ends on one member: a failed step's record, its containment,
and the release every session ends with (moved, drained, finished or failed).

Mixed into ``FlyingEngine`` through ``Lifecycle``. Invariant: ``_end`` leaves the TP
state and returns every reservation in its ``finally``, whatever failed before it, so
an engine always comes back to DP with its own allocator, queues and limits.
"""

from __future__ import annotations

import logging
import time

from flying.session import containment, report, tp_scope
from flying.session.group import GroupSession, State

logger = logging.getLogger(__name__)


class Release:
    """Failure and release of a session (mixed into ``Lifecycle``)."""

    def _failed(self, s: GroupSession, exc: BaseException) -> None:
        """Record a TP step's failure and wake the peers (poisoned segment)."""
        if s.failure is None:
            s.failure = exc
            s.member.poison()
            self.counters.faulted_sessions += 1
            self.counters.last_fault = f"{type(exc).__name__}: {exc}"[:300]
            logger.error(
                "flying: engine %d: TP-%d session failed: %s", self.dp_rank, s.bind.degree,
                self.counters.last_fault, exc_info=exc,
            )

    def _contain(self, scheduler, s: GroupSession, exc: BaseException) -> None:
        """End a failed session (in its TP state): free its rows, re-run or abort its
        requests (``containment.abandon``), and release it."""
        rerun, resume = [], []
        try:
            if not s.scope.entered:
                s.scope.enter()
            answers = s.is_leader if s.answerer is None else s.answerer
            rerun, resume = containment.abandon(
                scheduler, answers, f"TP-{s.bind.degree} group failed: {exc}",
                s.scope.tokenized, s.scope.handed, s.batch, self.dp_limit,
            )
        finally:
            self._end(scheduler, s, rerun, resume)

    def _end(self, scheduler, s: GroupSession, rerun: list, resume: list = ()) -> None:
        """RELEASED: leave the TP state for good, return the reservations, count; the
        leader hands a failed session's requests to DP (``rerun``: as they arrived;
        ``resume``: SGLang ``Req``s with their output so far, ``containment.abandon``)."""
        try:
            if self.result.kept:  # a group step's result: processed in its TP state
                if not s.scope.entered:
                    s.scope.enter()
                self.result.process(scheduler)
            s.scope.leave()
        finally:
            s.scope.release_all()
            self.session = None
            s.state = State.RELEASED
            self.aborts.end_session()
            if s.ticket is not None:
                self.pool.settle(s.ticket)
            tp_scope.restock(s.scope.prepared)
        for req in rerun:  # leader only: nothing was streamed, so DP answers instead
            self.counters.rerun_in_dp += 1
            scheduler.handle_generate_request(req)
            report.mark(scheduler, req.rid, 1, f"re-run in DP: the TP-{s.bind.degree} group failed")
        for req in resume:  # as SGLang takes back a retracted request
            self.counters.resumed_in_dp += 1
            scheduler.waiting_queue.append(req)
            report.moved(req, 1, f"resumed in DP: the TP-{s.bind.degree} group failed")
        self.publish_load(scheduler)
        self.counters.released(s, time.perf_counter())
        self.publish(scheduler, force=True)
        logger.info(
            "flying: engine %d -> DP (bind %s released: %d TP requests, %d TP steps, "
            "%d DP steps between them)",
            self.dp_rank, s.bind.bind_id, len(s.scope.tokenized), s.tp_steps, s.dp_steps,
        )
