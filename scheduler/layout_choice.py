"""The adaptive policy's layout: the one predicted to serve the most requests within SLO.

At each decision the chooser predicts every layout's service (``scheduler.service``) at
the rate the node is about to serve (``scheduler.traffic``) with the queue it has, and
keeps or changes its layout:

- the best layout is the ranking's (``scheduler.layout_rank``: the highest predicted
  goodput, latency among equals under its rules, only layouts within reach);
- it switches only when the gain over the expected phase outlasts the switch (its
  price: ``scheduler.switch_charge``): a goodput gain ``dG`` (req/s) over
  ``horizon_s`` seconds must exceed the requests the switch delays (those running,
  unless the current layout is saturated and they miss their SLOs anyway, and those
  arriving during it) weighted by the share of the TTFT SLO the switch's time takes
  (``SwitchCosts``); a latency gain likewise, in request-milliseconds. A switch
  between two layouts with groups also waits for the old groups to finish their
  requests (running requests move only to DP): about one output at the current TPOT,
  charged where anything runs. A switch that forms groups on engines running DP waits
  while requests are queued (``_waits_for_queue``: such a group hands its requests to
  DP at once). A switch from DP to groups while DP requests run takes them into the
  new groups with their KV (``joins``, up to ``MAX_JOIN`` a group: the switch's
  relayout cost); those it leaves beside the groups (``beside``) put some of
  themselves and of the groups' first requests past the TPOT SLO
  (``interleave_lost``): a goodput gain must repay them (and among the layouts that
  gain goodput, each is charged its own: ``_net_of_interleave``), a latency gain may
  not cost one and must repay the latency the interleaving adds (``interleave_ms``);
- where no layout serves anything within SLO at the rate read (past saturation, or a
  phase's first arrivals reading it high), the layouts are compared at the first edge
  of the rate's band below it, half a standard error to three, where one does
  (``_lower_edge``, with the dwell in ``scheduler.overload``): what a layout serves
  past saturation it serves in the stream's lulls; where the current layout and the best are both saturated (goodput ~0), the
  one that serves the most output clears the queue soonest, read at the quiet points
  and at the costs the steps run at now (``_as_run``, ``_served``: a gain at one of
  the two, a loss beyond the margin at neither; a group not the margin ahead of DP at
  either is left, ``_group_unpaid``);
- hysteresis: a goodput gain must exceed ``GOODPUT_MARGIN`` of the current layout's
  goodput (and ``GOODPUT_TIE`` of the rate) across the rate estimate's uncertainty (at
  the band's edges the gain in the share within SLO counts, so behind one arrival a
  layout that meets the SLOs where the current one misses them wins; a gain that is
  not one across the band, or short of the margin at the rate, is a tie, which
  latency may decide under its own rules) and
  keep ``HOLD`` of itself at the costs the steps run at now; a change for latency must
  not lose goodput and must be ``latency_gain`` faster than the current layout, into
  groups or out of them (``_latency_saved``), and a layout is kept at least
  ``DWELL_S`` seconds (unless another predicts over ``DWELL_BREAK`` x its goodput, or
  it is saturated: then the overload's throughput rule decides), so a steady rate near
  the crossover does not flap; a layout with groups is left for its
  tails alone only past ``TAIL_LEAVE`` (above the bar to enter it), at the rate and at
  the upper edge of its band (where DP's tail is longest), and only for DP; it is left
  for DP too where its groups stream slower than DP engines at the costs the steps ran
  at (``_streams_slower``), seen at evaluations ``SLOW_FOR_S`` apart;
- the layouts are evaluated at most every ``EVALUATE_S`` or ``EVALUATE_ARRIVALS``
  arrivals, whichever comes first (requests in between take the current layout); with
  the ranking's capacity cache a decision costs microseconds.

Pure and replayable: the state is the current layout and when it was taken; every
input comes in the call (and is written to the decision log by the caller).
"""

from __future__ import annotations

from scheduler.costs import Costs
from scheduler.interleave import interleave_ms
from scheduler.layout_rank import (
    GOODPUT_MARGIN,
    GOODPUT_TIE,
    LIGHT,
    band_edge,
    goodput_margin,
)
from scheduler.overload import (  # noqa: F401 - Choice, DWELL_S: re-exported
    DWELL_S,
    Choice,
    OverloadRules,
)
from scheduler.service import Layout, Prediction, Slo
from scheduler.switch_charge import SwitchCosts  # noqa: F401 - re-exported
from scheduler.traffic import Traffic

#: How often the layouts are evaluated (seconds) ...
EVALUATE_S = 0.25
#: ... or after this many arrivals since the last evaluation, if sooner: a clump of
#: arrivals within milliseconds was otherwise placed whole by a choice made before it
#: (Azure code trace, hidden-1024 model, session 76: ~19 requests in the group within
#: one interval, then a switch to DP that moved them).
EVALUATE_ARRIVALS = 4
#: A layout with groups is left for its tails alone only where its predicted p99 gap
#: exceeds this multiple of DP's: above ``TAIL_TOLERANCE`` (the bar to enter it), so a
#: layout near the bar is neither entered nor left on each evaluation's noise. (DP's
#: p99 sits where ~1 % of its gaps hold a prefill and moves with the rate's estimate:
#: 8B on 8 H100s at 10 req/s read it 6-18 ms, and over the rate alone 1xTP8 was left
#: and taken back every 10-30 s.)
TAIL_LEAVE = 1.25
#: The tails rule acts on a rate seen from at least this many arrivals: a new phase
#: starts from a few (``scheduler.traffic``), and a low rate read from 4 of them sent
#: a loaded group layout to DP and back (simulated, Llama-3-70B at a steady 4 req/s:
#: a round trip every 1-3 minutes, each one moves and interleaved steps).
TAIL_MIN_ARRIVALS = 10
#: A layout with groups is left for DP where, at the costs each mode's steps ran at
#: when it last served (``Costs.lately``), its groups are predicted to stream this much
#: slower than DP engines (TPOT) for no goodput gain; it is entered for latency only
#: where they are predicted to stream no slower (``_streams_slower``).
TPOT_LEAVE = 0.05
#: ... and only where that held at two evaluations this far apart (seconds): a
#: group's steps for one request after an idle spell can run 1.4x its curve (session
#: 58, three-peak, hidden 512: the quiet phase's first request after a burst; the first
#: quiet phase's ran at its curve), and the memory of it kept the node out of the group
#: for the rest of the trace, where static TP served every phase better than static DP.
SLOW_FOR_S = 5.0


class LayoutChooser(OverloadRules):
    """The adaptive policy's layout over time: the ranking's best, switched to where
    the switch pays (module docstring; the price of a switch: ``SwitchCharge``)."""

    def __init__(self, num_engines: int, degrees: tuple[int, ...], horizon_s: float,
                 latency_gain: float, engine_kv_tokens: float, joins: bool = False,
                 mixed: bool = False, prefill_tokens: float = 0.0):
        super().__init__(num_engines, degrees, horizon_s, latency_gain, engine_kv_tokens,
                         joins, mixed, prefill_tokens)
        self.since = float("-inf")
        self._credit: dict[int, float] = {}
        self._last: Choice | None = None
        self._evaluated = float("-inf")
        self._since_evaluated = 0  # arrivals (calls) since the last evaluation
        self._slow_since: float | None = None  # the groups first seen streaming slower

    def choose(self, now: float, costs: Costs, traffic: Traffic, running: int, queued: int,
               slo: Slo, switch: SwitchCosts) -> Choice:
        self._since_evaluated += 1
        if self._last is not None and now - self._evaluated < EVALUATE_S and \
                self._since_evaluated < EVALUATE_ARRIVALS:
            return self._last
        self._evaluated, self._since_evaluated = now, 0
        self._last = self._choose(now, costs, traffic, running, queued, slo, switch)
        return self._last

    def _tails_to_leave(self, preds: dict[Layout, Prediction],
                        upper: dict[Layout, Prediction] | None,
                        traffic: Traffic) -> bool:
        """Whether the current layout's groups are left for their tails: their p99 gap
        over ``TAIL_LEAVE`` x DP's at the rate and at the upper edge of its band, from
        ``TAIL_MIN_ARRIVALS`` arrivals on. Not at the band's lower edge, which entering
        a group for latency checks (``_best``): a rate rising into a burst, read from a
        few arrivals, has a lower edge from before the burst, where a group's p99 gap
        holds a prefill and DP's not yet; leaving there (session 57, three-peak) took a
        checkpoint of hidden 512 out of the group its bursts were better served in
        (goodput 0.81x static TP), and the hidden-1024 model out of the group its first
        quiet phase's first tokens came 2x sooner in."""
        return traffic.behind >= TAIL_MIN_ARRIVALS and \
            self._tails_over(self.current, preds, TAIL_LEAVE) and \
            not (upper and not self._tails_over(self.current, upper, TAIL_LEAVE))

    def _leave_slow(self, now: float, costs: Costs, traffic: Traffic, queued: float,
                    slo: Slo, quiet: dict[Layout, Prediction],
                    briefs: dict[str, dict]) -> Choice | None:
        """The current layout with groups, serving now (its degree's stretch measured
        lately) and past its dwell, left for DP where its groups stream slower
        (``_streams_slower`` by ``TPOT_LEAVE``) and the quiet costs (``quiet``) do not
        put it ahead on goodput either, both at evaluations ``SLOW_FOR_S`` apart since
        the layout was taken and at each one between that compared the layouts at the
        rate read; None to decide as usual. Running group requests
        move to DP, as for the tails rule.

        Near a layout's capacity the predictions at stretched costs fall off a cliff (a
        group's decode batch read at 2.1 instead of 1.0 from a 17 % stretch: TPOT 40
        against 18 ms); in the hidden-1024 model's bursts, where the quiet costs put
        the group 30 % ahead on goodput, the rule without the quiet check left a group
        that served the bursts better than DP engines (session 57, three-peak)."""
        dp = self.candidates[0]
        if not self.current.groups or self.current.tp_degree not in costs.stretch or \
                now - self.since < DWELL_S or self.current not in quiet or dp not in quiet or \
                quiet[self.current].goodput - quiet[dp].goodput > \
                goodput_margin(quiet[dp].goodput, traffic.rate) or \
                not self._streams_slower(self.current, costs, traffic, queued, slo, TPOT_LEAVE):
            self._slow_since = None
            return None
        if self._slow_since is None or self._slow_since < self.since:  # not this layout's
            self._slow_since = now
        if now - self._slow_since < SLOW_FOR_S:
            return None
        self._slow_since = None
        old, self.current, self.since = self.current, self.candidates[0], now
        return Choice(self.current, f"goodput: {old.name} -> {self.current.name} (its groups stream "
                      "slower than DP at the costs the steps run at now)", briefs)

    def _briefs(self, preds: dict[Layout, Prediction], costs: Costs, traffic: Traffic,
                queued: float, slo: Slo) -> dict[str, dict]:
        """What the decision log records of ``preds`` (at the quiet points), each with,
        where a mode's steps are stretched, its ``loaded`` goodput, TTFT and TPOT: the
        same model at the costs each mode's steps ran at when it last served
        (``Costs.lately``, as ``_holds_loaded`` reads them). The quiet points are each
        mode's best, so the first is an upper bound of what the layout serves on a
        shared machine; the second stretches every step, the batches' growth included,
        and reads low at light load (hidden-1024 model, Poisson 0.75-2.6 req/s, session
        75's six runs replayed from their logs: the measured goodput between the two in
        four, the quiet prediction 18-495 % off, this one 25-99 %)."""
        briefs = {lay.name: p.brief() for lay, p in preds.items()}
        lately = costs.lately()
        if lately.loaded() is lately:
            return briefs
        for lay, p in self.predict_all(lately, traffic, queued, slo, loaded=True).items():
            if lay.name in briefs:
                briefs[lay.name]["loaded"] = {"goodput": round(p.goodput, 3),
                                              "ttft_ms": round(p.ttft_ms, 1),
                                              "tpot_ms": round(p.tpot_ms, 2)}
        return briefs

    def _choose(self, now: float, costs: Costs, traffic: Traffic, running: int, queued: int,
                slo: Slo, switch: SwitchCosts) -> Choice:
        preds = self.predict_all(costs, traffic, queued, slo)
        briefs = self._briefs(preds, costs, traffic, queued, slo)
        if self.current not in preds:  # the current layout cannot be predicted: DP
            self.current, self.since = self.candidates[0], now
            return Choice(self.current, "goodput: a mode is unmeasured; DP", briefs)
        output = traffic.output or 128.0
        reach = {lay: p for lay, p in preds.items() if self._within_reach(lay, p, costs)}
        edge = self._lower_edge(reach, costs, traffic, queued, slo)
        if edge is not None:
            return self._overloaded(now, edge, running, traffic, output, queued, costs, slo,
                                    switch, briefs)
        leave = self._leave_slow(now, costs, traffic, queued, slo, preds, briefs)
        if leave is not None:
            return leave
        # A latency bet holds across the rate's band: light load and tails are checked
        # at its upper edge too (one arrival's rate is the 1 s floor, not an estimate),
        # the tails at its lower edge as well; leaving a group for its tails at the
        # rate and the upper edge (``_tails_to_leave``).
        upper, lower, top = None, None, traffic.rate
        if traffic.behind >= 2 and any(lay.groups for lay in reach):
            top = band_edge(traffic, 1.0)
            upper = self.predict_all(costs, traffic, queued, slo, top)
            lower = self.predict_all(costs, traffic, queued, slo, band_edge(traffic, -1.0))
        edges = [e for e in (upper, lower) if e]
        cur = preds[self.current]
        best = self._best(reach, output, costs, top, edges)
        top_goodput = preds[best].goodput
        if top_goodput - cur.goodput > GOODPUT_TIE * max(top_goodput, cur.goodput, traffic.rate):
            # for goodput: of the layouts that gain it, one that leaves no DP request
            # beside its groups
            best = self._best(self._net_of_interleave(reach, cur, running, traffic.rate,
                                                      output, slo),
                              output, costs, top, edges)
        best = self._as_run(best, reach, costs, traffic, queued, slo)
        best = self._dp_unless_paid(best, reach, costs, traffic, queued, slo)
        new = preds[best]
        if best == self.current:
            return Choice(self.current, f"goodput: {cur.layout} predicted best", briefs)
        if self._dwells(now, cur, new):
            return Choice(self.current, f"goodput: keep {cur.layout} (dwell)", briefs)
        if self._waits_for_queue(best, queued):
            return Choice(self.current, self._queue_reason(cur, best, queued), briefs)
        regroup = bool(self.current.groups and best.groups)
        cost_ms, delayed, lost, left = self._charge(best, cur, new, running, traffic, output,
                                                    slo, switch)
        gain = new.goodput - cur.goodput
        tie = abs(gain) <= GOODPUT_TIE * max(new.goodput, cur.goodput, traffic.rate)
        margin = goodput_margin(cur.goodput, traffic.rate)
        # A gain short of the margin, across the rate's band or at the rate itself, is
        # no goodput switch but no loss either: latency may decide it, as any tie. (A
        # gain past the tie and short of the margin kept the layout whatever its
        # latency: the h1024 Azure replay's first 6 s in DP, TP-2 predicted 2 % more
        # goodput and 30 % less TTFT and TPOT, session 83.)
        short = ""
        if not tie and gain > margin:
            gain = self._robust_gain(best, costs, traffic, queued, slo)
            short = "not better across the rate's uncertainty" if gain <= margin else ""
        elif not tie and gain > 0:
            short = f"within {GOODPUT_MARGIN:.0%} of it"
        if short:
            if cur.saturated or new.saturated or regroup or not (
                    self._latency_may_take(best, reach, costs, top, edges)
                    and self._latency_saved(cur, new, output) > 0):
                return Choice(self.current, f"goodput: keep {cur.layout} ({best.name} "
                              f"{short})", briefs)
            tie = True
        if not tie and gain > margin:
            if not self._holds_loaded(best, costs, traffic, queued, slo, gain):
                return Choice(self.current, f"goodput: keep {cur.layout} ({best.name} not "
                              "better at the costs the steps run at now)", briefs)
            worth = self._repays(gain, cost_ms, delayed, lost, slo)
            kind = f"goodput {new.goodput:.2f} vs {cur.goodput:.2f} req/s"
        elif (tie and not (cur.saturated or new.saturated)  # light load: its gaps decide
              and not regroup and traffic.rate <= LIGHT * self.capacity(self.current)
              and self._tails_to_leave(preds, upper, traffic)):
            # each request of the horizon is spared at least one such gap; the switch
            # (moves to DP) delays what it delays
            mine, dp = preds[self.current].itl_tails_ms[1], preds[self.candidates[0]].itl_tails_ms[1]
            worth = (mine - dp) * traffic.rate * self.horizon_s > delayed * cost_ms
            kind = f"ITL p99 {mine:.0f} vs {dp:.0f} ms in DP"
        elif not tie or new.goodput < cur.goodput:  # not for less goodput
            return Choice(self.current, f"goodput: keep {cur.layout} (within "
                          f"{GOODPUT_MARGIN:.0%} of {best.name})", briefs)
        elif cur.saturated and new.saturated:  # an overload: decided by what each serves
            share, mine, theirs, least = self._served(best, preds, costs, traffic, queued, slo)
            extra = (theirs - mine) / output  # req/s
            unpaid = share <= GOODPUT_MARGIN and self._group_unpaid(best, least)
            if share <= GOODPUT_MARGIN and not unpaid:
                return Choice(self.current, f"goodput: keep {cur.layout} (saturated, "
                              f"within {GOODPUT_MARGIN:.0%} of {best.name}'s throughput)", briefs)
            worth = unpaid or self._repays(extra, cost_ms, delayed, lost, slo)
            kind = f"throughput {theirs:.0f} vs {mine:.0f} tok/s, both saturated" + \
                (f", the group not {GOODPUT_MARGIN:.0%} ahead at either cost" if unpaid else "")
        else:  # a tie on goodput, decided by latency
            saved = self._latency_saved(cur, new, output)
            if saved <= 0:
                return Choice(self.current, f"goodput: keep {cur.layout} ({best.name} not "
                              f"{self.latency_gain:.0%} faster end to end)", briefs)
            if best.groups and not self.current.groups and \
                    self._streams_slower(best, costs, traffic, queued, slo, 0.0):
                return Choice(self.current, f"goodput: keep {cur.layout} ({best.name} "
                              "streams slower at the costs the steps run at now)", briefs)
            # not for a request's SLO (expected): a latency gain must not cost goodput,
            # and must repay what interleaving with the running DP requests adds
            drag = 0.0 if self.current.groups or not best.groups else \
                interleave_ms(cur, new, left, traffic.rate, output)
            worth = lost < 1.0 and \
                saved * traffic.rate * self.horizon_s > delayed * cost_ms + drag
            kind = f"latency {new.e2e_ms(output):.0f} vs {cur.e2e_ms(output):.0f} ms"
        if not worth:
            return Choice(self.current, f"goodput: keep {cur.layout}: {best.name} gains "
                          f"less than its switch ({cost_ms:.0f} ms)", briefs)
        self.current, self.since = best, now
        return Choice(best, f"goodput: {cur.layout} -> {best.name} ({kind})", briefs)

    def route(self) -> int:
        """The degree the next request runs at under the current layout: every request
        in a group where all engines are grouped, none where none are; in a mixed
        layout, groups and DP engines take requests in proportion to their capacity, as
        ``predict`` spreads the rate over them (their number of servers where a
        capacity is not known yet; smooth weighted round robin: deterministic, so
        replayable)."""
        counts: dict[int, int] = {}
        for d in self.current.servers:
            counts[d] = counts.get(d, 0) + 1
        if len(counts) == 1:
            return next(iter(counts))
        caps = self._quiet_caps[1]
        known = all(caps.get(d, 0.0) > 0 for d in counts)
        weights = {d: n * caps[d] if known else float(n) for d, n in counts.items()}
        total = sum(weights.values())
        for d, w in weights.items():
            self._credit[d] = self._credit.get(d, 0.0) + w / total
        pick = max(counts, key=lambda d: (self._credit[d], d))
        self._credit[pick] -= 1.0
        return pick
