"""What an engine tells the node: its load snapshot and its status document.

Mixed into ``FlyingEngine`` (``flying.session.engine``). SGLang's load inquirer
(``sglang_patches.load_inquirer``) passes every snapshot through ``count_load``, which the
DP controller, its dispatch and the adaptive policy read; ``publish`` refreshes the
engine's slot of the status board (/flying/status). Both read the engine's session,
pending binds and clock; neither changes what the engine runs.
"""

from __future__ import annotations

import logging
import time

from flying.session import status

logger = logging.getLogger(__name__)

#: How often a busy engine (DP or in a session) refreshes its published status: the
#: DP controller's costs refresh (``flying.node.costs_reader.REFRESH_S``), which is
#: what reads it while serving, so a document it reads is at most two refreshes old.
#: Each refresh builds the document and writes it to the node's status board
#: (``flying.substrate.status_board``: a memory copy, no system call).
STATUS_EVERY_S = 0.5


class Publishing:
    """Load counts and status refreshes of one engine (see the module docstring)."""

    def count_load(self, snapshot):
        """SGLang's load snapshot of this engine, as the controller reads it: a session's
        requests counted once (``count_session``), the binds this engine leads that wait
        to be bound or admitted counted as waiting, and ``timestamp`` the time the loop
        last took input, so the controller counts as in flight exactly what was sent
        after it (``flying.node.in_flight``)."""
        snapshot = self.count_session(snapshot)
        snapshot.num_waiting_reqs += sum(
            1 for b in self.pending if b.req is not None and b.ranks[0] == self.dp_rank
        )
        if self.received_at:
            snapshot.timestamp = self.received_at
        return snapshot

    def count_session(self, snapshot):
        """SGLang's load snapshot of this engine (``LoadSnapshot``), with a session's
        requests counted once, on its leader, in whichever state the engine is in.

        SGLang's inquirer counts the current state's batch and queue only: the session's
        requests while a TP step runs (on every member: the others' are copies), the
        engine's DP requests otherwise. So a load read between two steps missed the
        session, one read during a step missed the DP work and counted the group m
        times; SGLang's dispatch and the adaptive policy read these snapshots."""
        s = self.session
        if s is None:
            return snapshot
        other = s.scope.state.other
        scheduler = s.scope.scheduler
        running = len(other(scheduler, "running_batch").reqs)
        waiting = len(other(scheduler, "waiting_queue"))
        if s.scope.entered and not s.is_leader:  # counted the session's copies: not ours
            snapshot.num_running_reqs, snapshot.num_waiting_reqs = running, waiting
        elif s.scope.entered or s.is_leader:
            snapshot.num_running_reqs += running
            snapshot.num_waiting_reqs += waiting
        return snapshot

    def publish_load(self, scheduler) -> None:
        """Publish SGLang's load snapshot now (DP state): requests changed engines or
        layout (a session ended, its requests moved), which SGLang's own every-15-steps
        publishing would show only seconds later on a slow model."""
        try:
            scheduler.publish_load_snapshot(force=True)
        except Exception:  # noqa: BLE001 - a stale snapshot is SGLang's normal case
            logger.exception("flying: engine %d could not publish its load", self.dp_rank)

    def publish(self, scheduler, force: bool = False, plan=None) -> None:
        """Refresh the engine's status in the store: on events (``force``; a session's
        first step, its bind), when the engine falls idle, and every ``STATUS_EVERY_S``
        while busy (in DP the first one that long after it became busy), so that
        /flying/status is current when read (an idle engine does not step).

        Not when DP work starts on an idle engine: the document says nothing of busy
        (only its KV counts move, for at most ``STATUS_EVERY_S``), and building it there
        put it in front of the step that serves the request just arrived: on the demo
        model at 6 req/s an engine falls idle and busy again for most requests. A
        session starting is an event (its mode and bind count): published at once."""
        if self.pool is None:
            return
        now = time.monotonic()
        running = plan.running_batch if plan is not None else scheduler.running_batch
        batch = plan.batch_to_run if plan is not None else None
        busy = bool(scheduler.waiting_queue) or batch is not None or not running.is_empty()
        busy = busy or self.session is not None
        degree = self.session.bind.degree if self.session is not None else 1  # its mode
        if busy and not self._published_busy and not force and degree == self._published_degree:
            self._published_busy, self._status_at = True, now  # DP work starting: no event
            return
        # On falling idle and on a change of mode too: work that starts and ends
        # between two timed refreshes would otherwise never be published (an idle
        # engine does not step, so nothing refreshes it later).
        changed = busy != self._published_busy or degree != self._published_degree
        if force or changed or now - self._status_at >= STATUS_EVERY_S:
            self._status_at = now
            self._published_busy, self._published_degree = busy, degree
            self._serving()
            status.publish(self.pool.store, self.dp_rank, self, scheduler)

    def _serving(self) -> None:
        """Once the start-up probe is done, forget the stretch and live steps its
        calibration measured (``StepClock.forget_calibration``): both are of serving.
        Asked at each status refresh until then (a store round trip; the probe makes
        every engine step, and so refresh, after it is done)."""
        if self._calibrating and status.calibration_over(self.pool.store):
            self._calibrating = False
            self.clock.forget_calibration()
