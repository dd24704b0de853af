"""The start-up calibration's staggered batches (``flying.node.probe``)."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from flying.node import probe

pytestmark = pytest.mark.unit


def _batch_per_step(lengths: list[int]) -> list[int]:
    """Requests decoding at each step of a batch whose requests stop after ``lengths``
    tokens (all admitted together)."""
    return [sum(n >= step for n in lengths) for step in range(1, max(lengths) + 1)]


def test_the_stagger_decodes_the_same_steps_at_every_calibrated_size():
    steps = Counter(_batch_per_step(probe.stagger_lengths()))
    assert steps == {size: probe.CALIBRATE_STEPS for size in probe.CALIBRATE_SIZES}
    assert max(probe.CALIBRATE_SIZES) >= 16  # past the small sizes whose slope is flat


def test_a_custom_stagger_runs_each_size_for_its_steps():
    assert probe.stagger_lengths((5, 2), steps=3) == [3, 3, 3, 6, 6]
    assert Counter(_batch_per_step(probe.stagger_lengths((6, 3, 1), 2))) == {6: 2, 3: 2, 1: 2}


def test_dp_runs_the_whole_stagger_on_every_engine_and_a_group_runs_it_once():
    lengths = probe.stagger_lengths()
    dp = probe.calibration_asks(1, engines=2)
    assert sorted(n for e, n in dp if e == 0) == lengths
    assert sorted(n for e, n in dp if e == 1) == lengths
    assert len(dp) == 2 * len(lengths)
    assert probe.calibration_asks(2, engines=2) == [(None, n) for n in lengths]


def test_a_bigger_batch_is_calibrated_only_where_it_fits_in_half_the_kv_slots():
    longest = probe.CALIBRATE_PROMPT + probe.CALIBRATE_STEPS * len(probe.CALIBRATE_SIZES)
    assert probe.calibration_sizes(0) == (4, 3, 2, 1)
    assert probe.calibration_sizes(2048) == (4, 3, 2, 1)  # the tests' engines
    assert probe.calibration_sizes(2 * 8 * longest) == (8, 4, 3, 2, 1)
    assert probe.calibration_sizes(16384) == probe.CALIBRATE_SIZES  # hidden-768 on CPU
    small = probe.calibration_asks(1, 1, probe.calibration_sizes(0))
    assert sorted(n for _, n in small) == [8, 16, 24, 32]


def test_every_mode_is_calibrated_twice_in_turn_each_pass_with_a_prompt_of_its_own():
    """DP, TP-2, DP, TP-2: a stretch of the machine during one pass leaves the other
    pass's lower points; no pass finds another's prompt cached (its prefill is
    measured again)."""
    passes = probe.calibration_passes([2])
    assert [d for d, _ in passes] == [1, 2] * probe.CALIBRATE_PASSES
    assert probe.CALIBRATE_PASSES >= 2
    assert len({p[0] for _, p in passes}) == len(passes)  # first tokens all differ
    assert all(len(p) == probe.CALIBRATE_PROMPT for _, p in passes)
    assert [d for d, _ in probe.calibration_passes([2, 4], passes=1)] == [1, 2, 4]


class _Store:
    """The keys the probe sets, in order."""

    def __init__(self):
        self.sets: list[tuple[str, str]] = []

    def set(self, key: str, value: str) -> None:
        self.sets.append((key, value))


@pytest.mark.parametrize("outcome", ["open", "differs", "no-degree"])
def test_the_probe_is_marked_done_once_and_before_the_gate_opens(monkeypatch, outcome):
    from flying.session.status import CALIBRATED_KEY

    asks: list[tuple[int, int | None]] = []

    def ask(url, degree, prompt=probe.PROBE_PROMPT, tokens=8, engine=None):
        asks.append((degree, engine))
        return [1, 2] if degree == 1 or outcome == "open" else [3]

    monkeypatch.setitem(probe._STATE, "gate", probe.PROBING)
    monkeypatch.setattr(probe, "_ask", ask)
    monkeypatch.setattr(probe, "_counts", lambda url: (0, 0))
    monkeypatch.setattr(probe, "calibrate", lambda url, degrees, engines: None)
    monkeypatch.setattr(probe, "_log_slo", lambda store, degrees, engines: None)
    store = _Store()
    degrees = [] if outcome == "no-degree" else [2]
    gate = probe.run("http://node", degrees, store, engines=2)
    keys = [k for k, _ in store.sets]
    assert keys.count(CALIBRATED_KEY) == 1
    if outcome == "open":
        assert gate == probe.OPEN
        assert keys.index(CALIBRATED_KEY) < keys.index(probe.GATE_KEY)
        assert asks[-2:] == [(1, 0), (1, 1)]  # each engine steps once after it is set
    else:
        assert gate.startswith("closed:") and store.sets[-1] == (CALIBRATED_KEY, "1")
        assert (1, 0) not in asks  # no engine is asked to step for a calibration not run



def test_every_mode_measures_a_long_extend_step_after_its_passes(monkeypatch):
    """After the passes, a long prompt alone on each of every mode's servers (the DP
    engines together, then the group), sharing no prefix with any pass's prompt; at most
    a quarter of an engine's KV slots, none where that is short; ids valid in the demo
    vocabulary."""
    sent: list[tuple[int, int | None, tuple[int, ...]]] = []
    together = threading.Barrier(2, timeout=5)  # one engine after the other breaks it

    def ask(url, degree, prompt=probe.PROBE_PROMPT, tokens=probe.PROBE_TOKENS, engine=None):
        sent.append((degree, engine, tuple(prompt)))
        if degree == 1 and len(prompt) > probe.CALIBRATE_PROMPT:
            together.wait()
        return [1]

    monkeypatch.setattr(probe, "_ask", ask)
    monkeypatch.setattr(probe, "_kv_slots", lambda url: 16384)
    probe.calibrate("http://node", [2], engines=2)
    long = [(d, e, len(p)) for d, e, p in sent if len(p) > probe.CALIBRATE_PROMPT]
    assert sorted(long[:2]) == [(1, 0, 2048), (1, 1, 2048)]  # the DP engines together
    assert long[2:] == [(2, None, 2048)]
    firsts = {p[0] for _, _, p in sent[:-3]}
    assert not firsts & {p[0] for _, _, p in sent[-3:]}
    assert max(t for _, _, p in sent for t in p) < 512
    assert probe.long_prompt_length(2048) == 512  # the tests' engines
    assert probe.long_prompt_length(1000) == 0 and probe.long_prompt_length(0) == 0


def test_a_rejected_long_prompt_loses_its_point_alone(monkeypatch):
    calls: list[int] = []

    def ask(url, degree, prompt=probe.PROBE_PROMPT, tokens=probe.PROBE_TOKENS, engine=None):
        calls.append(len(prompt))
        if len(prompt) > probe.CALIBRATE_PROMPT:
            raise RuntimeError("HTTP 400: longer than the model's context")
        return [1]

    monkeypatch.setattr(probe, "_ask", ask)
    monkeypatch.setattr(probe, "_kv_slots", lambda url: 16384)
    probe.calibrate("http://node", [2], engines=2)  # never raises
    # every pass ran (each mode's prompt alone and its batch), then the DP engines' long
    # attempts (together), and no group's after them
    per_pass = {1: 2 * (1 + len(probe.stagger_lengths())), 2: 1 + len(probe.stagger_lengths())}
    passes = sum(per_pass[d] for d, _ in probe.calibration_passes([2]))
    assert calls == [probe.CALIBRATE_PROMPT] * passes + [probe.CALIBRATE_LONG] * 2
