"""The layout chooser's rules where no layout serves within SLO at the rate read, and
the dwell that holds a layout once taken (``scheduler.layout_choice`` decides the rest).

- Past saturation, or where a phase's first arrivals read the rate high, every layout
  predicts ~0 goodput at the rate read; the layouts are then compared at the first edge
  of the rate's band below it where one serves anything (``_lower_edge``) and switched
  to for a gain there as for one at the rate (``_overloaded``).
- A layout is kept at least ``DWELL_S`` once taken, unless another predicts over
  ``DWELL_BREAK`` x its goodput or it is saturated (``_dwells``).

Pure: the state is the chooser's current layout and when it was taken (``since``).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.costs import Costs
from scheduler.layout_rank import GOODPUT_TIE, band_edge, goodput_margin
from scheduler.service import Layout, Prediction, Slo
from scheduler.switch_charge import SwitchCharge, SwitchCosts
from scheduler.traffic import Traffic

#: The least time a layout is kept once taken (seconds).
DWELL_S = 5.0
#: The dwell does not hold a layout whose predicted goodput is below 1/this of the
#: best's (a choice made at light load, say, as a burst arrives).
DWELL_BREAK = 2.0
#: Where no layout serves anything within SLO at the rate read, the layouts are
#: compared this many standard errors below it, the first edge where one does
#: (``_lower_edge``); beyond three the rate read is not where the node is. Half steps:
#: the layouts' ranking moves with the rate near saturation (8B on 8 H100s, measured
#: kernels, at 50 req/s: TP-4 first one standard error below the rate read, TP-2 at
#: half of one; static TP-2 served 13.25 req/s within SLO, static TP-4 10.52).
LOWER_EDGES = (0.5, 1.0, 1.5, 2.0, 2.5, 3.0)


@dataclass(frozen=True)
class Choice:
    layout: Layout
    reason: str
    predictions: dict[str, dict]


class OverloadRules(SwitchCharge):
    """The chooser's overload and dwell rules (module docstring); ``since``: when the
    current layout was taken, kept by the chooser."""

    since: float

    def _dwells(self, now: float, cur: Prediction, new: Prediction) -> bool:
        """The current layout is held: taken under ``DWELL_S`` ago, not saturated, and
        the other does not predict over ``DWELL_BREAK`` x its goodput.

        Not a saturated one: past saturation each second in the layout that serves
        less adds to the queue every later request waits behind, and both layouts
        predict ~0 goodput there, so the goodput ratio never broke the dwell. What
        keeps a saturated node from flapping is the overload's own rule (another
        layout's throughput must be ``GOODPUT_MARGIN`` ahead, and repay the switch).
        (Hidden-768 model, cpu-burst, session 82: a group taken for latency 0.8 s
        before a burst was held 4.3 s into it, 78 requests placed in it, while DP was
        predicted to serve 50 % more; then switched to DP, as it would have been at
        the burst's first evaluation.)"""
        return (now - self.since < DWELL_S and not cur.saturated
                and new.goodput <= DWELL_BREAK * cur.goodput)

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
            rate = band_edge(traffic, -k)
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
        if self._waits_for_queue(best, queued):
            return Choice(self.current, self._queue_reason(cur, best, queued), briefs)
        cost_ms, delayed, lost, _ = self._charge(best, cur, new, running, traffic, output,
                                                 slo, switch)
        gain = new.goodput - cur.goodput
        if gain <= goodput_margin(cur.goodput, rate) or \
                not self._repays(gain, cost_ms, delayed, lost, slo):
            return Choice(self.current, f"goodput: keep {cur.layout}: {best.name} gains "
                          f"less than its margin or switch ({cost_ms:.0f} ms) {where}", briefs)
        if not self._holds_loaded(best, costs, traffic, queued, slo, gain, rate):
            return Choice(self.current, f"goodput: keep {cur.layout} ({best.name} not "
                          f"better at the costs the steps run at now) {where}", briefs)
        self.current, self.since = best, now
        return Choice(best, f"goodput: {cur.layout} -> {best.name} (goodput "
                      f"{new.goodput:.2f} vs {cur.goodput:.2f} req/s {where})", briefs)
