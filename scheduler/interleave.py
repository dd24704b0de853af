"""What a switch from DP to groups costs the DP requests it leaves running beside them.

A forming group's members keep their running DP requests (those not joining the
group: ``scheduler.relayout.MAX_JOIN``) and run one DP step between group steps until
they end, so both kinds of request stream at about both TPOTs together for a while.
The chooser (``scheduler.layout_choice``) charges a switch for it: the requests it puts
past the TPOT SLO (``interleave_lost``, against a goodput gain) and the latency it adds
(``interleave_ms``, against a latency gain). Pure: numbers in, numbers out.
"""

from __future__ import annotations

from scheduler.service import TPOT_EDGE, Prediction, Slo

#: Points of the midpoint sums ``interleave_lost`` integrates over.
_POINTS = 32


def _past(tpot: float, slo: float) -> float:
    """The share of requests at a mean TPOT of ``tpot`` that miss ``slo``: the steps
    spread at least uniformly within ``TPOT_EDGE`` of the SLO about the mean
    (``scheduler.service``), so a mean just under the SLO still puts some past it."""
    edge = TPOT_EDGE * slo
    return min(1.0, max(0.0, (tpot - slo + edge) / (2.0 * edge))) if edge > 0 else \
        float(tpot > slo)


def interleave_lost(cur: Prediction, new: Prediction, running: int, rate: float,
                    output: float, slo: Slo) -> float:
    """Requests expected to miss the TPOT SLO because a switch from DP to groups is
    taken while DP requests run on the members, that would have met it undisturbed:
    the running DP requests against DP alone, the group's arrivals against the group
    alone (its predicted goodput, which the switch's gain counts).

    Until those finish, each member runs one DP step between group steps, so both kinds
    of request stream at ``cur.tpot + new.tpot`` for ``D = output / 2 x (cur.tpot +
    new.tpot)`` ms (the running ones' mean remaining output). A running DP request with
    ``r`` of its ``output`` tokens left averages ``cur + new x r / output``; a group
    request arriving ``u`` ms into ``D`` spends ``D - u`` of its undisturbed life
    ``L = output x new`` slowed, averaging ``new + cur x min(1, (D - u) / L)``. Each
    counts by how much more likely it is to miss the SLO than at its undisturbed TPOT
    (``_past``: a mean within ``TPOT_EDGE`` of the SLO misses in part), summed over
    ``r`` uniform in the output and ``u`` over the drain. The arrivals count as far as
    the group would have served them within the SLO (``new.goodput``, at most the
    ``rate``): the gain the switch is weighed by counts those, and one slowed past the
    SLO during the drain is not served within it, whether or not DP would have served
    it; only the running requests DP misses already lose nothing. (Counting the
    arrivals as far as DP would have met the SLO charged a switch from a DP past it
    nothing for them, however long the drain.) (Measured-kernel GPU profiles:
    a DP step of one or two requests costs almost a full step, so interleaving doubles
    the group's cadence: simulated on Llama-3-8B, 8 x H100, the switch at a burst's
    start put 282 requests past the SLO. And a cadence just under the SLO is not safe:
    8B on 8 H100s (first principles) at a steady 10 req/s, DP at 6.5 ms and TP-8 at
    1.8 against a 9 ms SLO, the node took TP-8 for latency six times with 16 DP requests
    beside it, each counted as losing none, and 112 requests missed the SLO where both
    static layouts served all.)"""
    both = cur.tpot_ms + new.tpot_ms
    if running <= 0 or new.tpot_ms <= 0 or cur.tpot_ms <= 0:
        return 0.0
    tpot = slo.tpot_ms
    mids = [(i + 0.5) / _POINTS for i in range(_POINTS)]
    base = _past(cur.tpot_ms, tpot)
    lost_running = sum(max(0.0, _past(cur.tpot_ms + new.tpot_ms * f, tpot) - base)
                       for f in mids) / _POINTS
    drain_ms = output / 2 * both
    life_ms = output * new.tpot_ms
    base = _past(new.tpot_ms, tpot)
    if base >= 1.0:  # the group's arrivals miss the SLO undisturbed: none to lose
        return running * lost_running
    lost_arriving = sum(
        max(0.0, _past(new.tpot_ms + cur.tpot_ms * min(1.0, (1.0 - f) * drain_ms / life_ms),
                       tpot) - base)
        for f in mids) / _POINTS / (1.0 - base)
    served = min(rate, new.goodput)  # the arrivals the gain counts, per second
    return running * lost_running + served * drain_ms / 1000.0 * lost_arriving


def interleave_ms(cur: Prediction, new: Prediction, running: int, rate: float,
                  output: float) -> float:
    """Request-milliseconds of latency a switch from DP to groups adds by interleaving
    (``interleave_lost``'s drain): each running DP request streams its remaining
    ``output / 2`` tokens (on average) one group step slower, ``new.tpot`` each; a group
    request arriving during the drain ``D = output / 2 x (cur.tpot + new.tpot)`` streams
    ``(D - u) / (cur.tpot + new.tpot)`` tokens of it one DP step slower, which averages
    ``output / 4 x cur.tpot`` over the ``rate x D`` arrivals. The predicted latency of
    the new layout is its service after the drain, so a latency gain must repay this:
    on the hidden-1024 model, TP-2 groups formed for latency beside a member's 6 and 4
    running DP requests streamed their own at a TPOT of 101-121 ms, where static DP
    served the same requests at 43-62 (cpu-three-peak, session 35)."""
    if running <= 0:  # nothing to drain
        return 0.0
    drain_ms = output / 2 * (cur.tpot_ms + new.tpot_ms)
    return (running * output / 2 * new.tpot_ms
            + rate * drain_ms / 1000.0 * output / 4 * cur.tpot_ms)
