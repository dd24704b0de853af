"""Measured step costs per mode, as curves: what a step costs against what it does.

The engines time every step they run (``flying.session.step_costs``) and key it by
mode (degree; 1 = one engine in DP) and by what the step did: a decode step by its
batch size, a prefill (extend) step by its new tokens. Each key keeps the lowest value
its windowed low percentile has reached (the step's own cost on a quiet machine, not
its cost while other processes share the cores). Here those points become curves:

- ``decode(degree, batch)``: ms of one decode step of ``batch`` running requests;
- ``prefill(degree, tokens)``: ms of one extend step of ``tokens`` new tokens.

Both are piecewise linear through the measured points, made non-decreasing (a decode
point above a bigger batch's is lowered to it, a prefill point there dropped:
``_monotone``; below the first point: its value; beyond the last: the last segment's
slope). Outside a TP mode's
measured points (beyond its last, below its first; one point: everywhere but there) the
mode grows as DP's curve does, scaled to pass through its own nearest point (the
start-up calibration measures every mode at a few sizes; traffic fills in the rest, DP
first since it runs most): the ratio of a TP step to a DP step at the same work is what
is known there, and a flat extension would make a mode measured at small batches look
free to batch without bound, or one measured at a long prefill charge its time for
every short prompt.

Pure: no torch, no sockets. ``Costs.decode_ms`` (single-request decode per degree)
is kept as it was: the test "is a group faster per step" for latency-first requests.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

Point = tuple[float, float]  # (work: batch size or tokens, ms)

#: Prefill per token as a fraction of a single-request decode step, used only while no
#: mode has measured a prefill (the first requests after start-up): a small model on
#: a CPU prefills ~50-200 tokens in the time of one decode step; the value only has to
#: keep predictions finite until the first extend step is measured.
PREFILL_TOKENS_PER_DECODE = 64.0


def interpolate(points: tuple[Point, ...], x: float) -> float:
    """Piecewise-linear value at ``x`` through ``points`` (ascending in x): flat below
    the first point, the last segment's slope (>= 0) beyond the last."""
    if not points:
        raise ValueError("no points")
    if len(points) == 1 or x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    (x0, y0), (x1, y1) = points[-2], points[-1]
    slope = max(0.0, (y1 - y0) / (x1 - x0)) if x1 > x0 else 0.0
    return y1 + slope * (x - x1)


def _points(raw: Iterable) -> tuple[Point, ...]:
    """Sorted (x, ms) points, one per x (the lower ms where x repeats)."""
    best: dict[float, float] = {}
    for x, ms in raw:
        x, ms = float(x), float(ms)
        if x > 0 and ms > 0:
            best[x] = min(ms, best.get(x, ms))
    return tuple(sorted(best.items()))


@functools.lru_cache(maxsize=1024)
def _monotone(points: tuple[Point, ...], drop: bool = False) -> tuple[Point, ...]:
    """``points`` made non-decreasing in ms: a point above a point at bigger work is
    lowered to the cheapest point beyond it (decode), or dropped so that the curve runs
    straight from the point before it to the cheaper one (``drop``: prefill).

    Decode: this CPU's decode steps are not monotone at small batches (a quiet batch 3
    costs more than batch 4 on every checkpoint calibrated: hidden-768 one engine 51 /
    64 / 51 ms at batch 2-4, TP-2 29 / 34 / 29), so a line from batch 1 to batch 4
    would read batch 2 a third low; lowering reads it at batch 4's cost, about its own.
    Raising the later points instead let one stalled sample (TP-2 at batch 3: 49 ms
    between 10 and 12) price every bigger batch.

    Prefill: cost grows with the new tokens; a small prefill above a bigger one is a
    stretched sample (noise on a shared machine only stretches a step), and lowering it
    flattened the curve at the bigger one's cost all the way to it: on the hidden-768
    model one engine's curve read 283 ms at 105 tokens, where the points either side of
    a stretched 20-token sample (326 ms) put ~245.

    Cached: every predicted step reads both its mode's and DP's curve through here
    (~70 % of a decision's time before), and a node's curves change rarely."""
    out: list[Point] = []
    low = math.inf
    for x, y in reversed(points):
        if y <= low or not drop:
            low = min(low, y)
            out.append((x, low))
    return tuple(reversed(out))


def read(points: Iterable, x: float, kind: str = "decode") -> float:
    """What a curve of ``kind`` through the raw ``points`` ((work, ms), any order) reads
    at ``x``, as the policy reads it (one point per work, made non-decreasing,
    interpolated). The engines' step clock measures how stretched a step ran against
    this."""
    return interpolate(_monotone(_points(points), kind == "prefill"), x)


@dataclass(frozen=True)
class Curve:
    """One mode's measured points: decode (batch size, ms) and prefill (tokens, ms)."""

    decode: tuple[Point, ...] = ()
    prefill: tuple[Point, ...] = ()

    @staticmethod
    def of(decode: Iterable = (), prefill: Iterable = ()) -> Curve:
        return Curve(_points(decode), _points(prefill))


@dataclass(frozen=True)
class Costs:
    """Measured step costs, per degree (1 = one engine in DP).

    ``decode_ms``: the single-request decode step (the latency test); ``curves``: the
    points behind ``decode`` and ``prefill`` (absent for a degree not yet measured at
    more than batch 1; ``decode_ms`` then stands for its only point)."""

    decode_ms: dict[int, float]
    curves: dict[int, Curve] = field(default_factory=dict)
    #: per degree that ran lately: how much slower its steps run now than its points
    #: (``flying.session.step_costs``; absent: not known, taken as 1)
    stretch: dict[int, float] = field(default_factory=dict)
    #: per degree: its last single-request decode steps while serving, however long
    #: ago, and the lowest their mean has been (``flying.session.step_costs``; absent:
    #: not known)
    live_ms: dict[int, float] = field(default_factory=dict)
    live_low_ms: dict[int, float] = field(default_factory=dict)
    #: per degree: its stretch when it last ran, however long ago (absent: never ran
    #: long enough to tell)
    stretch_last: dict[int, float] = field(default_factory=dict)

    # -- the latency test -----------------------------------------------------------

    def gain(self, degree: int) -> float | None:
        """How much faster a TP-``degree`` step is than one engine's (0.2 = 20 %
        faster, negative = slower); None if either is unmeasured.

        The lower of two comparisons: the modes' best steps (``decode_ms``, how fast
        each can step), and the group's latest live steps (``live_ms``, how fast it did
        step while serving) against one engine's lowest live mean (``live_low_ms``, its
        cadence at its quietest). The live one can only take a gain away: a group that
        streamed slower than its calibration promised is not formed for latency again
        (hidden-1024 model, session 36: TP-2 calibrated 26 % faster than one engine,
        41.3 ms while serving against DP's 43.4); and DP's live steps are read at their
        quietest, since a burst's stretched DP steps (there 59 ms as the next burst
        began) say nothing of the light load a latency group serves."""
        dp, tp = self.decode_ms.get(1), self.decode_ms.get(degree)
        if not dp or not tp:
            return None
        best = 1.0 - tp / dp
        live_dp, live_tp = self.live_low_ms.get(1), self.live_ms.get(degree)
        return min(best, 1.0 - live_tp / live_dp) if live_dp and live_tp else best

    def describe(self, degree: int) -> str:
        text = (f"TP-{degree} decode step {self.decode_ms.get(degree, 0):.2f} ms vs "
                f"{self.decode_ms.get(1, 0):.2f} ms on one engine")
        if self.live_low_ms.get(1) and self.live_ms.get(degree):
            text += (f", {self.live_ms[degree]:.2f} vs {self.live_low_ms[1]:.2f} ms "
                     "while serving")
        return text

    # -- under load -------------------------------------------------------------------

    def factor(self, degree: int) -> float:
        """How much slower a ``degree`` step runs now than its quiet point: its own
        stretch, and for a group at least one engine's (a group runs on its members'
        devices, shared with the same processes: a group that has not run lately is
        taken to be slowed as the engines are now, not to run as on a quiet machine).
        At least 1."""
        own = self.stretch.get(degree, 1.0)
        if degree != 1:
            own = max(own, self.stretch.get(1, 1.0))
        return max(1.0, float(f"{own:.2g}"))  # two digits: the predictions' cache key

    def loaded(self) -> Costs:
        """These costs as the steps run now: every point of each degree times its
        ``factor``, no stretch (without a stretch above 1: these costs themselves).

        The points are each mode's lowest cost, on a quiet machine; under load every
        step runs slower (hidden-1024 model at 1.5 req/s: DP's steps 1.0-1.7x their
        points, a TP-2 group's 1.2-1.6x). A switch for goodput must pay at both
        (``scheduler.layout_choice``); the SLOs and the latency test read the quiet
        points."""
        if all(self.factor(d) <= 1.0 for d in self.stretch):
            return self
        return _scaled(self)

    def lately(self) -> Costs:
        """These costs with each degree's stretch as it ran when it last served: its
        stretch now, else its last one (``stretch_last``), else its live single-request
        steps over its best one (``live_ms / decode_ms``: a node's status before
        ``stretch_last`` was published, and a mode whose serving never filled a
        stretch window). For comparing a group with DP where one of them is not running
        now: a mode's quiet points say how fast it can step, and on a shared machine a
        group's steps stretch more than one engine's (it needs every member's core at
        once)."""
        merged = {d: round(self.live_ms[d] / ms, 3) for d, ms in self.decode_ms.items()
                  if ms > 0 and self.live_ms.get(d, 0.0) > ms}
        merged.update(self.stretch_last)
        merged.update(self.stretch)
        if merged == self.stretch:
            return self
        return replace(self, stretch=merged)

    # -- curves ---------------------------------------------------------------------

    def known(self, degree: int) -> bool:
        return bool(self.decode_ms.get(degree)) or bool(self._own(degree, "decode"))

    def measured_batch(self, degree: int) -> float:
        """The largest decode batch measured in mode ``degree`` (0: unmeasured): beyond
        it the curve is DP's shape through its last point, a guess."""
        points = self._own(degree, "decode")
        return max((b for b, _ in points), default=0.0)

    def measured_prefill(self, degree: int) -> float:
        """The most new tokens of an extend step measured in mode ``degree`` (0: none):
        beyond it the curve is a guess (its last segment's slope, or DP's shape for a
        TP mode)."""
        return max((x for x, _ in self._own(degree, "prefill")), default=0.0)

    def decode_knots(self, degree: int) -> tuple[float, ...]:
        """Batch sizes where ``decode(degree, .)`` may bend: its own points and, for a
        TP mode (which grows as DP does outside its points), DP's. Between two knots,
        below the first and beyond the last, the curve is linear in the batch."""
        xs = {b for b, _ in self._own(degree, "decode")}
        if degree != 1:
            xs |= {b for b, _ in self._own(1, "decode")}
        return tuple(sorted(xs))

    def _own(self, degree: int, kind: str) -> tuple[Point, ...]:
        curve = self.curves.get(degree)
        points = getattr(curve, kind) if curve is not None else ()
        if kind == "decode" and not points and self.decode_ms.get(degree):
            points = ((1.0, self.decode_ms[degree]),)
        return points

    def _value(self, degree: int, kind: str, x: float) -> float | None:
        drop = kind == "prefill"
        own, dp = _monotone(self._own(degree, kind), drop), _monotone(self._own(1, kind), drop)
        if own and degree != 1 and len(dp) >= 2 and not own[0][0] <= x <= own[-1][0]:
            # outside its measured points a mode grows as DP does, scaled at its nearest
            # point (one point: DP's shape through it). Not flat: a group measured only
            # at the calibration's 384-token prefill would otherwise charge 384 tokens'
            # time for a 100-token prompt (the hidden-1024 model: 520 ms predicted, 135
            # measured), and never look faster than DP for the first token.
            x0, y0 = own[-1] if x > own[-1][0] else own[0]
            return interpolate(dp, x) * y0 / interpolate(dp, x0)
        if own:
            return interpolate(own, x)
        if kind == "prefill" and dp:  # no prefill measured: DP's, scaled by decode
            ratio = (self.decode(degree, 1) or 0) / (self.decode(1, 1) or 1)
            return interpolate(dp, x) * ratio if ratio > 0 else None
        return None

    def decode(self, degree: int, batch: float) -> float | None:
        """ms of one decode step of ``batch`` requests in mode ``degree`` (None:
        unmeasured)."""
        return self._value(degree, "decode", max(1.0, batch))

    def prefill(self, degree: int, tokens: float) -> float | None:
        """ms of one extend step of ``tokens`` new tokens in mode ``degree``; before any
        prefill is measured, a guess from the decode step (PREFILL_TOKENS_PER_DECODE)."""
        value = self._value(degree, "prefill", max(1.0, tokens))
        if value is None:
            one = self.decode(degree, 1)
            value = None if one is None else one * (1.0 + tokens / PREFILL_TOKENS_PER_DECODE)
        return value

    # -- JSON (status documents, the decision log) ----------------------------------

    def to_json(self) -> dict:
        doc: dict = {"decode_ms": {str(d): ms for d, ms in sorted(self.decode_ms.items())}}
        if self.stretch:
            doc["stretch"] = {str(d): x for d, x in sorted(self.stretch.items())}
        for name, values in (("live_ms", self.live_ms), ("live_low_ms", self.live_low_ms),
                             ("stretch_last", self.stretch_last)):
            if values:
                doc[name] = {str(d): ms for d, ms in sorted(values.items())}
        if self.curves:
            doc["curves"] = {
                str(d): {"decode": [list(p) for p in c.decode],
                         "prefill": [list(p) for p in c.prefill]}
                for d, c in sorted(self.curves.items())
            }
        return doc

    @staticmethod
    def from_json(doc: dict | None) -> Costs | None:
        if doc is None:
            return None
        curves = {
            int(d): Curve.of(c.get("decode", ()), c.get("prefill", ()))
            for d, c in (doc.get("curves") or {}).items()
        }
        return Costs({int(k): float(v) for k, v in doc.get("decode_ms", {}).items()}, curves,
                     {int(k): float(v) for k, v in (doc.get("stretch") or {}).items()},
                     *({int(k): float(v) for k, v in (doc.get(name) or {}).items()}
                       for name in ("live_ms", "live_low_ms", "stretch_last")))


@functools.lru_cache(maxsize=64)
def _scaled_points(points: tuple[Point, ...], k: float) -> tuple[Point, ...]:
    return tuple((x, ms * k) for x, ms in points)


def _scaled(costs: Costs) -> Costs:
    """``costs`` with every degree's points times its factor, no stretch, the same live
    steps."""
    curves = {d: Curve(_scaled_points(c.decode, costs.factor(d)),
                       _scaled_points(c.prefill, costs.factor(d)))
              for d, c in costs.curves.items()}
    return Costs({d: ms * costs.factor(d) for d, ms in costs.decode_ms.items()}, curves,
                 live_ms=costs.live_ms, live_low_ms=costs.live_low_ms)
