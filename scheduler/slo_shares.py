"""How a server's requests spread about its means: the shares within the SLOs, the gaps.

The service model (``scheduler.service``) predicts a server's means (TTFT, TPOT, the
decode step); these say what share of its requests meet each SLO about those means and
how long its inter-token tail is: the TPOT spread of the prefills a request's life
meets, the arrivals a backlog makes miss the TTFT SLO, the prefill pauses in a gap's
tail. Pure: no torch, no sockets.
"""

from __future__ import annotations

import math

#: How far (a share of the TPOT SLO) a request's TPOT varies about the mean at least:
#: uniform within it (``tpot_within``).
TPOT_EDGE = 0.1
#: The squared coefficient of variation of prompt sizes (``tpot_within``): an
#: assumption (the arrival estimate keeps the mean only); U[128, 4000], the paper
#: preset's, is 0.29.
PROMPT_CV2 = 0.3

#: The inter-token gap quantiles a layout's tail is predicted at (``gap_tails``).
TAIL_QUANTILES = (0.95, 0.99)


def gap_tails(lam: float, tpot: float, step: float, pre: float) -> tuple[float, float]:
    """Predicted p95 and p99 inter-token gap (ms) of a running request on a server that
    takes ``lam`` req/s, decodes a step in ``step`` ms (``tpot`` with prefill pauses)
    and prefills a prompt in ``pre`` ms. Every arrival's prefill pauses every running
    request of its server (SGLang runs a prefill as its own step), so a share
    ``lam * tpot`` of a request's gaps holds a prefill: a quantile well within the rest
    is a decode step, one well beyond it a step plus a prefill, and between (a share
    from 0.75 to 1.25 times the quantile's tail, where the rate's estimate and the
    arrivals' clustering decide) the pause counts in proportion. So one group
    taking every arrival has a longer tail than DP engines splitting them, at the same
    rate, even where its prefill is faster."""
    share = lam * tpot / 1000.0
    return tuple(  # type: ignore[return-value]
        step + pre * min(1.0, max(0.0, 2.0 * share / (1.0 - q) - 1.5)) for q in TAIL_QUANTILES
    )


def tpot_within(tpot: float, slo: float, lam: float, pre: float, out: float,
                 rho: float, share: float) -> float:
    """The share of a server's requests whose TPOT is within ``slo`` (ms), at a mean TPOT
    of ``tpot``. A request's TPOT is a decode step plus the prefills of the arrivals
    during its life (``life = out x tpot``) spread over its tokens; each extra prefill
    also lengthens the life it lands in, which lets more arrive (a factor
    ``1 / (1 - rho)``). Their number and sizes vary: the node's arrivals are Poisson
    and the server takes its ``share`` of them in turn (a round robin: the count's
    variance is ``share x lam x life``), each prompt's size varies (``PROMPT_CV2``), so
    the prefills' part has sd ``s = pre x sqrt(lam tpot (share + PROMPT_CV2) / (1000
    out)) / (1 - rho)``, 0 at light load. The steps vary with the batch too: at least
    as much as a uniform spread within ``TPOT_EDGE`` of the SLO about the mean (alone,
    the model's old edge: 1 below 0.9x the SLO, 0 above 1.1x). The share is the CDF at
    the SLO of that uniform spread (what ``s`` leaves of its variance) plus the normal.

    Past the SLO a layout still serves the requests that drew few prefills: simulated
    at 8 req/s on Llama-3-70B, 4 engines, static TP-2 at a TPOT p50 of 45 ms served
    17 % within a 37 ms SLO and DP at 56 ms 2 % (TPOT sd 10.2 and 10.1 ms; ``s`` 8.7
    and 7.9), and the edge alone predicted 0 for both, so the node took DP; 8B on 8
    engines of an H200 in DP at 29 req/s: TPOT sd 0.42 ms, ``s`` 0.40."""
    if tpot <= 0.0 or not math.isfinite(slo):
        return 1.0
    x = slo - tpot
    s = pre * math.sqrt(max(0.0, lam) * tpot * (share + PROMPT_CV2) / (1000.0 * out)) \
        / max(1e-6, 1.0 - rho)
    a = math.sqrt(max(0.0, (TPOT_EDGE * slo) ** 2 - 3.0 * s * s))  # uniform +-a: var a^2/3
    if s < 1e-6 * slo:  # the uniform spread alone
        return min(1.0, max(0.0, (x + a) / (2.0 * a)))
    if a < 1e-6 * slo:  # the normal alone
        return 0.5 * (1.0 + math.erf(x / (s * math.sqrt(2.0))))

    def g(z: float) -> float:  # the integral of the normal CDF up to z
        return z * 0.5 * (1.0 + math.erf(z / math.sqrt(2.0))) + \
            math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)

    return min(1.0, max(0.0, s / (2.0 * a) * (g((x + a) / s) - g((x - a) / s))))


def backlog_missed(backlog: float, slack: float, rho: float, horizon_s: float) -> float:
    """The share of the horizon's arrivals that miss the TTFT SLO behind the requests
    already waiting (``backlog`` ms of prefill) on a server that keeps up: the backlog
    drains in ``D = backlog / (1 - rho)`` ms and an arrival ``u`` ms into it waits the
    rest, ``backlog (1 - u / D)``, so those in the first ``1 - slack / backlog`` of it
    miss (``slack``: the SLO less its own prefill). (Charging the whole backlog to every
    arrival of the horizon put a group layout just formed at 0 behind the requests its
    binds had held: simulated, 8B on 8 H100s at 50 req/s, 2xTP4 -> 4xTP2 1.4 s after
    2xTP4 was taken, 23 requests waiting, 0.78x the goodput of staying.)"""
    if backlog <= 0.0:
        return 0.0
    drained = min(1.0, backlog / max(1e-6, 1.0 - rho) / (1000.0 * max(horizon_s, 1e-6)))
    return drained * min(1.0, max(0.0, 1.0 - slack / backlog))
