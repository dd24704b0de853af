"""What a layout switch costs the requests it touches, and whether its gain repays it.

The chooser (``scheduler.layout_choice``) decides where to go; this prices getting
there. A switch takes time (``SwitchCosts``: binds, relayouts of the running requests'
KV) that delays the running requests and the arrivals during it; a switch between two
layouts with groups waits for the old groups' requests too; one that forms groups on
engines running DP leaves their requests beside the groups, interleaved with them
(``scheduler.interleave``), and waits while requests are queued. A goodput gain repays
it where the requests gained over the horizon outnumber those it delays (weighted by
the share of the TTFT SLO the switch takes) and those it puts past the TPOT SLO; a
latency gain likewise in request-milliseconds (``_latency_saved``).

Pure: no torch, no sockets; the state read is the ranking's current layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.interleave import interleave_lost
from scheduler.layout_rank import LayoutRanking
from scheduler.service import Layout, Prediction, Slo
from scheduler.traffic import Traffic


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


class SwitchCharge(LayoutRanking):
    """The ranking with the price of leaving its current layout for another."""

    def _latency_saved(self, cur: Prediction, new: Prediction, output: float) -> float:
        """Request-ms a switch for latency saves each request: the current layout's
        predicted end-to-end latency less the new one's charged ``latency_gain`` more,
        in either direction. Charging only a layout with groups (``_latency``, the
        ranking's rule) set one bar for entering a group and for leaving it, so a
        latency tie near it flipped with each evaluation's estimates: on the
        hidden-1024 model at 1.5 req/s (SGLang's benchmark, session 48) the node left
        its TP-2 group for DP six times, predicting DP from 9 % slower to 7 % faster
        than the group, and went back on goodput 0.4-37 s later, each round trip
        moving the running requests (TPOT p50 0.71-1.44x groups off by round); with
        this bar it kept the group throughout (0.70-0.86x). The bar holds a group
        whose prefills pause every running request, too: on a checkpoint of hidden
        512 at 3 req/s its ITL p95 was 0.89-1.58x groups off (docs/BENCHMARKS.md)."""
        return cur.e2e_ms(output) - new.e2e_ms(output) * (1 + self.latency_gain)

    def _waits_for_queue(self, best: Layout, queued: float) -> bool:
        """Whether a switch to ``best`` waits for the node's queue to drain: it forms
        groups on engines that run DP now while ``queued`` requests wait for room. A
        group whose members' DP requests wait hands its requests to DP at its next
        step (``flying.session.lifecycle``: DP work is never kept waiting for a group)
        and nothing joins it (``flying.session.join``), so each arrival routed to it
        would be bound, prefilled and moved: groups formed over a backlog serve
        nothing as groups until it has drained, and their moves slow the backlog.
        (Measured, hidden-768 model, cpu-burst, session 73: the node took TP-2 for
        the lull's goodput as a burst ended with 47 requests queued or running on the
        DP engines, moved 58 requests back to DP and went back to DP at the next burst:
        goodput 0.64x the better static layout, throughput 0.85; with this wait, session
        74, it held DP there in all four rounds, 32-50 requests queued, pooled 1.14x and
        1.38x.) The queue is the node's (a mixed layout's groups' waiting requests count
        too: a wait, never a wrong switch)."""
        return queued > 0 and bool(self._formed(best)[1])

    def _formed(self, best: Layout) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """The groups a switch to ``best`` forms (a group both layouts have is kept as
        it is): those on engines grouped now, and those on engines running DP now."""
        old = self.current.group_ranks()
        grouped = {r for g in old for r in g}
        formed = best.group_ranks() - old
        regrouped = [g for g in formed if grouped.intersection(g)]
        return regrouped, [g for g in formed if not grouped.intersection(g)]

    @staticmethod
    def _queue_reason(cur: Prediction, best: Layout, queued: float) -> str:
        return (f"goodput: keep {cur.layout} ({best.name} waits for the {queued:.0f} "
                "queued requests)")

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
        regrouped, on_dp_groups = self._formed(best)
        if regrouped and running and not cur.saturated:
            # Running requests move only to DP: the new groups' binds wait until the
            # old groups have finished theirs (the longest, about a whole output).
            # (Saturated: staying costs more.)
            cost_ms += output * cur.tpot_ms
        # The requests a switch delays: the running ones (not where the layout is
        # saturated: they miss their SLOs whether it switches or not) and the arrivals
        # during it.
        delayed = (0 if cur.saturated else running) + traffic.rate * cost_ms / 1000.0
        # groups formed on engines that run DP now meet those engines' running requests
        on_dp = len(on_dp_groups)
        left = self.beside(best, running, on_dp)
        lost = 0.0 if not on_dp or cur.saturated else \
            interleave_lost(cur, new, left, traffic.rate, output, slo)
        return cost_ms, delayed, lost, left
