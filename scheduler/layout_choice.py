"""The adaptive policy's layout: the one predicted to serve the most requests within SLO.

At each decision the chooser predicts every layout's service (``scheduler.service``) at
the rate the node is about to serve (``scheduler.traffic``) with the queue it has, and
keeps or changes its layout:

- the best layout is the one with the highest predicted goodput; layouts within
  ``GOODPUT_TIE`` of it (or of the rate, where that is more) count as equal, and among equals one that keeps up with the
  rate, then the lowest predicted end-to-end latency (TTFT + output x TPOT) wins, but
  a layout with groups only where it is faster by ``latency_gain`` (the
  ``--flying-tp-gain`` margin: a group that is barely faster does not earn back
  forming it), its decode step is that much faster than one engine's, the load is
  light (``LIGHT``) and its predicted inter-token tails are no longer than DP's
  (``TAIL_TOLERANCE``); where every equal layout is saturated, the one serving the most;
- it switches only when the gain over the expected phase outlasts the switch: a
  goodput gain ``dG`` (req/s) over ``horizon_s`` seconds must exceed the requests the
  switch delays (those running, unless the current layout is saturated and they miss
  their SLOs anyway, and those arriving during it) weighted by the share of the TTFT
  SLO the switch's time takes (``switch_cost``); a latency gain likewise, in
  request-milliseconds. A switch between two layouts with groups also waits for the
  old groups to finish their requests (running requests move only to DP): about one
  output at the current TPOT, charged where anything runs. A switch from DP to groups
  while DP requests run takes them into the new groups with their KV (``joins``, up to
  ``MAX_JOIN`` a group: the switch's relayout cost); those it leaves beside the groups
  (``beside``) put some of themselves and of the groups' first requests past the TPOT
  SLO (``interleave_lost``): a goodput gain must repay them (and among the layouts that
  gain goodput, each is charged its own: ``_net_of_interleave``), a latency gain may not
  cost one and must repay the latency the interleaving adds (``interleave_ms``);
- where no layout serves anything within SLO at the rate read (past saturation, or a
  phase's first arrivals reading it high), the layouts are compared at the first edge
  of the rate's band below it, half a standard error to three, where one does
  (``_lower_edge``): what a layout serves past saturation it serves in the stream's
  lulls;
- the candidates are the uniform layouts (DP, or every engine in groups of one
  degree): a mixed one is not what the mechanism runs (``LayoutChooser.__init__``);
- hysteresis: a goodput gain must exceed ``GOODPUT_MARGIN`` of the current layout's
  goodput (and ``GOODPUT_TIE`` of the rate) across the rate estimate's uncertainty
  (at the rate, and one standard error below and above it: a Poisson stream's 30 s
  window varies by +-15 % at 1.5 req/s; at the band's edges the gain in the share
  within SLO counts, so behind one arrival a layout that meets the SLOs where the
  current one misses them wins; a gain that is not one across the band is a tie,
  which latency may decide under its own rules) and keep ``HOLD`` of itself at the
  costs the steps run at now, a
  change for latency must not lose goodput, and a layout is kept at least ``DWELL_S``
  seconds (unless another predicts over ``DWELL_BREAK`` x its goodput), so a steady
  rate near the crossover does not flap; a layout with groups is left for its tails
  alone only past ``TAIL_LEAVE`` (above the bar to enter it), at the rate and at the
  upper edge of its band (where DP's tail is longest), and only for DP;
- the layouts are evaluated at most every ``EVALUATE_S`` (requests in between take
  the current layout), with each degree's capacity cached for the costs and the
  request sizes (two significant digits), so a decision costs microseconds.

Pure and replayable: the state is the current layout and when it was taken; every
input comes in the call (and is written to the decision log by the caller).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from scheduler.costs import Costs
from scheduler.interleave import interleave_lost, interleave_ms
from scheduler.relayout import MAX_JOIN
from scheduler.service import Layout, Prediction, Slo, layouts, predict
from scheduler.traffic import Traffic

#: Goodputs this close (a share of the larger one, or of the rate where that is more:
#: layouts that all serve next to nothing within SLO tie) are a tie, decided by latency.
GOODPUT_TIE = 0.02
#: A goodput gain must be at least this share of the current layout's goodput.
GOODPUT_MARGIN = 0.05
#: A goodput gain predicted at the quiet points holds at the costs the steps run at now
#: where at least this share of it is left (``_holds_loaded``).
HOLD = 0.5
#: The least time a layout is kept once taken (seconds).
DWELL_S = 5.0
#: The dwell does not hold a layout whose predicted goodput is below 1/this of the
#: best's (a choice made at light load, say, as a burst arrives).
DWELL_BREAK = 2.0
#: How often the layouts are evaluated (seconds).
EVALUATE_S = 0.25
#: The lowest edge of the rate's uncertainty band, as a share of the rate.
MIN_BAND = 0.01
#: Light load: a rate at most this share of a layout's capacity. Only then may latency
#: pick a layout with groups over an equal goodput without them.
LIGHT = 0.5
#: Latency picks a layout with groups only where its predicted p99 inter-token gap is
#: at most this multiple of DP's (``Prediction.itl_tails_ms``).
TAIL_TOLERANCE = 1.05
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
#: A layout with groups is a switch target only where its groups' predicted decode
#: batch is at most this multiple of the largest batch their degree was measured at
#: (1: within the measured points).
REACH = 1.0
#: Where no layout serves anything within SLO at the rate read, the layouts are
#: compared this many standard errors below it, the first edge where one does
#: (``_lower_edge``); beyond three the rate read is not where the node is. Half steps:
#: the layouts' ranking moves with the rate near saturation (8B on 8 H100s, measured
#: kernels, at 50 req/s: TP-4 first one standard error below the rate read, TP-2 at
#: half of one; static TP-2 served 13.25 req/s within SLO, static TP-4 10.52).
LOWER_EDGES = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0)



def _band_edge(traffic: Traffic, k: float) -> float:
    """The rate ``k`` standard errors from the estimate (``Traffic.uncertainty``), kept
    at least ``MIN_BAND`` of it."""
    return max(MIN_BAND * traffic.rate, traffic.rate * (1.0 + k * traffic.uncertainty))


def _margin(goodput: float, rate: float) -> float:
    """The least goodput gain (req/s) over a layout serving ``goodput`` at ``rate`` that
    pays a switch: ``GOODPUT_MARGIN`` of it, and at least ``GOODPUT_TIE`` of the rate
    (where every layout serves next to nothing within SLO, a relative margin alone
    takes 1e-13 req/s over 1e-28 for a gain)."""
    return max(GOODPUT_MARGIN * goodput, GOODPUT_TIE * rate)


def _sig2(x: float) -> float:
    """``x`` to two significant digits (request sizes: the capacity cache's key)."""
    return float(f"{x:.2g}")


@dataclass(frozen=True)
class SwitchCosts:
    """What changing layout costs, as the engines measured it (defaults: this machine's
    demo-model figures in docs/BENCHMARKS.md, until a switch has been measured)."""

    bind_ms: float = 2.0  # bind -> first group step
    move_ms_per_ktok: float = 10.0  # moving running requests' KV between layouts
    #: Fixed part of one relayout, whatever its size (GPU profiles: a gather and a write
    #: per layer and buffer, launch-bound below a few thousand tokens); 0 where the
    #: per-token figure was measured whole (the live node's moves).
    move_ms: float = 0.0

    def relayout(self, tokens: float) -> float:
        """One relayout (move, join or upgrade) of ``tokens`` tokens of KV; 0 for none."""
        return self.move_ms + self.move_ms_per_ktok * tokens / 1000.0 if tokens > 0 else 0.0

    def of(self, in_flight_tokens: float) -> float:
        return self.bind_ms + self.relayout(in_flight_tokens)


@dataclass(frozen=True)
class Choice:
    layout: Layout
    reason: str
    predictions: dict[str, dict]


class LayoutChooser:
    def __init__(self, num_engines: int, degrees: tuple[int, ...], horizon_s: float,
                 latency_gain: float, engine_kv_tokens: float, joins: bool = False):
        # Uniform layouts only: the mechanism runs a mixed one as neither (DP requests
        # go to every engine, binds round robin over every group of the degree), so
        # its groups meet DP arrivals and move (docs/BENCHMARKS.md, simulated, problem 5).
        self.candidates = layouts(num_engines, degrees, mixed=False)
        self.current = self.candidates[0]  # DP until a group is shown to pay
        self.since = float("-inf")
        self.horizon_s = horizon_s
        self.latency_gain = latency_gain
        self.engine_kv_tokens = engine_kv_tokens
        self.joins = joins  # a forming group takes its members' running DP requests in
        self.num_engines = num_engines
        self._credit: dict[int, float] = {}
        #: [(points, prompt, output), {degree: capacity}] for the quiet and loaded costs
        self._quiet_caps: list = [None, {}]
        self._loaded_caps: list = [None, {}]
        self._last: Choice | None = None
        self._evaluated = float("-inf")

    def predict_all(self, costs: Costs, traffic: Traffic, queued: float, slo: Slo,
                    rate: float | None = None, loaded: bool = False) -> dict[Layout, Prediction]:
        """Every candidate's predicted service at ``rate`` (default: the traffic's), from
        the quiet costs or (``loaded``) the costs as the steps run now (``Costs.loaded``).
        Each degree's capacity is cached for the costs and sizes, the two kinds apart
        (``capacity`` reads the quiet one)."""
        prompt, output = _sig2(traffic.prompt or 128.0), _sig2(traffic.output or 128.0)
        if loaded:
            costs = costs.loaded()
        slot = self._loaded_caps if loaded else self._quiet_caps
        key = (costs.decode_ms, costs.curves, prompt, output)  # not the stretch: unread
        if slot[0] != key:
            slot[:] = [key, {}]
        caps = slot[1]
        out = {}
        for layout in self.candidates:
            p = predict(layout, costs, traffic.rate if rate is None else rate, prompt,
                        output, queued, slo, self.horizon_s, self.engine_kv_tokens, caps)
            if p is not None:
                out[layout] = p
        return out

    def beside(self, lay: Layout, running: int) -> int:
        """The running DP requests a switch from DP to ``lay`` leaves beside its groups,
        running their DP steps between the groups' until they end: all of them, or with
        ``joins`` those beyond ``MAX_JOIN`` a group (each group's members hold their
        engines' share of ``running``; the rest join it with their KV, at the switch's
        relayout cost)."""
        if not self.joins or not lay.groups:
            return running
        share = running * lay.tp_degree / self.num_engines
        return round(lay.groups * max(0.0, share - MAX_JOIN))

    def capacity(self, layout: Layout) -> float:
        """The layout's capacity (req/s) for the costs and sizes of the last prediction
        (``predict_all`` fills the per-degree cache; 0 if a degree is not in it)."""
        return sum(self._quiet_caps[1].get(d, 0.0) for d in layout.servers)

    def _robust_gain(self, best: Layout, costs: Costs, traffic: Traffic, queued: float,
                     slo: Slo) -> float:
        """The least goodput gain of ``best`` over the current layout across the rate
        estimate's one-standard-error band, at the estimated rate: at each edge of the
        band the gain in the share of requests within SLO, times the rate. (An
        absolute gain vanishes where the band reaches 0 req/s, as it does behind one
        arrival, though a layout that meets the SLOs where the other misses them is
        better at any rate; the edge is kept above 0 for that.)"""
        gains = []
        for k in (-1.0, 1.0):
            rate = _band_edge(traffic, k)
            preds = self.predict_all(costs, traffic, queued, slo, rate)
            share = (preds[best].goodput - preds[self.current].goodput) / rate
            gains.append(share * traffic.rate)
        return min(gains)

    def _holds_loaded(self, best: Layout, costs: Costs, traffic: Traffic, queued: float,
                      slo: Slo, gain: float, rate: float | None = None) -> bool:
        """Whether ``best``'s goodput gain over the current layout also holds at the
        costs as the steps run now (``Costs.loaded``: the quiet points times each mode's
        measured stretch): the quiet points are each mode's best, and under load every
        step is slower, so a gain predicted from them alone may be the model's error
        near the TPOT SLO's edge, the model's cliff (hidden-1024 model at 1.5 req/s: a
        group predicted to serve 0.11 req/s within SLO where DP served none; both
        streamed 4-5x past the SLO, the group 1.4x slower than DP; no decision log was
        kept of that run, so this check is not shown to have stopped that switch). It
        holds where at least ``HOLD`` of the ``gain`` predicted at the quiet points is
        left, and more than the margin (at ``rate``, default the traffic's). True where
        nothing is stretched."""
        loaded = costs.loaded()
        if loaded is costs:
            return True
        rate = traffic.rate if rate is None else rate
        preds = self.predict_all(loaded, traffic, queued, slo, rate, loaded=True)  # scaled once
        cur = preds[self.current].goodput
        return preds[best].goodput - cur > max(_margin(cur, rate), HOLD * gain)

    def _latency(self, lay: Layout, p: Prediction, output: float) -> float:
        """A request's predicted end-to-end latency (ms), a layout with groups charged
        ``latency_gain`` more (it must be that much faster to be worth forming)."""
        e2e = p.ttft_ms + output * p.tpot_ms
        return e2e * (1 + self.latency_gain) if lay.groups else e2e

    def _best(self, preds: dict[Layout, Prediction], output: float,
              costs: Costs | None = None, rate: float = 0.0,
              upper: dict[Layout, Prediction] | None = None) -> Layout:
        """The highest goodput; among ties a layout that keeps up with the rate before
        one that does not, then the lowest latency; where every tie is saturated (an
        overload: goodput ~0 everywhere, and the latency of a saturated layout says
        little), the one that serves the most clears its queue soonest.

        Latency picks a layout with groups only where the group's measured decode step
        is ``latency_gain`` faster than one engine's (``Costs.gain``, the rule priority
        requests follow): a group about as fast per step as one engine wins a predicted
        latency tie by its prefill alone, and then, sharing the cores with the node's
        other processes under load, streams slower than the DP engines would have
        (measured: TPOT 1.5x groups-off on the demo model at 6 req/s). And only at light
        load (the rate at most ``LIGHT`` of the layout's capacity): near saturation a
        latency tie flips with each mode's measured costs, and every flip moves the
        running requests (measured on the hidden-1024 model at 1.5 req/s: a switch every
        5-25 s, ITL p95 2x groups-off). And only where its predicted inter-token tails
        stay within ``TAIL_TOLERANCE`` of DP's: one group pauses every running request
        for each arrival's prefill, where DP engines split the arrivals (measured on the
        hidden-1024 model at 0.6 req/s: TTFT p50 0.55x DP but ITL p99 2.8x, every long
        gap another request's prefill).

        Both hold across the rate's uncertainty: ``rate`` (the light test's) is the
        upper edge of its one-standard-error band, and the tails are checked at the rate
        and at that edge (``upper``). On the hidden-1024 model a round's second arrival,
        2.7 s after its first, read 0.73 req/s, under half the group's predicted
        capacity, and the round's burst joined the group; and a group's tails grow with
        the rate twice as fast as DP's (it takes every arrival), so a rate read from a
        lull's few arrivals let latency form a group that the tail rule left once the
        rate was back (at 0.6 req/s: four round trips in a round, ITL p95 1.46x
        groups-off)."""
        top = max(p.goodput for p in preds.values())
        equal = [lay for lay, p in preds.items()
                 if p.goodput >= top - GOODPUT_TIE * max(top, rate)]
        keeping_up = [lay for lay in equal if not preds[lay].saturated]
        if not keeping_up:
            return max(equal, key=lambda lay: (preds[lay].throughput, -lay.groups))
        if costs is not None:
            fast = [lay for lay in keeping_up
                    if self._latency_may_take(lay, preds, costs, rate, upper)]
            keeping_up = fast or keeping_up
        return min(keeping_up, key=lambda lay: (self._latency(lay, preds[lay], output), lay.groups))

    def _latency_may_take(self, lay: Layout, preds: dict[Layout, Prediction], costs: Costs,
                          rate: float, upper: dict[Layout, Prediction] | None) -> bool:
        """Whether latency may pick ``lay`` over a goodput tie (``_best``'s rules): DP
        always; a layout with groups where its degree's step is ``latency_gain`` faster,
        the load light at ``rate`` and its tails within DP's at the rate and at
        ``upper``."""
        return not lay.groups or (
            (costs.gain(lay.tp_degree) or -1.0) >= self.latency_gain
            and rate <= LIGHT * self.capacity(lay)
            and not self._tails_over(lay, preds)
            and not (upper and lay in upper and self._tails_over(lay, upper)))

    def _tails_over(self, lay: Layout, preds: dict[Layout, Prediction],
                    tolerance: float = TAIL_TOLERANCE) -> bool:
        """A layout with groups whose predicted p99 gap exceeds ``tolerance`` x DP's."""
        dp = preds.get(self.candidates[0])
        return bool(lay.groups) and dp is not None and \
            preds[lay].itl_tails_ms[1] > tolerance * dp.itl_tails_ms[1]

    def choose(self, now: float, costs: Costs, traffic: Traffic, running: int, queued: int,
               slo: Slo, switch: SwitchCosts) -> Choice:
        if self._last is not None and now - self._evaluated < EVALUATE_S:
            return self._last
        self._evaluated = now
        self._last = self._choose(now, costs, traffic, running, queued, slo, switch)
        return self._last

    def _within_reach(self, lay: Layout, p: Prediction, costs: Costs) -> bool:
        """Whether ``lay`` may be switched to: the current layout and DP always; a layout
        with groups only where its groups' predicted batch is within ``REACH`` of the
        largest their degree was measured at. Beyond it the group's curve is DP's shape
        through its last point, and a few noisy start-up points decide the prediction:
        on the hidden-1024 model at 1.5 req/s, with a TP-2 curve measured to batch 4 by
        the start-up calibration, the node formed a group under load that the guess
        said kept up where two DP engines did not; its steps were no faster at the
        batches it then ran, and 11 s later it moved 17 running requests back to DP
        (0.7 s with every request stalled; ITL max 8.7 s in that round). A group
        measures larger batches as it serves them (the current layout may always
        stay), so its reach grows with the load it was shown to carry."""
        if lay == self.current or not lay.groups:
            return True
        return p.group_batch <= REACH * costs.measured_batch(lay.tp_degree)

    def _net_of_interleave(self, preds: dict[Layout, Prediction], cur: Prediction,
                           running: int, rate: float, output: float,
                           slo: Slo) -> dict[Layout, Prediction]:
        """``preds`` with each layout with groups charged, over the horizon, the requests
        its switch from DP would put past the TPOT SLO by interleaving with the DP
        requests it leaves beside its groups (``interleave_lost``). Among layouts of about
        the same goodput, one whose groups take every running request in (smaller
        groups: ``MAX_JOIN`` each) serves its first requests within SLO where a larger
        group beside them does not (simulated, Llama-3-70B on 4 H200s at a steady 4 req/s:
        1xTP4 taken over 2xTP2 beside 4 DP requests of a 37 ms step, 143 of its requests
        past a 37 ms SLO; both static layouts served all). Unchanged from groups, or
        where DP is saturated (its requests miss whether it switches or not)."""
        if self.current.groups or cur.saturated or running <= 0:
            return preds
        out = dict(preds)
        for lay, p in preds.items():
            if lay.groups:
                lost = interleave_lost(cur, p, self.beside(lay, running), rate, output, slo)
                out[lay] = replace(p, goodput=max(0.0, p.goodput - lost / self.horizon_s))
        return out

    def _lower_edge(self, reach: dict[Layout, Prediction], costs: Costs, traffic: Traffic,
                    queued: float, slo: Slo) -> tuple[float, dict[Layout, Prediction]] | None:
        """Where no layout in ``reach`` serves anything within SLO at the rate read (each
        within ``GOODPUT_TIE`` of the rate of 0): the first rate ``LOWER_EDGES``
        standard errors below it where one does, and every layout predicted there; else
        None. Past saturation every layout predicts ~0 at the rate, and the tie went to
        latency or throughput, both DP's; but the rate is an estimate (a phase's first
        arrivals read it high), and the lulls of a stream past saturation are where a
        layout serves anything: the one that serves the most below the rate read
        serves the most of it. (Simulated, 8B on 8 H200s, measured kernels, at a
        steady 50 req/s: the first 82 arrivals read 62 req/s, every layout ~0 there,
        and the node took DP where TP-2 served 35 req/s at the rate, 493 of its first
        497 requests past the SLOs against static TP-2's 186; 70B on 4 H200s at 8
        req/s: DP on a latency tie for 55 s, 0.98 req/s within SLO against static
        TP-2's 1.35.)"""
        if max(p.goodput for p in reach.values()) >= GOODPUT_TIE * traffic.rate:
            return None
        for k in LOWER_EDGES:
            rate = _band_edge(traffic, -k)
            low = {lay: p for lay, p in
                   self.predict_all(costs, traffic, queued, slo, rate).items() if lay in reach}
            if self.current not in low:
                return None
            if max(p.goodput for p in low.values()) >= GOODPUT_TIE * rate:
                return rate, low
        return None

    def _overloaded(self, now: float, edge: tuple[float, dict[Layout, Prediction]],
                    running: int, traffic: Traffic, output: float, queued: float,
                    costs: Costs, slo: Slo, switch: SwitchCosts,
                    briefs: dict[str, dict]) -> Choice:
        """The choice where no layout serves within SLO at the rate read: the one that
        serves the most at the lower ``edge`` (``_lower_edge``), switched to for a
        goodput gain there as for one at the rate (margin, dwell, at the costs the
        steps run at now too, the switch's charge)."""
        rate, low = edge
        best = max(low, key=lambda lay: (low[lay].goodput, lay == self.current))
        cur, new = low[self.current], low[best]
        where = f"at {rate:.1f} req/s, none within SLO at {traffic.rate:.1f}"
        if best == self.current:
            return Choice(self.current, f"goodput: {cur.layout} predicted best {where}", briefs)
        if self._dwells(now, cur, new):
            return Choice(self.current, f"goodput: keep {cur.layout} (dwell)", briefs)
        cost_ms, delayed, lost, _ = self._charge(best, cur, new, running, traffic, output,
                                                 slo, switch)
        gain = new.goodput - cur.goodput
        if gain <= _margin(cur.goodput, rate) or \
                not self._repays(gain, cost_ms, delayed, lost, slo):
            return Choice(self.current, f"goodput: keep {cur.layout}: {best.name} gains "
                          f"less than its margin or switch ({cost_ms:.0f} ms) {where}", briefs)
        if not self._holds_loaded(best, costs, traffic, queued, slo, gain, rate):
            return Choice(self.current, f"goodput: keep {cur.layout} ({best.name} not "
                          f"better at the costs the steps run at now) {where}", briefs)
        self.current, self.since = best, now
        return Choice(best, f"goodput: {cur.layout} -> {best.name} (goodput "
                      f"{new.goodput:.2f} vs {cur.goodput:.2f} req/s {where})", briefs)

    def _dwells(self, now: float, cur: Prediction, new: Prediction) -> bool:
        """The current layout is held: taken under ``DWELL_S`` ago, and the other does
        not predict over ``DWELL_BREAK`` x its goodput."""
        return now - self.since < DWELL_S and new.goodput <= DWELL_BREAK * cur.goodput

    def _repays(self, gain: float, cost_ms: float, delayed: float, lost: float,
                slo: Slo) -> bool:
        """Whether ``gain`` req/s over the horizon outlasts a switch of ``cost_ms`` that
        delays ``delayed`` requests (each charged the share of the TTFT SLO the switch
        takes) and puts ``lost`` past the TPOT SLO (``_charge``)."""
        return gain * self.horizon_s > delayed * min(1.0, cost_ms / slo.ttft_ms) + lost

    def _charge(self, best: Layout, cur: Prediction, new: Prediction, running: int,
                traffic: Traffic, output: float, slo: Slo,
                switch: SwitchCosts) -> tuple[float, float, float, int]:
        """What a switch from the current layout to ``best`` costs: its time (ms), the
        requests it delays, those its interleaving puts past the TPOT SLO, and the
        running DP requests it leaves beside its groups (the rest join them)."""
        cost_ms = switch.of(running * ((traffic.prompt or 128.0) + output / 2))
        if self.current.groups and best.groups and running and not cur.saturated:
            # Running requests move only to DP: the new groups' binds wait until the
            # old groups have finished theirs (the longest, about a whole output).
            # (Saturated: staying costs more.)
            cost_ms += output * cur.tpot_ms
        # The requests a switch delays: the running ones (not where the layout is
        # saturated: they miss their SLOs whether it switches or not) and the arrivals
        # during it.
        delayed = (0 if cur.saturated else running) + traffic.rate * cost_ms / 1000.0
        left = self.beside(best, running)
        lost = 0.0 if self.current.groups or not best.groups or cur.saturated else \
            interleave_lost(cur, new, left, traffic.rate, output, slo)
        return cost_ms, delayed, lost, left

    def _choose(self, now: float, costs: Costs, traffic: Traffic, running: int, queued: int,
                slo: Slo, switch: SwitchCosts) -> Choice:
        preds = self.predict_all(costs, traffic, queued, slo)
        briefs = {lay.name: p.brief() for lay, p in preds.items()}
        if self.current not in preds:  # the current layout cannot be predicted: DP
            self.current, self.since = self.candidates[0], now
            return Choice(self.current, "goodput: a mode is unmeasured; DP", briefs)
        output = traffic.output or 128.0
        reach = {lay: p for lay, p in preds.items() if self._within_reach(lay, p, costs)}
        edge = self._lower_edge(reach, costs, traffic, queued, slo)
        if edge is not None:
            return self._overloaded(now, edge, running, traffic, output, queued, costs, slo,
                                    switch, briefs)
        # A latency bet holds across the rate's band: light load and tails are checked
        # at its upper edge too (one arrival's rate is the 1 s floor, not an estimate);
        # so is leaving a group for its tails.
        upper, top = None, traffic.rate
        if traffic.behind >= 2 and any(lay.groups for lay in reach):
            top = _band_edge(traffic, 1.0)
            upper = self.predict_all(costs, traffic, queued, slo, top)
        cur = preds[self.current]
        best = self._best(reach, output, costs, top, upper)
        top_goodput = preds[best].goodput
        if top_goodput - cur.goodput > GOODPUT_TIE * max(top_goodput, cur.goodput, traffic.rate):
            # for goodput: of the layouts that gain it, one that leaves no DP request
            # beside its groups
            best = self._best(self._net_of_interleave(reach, cur, running, traffic.rate,
                                                      output, slo),
                              output, costs, top, upper)
        new = preds[best]
        if best == self.current:
            return Choice(self.current, f"goodput: {cur.layout} predicted best", briefs)
        if self._dwells(now, cur, new):
            return Choice(self.current, f"goodput: keep {cur.layout} (dwell)", briefs)
        regroup = bool(self.current.groups and best.groups)
        cost_ms, delayed, lost, left = self._charge(best, cur, new, running, traffic, output,
                                                    slo, switch)
        gain = new.goodput - cur.goodput
        tie = abs(gain) <= GOODPUT_TIE * max(new.goodput, cur.goodput, traffic.rate)
        margin = _margin(cur.goodput, traffic.rate)
        if not tie and gain > margin:
            gain = self._robust_gain(best, costs, traffic, queued, slo)
            if gain <= margin:  # a tie somewhere in the band
                if cur.saturated or new.saturated or regroup or not (
                        self._latency_may_take(best, reach, costs, top, upper)
                        and self._latency(best, new, output)
                        < self._latency(self.current, cur, output)):
                    return Choice(self.current, f"goodput: keep {cur.layout} ({best.name} "
                                  "not better across the rate's uncertainty)", briefs)
                tie = True  # latency may decide it, as any tie
        if not tie and gain > margin:
            if not self._holds_loaded(best, costs, traffic, queued, slo, gain):
                return Choice(self.current, f"goodput: keep {cur.layout} ({best.name} not "
                              "better at the costs the steps run at now)", briefs)
            worth = self._repays(gain, cost_ms, delayed, lost, slo)
            kind = f"goodput {new.goodput:.2f} vs {cur.goodput:.2f} req/s"
        elif (tie and not (cur.saturated or new.saturated)  # light load: its gaps decide
              and not regroup and traffic.behind >= TAIL_MIN_ARRIVALS
              and traffic.rate <= LIGHT * self.capacity(self.current)
              and self._tails_over(self.current, preds, TAIL_LEAVE)
              and not (upper and not self._tails_over(self.current, upper, TAIL_LEAVE))):
            # each request of the horizon is spared at least one such gap; the switch
            # (moves to DP) delays what it delays
            spared = cur.itl_tails_ms[1] - preds[self.candidates[0]].itl_tails_ms[1]
            worth = spared * traffic.rate * self.horizon_s > delayed * cost_ms
            kind = (f"ITL p99 {cur.itl_tails_ms[1]:.0f} vs "
                    f"{preds[self.candidates[0]].itl_tails_ms[1]:.0f} ms in DP")
        elif not tie or new.goodput < cur.goodput:  # not for less goodput
            return Choice(self.current, f"goodput: keep {cur.layout} (within "
                          f"{GOODPUT_MARGIN:.0%} of {best.name})", briefs)
        elif cur.saturated and new.saturated:  # an overload: decided by what each serves
            extra = (new.throughput - cur.throughput) / output  # req/s
            if extra <= GOODPUT_MARGIN * cur.throughput / output:
                return Choice(self.current, f"goodput: keep {cur.layout} (saturated, "
                              f"within {GOODPUT_MARGIN:.0%} of {best.name}'s throughput)", briefs)
            worth = self._repays(extra, cost_ms, delayed, lost, slo)
            kind = f"throughput {new.throughput:.0f} vs {cur.throughput:.0f} tok/s, both saturated"
        else:  # a tie on goodput, decided by latency
            saved = self._latency(self.current, cur, output) - self._latency(best, new, output)
            # not for a request's SLO (expected): a latency gain must not cost goodput,
            # and must repay what interleaving with the running DP requests adds
            drag = 0.0 if self.current.groups or not best.groups else \
                interleave_ms(cur, new, left, traffic.rate, output)
            worth = lost < 1.0 and \
                saved * traffic.rate * self.horizon_s > delayed * cost_ms + drag
            kind = f"latency {new.ttft_ms + output * new.tpot_ms:.0f} vs " \
                   f"{cur.ttft_ms + output * cur.tpot_ms:.0f} ms"
        if not worth:
            return Choice(self.current, f"goodput: keep {cur.layout}: {best.name} gains "
                          f"less than its switch ({cost_ms:.0f} ms)", briefs)
        self.current, self.since = best, now
        return Choice(best, f"goodput: {cur.layout} -> {best.name} ({kind})", briefs)

    def route(self) -> int:
        """The degree the next request runs at under the current layout: every request
        in a group where all engines are grouped, none where none are; in a mixed
        layout, groups and DP engines take requests in proportion to their number of
        servers (smooth weighted round robin: deterministic, so replayable)."""
        counts: dict[int, int] = {}
        for d in self.current.servers:
            counts[d] = counts.get(d, 0) + 1
        if len(counts) == 1:
            return next(iter(counts))
        total = sum(counts.values())
        for d, n in counts.items():
            self._credit[d] = self._credit.get(d, 0.0) + n
        pick = max(counts, key=lambda d: (self._credit[d], d))
        self._credit[pick] -= total
        return pick
