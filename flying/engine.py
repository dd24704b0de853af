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
that with one tiny broadcast of the leader's batch signature. Only the leader streams
outputs to the detokenizer.
"""

from __future__ import annotations

import datetime as _dt
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch.distributed as dist

from flying import admission
from flying.comm_pool import CommPool
from flying.messages import Bind
from flying.metrics import SWITCH_BUCKETS_MS, bucket_index
from flying.placement import ADMISSION_SLACK

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


@dataclass
class EngineCounters:
    binds: int = 0
    releases: int = 0
    aborted_binds: int = 0
    preempted_dp_requests: int = 0
    tp_requests: int = 0
    #: switch latency (bind taken at a step boundary -> group ready) histogram, counts
    #: per ``metrics.SWITCH_BUCKETS_MS`` bucket (+Inf last), and the sum in ms
    switch_hist: list[int] = field(default_factory=lambda: [0] * (len(SWITCH_BUCKETS_MS) + 1))
    switch_ms_sum: float = 0.0
    last_switch_ms: dict[str, float] = field(default_factory=dict)


class FlyingEngine:
    def __init__(
        self, dp_rank: int, pool: CommPool | None, bind_timeout_s: float, preempt: str = "hard"
    ):
        self.dp_rank = dp_rank
        self.pool = pool
        self.bind_timeout_s = bind_timeout_s
        self.preempt = preempt
        #: Soft preemption: this engine is finishing its running DP requests (admitting
        #: none) for the bind at the head of ``pending``.
        self.draining = False
        self.pending: deque[Bind] = deque()
        #: Non-bind input received during a session; handed to SGLang after it.
        self.deferred: list = []
        self.counters = EngineCounters()
        self.mode = "dp"
        self.in_session = False

    def on_bind(self, bind: Bind) -> None:
        self.pending.append(bind)

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
        held back while draining), so a wait never blocks an engine for long."""
        if self.preempt != "soft" or self.pool is None:
            return True
        self.draining = True
        if not _nothing_running(scheduler):
            return False
        base = f"flying/drain/{bind.bind_id}"
        self.pool.store.set(f"{base}/{self.dp_rank}", "1")
        try:
            self.pool.store.wait(
                [f"{base}/{r}" for r in bind.ranks], _dt.timedelta(seconds=DRAIN_POLL_S)
            )
        except (RuntimeError, dist.DistStoreError):
            return False
        return True

    def poll(self, scheduler) -> None:
        """Receive input during a session: binds queue up, the rest waits for DP mode."""
        for req in scheduler.request_receiver.recv_requests(local_reqs=[]):
            if isinstance(req, Bind):
                self.pending.append(req)
            else:
                self.deferred.append(req)

    # -- one session ----------------------------------------------------------------

    def _run(self, scheduler, bind: Bind, next_batch) -> None:
        from flying import tp_scope

        t0 = time.perf_counter()
        degree = bind.degree
        is_leader = self.dp_rank == bind.ranks[0]
        reservation = tp_scope.reserve_for(scheduler, tokens_needed(bind), degree)
        decision = (
            self.pool.rendezvous(bind.bind_id, degree, reservation is not None, self.bind_timeout_s)
            if self.pool is not None
            else "abort:no communicator pool"
        )
        t_rdv = time.perf_counter()
        if decision != "go":
            if reservation is not None:
                tp_scope.release(scheduler, reservation)
            self.counters.aborted_binds += 1
            logger.warning("flying: bind %s aborted: %s", bind.bind_id, decision)
            if is_leader:
                tp_scope.reject(scheduler, bind.req, f"TP-{degree} bind failed: {decision[6:]}")
            return
        member = self.pool.member(degree)
        paused = len(scheduler.running_batch.reqs) + len(scheduler.waiting_queue)
        self.counters.binds += 1
        self.counters.preempted_dp_requests += len(scheduler.running_batch.reqs)
        self.mode, self.in_session = f"tp{degree}", True
        session = None
        try:
            with tp_scope.session_scope(scheduler, member, reservation, is_leader) as session:
                t_scope = time.perf_counter()
                logger.info(
                    "flying: engine %d -> TP-%d group %s (bind %s, %d DP requests paused)",
                    self.dp_rank, degree, list(bind.ranks), bind.bind_id, paused,
                )
                scheduler.handle_generate_request(bind.req)
                admitted = 1 + self._steps(scheduler, member, bind, session, next_batch)
        finally:
            if session is not None:
                session.release_all()
            else:
                tp_scope.release(scheduler, reservation)
            self.mode, self.in_session = "dp", False
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
        logger.info(
            "flying: engine %d -> DP (bind %s released, %d TP requests served)",
            self.dp_rank, bind.bind_id, admitted,
        )

    def _steps(self, scheduler, member, bind: Bind, session, next_batch) -> int:
        """SGLang's own loop body (``event_loop_normal``) until the session is drained;
        returns how many further requests joined the session.

        Every step the leader shares its batch signature (lockstep check) and the ids of
        binds for this same group that it has received, in order; at the next step
        boundary every member admits them into the running session (continuous
        batching inside the group). The session ends only on an empty plan with nothing
        waiting, running or announced: all three are the same on every member.
        """
        idle, joined, announced, dp_waiting = 0, 0, [], 0
        t_start = time.monotonic()
        for _ in range(MAX_SESSION_STEPS):
            if announced:
                joined += admission.admit(self, scheduler, member, session, announced)
            plan = next_batch(
                scheduler, running_batch=scheduler.running_batch, last_batch=scheduler.last_batch
            )
            scheduler.running_batch = plan.running_batch
            batch = plan.batch_to_run
            scheduler.last_batch = batch
            self.poll(scheduler)
            # Admission stays open while no member has DP work waiting; once one has,
            # for MAX_ADMIT_S more at most (hard preemption delays DP, never starves it).
            if dp_waiting and time.monotonic() - t_start > MAX_ADMIT_S:
                session.admitting = False
            offer = admission.candidates(self.pending, bind) if session.admitting else []
            announced, dp_waiting = _exchange(member, batch, offer, session.has_dp_work(self))
            if batch is None:
                if not scheduler.waiting_queue and scheduler.running_batch.is_empty():
                    if not announced:
                        return joined
                    continue
                idle += 1
                if idle >= MAX_IDLE_STEPS:
                    raise RuntimeError(f"flying: TP session made no progress: {_describe(scheduler)}")
                continue
            idle = 0
            result = scheduler.run_batch(batch)
            scheduler.process_batch_result(batch, result)
        raise RuntimeError("flying: TP session did not finish")


def _nothing_running(scheduler) -> bool:
    """No DP request is running or about to be merged into the running batch."""
    last = scheduler.last_batch
    return scheduler.running_batch.is_empty() and (
        last is None or all(r.finished() for r in last.reqs)
    )


def tokens_needed(bind: Bind) -> int:
    """KV tokens one TP request of ``bind`` may use: prompt + max_new_tokens + slack."""
    return len(bind.req.input_ids) + bind.req.sampling_params.max_new_tokens + ADMISSION_SLACK


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


def _signature(batch) -> list[int]:
    if batch is None:
        return [0, 0, 0]
    lens = sum(len(r.origin_input_ids) + len(r.output_ids) for r in batch.reqs)
    return [len(batch.reqs), lens, int(batch.forward_mode.value) + 1]


def _exchange(member, batch, offer: list[int], has_dp_work: bool) -> tuple[list[int], int]:
    """One collective per step: check that every member formed the leader's batch, learn
    the bind ids the leader offers for admission at the next boundary, and how many
    members have DP work waiting."""
    mine = _signature(batch)
    padded = [len(offer), *offer, *[0] * (admission.MAX_PER_STEP - len(offer))]
    shared, waiting = member.share_ints(
        mine + padded, 4 + admission.MAX_PER_STEP, own=int(has_dp_work)
    )
    if shared[:3] != mine:
        raise RuntimeError(
            f"flying: TP group out of lockstep: leader batch {shared[:3]}, "
            f"member {member.tp_rank} batch {mine}"
        )
    return shared[4 : 4 + shared[3]], waiting


_ENGINE: FlyingEngine | None = None


def set_engine(engine: FlyingEngine) -> None:
    global _ENGINE
    if _ENGINE is not None:
        raise RuntimeError("Flying engine state already set in this process")
    _ENGINE = engine


def get_engine() -> FlyingEngine | None:
    return _ENGINE
