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

import logging
import time
from collections import deque

from flying.session import hand_back, handoff, move, overlap, standby, tp_scope, upgrade
from flying.session.aborts import AbortBook
from flying.session.counters import EngineCounters
from flying.session.drain import Drain, nothing_running
from flying.session.drain import scheduler_form as _form
from flying.session.faults import FaultSwitch, step_delays
from flying.session.group import DP, GroupSession, Mode, State
from flying.session.lifecycle import Lifecycle
from flying.session.load_refresh import LoadRefresh
from flying.session.messages import Bind
from flying.session.publishing import Publishing
from flying.session.step_costs import StepClock, sample_of
from flying.substrate.comm_pool import CommPool
from scheduler import hold

logger = logging.getLogger(__name__)

__all__ = ["DP", "FlyingEngine", "Mode", "get_engine", "set_engine"]

#: How long the leader waits for the group's members to reach a step boundary.
DEFAULT_BIND_TIMEOUT_S = 30.0


class FlyingEngine(Lifecycle, Drain, Publishing):
    def __init__(
        self, dp_rank: int, pool: CommPool | None, bind_timeout_s: float, preempt: str = "hard",
        dp_limit: int = 0, move_to_dp: str = "policy", upgrades: bool = False,
        hold_steps: int = hold.HOLD_STEPS,
    ):
        self.dp_rank = dp_rank
        self.pool = pool
        self.bind_timeout_s = bind_timeout_s
        self.preempt = preempt
        #: which sessions hand their requests to DP when DP work waits (``move.allowed``)
        self.move_to_dp = move_to_dp
        #: the most group steps an arrival waits for the running requests to finish
        #: (``scheduler.hold``; 0: never)
        self.hold_steps = hold_steps
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
        #: when the loop last took input (``time.time``): the load snapshot's timestamp
        #: (``count_load``); 0.0 before the first
        self.received_at = 0.0
        #: publishes the load snapshot between SGLang's own in long DP decodes
        self.load_refresh = LoadRefresh()
        #: when this engine's session last wanted to move to DP (``time.time``): policy
        #: binds issued before are voted down (``hand_back.stale``)
        self.left_at = 0.0
        self.counters = EngineCounters()
        #: requests without a bound of their own, which ask for a group as they outgrow
        #: this engine (``upgrades``: a group may hold more than this engine)
        self.watch = upgrade.Watch(dp_rank, upgrades, self.counters)
        self.clock = StepClock()  # measured step costs per mode and work (curves)
        self._delays = step_delays()  # test-only slower modes; {} normally
        self.session: GroupSession | None = None
        #: a request that left its group for a larger one, until that group's bind
        #: (``flying.session.regroup.Parked``; on the old group's leader)
        self.parked = None
        #: the outbox a move's rows are published in, and the peers' it read
        #: (``flying.session.handoff``); each boundary notes its steps while one is in flight
        self.mail = handoff.Mail()
        #: degree -> the objects a group of that degree needs, built at start-up
        self.prepared: dict[int, tp_scope.Prepared] = {}
        #: a bind's reservation and scope made ready before an idle sleep
        #: (``flying.session.standby``), and the (degree, tokens) of the last bind
        #: here, which the next standby is made for
        self.standby: standby.Standby | None = None
        self.want: tuple[int, int] | None = None
        self.aborts = AbortBook()
        self.faults = FaultSwitch(pool.store if pool else None, dp_rank)
        self._merged_for = ""  # the bind that waited one DP step (``_merge_first``)
        #: SGLang's overlap loop: the pending result, processed before a state change
        self.result = overlap.PendingResult()
        self._status_at = 0.0
        self._published_busy = False
        self._published_degree = 1  # the mode's degree in the last published document
        #: until the start-up probe is done: its steps are no serving (``_serving``)
        self._calibrating = True

    @property
    def mode(self) -> Mode:
        return self.session.mode if self.session is not None else DP

    @property
    def holds_work(self) -> bool:
        """Work SGLang's queues do not show: a bind taken off the socket, input deferred
        to the next boundary, a session, or a request parked between two groups. SGLang
        must not sleep on idle (``--sleep-on-idle`` polls its sockets up to 1 s, and
        this work is no longer on them)."""
        return bool(self.pending or self.deferred or self.session is not None
                    or self.parked is not None)

    def before_sleep(self, scheduler) -> None:
        """SGLang's idle sleep is next (``--sleep-on-idle``; it holds no work): make the
        next bind's reservation and scope ready while this process is warm."""
        if getattr(scheduler, "idle_sleeper", None) is not None:
            standby.take(self, scheduler)

    @property
    def in_dp_state(self) -> bool:
        """SGLang's scheduler holds this engine's DP state (not a session's TP state)."""
        s = self.session
        return s is None or not s.scope.entered

    def prepare(self, scheduler) -> None:
        """Build every degree's views, pools and backend now (start-up), so a bind swaps."""
        if self.pool is None:
            return
        for degree, member in sorted(self.pool.members.items()):
            try:
                self.prepared[degree] = tp_scope.prepare(scheduler, member)
                tp_scope.restock(self.prepared[degree])
            except Exception as exc:  # noqa: BLE001 - the probe closes groups it cannot run
                logger.warning("flying: engine %d cannot prepare TP-%d: %s", self.dp_rank, degree, exc)
        self.mail.open(self.pool.members, self.prepared)

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
            # kept for the loop if the next step is a group step (``overlap``), else now
            if s.failure is None and overlap.keeps(s.shared) and self.result.keep(scheduler):
                self.counters.overlapped_tp_steps += 1
            else:
                self.result.process(scheduler)
            if s.failure is not None:
                self._contain(scheduler, s, s.failure)
            else:
                s.scope.leave()
                s.batch = None
                s.to(State.YIELDED)
        self.received_at = time.time()  # what was sent before is in recv_reqs
        reqs = [r for r in recv_reqs if not self.on_input(r)]
        if self.standby is not None and not self.pending:  # woken by no bind
            standby.drop(self, scheduler)
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
        if self.mail.sending:
            self.mail.note(scheduler.forward_ct)
        if (self.session is not None or self.pending) and not self.result.kept:
            self.result.process(scheduler)  # the state may change here
        self.watch.check(scheduler)
        plan = self._next_batch(scheduler, original)
        if self.standby is not None:  # the bind did not start here (or took none)
            standby.drop(self, scheduler)
        self.result.formed(scheduler)
        s = self.session
        if s is not None and s.scope.entered:
            degree, interleaved = s.bind.degree, bool(s.shared.dp_waiting)
        else:
            degree, interleaved = 1, s is not None
        self.clock.label(sample_of(plan.batch_to_run, degree, interleaved), started)
        if self._delays and plan.batch_to_run is not None and degree in self._delays:
            time.sleep(self._delays[degree])  # test-only (faults.step_delays)
        return plan

    def _next_batch(self, scheduler, original):
        s = self.session
        dp_work = False  # at a bind's boundary, the DP state's (the bind enters the TP state)
        if s is None:
            self._vote_down_stale(scheduler)
        if s is None and self.pending:
            was_draining = self.draining
            if self.draining_blocks(scheduler):  # soft preemption: drain first
                plan = self._drain_step(scheduler, original)
                self.publish(scheduler, force=not was_draining, plan=plan)
                return plan
            if self._merge_first(scheduler):
                plan = _form(scheduler, original)
                self.publish(scheduler, plan=plan)
                return plan
            dp_work = _has_dp_work(scheduler)
            s = self._bind(scheduler, self.pending.popleft())
        if s is not None:
            # entered: the boundary that just bound it, whose queues are the session's now
            # (its request handed in); read as DP work, it kept no first step's result
            s.dp_work = dp_work if s.scope.entered else _has_dp_work(scheduler)
            s.dp_held = s.dp_held and s.dp_work
            if not s.scope.entered:  # DP state (not the boundary that just bound it)
                s.dp_arrived = s.dp_work and (s.dp_arrived or bool(scheduler.waiting_queue))
            # a kept result: DP work goes after the group step that announces it
            if s.dp_turn and s.dp_work and not self.result.kept:
                s.dp_turn = False
                plan = self._dp_step(scheduler, s, original)
                if plan is not None:
                    return plan
            plan = self._tp_boundary(scheduler, s, original)
            if plan is not None:
                return plan
        plan = _form(scheduler, original)
        self.publish(scheduler, plan=plan)  # cheap unless due: /flying/status stays current
        return plan

    def _vote_down_stale(self, scheduler) -> None:
        """Vote down the stale binds at the head of ``pending`` (``hand_back.stale``) in
        one boundary, so that their requests, served in DP, are prefilled together as
        SGLang's DP would prefill a clump, not one per step between the running
        requests' decode steps. Each still goes through the bind's handshake (the
        members' one verdict); a member that has not received the next one yet is at
        most a step behind (binds arrive in one order on every member)."""
        for _ in range(hand_back.STALE_PER_STEP):
            if not self.pending or not hand_back.stale(self, self.pending[0]):
                return
            self._bind(scheduler, self.pending.popleft())

    def _dp_step(self, scheduler, s, original):
        """The DP step between two group steps (DP state): SGLang's plan, or None when
        there is nothing to run or the step is held. A DP decode that needs the KV
        slots the session reserved here is held (its requests keep their KV) until the
        session yields: the exchange tells every member (``dp_held``)."""
        s.dp_held = move.holds_dp(scheduler, s.scope)
        if s.dp_held:
            self.counters.dp_held_for_kv += 1
            return None
        plan = _form(scheduler, original)
        if plan.batch_to_run is None:
            scheduler.running_batch, scheduler.last_batch = plan.running_batch, None
            return None
        s.dp_steps += 1
        s.dp_wait_steps = 0
        self.counters.dp_steps_in_session += 1
        self.publish(scheduler, plan=plan)
        return plan

    def _merge_first(self, scheduler) -> bool:
        """Whether the pending bind waits one DP step (once per bind): requests this
        engine just prefilled sit in SGLang's last batch until the next step merges them
        into its running batch, and only running requests can join a forming group
        (``join``); the peers wait for this member in the bind's rendezvous."""
        bind = self.pending[0]
        last = scheduler.last_batch
        if (
            bind.bind_id == self._merged_for
            or not move.allowed(self.move_to_dp, {bind.reason})
            or last is None
            or not last.forward_mode.is_extend()
            or scheduler.chunked_req is not None
        ):
            return False
        self._merged_for = bind.bind_id
        return True

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
        in_group = s is not None and s.scope.entered
        if batch is not None and batch.forward_mode.is_extend() and (not in_group or s.is_leader):
            self.counters.prefill_tokens += int(batch.extend_num_tokens or 0)
        if not in_group:
            out = original(scheduler, batch, result)
            self.load_refresh.after_step(scheduler, self.publish_load)
            return out
        if s.failure is not None:
            return None
        try:
            return original(scheduler, batch, result)
        except Exception as exc:  # noqa: BLE001 - containment: this session only
            self._failed(s, exc)
            return None


def _has_dp_work(scheduler) -> bool:
    """DP requests are waiting, or running in the engine's (current) DP state."""
    return bool(scheduler.waiting_queue) or not nothing_running(scheduler)


_ENGINE: FlyingEngine | None = None


def set_engine(engine: FlyingEngine) -> None:
    global _ENGINE
    if _ENGINE is not None:
        raise RuntimeError("Flying engine state already set in this process")
    _ENGINE = engine


def get_engine() -> FlyingEngine | None:
    return _ENGINE
