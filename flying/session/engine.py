"""An engine's Flying side: the runtime object of one engine process.

``FlyingEngine`` holds everything Flying knows in an engine process (pending binds, the
current group session, the per-degree prepared objects, counters, abort notes, fault
switches); SGLang's scheduler hooks (``sglang_patches.scheduler``) call its methods at
SGLang's own step boundaries:

- ``before_input`` (top of every loop iteration, ``process_input_requests``): leave the
  TP state a TP step ran in (or contain its failure); binds are taken out of the input.
- ``next_batch`` (``get_next_batch_to_run``): start a pending bind, and choose what this
  step runs: the session's next TP batch, or, after a TP step, one DP step when this
  engine has DP work waiting (``flying.session.group`` has the states).
- ``run_batch`` / ``process_batch_result``: SGLang's own, with a TP step's exception
  contained (the session ends, the engine keeps serving).

So a session is SGLang's own machinery run in the session's TP state: requests go
through ``handle_generate_request``, batches are formed by ``get_next_batch_to_run`` and
run by ``run_batch`` / ``process_batch_result`` in SGLang's loop; no loop body is copied.

Lockstep: every member runs the identical request set with identical KV capacity, so
SGLang's deterministic scheduling forms identical TP batches; each TP step the members
check that with one tiny collective of the leader's batch signature
(``flying.session.exchange``), and every sampled token is the leader's
(``Member.share_tokens_``). DP steps between TP steps are each member's own: they need
no collective, and a member without DP work simply waits in the next TP step's.

Containment: any exception in a TP step (formation, forward, collective, sampling,
lockstep) ends that session only (``flying.session.containment``); the engine returns to
DP with its KV slots and request rows accounted for and keeps serving.
"""

from __future__ import annotations

import datetime as _dt
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch.distributed as dist

from flying.session import aborts, admission, containment, exchange, report, status, tp_scope
from flying.session.aborts import AbortBook
from flying.session.faults import FaultSwitch
from flying.session.group import DP, GroupSession, Mode, State
from flying.session.messages import Bind
from flying.session.status import SESSION_BUCKETS_S, SWITCH_BUCKETS_MS, bucket_index
from flying.session.step_costs import StepClock, sample_degree
from flying.substrate.comm_pool import CommPool

logger = logging.getLogger(__name__)

__all__ = ["DP", "FlyingEngine", "Mode", "get_engine", "set_engine"]

#: How long the leader waits for the group's members to reach a step boundary.
DEFAULT_BIND_TIMEOUT_S = 30.0
#: Consecutive TP boundaries without a batch after which a session is declared stuck.
MAX_IDLE_STEPS = 50
#: Soft preemption: how long a drained member waits for the others per step boundary.
DRAIN_POLL_S = 0.2
#: How often a busy engine (DP or in a session) refreshes its published status.
STATUS_EVERY_S = 0.1


@dataclass
class EngineCounters:
    binds: int = 0
    releases: int = 0
    aborted_binds: int = 0
    faulted_sessions: int = 0
    client_aborts: int = 0
    rerun_in_dp: int = 0
    preempted_dp_requests: int = 0
    tp_requests: int = 0
    tp_steps: int = 0
    #: DP steps an engine ran between the TP steps of its sessions
    dp_steps_in_session: int = 0
    #: the most TP steps a member ran in a row while it had DP work waiting (the
    #: longest a DP request waits for a group, in group steps; 1 by construction)
    max_dp_wait_steps: int = 0
    #: switch latency (bind taken at a step boundary -> group ready) histogram, counts
    #: per ``metrics.SWITCH_BUCKETS_MS`` bucket (+Inf last), and the sum in ms
    switch_hist: list[int] = field(default_factory=lambda: [0] * (len(SWITCH_BUCKETS_MS) + 1))
    switch_ms_sum: float = 0.0
    #: group session length (bind -> release) histogram per ``SESSION_BUCKETS_S``
    session_hist: list[int] = field(default_factory=lambda: [0] * (len(SESSION_BUCKETS_S) + 1))
    session_s_sum: float = 0.0
    last_switch_ms: dict[str, float] = field(default_factory=dict)
    last_fault: str = ""


class FlyingEngine:
    def __init__(
        self, dp_rank: int, pool: CommPool | None, bind_timeout_s: float, preempt: str = "hard",
        dp_limit: int = 0,
    ):
        self.dp_rank = dp_rank
        self.pool = pool
        self.bind_timeout_s = bind_timeout_s
        self.preempt = preempt
        #: The longest request (prompt + output) SGLang admits on this engine in DP mode
        #: (its max_req_len, before any session swaps it): what a request without
        #: max_new_tokens may grow to.
        self.dp_limit = dp_limit
        #: Soft preemption: this engine is finishing its running DP requests (admitting
        #: none) for the bind at the head of ``pending``.
        self.draining = False
        self.pending: deque[Bind] = deque()
        #: Non-bind input received while a TP step waited for offered binds; handed to
        #: SGLang at the next input boundary, ahead of what arrives then.
        self.deferred: list = []
        self.counters = EngineCounters()
        self.clock = StepClock()  # measured decode step costs per degree
        self.session: GroupSession | None = None
        #: degree -> the objects a group of that degree needs, built at start-up
        self.prepared: dict[int, tp_scope.Prepared] = {}
        self.aborts = AbortBook()
        self.faults = FaultSwitch(pool.store if pool else None, dp_rank)
        self._status_at = 0.0
        self._published_busy = False

    @property
    def mode(self) -> Mode:
        return self.session.mode if self.session is not None else DP

    def prepare(self, scheduler) -> None:
        """Build every degree's views, pools and backend now (start-up), so a bind swaps."""
        if self.pool is None:
            return
        for degree, member in sorted(self.pool.members.items()):
            try:
                self.prepared[degree] = tp_scope.prepare(scheduler, member)
            except Exception as exc:  # noqa: BLE001 - the probe closes groups it cannot run
                logger.warning("flying: engine %d cannot prepare TP-%d: %s", self.dp_rank, degree, exc)

    # -- inputs ---------------------------------------------------------------------

    def on_input(self, req) -> bool:
        """Take Flying's part of one input message; True if SGLang must not see it."""
        from sglang.srt.managers.io_struct import AbortReq

        if isinstance(req, Bind):
            self.pending.append(req)
            return True
        if isinstance(req, AbortReq):
            self.aborts.note(req)
        return False

    def before_input(self, scheduler, recv_reqs: list) -> list:
        """Top of SGLang's loop: back to the DP state (or contain a failed TP step);
        returns the input SGLang should process, binds taken out."""
        s = self.session
        if s is not None and s.scope.entered:
            if s.failure is not None:
                self._contain(scheduler, s, s.failure)
            else:
                s.scope.leave()
                s.batch = None
                s.to(State.YIELDED)
        reqs = [r for r in recv_reqs if not self.on_input(r)]
        if self.deferred:
            reqs, self.deferred = [*self.deferred, *reqs], []
        return reqs

    def poll(self, scheduler) -> None:
        """Receive input inside a TP boundary (waiting for offered binds): binds queue
        up, aborts are noted, the rest is handed to SGLang at the next input boundary."""
        for req in scheduler.request_receiver.recv_requests(local_reqs=[]):
            if not self.on_input(req):
                self.deferred.append(req)

    # -- the step boundary ------------------------------------------------------------

    def next_batch(self, scheduler, original):
        """SGLang's ``get_next_batch_to_run`` for this step (the engine is in DP state);
        the interval to the next boundary is this step's measured cost."""
        started = self.clock.boundary()
        plan = self._next_batch(scheduler, original)
        s = self.session
        if s is not None and s.scope.entered:
            degree, interleaved = s.bind.degree, bool(s.shared.dp_waiting)
        else:
            degree, interleaved = 1, s is not None
        self.clock.label(sample_degree(plan.batch_to_run, degree, interleaved), started)
        return plan

    def _next_batch(self, scheduler, original):
        s = self.session
        if s is None and self.pending:
            was_draining = self.draining
            if self.draining_blocks(scheduler):  # soft preemption: drain first
                plan = self._drain_step(scheduler, original)
                self.publish(scheduler, force=not was_draining, plan=plan)
                return plan
            s = self._bind(scheduler, self.pending.popleft())
        if s is not None:
            s.dp_work = _has_dp_work(scheduler)
            if s.dp_turn and s.dp_work:
                s.dp_turn = False
                plan = _form(scheduler, original)
                if plan.batch_to_run is not None:
                    s.dp_steps += 1
                    s.dp_wait_steps = 0
                    self.counters.dp_steps_in_session += 1
                    self.publish(scheduler, plan=plan)
                    return plan
                scheduler.running_batch, scheduler.last_batch = plan.running_batch, None
            plan = self._tp_boundary(scheduler, s, original)
            if plan is not None:
                return plan
        plan = _form(scheduler, original)
        self.publish(scheduler, plan=plan)  # cheap unless due: /flying/status stays current
        return plan

    def run_batch(self, scheduler, original, batch):
        s = self.session
        if s is None or not s.scope.entered:
            return original(scheduler, batch)
        try:
            return original(scheduler, batch)
        except Exception as exc:  # noqa: BLE001 - containment: this session only
            self._failed(s, exc)
            return None

    def process_batch_result(self, scheduler, original, batch, result):
        s = self.session
        if s is None or not s.scope.entered:
            return original(scheduler, batch, result)
        if s.failure is not None:
            return None
        try:
            return original(scheduler, batch, result)
        except Exception as exc:  # noqa: BLE001 - containment: this session only
            self._failed(s, exc)
            return None

    def draining_blocks(self, scheduler) -> bool:
        """Soft preemption: True while this engine must drain before the head bind.

        Hard preemption: never. Soft: until every member has drained its DP work for
        the bind. Each announces it in the store, then waits at most ``DRAIN_POLL_S``
        for the others (it has nothing else to run: new DP work is held back while
        draining), so a wait never blocks an engine for long. The drain keys are deleted
        by the bind's rendezvous."""
        if self.preempt != "soft" or self.pool is None:
            return False
        bind = self.pending[0]
        self.draining = True
        if not _nothing_running(scheduler):
            return True
        keys = drain_keys(bind)
        self.pool.store.set(keys[bind.ranks.index(self.dp_rank)], "1")
        try:
            self.pool.store.wait(keys, _dt.timedelta(seconds=DRAIN_POLL_S))
        except (RuntimeError, dist.DistStoreError):
            return True
        return False

    def _drain_step(self, scheduler, original):
        """Soft preemption: SGLang's step over the running DP requests only (the waiting
        ones stay queued until after the session). Requests SGLang retracts meanwhile
        go back to the real waiting queue."""
        waiting, scheduler.waiting_queue = scheduler.waiting_queue, []
        try:
            return _form(scheduler, original)
        finally:
            waiting.extend(scheduler.waiting_queue)
            scheduler.waiting_queue = waiting

    def publish(self, scheduler, force: bool = False, plan=None) -> None:
        """Refresh the engine's status in the store: on events (``force``), at most every
        ``STATUS_EVERY_S`` while busy, and at once when the engine falls idle, so that
        /flying/status is current when read (an idle engine does not step)."""
        if self.pool is None:
            return
        now = time.monotonic()
        running = plan.running_batch if plan is not None else scheduler.running_batch
        batch = plan.batch_to_run if plan is not None else None
        busy = bool(scheduler.waiting_queue) or batch is not None or not running.is_empty()
        busy = busy or self.session is not None
        went_idle = self._published_busy and not busy
        if force or went_idle or now - self._status_at >= STATUS_EVERY_S:
            self._status_at = now
            self._published_busy = busy
            status.publish(self.pool.store, self.dp_rank, self, scheduler)

    # -- one session --------------------------------------------------------------------

    def _vote(self, scheduler, bind: Bind):
        """(reservation or None, vote): "" if this member can serve the bind."""
        self.faults.refresh()
        try:
            self.faults.check("bind")
            if self.aborts.hits(bind.req.rid):
                return None, "request aborted by the client"
            if bind.degree not in self.prepared:
                return None, f"engine {self.dp_rank} has no TP-{bind.degree} views"
            reservation = tp_scope.reserve_for(
                scheduler, admission.tokens_needed(bind, self.dp_limit), bind.degree
            )
        except Exception as exc:  # noqa: BLE001 - any failure is this member's "no"
            logger.exception("flying: engine %d cannot join bind %s", self.dp_rank, bind.bind_id)
            return None, f"engine {self.dp_rank} failed to prepare: {exc}"
        return reservation, "" if reservation is not None else "member lacks KV capacity"

    def _bind(self, scheduler, bind: Bind) -> GroupSession | None:
        """BINDING: vote, rendezvous, open the scope and hand the request; the session
        is RUNNING (TP state entered) on return, or None if the bind did not form."""
        self.draining = False
        t0 = time.perf_counter()
        is_leader = self.dp_rank == bind.ranks[0]
        reservation, vote = self._vote(scheduler, bind)
        verdict = self.pool.rendezvous(bind.bind_id, bind.degree, vote, self.bind_timeout_s)
        if self.preempt == "soft":  # every member is past its drain wait now
            self.pool.store.delete_key(drain_keys(bind)[bind.ranks.index(self.dp_rank)])
        t_rdv = time.perf_counter()
        if not verdict.go:
            tp_scope.release(scheduler, reservation)
            self.counters.aborted_binds += 1
            logger.warning("flying: bind %s aborted: %s", bind.bind_id, verdict.reason)
            if is_leader and self.aborts.hits(bind.req.rid):
                tp_scope.reject(scheduler, bind.req, "request aborted by the client")
            elif is_leader:  # the group could not form: serve the request in DP instead
                self.counters.rerun_in_dp += 1
                scheduler.handle_generate_request(bind.req)
                report.mark(scheduler, bind.req.rid, 1, f"TP-{bind.degree} group did not form: {verdict.reason}")
            return None
        member = self.pool.member(bind.degree)
        self.counters.binds += 1
        self.counters.preempted_dp_requests += len(scheduler.running_batch.reqs)
        scope = tp_scope.open_scope(
            scheduler, self.prepared[bind.degree], member, reservation, is_leader, self.faults
        )
        s = GroupSession(bind, member, scope, is_leader, t_bind=t0, t_rendezvous=t_rdv)
        self.session = s
        try:
            scope.enter()
            s.to(State.RUNNING)
            scope.tokenized[bind.req.rid] = bind.req
            self.faults.check("scope")
            s.t_ready = time.perf_counter()  # switched: the rest is SGLang taking the request
            scope.hand(scheduler, bind.req)
        except Exception as exc:  # noqa: BLE001 - containment: this session only
            self._failed(s, exc)
            self._contain(scheduler, s, exc)
            return None
        logger.info(
            "flying: engine %d -> TP-%d group %s (bind %s)",
            self.dp_rank, bind.degree, list(bind.ranks), bind.bind_id,
        )
        return s

    def _tp_boundary(self, scheduler, s: GroupSession, original):
        """A TP step's boundary: enter the TP state, apply the last exchange (aborts,
        admissions), form the batch and exchange its signature. Returns the plan for
        SGLang to run in the TP state, or None when the session has ended (DP state)."""
        try:
            if not s.scope.entered:
                s.scope.enter()
                s.to(State.RUNNING)
            while True:
                plan = self._tp_form(scheduler, s, original)
                if plan is not None:
                    return plan
                if s.state is State.RELEASED:
                    return None
        except Exception as exc:  # noqa: BLE001 - containment: this session only
            self._failed(s, exc)
            self._contain(scheduler, s, exc)
            return None

    def _tp_form(self, scheduler, s: GroupSession, original):
        """One attempt at a TP batch; None if there was none this time (the session
        may have ended: every member saw "done" in the same exchange)."""
        shared = s.shared
        s.shared = exchange.Shared([], [], 0)
        if shared.aborts:
            self.counters.client_aborts += aborts.apply(
                scheduler, containment.session_reqs(scheduler), shared.aborts
            )
        if shared.offers:
            s.joined += admission.admit(self, scheduler, s.member, s.scope, shared.offers)
        plan = _form(scheduler, original)
        batch = plan.batch_to_run
        # What SGLang's loop does next; done here so that containment finds the batch's
        # requests (and frees their rows) if the exchange below raises.
        scheduler.running_batch, s.batch = plan.running_batch, batch
        self.publish(scheduler, plan=plan)
        self.faults.check("step")
        # Admission stays open (DP work runs between group steps, so it never waits
        # for the group); it closes only when a request could not reserve its KV.
        offers = admission.candidates(self.pending, s.bind) if s.scope.admitting else []
        due = (
            self.aborts.due(containment.session_reqs(scheduler), exchange.MAX_ABORTS)
            if s.is_leader else []
        )
        busy = bool(scheduler.waiting_queue) or not scheduler.running_batch.is_empty()
        s.shared = exchange.exchange(s.member, batch, offers, due, s.dp_work, busy)
        if batch is not None:
            s.idle_steps = 0
            s.tp_steps += 1
            self.counters.tp_steps += 1
            s.dp_turn = True
            if s.dp_work:
                s.dp_wait_steps += 1
                self.counters.max_dp_wait_steps = max(
                    self.counters.max_dp_wait_steps, s.dp_wait_steps
                )
            return plan
        scheduler.last_batch = None
        if s.shared.done:
            self.faults.check("release")
            self._end(scheduler, s, [])
            return None
        if s.shared.busy:
            s.idle_steps += 1
            if s.idle_steps >= MAX_IDLE_STEPS:
                raise RuntimeError(f"flying: TP session made no progress: {_describe(scheduler)}")
        self.poll(scheduler)  # offers to take: their binds may still be in flight
        return None

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
        rerun = []
        try:
            if not s.scope.entered:
                s.scope.enter()
            rerun = containment.abandon(
                scheduler, s.is_leader, f"TP-{s.bind.degree} group failed: {exc}",
                s.scope.tokenized, s.scope.handed, s.batch,
            )
        finally:
            self._end(scheduler, s, rerun)

    def _end(self, scheduler, s: GroupSession, rerun: list) -> None:
        """RELEASED: leave the TP state for good, return the reservations, count."""
        try:
            s.scope.leave()
        finally:
            s.scope.release_all()
            self.session = None
            s.state = State.RELEASED
            self.aborts.end_session()
        for req in rerun:  # leader only: nothing was streamed, so DP answers instead
            self.counters.rerun_in_dp += 1
            scheduler.handle_generate_request(req)
            report.mark(scheduler, req.rid, 1, f"re-run in DP: the TP-{s.bind.degree} group failed")
        c = self.counters
        c.releases += 1
        c.tp_requests += len(s.scope.tokenized)
        t_end = time.perf_counter()
        t0, t_rdv = s.t_bind, s.t_rendezvous
        t_scope = s.t_ready or t_rdv
        c.last_switch_ms = {
            "control_ms": max(0.0, (time.time() - s.bind.issued_at) * 1e3 - (t_end - t0) * 1e3),
            "rendezvous_ms": (t_rdv - t0) * 1e3,
            "scope_setup_ms": (t_scope - t_rdv) * 1e3,
            "session_ms": (t_end - t_scope) * 1e3,
        }
        switch_ms = (t_scope - t0) * 1e3
        c.switch_hist[bucket_index(switch_ms)] += 1
        c.switch_ms_sum += switch_ms
        c.session_hist[bucket_index(t_end - t0, SESSION_BUCKETS_S)] += 1
        c.session_s_sum += t_end - t0
        self.publish(scheduler, force=True)
        logger.info(
            "flying: engine %d -> DP (bind %s released: %d TP requests, %d TP steps, "
            "%d DP steps between them)",
            self.dp_rank, s.bind.bind_id, len(s.scope.tokenized), s.tp_steps, s.dp_steps,
        )


def _form(scheduler, original):
    """SGLang's batch formation for the scheduler's current state (DP or TP): the loop
    read ``running_batch`` / ``last_batch`` before this hook switched state."""
    return original(scheduler, running_batch=scheduler.running_batch, last_batch=scheduler.last_batch)


def _has_dp_work(scheduler) -> bool:
    """DP requests are waiting or running in the engine's (current) DP state."""
    last = scheduler.last_batch
    return (
        bool(scheduler.waiting_queue)
        or not scheduler.running_batch.is_empty()
        or (last is not None and not all(r.finished() for r in last.reqs))
    )


def drain_keys(bind: Bind) -> list[str]:
    """Soft preemption: the store keys by which the members announce they drained."""
    return [f"flying/drain/{bind.bind_id}/{r}" for r in bind.ranks]


def _nothing_running(scheduler) -> bool:
    """No DP request is running or about to be merged into the running batch."""
    last = scheduler.last_batch
    return scheduler.running_batch.is_empty() and (
        last is None or all(r.finished() for r in last.reqs)
    )


def _describe(scheduler) -> str:
    reqs = [
        f"{r.rid[:8]} in={len(r.origin_input_ids)} finished={r.finished()}"
        for r in scheduler.waiting_queue
    ]
    alloc = scheduler.token_to_kv_pool_allocator
    return (
        f"waiting={reqs} running={len(scheduler.running_batch.reqs)} "
        f"free_tp_slots={alloc.available_size()} "
        f"free_req_slots={scheduler.req_to_token_pool.available_size()}"
    )


_ENGINE: FlyingEngine | None = None


def set_engine(engine: FlyingEngine) -> None:
    global _ENGINE
    if _ENGINE is not None:
        raise RuntimeError("Flying engine state already set in this process")
    _ENGINE = engine


def get_engine() -> FlyingEngine | None:
    return _ENGINE
