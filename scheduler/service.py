"""A small model of a layout's service: predicted TTFT, TPOT, output rate and goodput.

A *layout* splits the node's engines into servers: TP groups of some degree and single
engines (DP). Each server is SGLang's continuous batching on its own KV; arrivals are
spread over the servers in proportion to what each can serve. Per server, at arrival
rate ``lam`` (req/s) of requests with ``P`` prompt and ``O`` output tokens:

- prefill: SGLang runs an extend step for new requests before the next decode step,
  so prefills take ``rho = lam * prefill(P)`` of the server's time and queue among
  themselves (M/D/1: mean wait ``rho * S / (2 (1 - rho))``);
- decode: ``L = lam * O * TPOT`` requests decode at once on average (Little's law),
  with ``TPOT = decode(B) / (1 - rho)`` (prefill steps stretch the gaps between
  tokens), and a request steps in a batch of itself and the others, ``B = 1 + L``
  (Poisson arrivals see the time average); the smallest fixed point, found by
  iteration from ``B = 1``, at most ``B_max`` (the KV the server holds). ``L`` past
  ``B_max`` there means the server is saturated;
- TTFT: the rest of the step in flight, the prefill queue and the waiting requests
  already at the node, then its own prefill;
- within SLO: ``P(TTFT <= slo)`` with an exponential queueing tail (M/M/1 shape:
  ``P(wait > t) = rho exp(-(1 - rho) t / S)``), less the arrivals that wait behind the
  requests already waiting until those have drained (``backlog_missed``), times the
  share of requests whose TPOT is within its SLO (``tpot_within``: the number of
  prefills a request's life meets varies, so a layout past the TPOT SLO on average
  still serves some within it);
- saturated (``lam`` above the capacity ``mu``): the queue grows for the whole phase
  (``horizon_s``); requests meet the TTFT SLO only while the queue's wait is below it,
  i.e. those arriving in the first ``t* = slack * mu / (lam - mu)`` seconds. A deep
  queue is prefilled in SGLang's extend steps of up to ``prefill_tokens`` (its chunked
  prefill size), not one prompt at a time: the capacity, a saturated server's service
  and, at any rate, the requests already waiting price a prompt at its share of such
  a step (``queue_prefill``).

Goodput is requests per second that meet both SLOs (SGLang's benchmark definition).
The model is small on purpose: its inputs are the measured cost curves
(``scheduler.costs``) and the arrival estimate (``scheduler.traffic``), its error
against measured runs is reported in docs/BENCHMARKS.md. Pure: no torch, no sockets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler.costs import Costs
from scheduler.slo_shares import (  # noqa: F401 - TPOT_EDGE, gap_tails: re-exported
    TPOT_EDGE,
    backlog_missed,
    gap_tails,
    tpot_within,
)

#: Fixed-point iterations for the decode batch (converges in a few where it exists).
ITERATIONS = 60
#: Requests a server may run at once beyond what its KV holds (SGLang's own cap on
#: running requests; a KV bound is usually tighter).
MAX_RUNNING = 256
#: The capacity (req/s) of a server whose steps cost nothing measurable.
MAX_RATE = 1e6


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True)
class Layout:
    """Servers by degree, largest first: (2,) is one TP-2 group, (1, 1) DP on two
    engines, (2, 1, 1) a TP-2 group beside two DP engines."""

    servers: tuple[int, ...]

    @property
    def name(self) -> str:
        parts = []
        for degree in sorted(set(self.servers), reverse=True):
            n = self.servers.count(degree)
            parts.append(f"{n}xDP" if degree == 1 else f"{n}xTP{degree}")
        return "+".join(parts)

    @property
    def tp_degree(self) -> int:
        """The degree of this layout's groups (1: none)."""
        return max(self.servers)

    @property
    def groups(self) -> int:
        return sum(1 for d in self.servers if d > 1)

    @property
    def mixed(self) -> bool:
        """Groups beside DP engines."""
        return self.groups > 0 and 1 in self.servers

    def placement(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(the engines of its groups, its DP engines): the groups on the lowest aligned
        ranks (k groups of degree m: engines 0 .. k*m - 1), the DP engines after them.
        Fixed per layout, so a switch between two mixed layouts of one degree keeps the
        groups both share."""
        grouped = sum(d for d in self.servers if d > 1)
        return tuple(range(grouped)), tuple(range(grouped, grouped + self.servers.count(1)))

    def group_ranks(self) -> frozenset[tuple[int, ...]]:
        """Each of its groups' engines (``placement``): 1xTP2+2xDP's is {(0, 1)}."""
        grouped, m = self.placement()[0], self.tp_degree
        return frozenset(grouped[i:i + m] for i in range(0, len(grouped), m))


def layouts(num_engines: int, degrees: tuple[int, ...], mixed: bool = True) -> list[Layout]:
    """DP, every degree's all-groups layout, and (``mixed``) on 4+ engines the mixed
    layouts of k groups of one degree beside DP engines (aligned groups first)."""
    found = [Layout((1,) * num_engines)]
    for m in degrees:
        for k in range(1, num_engines // m + 1):
            dp = num_engines - k * m
            if dp and (num_engines < 4 or not mixed):
                continue
            found.append(Layout((m,) * k + (1,) * dp))
    return found


@dataclass(frozen=True)
class Prediction:
    layout: str
    ttft_ms: float
    tpot_ms: float
    goodput: float  # req/s within both SLOs
    throughput: float  # output tok/s
    saturated: bool
    #: predicted p95 and p99 inter-token gap (ms) of a running request (``gap_tails``),
    #: the worst over the layout's servers
    itl_tails_ms: tuple[float, float] = (0.0, 0.0)
    #: the largest decode batch a group of the layout is predicted to run (0: no
    #: groups), which its degree's measured curve may or may not reach
    #: (``LayoutChooser``'s measured reach)
    group_batch: float = 0.0

    def e2e_ms(self, output: float) -> float:
        """A request's predicted end-to-end latency for ``output`` tokens."""
        return self.ttft_ms + output * self.tpot_ms

    def brief(self) -> dict:
        return {
            "goodput": round(self.goodput, 3), "ttft_ms": round(self.ttft_ms, 1),
            "tpot_ms": round(self.tpot_ms, 2), "tok_s": round(self.throughput, 1),
            "saturated": self.saturated,
            "itl_p95_ms": round(self.itl_tails_ms[0], 1),
            "itl_p99_ms": round(self.itl_tails_ms[1], 1),
            "group_batch": round(self.group_batch, 1),
        }


@dataclass(frozen=True)
class _Server:
    ttft_ms: float
    tpot_ms: float
    goodput: float
    throughput: float
    saturated: bool
    tails: tuple[float, float] = (0.0, 0.0)  # ``gap_tails``
    #: the decode batch it runs, its time-average (Little's law: a request steps beside
    #: about that many others), at least 1; at its capacity when saturated
    batch: float = 0.0


def _others(costs: Costs, degree: int, lam: float, out: float, free: float, b: float) -> float:
    """The time-average number of requests decoding on a server whose requests run in
    batches of ``b``: ``lam x life`` (Little's law), a life of ``out`` steps of
    ``decode(b) / free`` ms (``free``: the share of time not in prefills)."""
    return lam * out * (costs.decode(degree, b) or 0.0) / (1000.0 * free)


def _batch(costs: Costs, degree: int, lam: float, out: float, free: float, cap: float):
    """The decode batch a request runs in: itself and the others decoding beside it.
    Poisson arrivals see the time-average number decoding (``_others``), so the batch
    is the fixed point of ``b = 1 + others(b)``, at most ``cap``; None (saturated)
    where even ``cap`` would need more than ``cap`` decoding at once.

    (Taking the server's time-average batch, ``max(1, others)``, for the batch a request
    steps in counted no one beside it below one request decoding on average: on the
    hidden-1024 model at 1.36 req/s on 2 DP engines, about 0.9 decoding per engine,
    it put DP's TPOT at 48 ms; SGLang's DP-2 measured 101, and ``1 + others`` reads 97.)"""
    b = 1.0
    for _ in range(ITERATIONS):
        nxt = min(cap, 1.0 + _others(costs, degree, lam, out, free, b))
        settled, b = abs(nxt - b) < 1e-3, nxt
        if settled:
            break
    if b >= cap and _others(costs, degree, lam, out, free, cap) > cap:
        return None
    return b


def queue_prefill(costs: Costs, degree: int, prompt: float, cap: float,
                  prefill_tokens: float) -> float:
    """ms of prefill per request on a server with a deep queue: SGLang takes waiting
    prompts into one extend step up to ``prefill_tokens`` new tokens (its chunked prefill
    size; 0: unknown, one prompt a step) and the room of ``cap`` requests, so each pays
    its share of a step of ``min(prefill_tokens, cap x prompt)`` tokens.

    Priced one prompt at a time, the hidden-1024 model on this project's 2-core machine
    read a TP-2 group's saturated output 12-18 % above two DP engines' (1.3 against
    1.7 ms a prompt token at the traffic's mean prompt of 105), and the node kept the
    group through a burst where static DP served 13 % more output than SGLang's TP-2
    and 6x its goodput (cpu-burst, session 85). There SGLang's extend steps held 2,300
    -4,096 tokens, and at such steps the group's measured points read 1.45-1.55 ms a
    token, one engine's 2.3 (1.15 for the pair): the shares of a full step say what
    the mean prompt's point does not, in whichever direction a mode's curve bends.

    The step is at most the longest the mode has measured (``Costs.measured_prefill``):
    beyond its points a curve runs on its last segment's slope, and one engine's curve
    measured to 134 tokens, its last segment 3.75 ms a token between two noisy
    points, read a 4,096-token step at 15 s, a prompt's share 2.8x its own step, and
    kept a TP-2 group through a burst where static DP served 2.4x static TP's goodput
    (hidden-1024 model, cpu-burst, session 87)."""
    single = costs.prefill(degree, prompt) or 0.0
    tokens = min(prefill_tokens, cap * prompt, costs.measured_prefill(degree))
    if tokens <= prompt:
        return single
    return (costs.prefill(degree, tokens) or 0.0) * prompt / tokens


def _capacity(costs: Costs, degree: int, prompt: float, out: float, cap: float,
              prefill_tokens: float = 0.0) -> float:
    """The highest arrival rate (req/s) the server serves without saturating.

    At rate ``lam`` the batch's fixed point exists (``_batch``) where some batch ``b``
    in [1, cap] holds ``1 + lam * out * decode(b) / (1000 (1 - lam pre / 1000)) <= b``,
    i.e. ``lam <= 1000 (b - 1) / (out decode(b) + (b - 1) pre)``, or where ``cap``
    holds them all, ``lam <= 1000 cap / (out decode(cap) + cap pre)``: the capacity is
    the highest of these bounds. ``decode`` is linear between its knots, where either
    bound is monotone in ``b``, so the highest is at 1, ``cap`` or a knot between: a
    few curve reads (a bisection over ``_serve`` took thousands, ~30 ms of the DP
    controller's time per evaluation on every request it held up). Prompts at a deep
    queue's price (``queue_prefill``): the capacity is what the server serves with a
    queue."""
    pre = queue_prefill(costs, degree, prompt, cap, prefill_tokens)
    batches = {1.0, cap, *(b for b in costs.decode_knots(degree) if 1.0 < b < cap)}
    full = out * (costs.decode(degree, cap) or 0.0) + cap * pre
    if full <= 0.0:
        return MAX_RATE
    best = 1000.0 * cap / full
    for b in batches:
        per_request = out * (costs.decode(degree, b) or 0.0) + (b - 1.0) * pre
        if per_request > 0.0:
            best = max(best, 1000.0 * (b - 1.0) / per_request)
    return min(best, MAX_RATE)


def _serve(costs: Costs, degree: int, lam: float, prompt: float, out: float, cap: float,
           pre: float | None = None):
    """(prefill ms, prefill utilisation, batch, decode step ms) or None if saturated;
    ``pre``: a prompt's prefill ms (default: one prompt's step)."""
    pre = (costs.prefill(degree, prompt) or 0.0) if pre is None else pre
    rho = lam * pre / 1000.0
    if rho >= 1.0:
        return None
    b = _batch(costs, degree, lam, out, 1.0 - rho, cap)
    if b is None:
        return None
    return pre, rho, b, costs.decode(degree, b) or 0.0


def _server(
    costs: Costs, degree: int, lam: float, prompt: float, out: float, queued: float,
    slo: Slo, horizon_s: float, cap: float, mu: float, share: float = 1.0,
    prefill_tokens: float = 0.0,
) -> _Server:
    """One server's service at ``lam`` req/s, its ``share`` of the node's arrivals;
    saturated, its prompts prefilled as a deep queue's (``queue_prefill``). The
    ``queued`` requests already waiting are such a queue in either case: SGLang takes
    them into extend steps together, so below saturation too they drain at their
    shares of a step of ``min(cap, queued)`` prompts (priced one prompt a step, a
    server's backlog jumped at its capacity by the ratio of the two prices)."""
    served = _serve(costs, degree, lam, prompt, out, cap) if lam < mu else None
    if served is not None:
        pre, rho, _, step = served
        tpot = step / (1.0 - rho)
        backlog = queued * queue_prefill(costs, degree, prompt, min(cap, queued), prefill_tokens)
        wait = rho * pre / (2.0 * (1.0 - rho))
        ttft = step / 2.0 + wait + backlog + pre
        slack = slo.ttft_ms - (step / 2.0 + pre)
        p_ttft = 0.0 if slack < 0 else 1.0 - rho * math.exp(-(1.0 - rho) * slack / max(pre, 1e-6))
        p_ttft *= 1.0 - backlog_missed(backlog, slack, rho, horizon_s)
        good = lam * p_ttft * tpot_within(tpot, slo.tpot_ms, lam, pre, out, rho, share)
        return _Server(ttft, tpot, good, lam * out, False, gap_tails(lam, tpot, step, pre),
                       max(1.0, lam * out * tpot / 1000.0))
    at_mu = _serve(costs, degree, mu * 0.999, prompt, out, cap,
                   queue_prefill(costs, degree, prompt, cap, prefill_tokens)) if mu > 0 else None
    if at_mu is None:  # cannot serve even one request at a time
        return _Server(math.inf, math.inf, 0.0, 0.0, True)
    pre, rho, _, step = at_mu  # pre: a prompt's share of a deep queue's extend step
    one = costs.prefill(degree, prompt) or 0.0  # its own step, alone
    tpot = step / (1.0 - rho)
    base = step / 2.0 + one + queued * pre
    growth = max(1e-6, (lam - mu) / mu)  # seconds of wait added per second of the phase
    meet_s = max(0.0, (slo.ttft_ms - base) / 1000.0) / growth
    meeting = min(1.0, meet_s / horizon_s)
    ttft = base + 1000.0 * growth * horizon_s / 2.0  # the mean over the phase
    good = lam * meeting * tpot_within(tpot, slo.tpot_ms, mu, pre, out, rho, share)
    return _Server(ttft, tpot, min(good, mu), mu * out, True, (step + one, step + one),
                   max(1.0, mu * out * tpot / 1000.0))


def predict(
    layout: Layout, costs: Costs, rate: float, prompt: float, output: float,
    queued: float, slo: Slo, horizon_s: float, engine_kv_tokens: float,
    capacities: dict[int, float] | None = None, prefill_tokens: float = 0.0,
) -> Prediction | None:
    """The layout's predicted service (None: a mode it uses is unmeasured). ``rate`` in
    req/s, ``prompt``/``output`` mean tokens, ``queued`` requests already waiting at
    the node, ``engine_kv_tokens`` KV slots of one engine (a TP-m group pools m).
    ``capacities``: a cache of each degree's capacity (req/s) for these costs and
    sizes, shared by calls that differ only in rate and queue. ``prefill_tokens``: the
    most new tokens of one extend step (SGLang's chunked prefill size; 0: unknown)."""
    if not all(costs.known(d) for d in set(layout.servers)):
        return None
    prompt, output = max(1.0, prompt), max(1.0, output)
    known = {} if capacities is None else capacities
    for d in set(layout.servers):
        if d not in known:
            known[d] = _capacity(costs, d, prompt, output,
                                 _cap(d, engine_kv_tokens, prompt, output), prefill_tokens)
    caps = [known[d] for d in layout.servers]
    total = sum(caps) or 1.0
    results = [
        _server(costs, d, rate * c / total, prompt, output, queued * c / total, slo,
                horizon_s, _cap(d, engine_kv_tokens, prompt, output), c, c / total,
                prefill_tokens)
        for d, c in zip(layout.servers, caps, strict=True)
    ]
    shares = [c / total for c in caps]
    return Prediction(
        layout=layout.name,
        ttft_ms=sum(s * r.ttft_ms for s, r in zip(shares, results, strict=True)),
        tpot_ms=sum(s * r.tpot_ms for s, r in zip(shares, results, strict=True)),
        goodput=sum(r.goodput for r in results),
        throughput=sum(r.throughput for r in results),
        saturated=any(r.saturated for r in results),
        itl_tails_ms=tuple(max(r.tails[i] for r in results) for i in range(2)),  # type: ignore[arg-type]
        group_batch=max((r.batch for d, r in zip(layout.servers, results, strict=True) if d > 1),
                        default=0.0),
    )


def _cap(degree: int, engine_kv_tokens: float, prompt: float, out: float) -> float:
    return min(MAX_RUNNING, max(1.0, degree * engine_kv_tokens / (prompt + out)))


def quiet(costs: Costs, degree: int, prompt: float) -> tuple[float, float] | None:
    """(TTFT, TPOT) in ms of one request alone on a server of ``degree``."""
    if not costs.known(degree):
        return None
    step = costs.decode(degree, 1) or 0.0
    return (costs.prefill(degree, prompt) or 0.0) + step / 2.0, step
