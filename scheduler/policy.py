"""The global scheduler's policy: where a request runs, as a pure function of state.

No torch, no sockets: the inputs are plain values (the request's priority and lengths,
per-engine load, the node's TP degrees and per-engine KV capacity), the output is a
``Decision``. That keeps it unit-testable and replayable from a recorded event log
(``scheduler.replay``). Mechanism (binding, views, pools) lives in ``flying/``.

Order of rules for one request:
1. an explicit ``X-Flying-TP`` degree wins (operators' manual control), unless the
   request uses a feature that runs in DP only (``Request.dp_only``): then a rejection
   naming the feature;
2. prompt + max_new_tokens beyond one engine's KV -> the smallest degree that fits, or a
   rejection naming the limit and the largest degree (the only 400 for length); a
   DP-only request that only a group holds is rejected naming the feature;
3. priority at or above the threshold -> the largest degree (latency first), unless
   the measured step costs say a group of that degree is not faster than one engine
   (``Costs``): then DP, and the reason says so;
   (rules 2-4 are off under the manual policy: only explicit headers bind groups);
4. by policy: static-dp -> DP; static-tp -> the largest degree;
   adaptive -> the largest degree while the node is lightly loaded *and* a group pays
   (its measured decode step is at least ``tp_gain`` faster than one engine's), DP
   otherwise; load has hysteresis (enter TP below ``light_load``, leave above
   ``heavy_load`` requests per engine) so the mode does not flap; only a caller that
   passes the engines' loads and step costs gets a TP answer (without them it is DP:
   a group that has not been shown to pay is never chosen for latency); and under
   adaptive, a conversation's turn (``Request.turn_tokens``) runs in DP, where an
   engine keeps its history cached, and under chat traffic so does a first prompt
   (``Traffic.continued``: its next turn finds it cached; ``scheduler.conversations``).
A DP-only request never gets a group from rules 3 and 4: it runs in DP, and the
decision's reason names the feature. Rule 2 also applies mid-request: a running DP
request without a bound of its own that outgrows its engine joins a group
(``Policy.upgrade``).

``max_new_tokens=None`` is SGLang's "no limit": the request may generate until the
length limit of wherever it runs (SGLang 0.5.23 clips it to ``max_req_len - prompt - 1``
in ``Scheduler.init_req_max_new_tokens``). For placement it needs only room for its
prompt and one new token, so it is never upgraded to a group for length on its own;
it runs where its prompt fits and may grow to that place's limit.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler.conversations import CHAT_SHARE, MIN_TURN_TOKENS, is_turn
from scheduler.costs import Costs
from scheduler.layout_choice import Choice, LayoutChooser, SwitchCosts
from scheduler.policy_types import (
    POLICIES,
    Decision,
    EngineLoad,
    Node,
    PolicyConfig,
    Request,
)
from scheduler.relayout import serving_other
from scheduler.service import Slo
from scheduler.slo import derive_slo, group_for_own_slo
from scheduler.traffic import Traffic

__all__ = [
    "POLICIES", "Costs", "Decision", "EngineLoad", "Node", "PolicyConfig", "Request", "Slo",
    "SwitchCosts", "Traffic",
]


@dataclass
class Policy:
    config: PolicyConfig
    node: Node
    light: bool = field(default=True)  # adaptive hysteresis state (without traffic)
    #: the goodput layout choice (adaptive, with traffic); its last choice and SLOs
    chooser: LayoutChooser | None = field(default=None, repr=False)
    last_choice: Choice | None = field(default=None, repr=False)
    slo: Slo | None = None

    def fit_degree(self, tokens: int) -> int | None:
        """The smallest allowed degree whose pooled KV holds ``tokens`` (1 = one engine)."""
        if tokens <= self.node.capacity(1):
            return 1
        for m in self.node.degrees:
            if tokens <= self.node.capacity(m):
                return m
        return None

    def observe(self, loads: list[EngineLoad]) -> None:
        """Update the adaptive mode from load (requests per engine), with hysteresis."""
        if not loads:
            return
        per_engine = sum(e.requests for e in loads) / len(loads)
        if self.light and per_engine > self.config.heavy_load:
            self.light = False
        elif not self.light and per_engine < self.config.light_load:
            self.light = True

    def pays(self, degree: int, costs: Costs | None) -> tuple[bool, str]:
        """(whether a TP-``degree`` group pays for latency, why not)."""
        gain = costs.gain(degree) if costs is not None else None
        if gain is None:
            return False, f"no measured TP-{degree} step cost yet"
        if gain < self.config.tp_gain:
            return False, f"{costs.describe(degree)}: a group does not pay here"
        return True, ""

    def decide(
        self, req: Request, loads: list[EngineLoad] | None = None, costs: Costs | None = None,
        traffic: Traffic | None = None, switch: SwitchCosts | None = None,
    ) -> Decision:
        largest = max(self.node.degrees, default=1)
        tokens = req.tokens
        need = self.fit_degree(tokens)
        if req.explicit_degree > 1:
            if req.dp_only:
                return Decision(
                    "reject",
                    reason=f"X-Flying-TP: {req.dp_only} does not run in a TP group; "
                    "send the request without X-Flying-TP to run it in DP",
                )
            if req.explicit_degree not in self.node.degrees:
                return Decision("reject", reason=f"TP degree {req.explicit_degree} not allowed")
            if tokens > self.node.capacity(req.explicit_degree):
                return Decision("reject", reason=self._too_long(req, largest))
            return Decision("tp", req.explicit_degree, "explicit")
        if self.config.policy == "manual":  # only explicit headers bind groups
            return Decision("dp", 1, _dp_only(req) or "manual")
        if need is None:
            return Decision("reject", reason=self._too_long(req, largest))
        if need > 1:
            if req.dp_only:
                return Decision(
                    "reject",
                    reason=f"{self._describe(req)} only fit in a TP-{need} group "
                    f"({self.node.engine_capacity} fit one engine), and {req.dp_only} "
                    "runs in DP only",
                )
            return Decision("tp", need, "long context")
        if req.dp_only:  # priority and policy groups: DP, and say why
            return Decision("dp", 1, _dp_only(req))
        if largest > 1 and req.priority >= self.config.priority_threshold:
            # Without costs (the HTTP process) the group is proposed; the controller,
            # which sees the costs, keeps it only if it pays.
            if costs is None:
                return Decision("tp", largest, "priority")
            pays, why = self.pays(largest, costs)
            return Decision("tp", largest, "priority") if pays else Decision(
                "dp", 1, f"priority: {why}; ran in DP"
            )
        policy = self.config.policy
        if policy == "adaptive" and largest > 1 and (req.slo_ttft_ms or req.slo_tpot_ms):
            own = self._by_own_slo(req, loads, costs)
            if own is not None:
                return own
        if policy == "static-tp" and largest > 1:
            return Decision("tp", largest, "static-tp")
        if policy == "adaptive" and largest > 1 and loads is not None and traffic is not None:
            return _as_turn(req, self._by_goodput(loads, costs, traffic, switch or SwitchCosts()),
                            traffic)
        if policy == "adaptive" and largest > 1 and loads is not None:
            # Without loads (the HTTP process) the load rule is left to the caller that
            # sees them (the DP controller): the answer is DP, i.e. "no TP mark".
            # Without traffic (older callers, old logs): the requests-per-engine rule.
            self.observe(loads)
            if self.light:
                pays, why = self.pays(largest, costs)
                if pays:
                    return _as_turn(req, Decision("tp", largest, "light load"))
                return Decision("dp", 1, f"adaptive: {why}")
            return Decision("dp", 1, "adaptive: heavy load")
        return Decision("dp", 1, policy)

    def _by_goodput(
        self, loads: list[EngineLoad], costs: Costs | None, traffic: Traffic,
        switch: SwitchCosts,
    ) -> Decision:
        """The adaptive rule with traffic: the layout predicted to serve the most
        requests within SLO (``scheduler.layout_choice``), and this request's place in
        it. No measured costs: DP (a group is never chosen unmeasured)."""
        self.slo = derive_slo(self.config, costs, self.node.degrees, traffic.prompt)
        if costs is None or self.slo is None:
            self.last_choice = None
            return Decision("dp", 1, "adaptive: no measured step costs yet")
        if self.chooser is None:
            self.chooser = LayoutChooser(
                self.node.num_engines, self.node.degrees, self.config.phase_s,
                self.config.tp_gain, self.node.engine_slots or self.node.engine_capacity,
                joins=self.config.joins, mixed=self.config.mixed,
                prefill_tokens=self.node.prefill_tokens,
            )
        choice = self.chooser.choose(
            traffic.now, costs, traffic, sum(e.running for e in loads),
            sum(e.waiting for e in loads), self.slo, switch,
        )
        self.last_choice = choice
        degree = self.chooser.route()
        if degree > 1:
            return Decision("tp", degree, choice.reason)
        return Decision("dp", 1, choice.reason)

    def _by_own_slo(
        self, req: Request, loads: list[EngineLoad] | None, costs: Costs | None
    ) -> Decision | None:
        """The request's own SLOs (``scheduler.slo.group_for_own_slo``); None: the
        node's layout decides (also without costs: the HTTP process leaves it to the
        controller)."""
        if costs is None:
            return None
        batch = 1 + min((e.running for e in loads), default=0) if loads else 1
        found = group_for_own_slo(
            req.slo_ttft_ms, req.slo_tpot_ms, req.prompt_len, costs, self.node.degrees,
            lambda m: req.tokens <= self.node.capacity(m), batch,
        )
        return Decision("tp", found[0], found[1]) if found else None

    def engines_for(self, degree: int) -> tuple[int, ...]:
        """The engines a request of ``degree`` (1: DP) may run on under the adaptive
        layout now: in a mixed layout a request of its groups' degree on its groups'
        engines, a DP request on its DP engines (``Layout.placement``); () otherwise
        (any: SGLang's dispatch for DP, every aligned group of the degree for a bind).
        The controller keeps every DP request it dispatches to these, whatever rule put
        it in DP (a DP-only feature, a conversation's turn), so the groups meet no DP
        arrival and do not move."""
        lay = self.chooser.current if self.chooser is not None else None
        if lay is None or not lay.mixed:
            return ()
        grouped, dp = lay.placement()
        if degree <= 1:
            return dp
        return grouped if degree == lay.tp_degree else ()

    def upgrade(self, holder: int, current: int = 1,
                busy: Mapping[int, int] | None = None) -> Decision:
        """Where a running request goes that outgrows engine ``holder`` (``current`` 1)
        or the TP-``current`` group ``holder`` leads: it has no max_new_tokens of its
        own and is within a few tokens of its limit there (``flying.session.upgrade``,
        ``regroup``). The smallest larger degree whose group holds more, formed around
        the holder (its aligned group, which contains the current one: rule 2, long
        context, applied mid-request); or where it is, ending at that limit (in DP as in
        SGLang).

        ``busy`` (engine rank -> degree of the group it serves now) skips a group one of
        whose engines serves another group: its members would wait for that session
        to end at the bind (the request's own group, which ends as it leaves, and a
        session of the very group asked for, which takes it in, do not count)."""
        if self.config.policy == "manual":
            return Decision("dp", 1, "manual: only X-Flying-TP binds groups")
        now = self.node.capacity(current)
        blocked = ""
        for m in self.node.degrees:
            if m > current and self.node.capacity(m) > now and holder < self.node.num_engines // m * m:
                other = serving_other(holder, m, current, busy or {})
                if other is None:
                    return Decision("tp", m, "long context")
                blocked = blocked or f"TP-{m}: engine {other} serves another group now"
        where = "one engine" if current == 1 else f"its TP-{current} group"
        if blocked:
            return Decision("dp", 1, f"no TP group holds more than {where} now ({blocked})")
        return Decision("dp", 1, f"no TP group holds more than {where} ({now} tokens)")

    @staticmethod
    def _describe(req: Request) -> str:
        if req.max_new_tokens is None:
            return f"prompt of {req.prompt_len} tokens + 1 new token = {req.tokens} tokens"
        return f"prompt + max_new_tokens = {req.tokens} tokens"

    def _too_long(self, req: Request, largest: int) -> str:
        return (
            f"{self._describe(req)} exceeds the node's KV capacity: "
            f"{self.node.capacity(largest)} tokens with the largest TP degree {largest} "
            f"({self.node.engine_capacity} for one engine)"
        )


def _as_turn(req: Request, decision: Decision, traffic: Traffic | None = None) -> Decision:
    """``decision`` (the adaptive policy's own), or DP for a request it would put in a
    group that a cache on an engine serves better (``scheduler.conversations``):

    - a conversation's turn: an engine keeps the earlier turns in its prefix cache,
      where a group's cache ends with its session and the group would prefill the whole
      history again (the controller sends the turn to the engine holding its
      conversation: ``Decision.turn``); a turn whose history ran in a group
      (``Request.turn_held`` false) only under chat traffic, where its next turn is
      likely and finds it cached: otherwise no engine's cache serves it, and in DP it
      runs beside the groups, every step of its engine's a pause of its group's
      (SGLang's random-ids benchmark repeats a prompt now and then: on the
      hidden-1024 model at 1.5 req/s, session 58, 2-6 such prompts a round ran in DP
      beside a TP-2 group, and from the first of them the round's requests streamed
      at 2-2.8x the ITL of its earlier ones: TPOT p50 1.22x groups off in round 3);
    - under chat traffic (``traffic.continued`` >= ``CHAT_SHARE``), a first prompt long
      enough to be continued: in a group it saves at most half its prefill, and its next
      turn, finding it cached nowhere, pays all of it again (SGLang's dispatch places it,
      and the controller learns where).

    Rule 4 only: a request that asked for a group (header, priority, its own SLOs) or
    needs one (length) keeps it."""
    if decision.mode != "tp":
        return decision
    chat = traffic is not None and traffic.continued >= CHAT_SHARE
    if is_turn(req.turn_tokens, req.prompt_len) and (req.turn_held or chat):
        return Decision("dp", 1, f"a conversation's turn: {req.turn_tokens} of its "
                        f"{req.prompt_len} prompt tokens are an earlier prompt, kept by an "
                        f"engine's prefix cache (adaptive: {decision.reason})", turn=True)
    if chat and req.prompt_len >= MIN_TURN_TOKENS:
        return Decision("dp", 1, f"chat traffic: a later turn continued "
                        f"{traffic.continued:.0%} of the recent first prompts; this one runs "
                        f"where its next turn finds it cached (adaptive: {decision.reason})")
    return decision


def _dp_only(req: Request) -> str:
    """The reason a DP-only request runs in DP ("" if it has no such feature)."""
    return f"{req.dp_only} runs in DP" if req.dp_only else ""


def least_loaded_group(
    loads: list[EngineLoad], degree: int, num_engines: int
) -> tuple[tuple[int, ...], int]:
    """The aligned group of ``degree`` whose members hold the fewest DP requests
    (running + waiting) in ``loads``, and that count (first group on ties)."""
    per_rank = {e.rank: e.requests for e in loads}
    best: tuple[tuple[int, ...], int] | None = None
    for start in range(0, num_engines - degree + 1, degree):
        ranks = tuple(range(start, start + degree))
        n = sum(per_rank.get(r, 0) for r in ranks)
        if best is None or n < best[1]:
            best = (ranks, n)
    if best is None:
        raise ValueError(f"no TP-{degree} group on {num_engines} engines")
    return best
