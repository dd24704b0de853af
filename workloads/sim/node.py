"""The simulated node: engines, binds in one total order, group sessions, DP steps.

What the real node does with a decision, as ``flying.session`` does it:

- a DP request goes to an engine by SGLang's round robin (every engine, grouped or
  not: SGLang's dispatch does not know about groups) and joins its waiting queue;
- a bind goes to every member's pending queue, in the controller's one order. An
  engine without a session takes the bind at its queue's head at a step boundary and
  waits there (hard preemption: no DP step) until every member has taken it; then
  the members vote (each reserves the request's KV, ``ceil(tokens / per_slot)``
  slots) and the session starts ``bind_ms`` later, or, if one cannot reserve, the
  leader runs the request in DP. A rendezvous not complete ``bind_timeout_s`` after
  its first member arrived is aborted the same way;
- a session steps as one server (``batching``) over its members: a group step runs
  when every member is at its boundary; after it, a member with DP work runs one DP
  step (a member without waits in the next group step's collective); same-group binds
  at the head of the leader's queue join at the next boundary, before its batch is
  formed (as ``Lifecycle._tp_form`` does: ``exchange.offer``), while every member can
  reserve their KV (else admission closes for the session), unless the leader holds
  the head arrival while every running request finishes (``scheduler.hold``, the same
  function); the session ends when it has no request and no offer left;
- moves and joins (``relayout``) under ``--flying-move-to-dp``. A session moves when
  DP requests arrived at a member during it (``GroupSession.dp_arrived``: at one of the
  member's boundaries after the bind, a DP request waiting there, dispatched during the
  session or waiting since before it, to be prefilled between group steps; the member
  keeps the mark while it has DP work). DP requests already running there when it bound
  (preempted ones, or requests an earlier session moved there) are served one DP step
  between group steps and move nothing. The members learn the marks in the step
  exchange, so a session acts on them one group step later (``Shared.dp_arrived``).

SGLang's overlap loop (``Profile.overlap``): a DP step outside sessions hands its
tokens to the client when the engine's next step ends (``Batcher.reveal``); at a
boundary in a session or with a bind pending the engine processes the result at once.
A group's steps run under ``group_loop``: ``"flying"`` (a node since session 50,
``flying.session.overlap``): a group step's tokens wait for the next group step's end
unless every request in the step gets its last token, or a member has DP work (or it arrived
in the last exchange; upgrades are not offered in sessions here); a member whose DP
work arrived while a result is kept runs its DP step one group step later;
``"normal"`` (a node before it): each group step's tokens out when it ends;
``"sglang"`` (SGLang's own ``--tp-size``, which ``validate`` simulates as a group):
every step's tokens wait for the next step.

Invariants (``check``, asserted by the deadlock test): an engine is in at most one
session, a session's members are an aligned group and all point to it, KV counts never
go negative, and no two engines wait on each other's binds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from scheduler.hold import HOLD_STEPS, HOLDABLE, Running, holds, pause_breaks
from scheduler.layout_choice import SwitchCosts
from workloads.sim import relayout
from workloads.sim.batching import Batcher, SimRequest, Step
from workloads.sim.loop import Loop, assert_no_wait_cycle
from workloads.sim.parts import Bind, Engine, Session
from workloads.sim.profile import Profile

#: How a group's steps meet SGLang's overlap loop (module docstring).
GroupLoop = Literal["normal", "flying", "sglang"]


class SimNode:
    """The engines and what happens at their step boundaries (module docstring)."""

    def __init__(self, engines: int, profile: Profile, loop: Loop, move_to_dp: str = "policy",
                 bind_timeout_s: float = 30.0, on_done: Callable[[SimRequest], None] = lambda r: None,
                 on_layout: Callable[[float, list[int]], None] = lambda t, d: None,
                 log: Callable[[dict], None] | None = None, group_loop: GroupLoop = "flying",
                 hold_steps: int = HOLD_STEPS):
        self.profile = profile
        self.group_loop: GroupLoop = group_loop if profile.overlap else "normal"
        #: ``scheduler.hold``: how long a group's arrivals may wait (a node's groups only:
        #: SGLang's own TP and a node before session 52 admit at once)
        self.hold_steps = hold_steps if self.group_loop == "flying" else 0
        self.engines = [Engine(r, profile) for r in range(engines)]
        self.loop = loop
        self.move_to_dp = move_to_dp
        self.bind_timeout_s = bind_timeout_s
        self.switch: SwitchCosts = profile.switch
        self.on_done = on_done
        self.on_layout = on_layout
        self.log = log
        self.sessions: list[Session] = []
        self._rr = 0  # SGLang's round-robin counter
        self.counters = {"sessions": 0, "moves": 0, "joins": 0, "upgrades": 0,
                         "bind_timeouts": 0, "held": 0}

    # -- entering the node ------------------------------------------------------------

    def dispatch_dp(self, req: SimRequest, reason: str = "") -> None:
        """SGLang's round robin over every engine."""
        e = self.engines[self._rr % len(self.engines)]
        self._rr += 1
        self.queue_dp(e, req, reason)

    def queue_dp(self, e: Engine, req: SimRequest, reason: str = "") -> None:
        req.queued_at = self.loop.now
        req.degree, req.ranks, req.where = 1, (e.rank,), e
        req.reason = reason or req.reason
        e.dp.waiting.append(req)
        if e.state == "free":
            self.boundary(e)

    def issue(self, bind: Bind) -> None:
        """Send ``bind`` to every member (the controller's order is the call order)."""
        for r in bind.ranks:
            self.engines[r].pending.append(bind)
        for r in bind.ranks:
            if self.engines[r].state == "free":
                self.boundary(self.engines[r])

    def finish(self, req: SimRequest, error: str | None = None, status: int = 200) -> None:
        req.done, req.done_at, req.where = True, self.loop.now, None
        req.error, req.status = error, status
        self.on_done(req)

    def abort(self, req: SimRequest) -> None:
        """A client abort: the request leaves wherever it is, its KV is given back; a
        bind still pending for it is voted down when it forms."""
        if req.done:
            return
        where = req.where
        if isinstance(where, Engine):
            where.dp.remove(req)
            where.dp_used -= req.slots
        elif isinstance(where, Session):
            where.server.remove(req)
            where.used -= req.slots
        req.slots = 0
        self.finish(req, "aborted by the client")

    # -- step boundaries --------------------------------------------------------------

    def boundary(self, e: Engine) -> None:
        s = e.session
        if s is not None or e.pending:  # the pending result is processed now
            e.dp.reveal(self.loop.now)
        if s is not None:
            # DP state between group steps (the bind's own boundary does not count):
            # a DP request waiting here arrived during the session
            e.dp_arrived = e.dp.has_work() and (e.dp_arrived or bool(e.dp.waiting))
            if e.dp_turn:
                e.dp_turn = False  # not while a group result is kept: after the next step
                if e.dp.has_work() and not s.server.unseen and self._dp_step(e):
                    return
            e.state = "wait"
            self._group_boundary(s)
            return
        if e.pending:
            bind = e.pending[0]
            e.state = "rdv"
            if bind.first_wait is None:
                bind.first_wait = self.loop.now
                self.loop.at(self.loop.now + self.bind_timeout_s, self._timeout, bind)
            self._try_form(bind)
            return
        if not self._dp_step(e):
            e.state = "free"

    def _dp_step(self, e: Engine) -> bool:
        step = e.dp.form(self.loop.now, lambda r: self._admit_dp(e, r))
        e.dp.reveal(self.loop.now + (step.ms / 1000.0 if step else 0.0))
        if step is None:
            return False
        e.state = "dp"
        self.loop.at(self.loop.now + step.ms / 1000.0, self._dp_done, e, step)
        return True

    def _admit_dp(self, e: Engine, req: SimRequest) -> bool:
        if req.budget > e.free():
            return False
        e.dp_used += req.budget
        req.slots = req.budget
        return True

    def _dp_done(self, e: Engine, step: Step) -> None:
        e.dp.complete(step, self.loop.now, lambda r: self._done_dp(e, r),
                      defer=self.profile.overlap and e.session is None)
        e.state = "free"
        self.boundary(e)

    def _done_dp(self, e: Engine, req: SimRequest) -> None:
        e.dp_used -= req.slots
        req.slots = 0
        self.finish(req)

    # -- binds ------------------------------------------------------------------------

    def _try_form(self, bind: Bind) -> None:
        members = [self.engines[r] for r in bind.ranks]
        if not all(m.state == "rdv" and m.pending and m.pending[0] is bind for m in members):
            return
        for m in members:
            m.pending.popleft()
        bind.formed = True
        s = Session(bind, members, Batcher(bind.degree, self.profile.costs,
                                           self.profile.chunk_tokens, self.profile.max_running),
                    relayout.per_slot(bind.degree, self.profile.kv_heads), self.loop.now)
        if not relayout.take_bind(self, s, bind):  # voted down: nothing to run
            for m in members:
                m.state = "free"
            for m in members:
                self.boundary(m)
            return
        self.sessions.append(s)
        self.counters["sessions"] += 1
        s.extra_ms += self.switch.bind_ms
        for m in members:
            m.session, m.state, m.dp_turn, m.dp_arrived = s, "wait", False, False
        if bind.upgrade is None:
            relayout.join(self, s)
        self._layout()
        self._group_boundary(s)

    def _timeout(self, bind: Bind) -> None:
        if bind.formed:
            return
        bind.formed = True
        self.counters["bind_timeouts"] += 1
        waiting = []
        for r in bind.ranks:
            e = self.engines[r]
            if bind in e.pending:
                e.pending.remove(bind)
                if e.state == "rdv":
                    waiting.append(e)
        if bind.req is not None and not bind.req.done:
            self.queue_dp(self.engines[bind.ranks[0]], bind.req,
                          f"TP-{bind.degree} group did not form: rendezvous timed out")
        for e in waiting:
            if e.state == "rdv":
                e.state = "free"
                self.boundary(e)

    # -- sessions ---------------------------------------------------------------------

    def _group_boundary(self, s: Session) -> None:
        if any(m.state != "wait" for m in s.members):
            return
        again = True  # a boundary without a batch but with offers forms once more
        while True:
            # DP requests arrived at a member (shared by the last step's exchange): a
            # session that may hand its requests to DP moves them
            wants_move = (s.arrived and relayout.may_move(self.move_to_dp, s.reasons)
                          and s.tp_steps >= s.retry_at)
            # the binds pending now, offered and admitted before the batch is formed
            # (``Lifecycle._tp_form``, ``exchange.offer``)
            if s.admitting and not wants_move:
                offered = relayout.offers(s)
                if offered and self._holds(s, offered):
                    offered = []  # the running requests finish first (``scheduler.hold``)
                relayout.admit(self, s, offered)
            if wants_move and relayout.ready(s):
                if relayout.move(self, s):
                    return
                s.retry_at = s.tp_steps + relayout.RETRY_STEPS
            step = s.server.form(self.loop.now, lambda r: True)  # KV reserved on admission
            s.arrived = any(m.dp_arrived for m in s.members)  # this step's exchange
            offered = relayout.offers(s) if s.admitting and not wants_move else []
            if step is not None:
                break
            s.server.reveal(self.loop.now)  # nothing formed: a kept result goes out first
            if not (offered and again):
                self.release(s, 0.0)
                return
            # no batch but offers: the members form again at once (``_tp_boundary``);
            # once: an offer that cannot be admitted (its request aborted) ends it
            again = False
        ms = step.ms + s.extra_ms
        s.server.reveal(self.loop.now + ms / 1000.0)
        s.extra_ms = 0.0
        s.tp_steps += 1
        for m in s.members:
            m.state = "group"
        self.loop.at(self.loop.now + ms / 1000.0, self._group_done, s, step)

    def _holds(self, s: Session, offered: list[Bind]) -> bool:
        """``Lifecycle._holds``: whether the group's leader holds its queue's head arrival
        at this boundary while every running request finishes (and admitting the
        ``offered`` arrivals now would leave one past its TPOT SLO); counts the
        boundaries."""
        server, head = s.server, offered[0]
        left = [r.max_new - r.out for r in server.running]
        if (head.reason in HOLDABLE and not (server.waiting or server.chunk or server.prefilling)
                and holds(left, s.held_steps, self.hold_steps)
                and (s.held_steps or pause_breaks(
                    [Running(r.max_new - r.out, r.out, _pace_ms(r), head.slo_tpot_ms)
                     for r in server.running],
                    server.costs.prefill(server.degree, sum(b.req.prompt for b in offered if b.req)),
                    server.costs.decode(server.degree, len(server.running))))):
            s.held_steps += 1
            self.counters["held"] += s.held_steps == 1
            return True
        s.held_steps = 0
        return False

    def _group_done(self, s: Session, step: Step) -> None:
        s.server.complete(step, self.loop.now, lambda r: self._done_tp(s, r),
                          defer=self._keeps(s, step))
        for m in s.members:
            m.state, m.dp_turn = "free", True
        for m in s.members:
            if m.state == "free":
                self.boundary(m)

    def _keeps(self, s: Session, step: Step) -> bool:
        """Whether ``step``'s tokens wait for the next step (``group_loop``; for
        ``"flying"``, ``overlap.keeps`` and ``PendingResult.keep``)."""
        if self.group_loop != "flying":
            return self.group_loop == "sglang"
        if s.arrived or any(m.dp.has_work() for m in s.members):
            return False
        # kept unless every request in it gets its last token (``PendingResult.keep``)
        if step.kind == "decode":
            last = [r.out + 1 >= r.max_new for r in step.reqs if not r.done]
        else:
            last = [r.prefilled + k >= r.prompt and r.max_new <= 1
                    for r, k in zip(step.reqs, step.tokens, strict=True) if not r.done]
        return not (last and all(last))

    def _done_tp(self, s: Session, req: SimRequest) -> None:
        s.used -= req.slots
        req.slots = 0
        self.finish(req)

    def release(self, s: Session, after_ms: float) -> None:
        """End ``s``: its reservations go back; members are free ``after_ms`` later (a
        move's relayout), then at a boundary."""
        s.server.reveal(self.loop.now)
        for m in s.members:
            m.reserved -= s.reserved
            m.session, m.state, m.dp_turn, m.dp_arrived = None, "move", False, False
        self.sessions.remove(s)
        self._layout()
        self.loop.at(self.loop.now + after_ms / 1000.0, self._released, s.members)

    def _released(self, members: list[Engine]) -> None:
        for m in members:
            m.state = "free"
        for m in members:
            if m.state == "free":
                self.boundary(m)

    # -- what the rest of the simulator reads -----------------------------------------

    def load(self, e: Engine) -> tuple[int, int]:
        """(running, waiting) of ``e`` as SGLang's snapshot counts them with Flying's
        ``count_session``: its DP requests, and a session's on its leader only."""
        running, waiting = e.dp.load()
        s = e.session
        if s is not None and s.members[0] is e:
            r, w = s.server.load()
            running, waiting = running + r, waiting + w
        return running, waiting

    def _layout(self) -> None:
        degrees = [e.session.bind.degree if e.session else 1 for e in self.engines]
        self.on_layout(self.loop.now, degrees)

    def idle(self) -> bool:
        return all(e.state == "free" and not e.pending and not e.dp.has_work()
                   and e.session is None for e in self.engines)

    def check(self) -> None:
        """Assert the invariants (module docstring)."""
        for s in self.sessions:
            m, start = s.bind.degree, s.ranks[0]
            assert start % m == 0 and s.ranks == tuple(range(start, start + m)), s.ranks
            assert all(e.session is s for e in s.members), "a member left its session"
            assert s.used <= s.reserved, "a session uses more than it reserved"
        live = {id(s) for s in self.sessions}
        for e in self.engines:
            assert e.session is None or id(e.session) in live, "an engine in a dead session"
            assert e.reserved == sum(s.reserved for s in self.sessions if e in s.members)
            assert e.dp_used >= 0 and e.reserved >= 0
        assert_no_wait_cycle(self.engines)


def _pace_ms(r: SimRequest) -> float:
    """``hold_view.pace_ms``: ms per token between ``r``'s first and last tokens."""
    return 1000.0 * (r.times[-1] - r.times[0]) / (len(r.times) - 1) if len(r.times) > 1 else 0.0
