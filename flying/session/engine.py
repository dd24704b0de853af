"""An engine's Flying side: pending binds, and running a bound TP session.

A session runs synchronously at the engine's step boundary (before SGLang forms its next
DP batch). While it runs, the engine's DP requests simply do not step: their KV stays
where it is, and they resume afterwards with nothing recomputed (hard preemption). The
session itself is SGLang's own machinery: the request goes through
``handle_generate_request``, batches are formed by SGLang's ``get_next_batch_to_run``
and run by ``run_batch`` / ``process_batch_result``, with the scheduler and model runner
switched into TP mode by ``tp_scope.session_scope``.

Lockstep: every member runs the identical request set with identical KV capacity, so
SGLang's deterministic scheduling forms identical batches; each step the members check
that with one tiny broadcast of the leader's batch signature (``flying.session.exchange``), and
every sampled token is the leader's (``Member.share_tokens_``), so members write the
same tokens into their KV shards. Only the leader streams outputs to the client.

Containment: any exception inside a session (a step, a collective, a lockstep
mismatch) ends that session only (``flying.session.containment``); the engine returns to DP
with its KV slots and request rows accounted for and keeps serving.
"""

from __future__ import annotations

import datetime as _dt
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch.distributed as dist

from flying.session import aborts, admission, containment, exchange, status, tp_scope
from flying.session.aborts import AbortBook
from flying.session.faults import FaultSwitch
from flying.session.messages import Bind
from flying.session.status import SESSION_BUCKETS_S, SWITCH_BUCKETS_MS, bucket_index
from flying.substrate.comm_pool import CommPool

logger = logging.getLogger(__name__)

#: How long the leader waits for the group's members to reach a step boundary.
DEFAULT_BIND_TIMEOUT_S = 30.0
#: Upper bound on steps in one session (a guard against a scheduling bug, not a limit).
MAX_SESSION_STEPS = 1_000_000
#: Consecutive steps without a batch after which a session is declared stuck.
MAX_IDLE_STEPS = 50
#: Once a member has DP work waiting (paused, queued or newly arrived), a session
#: admits new requests for at most this long, then drains and releases, so that the
#: DP work gets its turn. With no DP work waiting, admission stays open.
MAX_ADMIT_S = 0.5
#: Soft preemption: how long a drained member waits for the others per step boundary.
DRAIN_POLL_S = 0.2
#: How often a busy engine (DP or in a session) refreshes its published status.
STATUS_EVERY_S = 0.1


@dataclass(frozen=True)
class Mode:
    """An engine's mode: DP (degree 1) or a member of a TP group of ``degree``."""

    degree: int = 1

    @property
    def is_dp(self) -> bool:
        return self.degree == 1

    def __str__(self) -> str:
        return "dp" if self.degree == 1 else f"tp{self.degree}"


DP = Mode(1)


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
        #: Non-bind input received during a session; handed to SGLang after it.
        self.deferred: list = []
        self.counters = EngineCounters()
        self.mode: Mode = DP
        self.in_session = False
        self.aborts = AbortBook()
        self.faults = FaultSwitch(pool.store if pool else None, dp_rank)
        self._status_at = 0.0
        self._published_busy = False

    def on_input(self, req) -> bool:
        """Take Flying's part of one input message; True if SGLang must not see it."""
        from sglang.srt.managers.io_struct import AbortReq

        if isinstance(req, Bind):
            self.pending.append(req)
            return True
        if isinstance(req, AbortReq):
            self.aborts.note(req)
        return False

    def run_pending(self, scheduler, next_batch) -> None:
        """Run the oldest pending bind (the controller's total order) as one session.

        One session per step boundary: the paused DP batch steps in between, so a stream
        of TP requests delays DP work but never starves it.
        """
        if self.pending and self._may_start(scheduler, self.pending[0]):
            self.draining = False
            self._run(scheduler, self.pending.popleft(), next_batch)
        if self.deferred:
            deferred, self.deferred = self.deferred, []
            scheduler.process_input_requests(deferred)

    def _may_start(self, scheduler, bind: Bind) -> bool:
        """Hard preemption: always. Soft: once every member has drained its DP work
        for this bind. Each announces it in the store, then waits at most
        ``DRAIN_POLL_S`` for the others (it has nothing else to run: new DP work is
        held back while draining), so a wait never blocks an engine for long. The drain
        keys are deleted by the bind's rendezvous."""
        if self.preempt != "soft" or self.pool is None:
            return True
        self.draining = True
        if not _nothing_running(scheduler):
            return False
        keys = drain_keys(bind)
        self.pool.store.set(keys[bind.ranks.index(self.dp_rank)], "1")
        try:
            self.pool.store.wait(keys, _dt.timedelta(seconds=DRAIN_POLL_S))
        except (RuntimeError, dist.DistStoreError):
            return False
        return True

    def poll(self, scheduler) -> None:
        """Receive input during a session: binds queue up, aborts are noted (the leader
        announces those of session requests), the rest waits for DP mode."""
        for req in scheduler.request_receiver.recv_requests(local_reqs=[]):
            if not self.on_input(req):
                self.deferred.append(req)

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
        went_idle = self._published_busy and not busy
        if force or went_idle or now - self._status_at >= STATUS_EVERY_S:
            self._status_at = now
            self._published_busy = busy
            status.publish(self.pool.store, self.dp_rank, self, scheduler)

    # -- one session ----------------------------------------------------------------

    def _vote(self, scheduler, bind: Bind):
        """(reservation or None, vote): "" if this member can serve the bind."""
        self.faults.refresh()
        try:
            self.faults.check("bind")
            if self.aborts.hits(bind.req.rid):
                return None, "request aborted by the client"
            reservation = tp_scope.reserve_for(
                scheduler, admission.tokens_needed(bind, self.dp_limit), bind.degree
            )
        except Exception as exc:  # noqa: BLE001 - any failure is this member's "no"
            logger.exception("flying: engine %d cannot join bind %s", self.dp_rank, bind.bind_id)
            return None, f"engine {self.dp_rank} failed to prepare: {exc}"
        return reservation, "" if reservation is not None else "member lacks KV capacity"

    def _run(self, scheduler, bind: Bind, next_batch) -> None:
        t0 = time.perf_counter()
        degree = bind.degree
        is_leader = self.dp_rank == bind.ranks[0]
        reservation, vote = self._vote(scheduler, bind)
        verdict = self.pool.rendezvous(bind.bind_id, degree, vote, self.bind_timeout_s)
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
            return
        member = self.pool.member(degree)
        paused = len(scheduler.running_batch.reqs) + len(scheduler.waiting_queue)
        self.counters.binds += 1
        self.counters.preempted_dp_requests += len(scheduler.running_batch.reqs)
        self.mode, self.in_session = Mode(degree), True
        session, admitted, rerun = None, 0, []
        t_scope = t_rdv
        try:
            with tp_scope.session_scope(
                scheduler, member, reservation, is_leader, self.faults
            ) as session:
                t_scope = time.perf_counter()
                logger.info(
                    "flying: engine %d -> TP-%d group %s (bind %s, %d DP requests paused)",
                    self.dp_rank, degree, list(bind.ranks), bind.bind_id, paused,
                )
                self.publish(scheduler, force=True)
                try:
                    session.tokenized[bind.req.rid] = bind.req
                    self.faults.check("scope")
                    session.hand(scheduler, bind.req)
                    admitted = 1 + self._steps(scheduler, member, bind, session, next_batch)
                    self.faults.check("release")
                except Exception as exc:  # noqa: BLE001 - containment: end this session only
                    member.poison()
                    self.counters.faulted_sessions += 1
                    self.counters.last_fault = f"{type(exc).__name__}: {exc}"[:300]
                    logger.exception("flying: engine %d: TP-%d session failed", self.dp_rank, degree)
                    rerun = containment.abandon(
                        scheduler, is_leader, f"TP-{degree} group failed: {exc}",
                        session.tokenized, session.handed,
                    )
                    admitted = len(session.tokenized)
        finally:
            if session is not None:
                session.release_all()
            else:
                tp_scope.release(scheduler, reservation)
            self.mode, self.in_session = DP, False
            self.aborts.end_session()
        for req in rerun:  # leader only: nothing was streamed, so DP answers instead
            self.counters.rerun_in_dp += 1
            scheduler.handle_generate_request(req)
        self.counters.releases += 1
        self.counters.tp_requests += admitted
        t_end = time.perf_counter()
        self.counters.last_switch_ms = {
            "control_ms": max(0.0, (time.time() - bind.issued_at) * 1e3 - (t_end - t0) * 1e3),
            "rendezvous_ms": (t_rdv - t0) * 1e3,
            "scope_setup_ms": (t_scope - t_rdv) * 1e3,
            "session_ms": (t_end - t_scope) * 1e3,
        }
        switch_ms = (t_scope - t0) * 1e3
        self.counters.switch_hist[bucket_index(switch_ms)] += 1
        self.counters.switch_ms_sum += switch_ms
        self.counters.session_hist[bucket_index(t_end - t0, SESSION_BUCKETS_S)] += 1
        self.counters.session_s_sum += t_end - t0
        logger.info(
            "flying: engine %d -> DP (bind %s released, %d TP requests served)",
            self.dp_rank, bind.bind_id, admitted,
        )

    def _steps(self, scheduler, member, bind: Bind, session, next_batch) -> int:
        """SGLang's own loop body (``event_loop_normal``) until the session is drained;
        returns how many further requests joined the session.

        Every step the leader shares its batch signature (lockstep check), the ids of
        binds for this same group that it has received, in order, and the requests the
        client aborted; at the next step boundary every member admits the binds into the
        running session (continuous batching inside the group) and aborts the requests.
        The session ends only on an empty plan with nothing waiting, running or
        announced: all three are the same on every member.
        """
        idle, joined = 0, 0
        shared = exchange.Shared([], [], 0)
        is_leader = member.tp_rank == 0
        t_start = time.monotonic()
        for _ in range(MAX_SESSION_STEPS):
            if shared.aborts:
                self.counters.client_aborts += aborts.apply(
                    scheduler, containment.session_reqs(scheduler), shared.aborts
                )
            if shared.offers:
                joined += admission.admit(self, scheduler, member, session, shared.offers)
            plan = next_batch(
                scheduler, running_batch=scheduler.running_batch, last_batch=scheduler.last_batch
            )
            scheduler.running_batch = plan.running_batch
            batch = plan.batch_to_run
            scheduler.last_batch = batch
            self.poll(scheduler)
            self.publish(scheduler)
            self.faults.check("step")
            # Admission stays open while no member has DP work waiting; once one has,
            # for MAX_ADMIT_S more at most (hard preemption delays DP, never starves it).
            if shared.dp_waiting and time.monotonic() - t_start > MAX_ADMIT_S:
                session.admitting = False
            offers = admission.candidates(self.pending, bind) if session.admitting else []
            due = (
                self.aborts.due(containment.session_reqs(scheduler), exchange.MAX_ABORTS)
                if is_leader else []
            )
            busy = bool(scheduler.waiting_queue) or not scheduler.running_batch.is_empty()
            shared = exchange.exchange(
                member, batch, offers, due, session.has_dp_work(self), busy
            )
            if batch is None:
                if shared.done:
                    return joined
                if not shared.busy:
                    continue  # offers or aborts to take at the next boundary
                idle += 1
                if idle >= MAX_IDLE_STEPS:
                    raise RuntimeError(f"flying: TP session made no progress: {_describe(scheduler)}")
                continue
            idle = 0
            result = scheduler.run_batch(batch)
            scheduler.process_batch_result(batch, result)
        raise RuntimeError("flying: TP session did not finish")


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
