"""The controller model: where each request goes, decided by Flying's own policy code.

A request passes two deciders in the real node, and here the same calls are made with
the same inputs:

1. the HTTP process (``flying.node.request_tags.place``): ``Policy.decide(request,
   loads=None)`` on the HTTP process's own policy (its ``Node`` has the model's
   context length and the largest degree as engine count): a rejection (HTTP 400),
   or a TP mark for explicit degrees, long context, priority and static-tp;
2. the DP controller (``flying.node.controller.binds_for``): every request counts in
   the arrival estimate (``scheduler.traffic.Arrivals``, fed the arrival times); a
   priority mark is kept only if ``Policy.decide`` with the loads, costs, traffic and
   switch costs still says TP (``_priority_pays``); an unmarked request under the
   adaptive policy is placed by ``Policy.decide`` (``_adaptive_degree``). Each of these
   decisions is written to the decision log in the real log's format
   (``scheduler.replay.record``), so ``python -m scheduler.replay`` replays it;
3. a TP decision becomes a bind for the group ``BindIssuer.choose`` gives (the real
   controller's round robin over the degree's aligned groups, or over a mixed layout's
   own groups; the least loaded group, ``scheduler.policy.least_loaded_group``, for
   priority requests under ``--flying-priority-max-paused``); anything else goes to DP:
   to a mixed layout's DP engines in turn (``BindIssuer.dp_engine``), else by SGLang's
   dispatch.

The loads are exact (``SimNode.load``: SGLang's snapshot with Flying's
``count_session``), where the real controller reads snapshots a few steps old.

The two policies' ``Node``s are built as the node builds them
(``flying.node.placement.node_of``, ``Profile.node``): the controller's knows each
engine's KV pool (what a server batches), the HTTP process's the model's context and
SGLang's request limit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from types import SimpleNamespace

from flying.node.bind_issuer import BindIssuer
from flying.node.config import FlyingConfig
from flying.node.placement import loads_of, policy_config, request_of
from flying.substrate.layout import Group, group_containing
from scheduler.policy import Decision, Policy, least_loaded_group
from scheduler.replay import record, record_upgrade
from scheduler.traffic import Arrivals
from workloads.sim.batching import SimRequest
from workloads.sim.node import SimNode
from workloads.sim.parts import Bind
from workloads.sim.profile import Profile

#: Why a request marked by the HTTP process is bound (``request_tags.place``).
_MARK = {"long context": "long", "priority": "priority"}


class Controller:
    def __init__(self, node: SimNode, profile: Profile, cfg: FlyingConfig,
                 degrees: tuple[int, ...], log: Callable[[str], None] | None = None):
        self.node = node
        self.cfg = cfg
        self.profile = profile
        engines = len(node.engines)
        self.policy = Policy(policy_config(cfg), profile.node(engines, degrees))
        self.http = Policy(policy_config(cfg), profile.node(engines, degrees, http=True))
        self.issuer = BindIssuer(engines, list(degrees)) if degrees else None
        self.arrivals = Arrivals()
        self.log = log
        self._binds = 0
        self.decisions = 0  # the policy's decisions with loads (the log's placement lines)
        if log is not None:  # the head line, as ``DecisionLog`` writes it
            log(json.dumps({"config": asdict(self.policy.config),
                            "node": asdict(self.policy.node)}))

    def arrive(self, req: SimRequest) -> None:
        """``req`` reaches the node now (the loop's time)."""
        now = self.node.loop.now
        if self.issuer is None:  # groups off: SGLang's own limits only
            if req.prompt > self.profile.max_req_len - 5:
                self.node.finish(req, f"prompt of {req.prompt} tokens exceeds the limit", 400)
                return
            req.max_new = min(req.max_new, self.profile.max_req_len - req.prompt - 1)
            self.node.dispatch_dp(req)
            return
        request = request_of(req.prompt, {"max_new_tokens": req.max_new}, req.priority,
                             req.explicit)
        marked = self.http.decide(request, loads=None)
        if marked.mode == "reject":
            self.node.finish(req, marked.reason, 400)
            return
        degree, why = 0, ""
        if marked.mode == "tp":
            degree = marked.degree
            why = "explicit" if req.explicit else _MARK.get(marked.reason, "policy")
        self.arrivals.note(now, req.prompt, req.max_new)  # ``_note_arrival``
        group = None
        if degree and why == "priority":
            decision = self._decide(req, max(req.priority, self.policy.config.priority_threshold))
            if decision.mode != "tp":
                degree, req.reason = 0, decision.reason
            elif self.cfg.priority_max_paused >= 0:
                group = self._priority_group(req, degree)
                degree = degree if group is not None else 0
        elif not degree and self.cfg.policy == "adaptive":
            decision = self._decide(req, req.priority)
            degree, why = (decision.degree if decision.mode == "tp" else 0), "policy"
        if not degree:  # ``_route_dp``: a mixed layout's DP engines, else SGLang's dispatch
            rank = self.issuer.dp_engine(self.policy.engines_for(1))
            if rank is None:
                self.node.dispatch_dp(req)
            else:
                self.node.queue_dp(self.node.engines[rank], req)
            return
        group = group or self.issuer.choose(degree, self.policy.engines_for(degree))
        slo = self.policy.slo  # ``controller._slo_tpot``: the node's (no request's own here)
        tpot = slo.tpot_ms if slo is not None else self.cfg.slo_tpot or 0.0
        self.node.issue(Bind(self._bind_id(), degree, group.ranks, req, why, slo_tpot_ms=tpot))

    def upgrade(self, req: SimRequest) -> Decision | None:
        """An engine asks for a group for ``req``, a running DP request outgrowing it
        (``upgrade_binds_for``); None if it is not running in DP."""
        holder = getattr(req.where, "rank", None)
        if self.issuer is None or holder is None or req.done:
            return None
        decision = self.policy.upgrade(holder)
        if self.log is not None:
            self.log(record_upgrade(holder, decision, rid=req.rid, t=self.node.loop.now))
        if decision.mode == "tp":
            group = group_containing(decision.degree, holder)
            self.node.issue(Bind(self._bind_id(), decision.degree, group.ranks, None, "long",
                                 upgrade=req, holder=holder))
        return decision

    def _bind_id(self) -> str:
        self._binds += 1
        return f"{self._binds:012x}"

    def snapshots(self) -> list[SimpleNamespace]:
        """The engines' load snapshots in the shape ``placement.loads_of`` reads."""
        out = []
        for e in self.node.engines:
            running, waiting = self.node.load(e)
            out.append(SimpleNamespace(dp_rank=e.rank, num_running_reqs=running,
                                       num_waiting_reqs=waiting))
        return out

    def _decide(self, req: SimRequest, priority: int) -> Decision:
        """``controller._decide``: the policy's decision with every input, logged."""
        now = self.node.loop.now
        loads = loads_of(self.snapshots())
        costs, switch = self.profile.costs, self.profile.switch
        traffic = self.arrivals.traffic(now)
        request = request_of(req.prompt, {"max_new_tokens": req.max_new}, priority, 0)
        decision = self.policy.decide(request, loads, costs, traffic, switch)
        self.decisions += 1
        if self.log is not None:
            choice = self.policy.last_choice
            self.log(record(request, loads, decision, costs, rid=req.rid, t=round(now, 6),
                            traffic=traffic, switch=switch, slo=self.policy.slo,
                            predictions=choice.predictions if choice else None))
        return decision

    def _priority_group(self, req: SimRequest, degree: int) -> Group | None:
        """``controller._priority_group``: the least loaded group if it pauses at most
        ``--flying-priority-max-paused`` DP requests."""
        loads = loads_of(self.snapshots())
        ranks, paused = least_loaded_group(loads, degree, len(self.node.engines))
        if paused <= self.cfg.priority_max_paused:
            return Group(degree, ranks[0] // degree)
        req.reason = (f"priority: a TP-{degree} group would pause {paused} DP requests "
                      f"(--flying-priority-max-paused {self.cfg.priority_max_paused}); ran in DP")
        return None
