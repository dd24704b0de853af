"""Measured step costs: how long a step takes in each mode, against what it does.

The policy picks a TP group for latency only where a group's step is measurably faster
than one engine's (``scheduler.policy.Costs``). The engines measure it themselves, as
the interval between consecutive step boundaries (formation, forward, sampling, output
processing, and for a group its exchange and state switch: everything a request waits
for per token), for single-request decode steps, per TP degree (1 = DP). The start-up probe's requests
calibrate it (one per degree, in a group and in DP); serving traffic keeps it current.
TP steps with DP steps interleaved are not counted (their interval includes another
batch's work).

Every step is a sample of a *curve point* (``scheduler.costs``): a decode step keyed by
its batch size, an extend (prefill) step by its new tokens, each in buckets (batch
sizes 1-4 exactly, then powers of two; tokens in powers of two from 16), so the policy
can predict a mode's service at the load it is about to have, not only at batch 1.
A bucket's point is (mean work of its window, the cost below), published with the
engine's status. ``decode_ms`` is the batch-1 decode point of each mode.

The cost of a degree is a low percentile (``QUANTILE``) of its last ``WINDOW`` samples:
the step's own cost. On a shared machine other processes (the HTTP server, the
detokenizer, the other engines' prefills) stretch some steps; a mean would charge that
to whichever mode happened to run during a burst, and DP runs during bursts far more
often than a group does, so a mean made DP look slow exactly when groups do not pay.

A low percentile of recent samples is not enough under sustained load: when every
sample of a window is stretched (a benchmark at a steady rate keeps both cores busy),
DP's recent cost rises while a group's, measured only when a group runs, stays at the
start-up probe's quiet-machine value, so a group that is slower than one engine looked
faster (SGLang's serving benchmark at 6 req/s formed such groups on the demo model).
So a degree's cost is the lowest its windowed percentile has been (``best``): each
mode's capability, for DP and TP measured alike by the probe on the same quiet machine
and lowered by traffic when a mode runs faster, never raised by contention that would
stretch either mode.

The stretch is published beside the curves, not folded into them (``stretch``): per
degree, the mean of the recent samples' ratio to what the curve reads at their point
(``scheduler.costs.read``), over the last ``STRETCH_S`` seconds, and
``stretch_last`` its last value however long ago. The curves say what a step costs on a quiet machine; the
stretch says how much slower the mode's steps run now (``stretch``). The policy checks a
goodput switch at both (``scheduler.costs.Costs.loaded``); the SLOs read the quiet
curves alone.

The best point of a mode is how fast it can step; ``live_ms`` is how fast it did step
while serving: per degree, the mean of its last ``LIVE_WINDOW`` single-request decode
steps, kept however long ago they ran (the stretch forgets a mode 10 s after it stops),
and ``live_low_ms`` the lowest that mean has been (the mode's cadence at its quietest,
the calibration's included; the mean itself is of serving alone). The "is a group
faster" test reads them beside the best points (``scheduler.costs.Costs.gain``): on
this project's 2-core machine the start-up calibration put a TP-2 step of the hidden-1024 model 7-26 % faster than one engine's,
while serving, its single-request steps ran 1.44x its best point (41.3 ms against DP's
43.4: no faster), and SGLang's own TP-2 streamed the quiet phases 1.2-1.4x slower than
DP (a group needs both cores in lockstep beside the HTTP, tokenizer and detokenizer
processes, which the calibration runs before): the node formed the slower group for
latency at every lull.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque

from scheduler.costs import read

#: Samples kept per curve point, and the percentile of them that is the point's cost.
WINDOW = 64
QUANTILE = 0.25
#: Steps longer than this are not samples of a step (an engine stalled or slept); an
#: extend step may take this long per 1,024 new tokens (``longest_s``).
MAX_SAMPLE_S = 5.0
#: A window's percentile becomes a point's best only from this many samples on (the
#: probe's calibration gives 15 per degree); until then the percentile itself is used.
MIN_SAMPLES = 8
#: The stretch is read from the samples of the last STRETCH_S seconds (at most
#: STRETCH_WINDOW of them per degree, at least MIN_SAMPLES): a mode that has not run
#: lately has none (its steps' cost now is unknown).
STRETCH_S = 10.0
STRETCH_WINDOW = 64
#: One step counts at most this many times its point's cost in the stretch (a stall of
#: seconds is not the mode's cadence).
MAX_STRETCH = 10.0
#: Single-request decode steps kept per degree for ``live_ms`` (no time limit: the
#: memory of the last time a mode served, for as long as it does not serve again).
LIVE_WINDOW = 32

DECODE, PREFILL = "decode", "prefill"
#: A prefill point is what one prompt's new tokens cost; an extend step of several
#: requests is a sample of it only where they bring at least this many new tokens each.
#: The start-up calibration's batch arrives with its prompt cached, so one extend step
#: carries ~20 requests of about one new token each, and it costs per request, not per
#: token: one engine read 394 / 427 ms for "20 tokens" on the hidden-1024 model (two
#: runs), between 107-116 ms at 7 tokens and 425-431 at 128, and 325 ms on hidden 512
#: (62 at 8, 202 at 128). Kept on the curve, it priced every 16-32-token prompt at it.
MIN_PROMPT_TOKENS = 16

#: (degree, kind, bucket): one curve point.
Key = tuple[int, str, int]
#: (degree, kind, work): what one step did (work: batch size or new tokens).
Sample = tuple[int, str, int]


def longest_s(kind: str, work: int) -> float:
    """The longest a step of ``kind`` doing ``work`` may take and be a sample. An extend
    step's time grows with its tokens: one engine of the hidden-1024 model prefilled the
    calibration's 4,096-token prompt in ~5.4 s, which a flat limit dropped, so its
    curve had no long step to price a deep queue at (``scheduler.service``)."""
    return MAX_SAMPLE_S * max(1.0, work / 1024.0) if kind == PREFILL else MAX_SAMPLE_S


def bucket(kind: str, work: int) -> int:
    """Decode batch sizes 1-4 are their own bucket, then powers of two; prefill tokens
    in powers of two from 16."""
    if kind == DECODE and work <= 4:
        return max(1, work)
    return 1 << (max(int(work), 16 if kind == PREFILL else 1) - 1).bit_length()  # ceil(log2)


class StepClock:
    """Step time per curve point: ``decode_ms()`` -> {degree: ms} (batch-1 decode) and
    ``curves()`` -> {degree: {"decode": [[batch, ms]], "prefill": [[tokens, ms]]}}."""

    def __init__(self) -> None:
        self._ms: dict[Key, _Window] = {}
        self._samples: dict[int, int] = {}  # single-request decode samples per degree
        self._best: dict[Key, tuple[float, float]] = {}  # lowest windowed percentile seen
        self._open: tuple[Sample, float] | None = None  # (sample, started) of a step
        #: per (degree, kind): its points' keys, by bucket
        self._keys: dict[tuple[int, str], list[Key]] = {}
        #: per degree: (when, sample ms / its point's best ms) of the latest samples
        self._ratios: dict[int, deque[tuple[float, float]]] = {}
        #: per degree: the latest single-request decode steps (ms), their mean now and
        #: the lowest it has been
        self._live: dict[int, deque[float]] = {}
        self._live_now: dict[int, float] = {}
        self._live_low: dict[int, float] = {}
        self._stretch_last: dict[int, float] = {}

    def boundary(self) -> float:
        """A step boundary starts: close the step in progress (if it was a sample) at
        this instant; returns the instant, the start of the step being formed."""
        now = time.perf_counter()
        if self._open is not None:
            (degree, kind, work), started = self._open
            if now - started <= longest_s(kind, work):
                self.record(degree, (now - started) * 1e3, kind, work, now)
        self._open = None
        return now

    def label(self, sample: Sample | None, started: float) -> None:
        """The step that started at ``started`` is ``sample`` (None: not a sample)."""
        self._open = (sample, started) if sample is not None else None

    def record(self, degree: int, ms: float, kind: str = DECODE, work: int = 1,
               now: float | None = None) -> None:
        key = (degree, kind, bucket(kind, work))
        floor = self._floor(key, float(work), ms)
        if floor is not None:
            ratios = self._ratios.get(degree)
            if ratios is None:
                ratios = self._ratios[degree] = deque(maxlen=STRETCH_WINDOW)
            now = time.perf_counter() if now is None else now
            ratios.append((now, ms / floor))
        window = self._ms.get(key)
        if window is None:
            window = self._ms[key] = _Window()
            self._keys.setdefault((degree, kind), []).append(key)
            self._keys[(degree, kind)].sort()
        window.append(float(work), ms)
        if kind == DECODE and work == 1:
            self._samples[degree] = self._samples.get(degree, 0) + 1
        if len(window) >= MIN_SAMPLES:
            point = window.point()
            if point[1] < self._best.get(key, (0.0, math.inf))[1]:
                self._best[key] = point
        if kind == DECODE and work == 1:
            self._live_step(degree, ms, (self._best.get(key) or window.point())[1])

    def _floor(self, key: Key, work: float, ms: float) -> float | None:
        """What the policy's curve reads at ``key``'s point (the sample ``(work, ms)``
        while it has none) for its degree and kind (``scheduler.costs.read``: a decode point above a
        bigger step's reads as the cheapest beyond it; a prefill point there is dropped,
        the curve runs straight past it), None until a point at or beyond ``key`` has a
        best. The stretch is measured against it, not against the point's own best: on
        the hidden-1024 model at 0.6 req/s a TP-2 group's serving points at batch 2-3
        (30.0, 34.5 ms) sat above the start-up calibration's quiet batch-4 point
        (24.9 ms), so the curve read 24.9 there while the stretch, against the serving
        points, said 1.1-1.3: the group was predicted to stream at 17 ms and streamed
        at 31-34."""
        keys = self._keys.get(key[:2], ())
        if not any(k[2] >= key[2] and k in self._best for k in keys):
            return None
        points = {k: self._best.get(k) or self._ms[k].point() for k in keys}
        points.setdefault(key, (work, ms))  # its first sample: the point it starts
        return read(points.values(), points[key][0], key[1])

    def _live_step(self, degree: int, ms: float, best: float) -> None:
        """A single-request decode step of ``ms``: the mode's live mean (each step at
        most ``MAX_STRETCH`` x its ``best``), from ``MIN_SAMPLES`` steps on."""
        steps = self._live.setdefault(degree, deque(maxlen=LIVE_WINDOW))
        steps.append(ms)
        if len(steps) >= MIN_SAMPLES:
            cap = MAX_STRETCH * best
            mean = round(sum(min(cap, x) for x in steps) / len(steps), 4)
            self._live_now[degree] = mean
            self._live_low[degree] = min(mean, self._live_low.get(degree, math.inf))

    def _points(self, given: dict[Key, tuple[float, float]] | None = None
                ) -> dict[Key, tuple[float, float]]:
        """The points: ``given`` (read once by the caller, even if empty), else read now."""
        if given is not None:
            return given
        return {key: self._best.get(key) or w.point() for key, w in sorted(self._ms.items())}

    def measured(self) -> tuple[dict[int, float], dict[int, dict[str, list[list[float]]]]]:
        """``(decode_ms(), curves())`` from one pass over the points (the status
        document's, every refresh)."""
        points = self._points()
        return self.decode_ms(points), self.curves(points)

    def decode_ms(self, points: dict[Key, tuple[float, float]] | None = None) -> dict[int, float]:
        """Per degree: its batch-1 decode point's cost (its best windowed percentile, or
        the percentile of its first few samples while it has fewer than MIN_SAMPLES)."""
        return {
            degree: round(ms, 4)
            for (degree, kind, b), (_, ms) in self._points(points).items()
            if kind == DECODE and b == 1
        }

    def curves(self, points: dict[Key, tuple[float, float]] | None = None
               ) -> dict[int, dict[str, list[list[float]]]]:
        out: dict[int, dict[str, list[list[float]]]] = {}
        for (degree, kind, _), (work, ms) in self._points(points).items():
            curve = out.setdefault(degree, {DECODE: [], PREFILL: []})
            curve[kind].append([round(work, 2), round(ms, 4)])
        return out

    def predict(self, degree: int, kind: str, work: float) -> float | None:
        """ms a step of ``kind`` doing ``work`` (batch size, new tokens) takes in mode
        ``degree`` now: its curve as the policy reads it times the mode's stretch;
        None where the mode has no point of that kind."""
        points = self.curves().get(degree, {}).get(kind)
        if not points:
            return None
        return read(points, work, kind) * self.stretch().get(degree, 1.0)

    def stretch(self, now: float | None = None) -> dict[int, float]:
        """Per degree that ran in the last ``STRETCH_S`` seconds (``MIN_SAMPLES`` steps
        at least): the mean of its recent steps' cost over what the curve reads at their
        point (``_floor``; each at most ``MAX_STRETCH``), at least 1. The mean, not a low percentile: a request's
        TPOT is the mean of its steps, and a mode whose steps stall now and then (a
        group needs every member's core) streams that much slower. Steps of a point
        without a best yet are not counted.

        Measured on the hidden-1024 model at 1.5 req/s (SGLang's benchmark): DP 1.0-1.7,
        a static TP-2 group 1.2-1.6, both lower when the load eases."""
        now = time.perf_counter() if now is None else now
        out = {}
        for degree, ratios in sorted(self._ratios.items()):
            recent = [min(MAX_STRETCH, r) for t, r in ratios if now - t <= STRETCH_S]
            if len(recent) >= MIN_SAMPLES:
                out[degree] = round(max(1.0, sum(recent) / len(recent)), 3)
        self._stretch_last.update(out)
        return out

    def forget_calibration(self) -> None:
        """Drop the stretch measured so far, now and last, and the live steps' mean (the
        start-up calibration's: ``flying.session.status.calibration_over``); the points
        and the lowest live mean (``live_low_ms``, the mode's quietest cadence) stay.

        The calibration is no serving: its modes run one after another, each with its
        own batch in flight from the HTTP process, and a mode's stretch there is its
        passes' spread. Kept, it was the "now" of the mode calibrated last and the
        "when it last served" of every mode, and the first decisions hinged on it
        (hidden-768 model, three starts: TP-2 at 1.56 / 1.34 / 1.15, one engine at
        1.25 / 1.43 / 1.07; the node kept DP "for a group that streams slower at the
        costs the steps run at now" in the first two, took TP-2 in the third).

        Its live steps likewise: kept, a group's single-request steps in one stretched
        pass were the "while serving" of a mode the node then never served, so never
        measured again (hidden-1024 model, three-peak, session 87: TP-2's calibration
        mean 28.0 ms, its best 20.3, one engine's quietest 31.0; not 10 % faster, the
        node never formed the group, 0.64x static TP's goodput; the start that read
        22.0 took it and read 1.14x)."""
        self._ratios.clear()
        self._stretch_last.clear()
        self._live.clear()
        self._live_now.clear()

    def stretch_last(self) -> dict[int, float]:
        """Per degree: its stretch the last time ``stretch`` read one, however long ago
        (as ``live_ms`` keeps a mode's steps): what a mode that stopped serving ran at
        when it last served, so a layout it left is not judged by its quiet points
        alone (``scheduler.layout_choice``'s check of a group at its loaded costs)."""
        return dict(sorted(self._stretch_last.items()))

    def live_ms(self) -> dict[int, float]:
        """Per degree with ``MIN_SAMPLES`` single-request decode steps: the mean of its
        last ``LIVE_WINDOW`` (each at most ``MAX_STRETCH`` times its best then), however
        long ago. The mean, as for the stretch: a request's TPOT is the mean of its
        steps. Until a mode serves, its calibration's steps."""
        return dict(sorted(self._live_now.items()))

    def live_low_ms(self) -> dict[int, float]:
        """Per degree: the lowest ``live_ms`` has been (a burst's stretched steps raise
        the mean now, not this)."""
        return dict(sorted(self._live_low.items()))

    def samples(self) -> dict[int, int]:
        return dict(sorted(self._samples.items()))


class _Window:
    """A curve point's latest ``WINDOW`` samples, their ms kept sorted and their work
    summed as they come and go, so that the point (``point``) is read at every step
    without sorting the window again (a 64-sample sort per step was most of Flying's
    per-step time on SGLang's loop: 0.44 % of the engines' samples at 2.8 ms decode
    steps, ``workloads.bench_hooks``)."""

    __slots__ = ("_samples", "_sorted", "_work")

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque()  # (work, ms), oldest first
        self._sorted: list[float] = []  # the same ms, ascending
        self._work = 0.0  # the sum of their work (whole tokens or requests: exact)

    def __len__(self) -> int:
        return len(self._samples)

    def append(self, work: float, ms: float) -> None:
        if len(self._samples) == WINDOW:
            old_work, old_ms = self._samples.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old_ms)]
            self._work -= old_work
        self._samples.append((work, ms))
        bisect.insort(self._sorted, ms)
        self._work += work

    def point(self) -> tuple[float, float]:
        """(mean work, ``QUANTILE`` of ms) of the window."""
        n = len(self._sorted)
        return self._work / n, self._sorted[int(QUANTILE * (n - 1))]


def sample_of(batch, degree: int, interleaved: bool) -> Sample | None:
    """What a step of ``batch`` is a sample of: a decode step by its batch size, an
    extend step by its new tokens; None for anything else (mixed, idle, interleaved,
    and an extend of many requests with a few new tokens each: ``MIN_PROMPT_TOKENS``)."""
    if batch is None or interleaved or not batch.reqs:
        return None
    mode = batch.forward_mode
    if mode.is_decode():
        return degree, DECODE, len(batch.reqs)
    if mode.is_extend() and not mode.is_mixed() and batch.extend_num_tokens:
        tokens, n = int(batch.extend_num_tokens), len(batch.reqs)
        if n > 1 and tokens < MIN_PROMPT_TOKENS * n:
            return None
        return degree, PREFILL, tokens
    return None
