"""Measured step costs: curve points per mode and work, robust to stretched steps."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from flying.session.step_costs import StepClock, bucket, sample_of

pytestmark = pytest.mark.unit


def _batch(n: int, decode: bool = True, tokens: int = 0, mixed: bool = False):
    mode = SimpleNamespace(is_decode=lambda: decode, is_extend=lambda: not decode,
                           is_mixed=lambda: mixed)
    return SimpleNamespace(reqs=[object()] * n, forward_mode=mode, extend_num_tokens=tokens)


def test_decode_steps_by_batch_size_and_prefill_steps_by_tokens():
    assert sample_of(_batch(1), 2, interleaved=False) == (2, "decode", 1)
    assert sample_of(_batch(5), 1, interleaved=False) == (1, "decode", 5)
    assert sample_of(_batch(2, decode=False, tokens=300), 1, False) == (1, "prefill", 300)
    assert sample_of(_batch(2, decode=False, tokens=300, mixed=True), 1, False) is None
    assert sample_of(_batch(1), 2, interleaved=True) is None
    assert sample_of(None, 1, interleaved=False) is None


def test_an_extend_of_many_requests_with_few_new_tokens_is_no_prefill_point():
    """The calibration's cached batch (20 requests, one new token each) costs per
    request; one prompt of any size, or several bringing a prompt's tokens each, count."""
    assert sample_of(_batch(20, decode=False, tokens=20), 1, False) is None
    assert sample_of(_batch(2, decode=False, tokens=31), 1, False) is None
    assert sample_of(_batch(2, decode=False, tokens=32), 1, False) == (1, "prefill", 32)
    assert sample_of(_batch(1, decode=False, tokens=3), 2, False) == (2, "prefill", 3)
    assert sample_of(_batch(31, decode=False, tokens=31 * 128), 2, False) == (2, "prefill", 3968)


def test_buckets():
    assert [bucket("decode", b) for b in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 3, 4, 8, 8, 16]
    assert [bucket("prefill", t) for t in (1, 16, 17, 300)] == [16, 16, 32, 512]


def test_curves_keep_a_point_per_bucket_with_its_mean_work():
    clock = StepClock()
    for _ in range(8):
        clock.record(1, 10.0, "decode", 1)
        clock.record(1, 14.0, "decode", 6)
        clock.record(1, 15.0, "decode", 8)
        clock.record(2, 30.0, "prefill", 100)
    curves = clock.curves()
    assert curves[1]["decode"] == [[1.0, 10.0], [7.0, 14.0]]  # 6 and 8 share a bucket
    assert curves[2]["prefill"] == [[100.0, 30.0]]
    assert clock.decode_ms() == {1: 10.0}  # batch-1 decode only
    assert clock.measured() == ({1: 10.0}, curves)  # the status document's one pass
    assert clock.samples() == {1: 8}


def test_cost_is_a_low_percentile_so_a_burst_does_not_charge_one_mode():
    clock = StepClock()
    for _ in range(16):
        clock.record(2, 12.0)  # the probe's group steps, on a quiet machine
        clock.record(1, 8.0)  # and one engine's
    for _ in range(30):
        clock.record(1, 40.0)  # DP steps stretched by a burst's other work
    costs = clock.decode_ms()
    assert costs == {1: 8.0, 2: 12.0}  # DP still measures faster than the group
    assert clock.samples() == {1: 46, 2: 16}


def test_sustained_load_does_not_make_a_slower_group_look_faster():
    """Every DP sample of a full window stretched (a steady benchmark keeps the cores
    busy) while the group, not running, keeps its probe value: DP must still win."""
    clock = StepClock()
    for _ in range(16):
        clock.record(2, 8.2)  # the probe's group steps
        clock.record(1, 6.9)  # and one engine's, on the same quiet machine
    for _ in range(200):
        clock.record(1, 9.5)  # DP under load: every sample of the window stretched
    assert clock.decode_ms() == {1: 6.9, 2: 8.2}
    for _ in range(64):
        clock.record(1, 5.0)  # DP measured faster later: the cost follows it down
    assert clock.decode_ms()[1] == 5.0


def test_few_samples_use_their_own_percentile():
    clock = StepClock()
    for ms in (3.0, 9.0, 9.0):
        clock.record(2, ms)
    assert clock.decode_ms() == {2: 3.0}


def test_boundary_label_measures_the_interval_between_boundaries(monkeypatch):
    import flying.session.step_costs as sc

    now = iter([1.0, 1.010, 1.030, 1.040])
    monkeypatch.setattr(sc.time, "perf_counter", lambda: next(now))
    clock = StepClock()
    started = clock.boundary()  # 1.000
    clock.label((1, "decode", 1), started)
    started = clock.boundary()  # 1.010: a 10 ms DP sample
    clock.label(None, started)  # this step is not a sample
    clock.boundary()  # 1.030: nothing recorded
    assert clock.decode_ms() == {1: 10.0}


def test_a_long_extend_step_is_a_sample_where_a_decode_step_as_long_is_a_stall(monkeypatch):
    """An extend step may take MAX_SAMPLE_S per 1,024 new tokens: one engine's 4,096-token
    prefill of ~5.4 s is a point; a decode step of 5.4 s is a stall, not a sample."""
    import flying.session.step_costs as sc

    now = iter([1.0, 6.4, 11.8])
    monkeypatch.setattr(sc.time, "perf_counter", lambda: next(now))
    clock = StepClock()
    started = clock.boundary()
    clock.label((1, "prefill", 4096), started)
    started = clock.boundary()  # 5.4 s of prefill: kept
    clock.label((1, "decode", 1), started)
    clock.boundary()  # 5.4 s of decode: dropped
    assert clock.curves() == {1: {"decode": [], "prefill": [[4096.0, 5400.0]]}}
    assert sc.longest_s("prefill", 512) == sc.longest_s("decode", 4096) == sc.MAX_SAMPLE_S


class _StatusStore:
    """The engines' status documents in a store; ``gate`` cleared: a launcher that
    does not answer (every read waits)."""

    def __init__(self, docs: dict[str, dict]):
        import threading

        self.docs = {k: json.dumps(v) for k, v in docs.items()}
        self.gate = threading.Event()
        self.gate.set()
        self.reads = 0

    def check(self, keys):
        self.gate.wait(5)
        self.reads += 1
        return all(k in self.docs for k in keys)

    def get(self, key):
        return self.docs[key].encode()


def test_the_controller_reads_costs_off_its_loop(monkeypatch):
    """The decision reads the last refresh's costs without a store round trip: a
    launcher that stops answering holds up the refresher thread, never ``read``."""
    import time

    from flying.node import costs_reader

    monkeypatch.setattr(costs_reader, "REFRESH_S", 0.05)
    doc = {"decode_ms": {"1": 10.0, "2": 7.0}, "curves": {"1": {"decode": [[1, 10.0], [4, 12.0]],
                                                              "prefill": []}}}
    store = _StatusStore({f"flying/status/{r}": {"rank": r, **doc} for r in (0, 1)})
    reader = costs_reader.CostsReader(lambda: store, num_engines=2)
    costs = reader.read()  # the first decision waits for the first refresh
    assert costs is not None and costs.decode_ms == {1: 10.0, 2: 7.0}
    assert costs.decode(1, 4) == pytest.approx(12.0)
    store.gate.clear()
    time.sleep(0.2)  # the refresher is now stuck in a read
    start = time.monotonic()
    assert reader.read() == costs and reader.switch() is not None
    assert time.monotonic() - start < 1.0  # a read through the store would wait the gate's 5 s
    store.gate.set()


def test_stretch_is_the_recent_steps_cost_over_their_points_best():
    """Once a point has a best, each step of it is a sample of how much slower the mode
    runs now; the stretch is their mean over the last STRETCH_S seconds, at
    least 1, and absent for a mode without enough recent steps."""
    from flying.session.step_costs import MIN_SAMPLES, STRETCH_S

    clock = StepClock()
    for i in range(MIN_SAMPLES):  # the calibration: a best of 10 ms at batch 1
        clock.record(1, 10.0, "decode", 1, now=float(i))
    assert clock.stretch(now=float(MIN_SAMPLES)) == {}  # no step after the best yet
    for i in range(MIN_SAMPLES):  # under load: 2x, the TP mode quiet
        clock.record(1, 20.0, "decode", 1, now=100.0 + i)
    for i in range(MIN_SAMPLES):  # the group's calibration: its best, no ratio yet
        clock.record(2, 7.0, "decode", 1, now=100.0 + i)
    assert clock.stretch(now=100.0 + MIN_SAMPLES) == {1: 2.0}  # a point's best stays
    assert clock.curves()[1]["decode"] == [[1.0, 10.0]]  # contention never raises it
    for i in range(MIN_SAMPLES):  # the group runs faster than its best: never below 1
        clock.record(2, 5.0, "decode", 1, now=120.0 + i)
    assert clock.stretch(now=120.0 + MIN_SAMPLES) == {2: 1.0}  # DP's steps: stale
    assert 120.0 + MIN_SAMPLES - (100.0 + MIN_SAMPLES) > STRETCH_S


def test_a_points_window_is_its_latest_samples():
    """Past ``WINDOW`` samples a point reads the latest ones only: its low percentile
    and mean work over them, whatever order the evicted samples came in (the window
    keeps its ms sorted as they come and go)."""
    import random

    from flying.session.step_costs import QUANTILE, WINDOW, _Window

    rng = random.Random(7)
    window, seen = _Window(), []
    for i in range(5 * WINDOW):
        work, ms = float(rng.choice([5, 6, 7, 8])), rng.choice([rng.uniform(5, 60), 9.0])
        window.append(work, ms)
        seen.append((work, ms))
        latest = seen[-WINDOW:]
        ordered = sorted(m for _, m in latest)
        assert len(window) == len(latest)
        assert window.point() == (sum(w for w, _ in latest) / len(latest),
                                  ordered[int(QUANTILE * (len(ordered) - 1))]), i


def test_a_stretched_prefill_point_is_measured_against_the_line_past_it():
    """A prefill point above a bigger one is dropped from the policy's curve (the line
    runs from 16 tokens straight to 64), so its steps are stretched against that line:
    20 tokens at 326 ms over 180 + 70 * 4 / 48 ms, not over the 64-token point's 250
    (what the curve read when such a point was lowered to the next)."""
    from flying.session.step_costs import MIN_SAMPLES

    clock = StepClock()
    for i in range(MIN_SAMPLES):  # quiet points: 16 and 64 tokens, 20 stretched
        for tokens, ms in ((16, 180.0), (20, 326.0), (64, 250.0)):
            clock.record(1, ms, "prefill", tokens, now=float(i))
    for i in range(2 * MIN_SAMPLES):
        clock.record(1, 326.0, "prefill", 20, now=100.0 + i)
    line = 180.0 + 70.0 * 4 / 48
    assert clock.stretch(now=100.0 + 2 * MIN_SAMPLES) == {1: pytest.approx(326.0 / line, abs=1e-3)}


def test_the_calibrations_stretch_is_forgotten_and_its_points_kept():
    """The start-up calibration's steps make points and live steps; their stretch (one
    pass over the other) and their live mean are no serving's and are forgotten when
    the probe is done, now and last; the quietest live mean stays; serving measures its
    own from then on."""
    from flying.session.step_costs import MIN_SAMPLES

    clock = StepClock()
    for i in range(MIN_SAMPLES):  # the first pass: a best of 10 ms at batch 1
        clock.record(2, 10.0, "decode", 1, now=float(i))
    for i in range(MIN_SAMPLES):  # the second pass ran 1.5x
        clock.record(2, 15.0, "decode", 1, now=10.0 + i)
    assert clock.stretch(now=20.0) == {2: 1.5} == clock.stretch_last()
    low = clock.live_low_ms()
    assert clock.live_ms()[2] > low[2]  # the stretched pass in the live mean
    clock.forget_calibration()
    assert clock.stretch(now=20.0) == {} == clock.stretch_last()
    assert clock.curves()[2]["decode"] == [[1.0, 10.0]] and clock.live_ms() == {}
    assert clock.live_low_ms() == low
    for i in range(MIN_SAMPLES):  # serving
        clock.record(2, 12.0, "decode", 1, now=30.0 + i)
    assert clock.stretch(now=40.0) == {2: 1.2} == clock.stretch_last()
    assert clock.live_ms() == {2: 12.0}  # serving's steps alone
