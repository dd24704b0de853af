"""A group session's lifecycle on one member: bind, TP steps, failure, release.

Mixed into ``FlyingEngine`` (``flying.session.engine``), whose hooks call these at
SGLang's step boundaries; the states are ``flying.session.group.State``.
"""

from __future__ import annotations

import itertools
import logging
import time

from flying.session import (
    aborts,
    admission,
    containment,
    exchange,
    hand_back,
    hold_view,
    join,
    layout_log,
    move,
    regroup,
    report,
    standby,
    tp_scope,
    upgrade,
)
from flying.session.drain import drain_keys
from flying.session.drain import scheduler_form as _form
from flying.session.group import GroupSession, State
from flying.session.messages import Bind
from flying.session.release import Release
from scheduler import hold

logger = logging.getLogger(__name__)

#: Consecutive TP boundaries without a batch after which a session is declared stuck.
MAX_IDLE_STEPS = 50


class Lifecycle(Release):
    """Binding, running and releasing group sessions (mixed into ``FlyingEngine``)."""

    def _vote(self, scheduler, bind: Bind, is_leader: bool):
        """(reservation or None, vote, scope or None): vote "" if this member can serve
        the bind; the scope is a standby's, opened before the bind came."""
        self.faults.refresh()
        try:
            self.faults.check("bind")
            if self.aborts.hits(bind.rid):
                return None, "request aborted by the client", None
            if hand_back.stale(self, bind):
                return None, hand_back.STALE_VOTE, None
            if bind.degree not in self.prepared:
                return None, f"engine {self.dp_rank} has no TP-{bind.degree} views", None
            # An upgrade's request reserves what it joins with (``upgrade.gather``);
            # the session itself starts from one slot per member.
            per_slot = self.prepared[bind.degree].per_slot
            if bind.upgrade:
                standby.drop(self, scheduler)  # here, in the DP state
                tokens = per_slot
            else:
                tokens = admission.tokens_needed(bind, self.dp_limit)
                self.want = (bind.degree, tokens)
                ready = standby.claim(self, scheduler, bind.degree, tokens, is_leader)
                if ready is not None:
                    self.counters.standby_binds += 1
                    return ready.reservation, "", ready.scope
            reservation = tp_scope.reserve_for(scheduler, tokens, per_slot)
        except Exception as exc:  # noqa: BLE001 - any failure is this member's "no"
            logger.exception("flying: engine %d cannot join bind %s", self.dp_rank, bind.bind_id)
            return None, f"engine {self.dp_rank} failed to prepare: {exc}", None
        return reservation, "" if reservation is not None else "member lacks KV capacity", None

    def _open_early(self, scheduler, bind: Bind, reservation, is_leader: bool):
        """The session's scope, opened between announcing and concluding the handshake
        so that its cost overlaps the peers' arrival; None if this member voted no or
        opening failed (logged; the bind then opens it after a go, raising as before).
        Nothing of it is entered: on abort it is dropped with the reservation."""
        if reservation is None:
            return None
        try:
            return tp_scope.open_scope(
                scheduler, self.prepared[bind.degree], self.pool.member(bind.degree),
                reservation, is_leader, self.faults,
            )
        except Exception:  # noqa: BLE001 - retried after the handshake
            logger.exception("flying: engine %d: opening bind %s's scope early failed",
                             self.dp_rank, bind.bind_id)
            return None

    def _bind(self, scheduler, bind: Bind) -> GroupSession | None:
        """BINDING: vote, announce, open the scope while the other members arrive,
        conclude the handshake, enter and hand the request; the session is RUNNING (TP
        state entered) on return, or None if the bind did not form."""
        self.draining = False
        t0 = time.perf_counter()
        is_leader = self.dp_rank == bind.ranks[0]
        reservation, vote, scope = self._vote(scheduler, bind, is_leader)
        t_vote = time.perf_counter()
        ticket = self.pool.announce(bind.bind_id, bind.degree, vote)
        if scope is None:  # no standby: open it while the peers arrive
            scope = self._open_early(scheduler, bind, reservation, is_leader)
        dp_running = len(scheduler.running_batch.reqs)
        if scope is not None and bind.upgrade is None and not move.allowed(self.move_to_dp, {bind.reason}):
            scope.enter()  # no DP request joins (``join.gather``): enter while the peers arrive
        t_open = time.perf_counter()
        verdict = None
        try:
            verdict = self.pool.conclude(ticket, self.bind_timeout_s)
        finally:
            if scope is not None and (verdict is None or not verdict.go):
                scope.leave()  # DP state again for the abort path (no-op if not entered)
        if self.preempt == "soft":  # every member is past its drain wait now
            self.pool.store.delete_key(drain_keys(bind)[bind.ranks.index(self.dp_rank)])
        t_rdv = time.perf_counter()
        if not verdict.go:
            self.pool.settle(ticket)
            tp_scope.release(scheduler, reservation)
            if scope is not None:  # opened early: its running batch was the spare one
                tp_scope.restock(scope.prepared)
            self.counters.aborted_binds += 1
            (logger.info if verdict.reason == hand_back.STALE_VOTE else logger.warning)(
                "flying: bind %s aborted: %s", bind.bind_id, verdict.reason)
            if bind.upgrade is not None:  # it goes on in DP; one that left a group ends
                parked = regroup.take(self, scheduler, bind.upgrade.rid)
                if parked is not None:
                    regroup.finish(scheduler, [parked.req])
            elif self.dp_rank != hand_back.runner(bind, verdict.reason):
                pass  # another member serves it
            elif self.aborts.hits(bind.req.rid):
                tp_scope.reject(scheduler, bind.req, "request aborted by the client")
            else:  # the group could not form: serve the request in DP instead
                self.counters.rerun_in_dp += 1
                scheduler.handle_generate_request(bind.req)
                report.mark(scheduler, bind.req.rid, 1, f"TP-{bind.degree} group did not form: {verdict.reason}")
            return None
        member = self.pool.member(bind.degree)
        self.counters.binds += 1
        if scope is None:  # opening it early failed: open it now, as the bind goes on
            scope = tp_scope.open_scope(
                scheduler, self.prepared[bind.degree], member, reservation, is_leader, self.faults
            )
        s = GroupSession(bind, member, scope, is_leader, ticket=ticket, t_bind=t0, t_vote=t_vote,
                         t_open=t_open, t_rendezvous=t_rdv)
        self.session = s
        if bind.upgrade is None:
            scope.tokenized[bind.req.rid] = bind.req  # containment re-runs it if all fails
        joining, landed = None, False
        try:
            if bind.upgrade is not None:
                joining = upgrade.gather(self, scheduler, bind, member, self.faults)
            else:
                joining = join.gather(self, scheduler, bind, member, is_leader, self.faults)
            s.t_join = time.perf_counter()
            self.counters.preempted_dp_requests += dp_running
            if not scope.entered:
                scope.enter()
            s.to(State.RUNNING)
            self.faults.check("scope")
            s.t_ready = time.perf_counter()  # switched: the rest is SGLang taking the request
            if bind.upgrade is None:
                scope.hand(scheduler, bind.req, bind.reason)
            else:  # the request joins below: the session's reason is the bind's
                scope.reasons.add(bind.reason)
            if joining is not None:
                join.land(scheduler, scope, joining)
                landed = True
                self._joined(s, joining, (time.perf_counter() - joining.t_agreed) * 1e3)
        except Exception as exc:  # noqa: BLE001 - containment: this session only
            self._failed(s, exc)
            self._contain(scheduler, s, exc)
            if joining is not None and not landed:
                join.recover(scheduler, joining)
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
        # DP requests arrived at a member: a session that may hand its requests to DP
        # moves them now (every member decides alike: shared values, lockstep). Any
        # session (unless moves are off) yields when a member's DP requests need the KV
        # it reserved there; while they do, it takes no one new.
        held = bool(shared.dp_held)
        wants_move = (bool(shared.dp_arrived) and self._may_move(s)) or (
            held and self.move_to_dp != "off" and s.tp_steps >= s.move_retry_at
        )
        if wants_move:  # binds issued before now would form a group beside DP work
            self.left_at = time.time()
        # Admission stays open (DP work runs between group steps, so it never waits
        # for the group); it closes only when a request could not reserve its KV. The
        # binds pending now are offered and admitted before the batch is formed, so a
        # request joins at the first boundary after its bind arrived, as SGLang's own
        # scheduler takes a request at its next step.
        admitting = s.scope.admitting and not wants_move and not held
        candidates = admission.candidates(self.pending, s.bind) if admitting else []
        if candidates and s.is_leader and self._holds(scheduler, s, len(candidates)):
            candidates = []  # offered (and admitted) once the running requests are done
        offers = exchange.offer(s.member, candidates)
        if offers:
            if offers[0] >= admission.UPGRADE_OFFER and self.result.kept:
                self.result.process(scheduler)  # an upgrade leaves the TP state: no kept step
            s.joined += admission.admit(self, scheduler, s.member, s.scope, offers)
        # The session's only request moves to a larger group (every member has its bind).
        if shared.parking == len(s.bind.ranks) and regroup.park(self, scheduler, s):
            self._end(scheduler, s, [])
            return None
        regroup.ask(self, scheduler, s)
        if wants_move and self._may_move(s) and scheduler.waiting_queue:
            hand_back.hand_back(self, scheduler, s)  # not prefilled here: start in DP
        if wants_move and move.ready(scheduler):
            moved = move.to_dp(scheduler, s, self.dp_limit, self.faults, self.bind_timeout_s,
                               self.mail)
            if moved is not None:
                self._moved(scheduler, s, moved)
                return None
            s.move_retry_at = s.tp_steps + move.RETRY_STEPS
        plan = _form(scheduler, original)
        batch = plan.batch_to_run
        # What SGLang's loop does next; done here so that containment finds the batch's
        # requests (and frees their rows) if the exchange below raises.
        scheduler.running_batch, s.batch = plan.running_batch, batch
        if batch is None and self.result.kept:  # the load below must count its finishes
            self.result.process(scheduler)
        self.publish(scheduler, plan=plan)
        self.faults.check("step")
        # Binds still pending (arrived since the offer above) keep the session from
        # ending in this exchange; they are offered at the next boundary.
        admitting = s.scope.admitting and not wants_move and not held
        offers = admission.candidates(self.pending, s.bind) if admitting else []
        due = (
            self.aborts.due(containment.session_reqs(scheduler), exchange.MAX_ABORTS)
            if s.is_leader else []
        )
        busy = bool(scheduler.waiting_queue) or not scheduler.running_batch.is_empty()
        s.shared = exchange.exchange(s.member, batch, offers, due, s.dp_work, busy, s.dp_held,
                                     s.dp_arrived, regroup.parking(self, s))
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

    def _holds(self, scheduler, s: GroupSession, offered: int) -> bool:
        """The leader, before offering: whether the arrival at its queue's head waits
        for the running requests to finish (``scheduler.hold``: all of them finish
        within the steps left, and admitting the ``offered`` arrivals now would put one
        past its TPOT SLO); counts the boundaries it has waited. Only the leader's
        answer is shared (``offer``)."""
        head = self.pending[0]
        arrivals = list(itertools.islice(self.pending, offered))
        reqs = hold_view.running(scheduler)
        hold_view.note_slos(s.slo_tpot, (s.bind, *arrivals), scheduler, reqs)
        waiting = bool(scheduler.waiting_queue) or scheduler.chunked_req is not None
        bounds = [r.sampling_params.max_new_tokens for r in reqs]
        if (head.upgrade is None and head.reason in hold.HOLDABLE and not waiting
                and None not in bounds):  # one without a bound (joined from DP) may run on
            running = hold_view.views(reqs, bounds, s.slo_tpot)
            if hold.holds([r.left for r in running], s.held_steps, self.hold_steps) and (
                    s.held_steps or hold.pause_breaks(
                        running, hold_view.pause_ms(self.clock, s.bind.degree, arrivals),
                        self.clock.predict(s.bind.degree, "decode", len(reqs)))):
                s.held_steps += 1
                self.counters.held_admissions += s.held_steps == 1
                return True
        s.held_steps = 0
        return False

    def upgrade_into(self, scheduler, bind: Bind) -> int:
        """Every member, TP state, the same boundary (``admission.admit``): a member's
        running DP request outgrew its engine while this session runs, and its upgrade
        bind is for this session's group: it joins the session with its KV (as into a
        forming group: ``upgrade.gather`` in the DP state, ``join.land`` here) instead of
        waiting for the session to end, when it would have ended at its DP limit.
        Returns 1 if it joined, else 0 (it goes on in DP)."""
        s = self.session
        self.pending.remove(bind)
        s.scope.leave()
        try:
            joining = upgrade.gather(self, scheduler, bind, s.member, self.faults)
        finally:
            s.scope.enter()
        if joining is None:
            return 0
        try:
            join.land(scheduler, s.scope, joining)
        except BaseException:
            s.scope.leave()
            try:
                join.recover(scheduler, joining)
            finally:
                s.scope.enter()
            raise
        self._joined(s, joining, (time.perf_counter() - joining.t_agreed) * 1e3)
        return 1

    def _may_move(self, s: GroupSession) -> bool:
        return move.allowed(self.move_to_dp, s.scope.reasons) and s.tp_steps >= s.move_retry_at

    def _moved(self, scheduler, s: GroupSession, moved: move.Moved) -> None:
        """The session's requests now run in DP, spread over its members: count and
        report this member's, release."""
        self.counters.moved(moved)
        for req in moved.reqs:
            report.moved(req, s.bind.degree, move.MOVED_REASON)
        if moved.decision is not None and layout_log.enabled():
            layout_log.write("move", {
                **layout_log.about(s.bind, self.dp_rank), **moved.decision,
                "requests": moved.requests, "tokens": moved.tokens,
                "bytes_in": moved.bytes_in, "ms": round(moved.ms, 3),
                "peer_steps": moved.peer_steps,
            })
        logger.info(
            "flying: engine %d: %d request(s) of bind %s moved to DP here "
            "(%d tokens of KV, %.2f ms)", self.dp_rank, moved.requests, s.bind.bind_id,
            moved.tokens, moved.ms,
        )
        self._end(scheduler, s, [])

    def _joined(self, s: GroupSession, joining: join.Joining, ms: float) -> None:
        """Running DP requests (the members', or an upgrade's) joined the forming session;
        each is counted by the member it came from."""
        self.counters.joined(joining, ms)
        if joining.upgrade and self.watch.enabled:  # may outgrow this group too
            s.growable.update(r.rid for r in joining.reqs)
        if joining.upgrade:
            for req in joining.reqs:  # the leader's copy answers from here on
                report.moved(req, s.bind.degree, upgrade.UPGRADED_REASON)
        if joining.log is not None:
            layout_log.write("upgrade_join" if joining.upgrade else "join", {
                **joining.log, "ms": round(ms, 3), "tokens": sum(joining.lens),
                "carry_ms": round((joining.t_carried - joining.t_agreed) * 1e3, 3),
                "kv_bytes": layout_log.kv_bytes(joining.shard),
            })
        logger.info(
            "flying: engine %d: %d running DP request(s) joined bind %s (%d tokens of KV, %.2f ms)",
            self.dp_rank, len(joining.reqs), s.bind.bind_id, sum(joining.lens), ms,
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
