"""The start-up calibration's requests (``flying.node.probe.calibrate``), without a server."""

from __future__ import annotations

import threading
import time

import pytest

from flying.node import probe

pytestmark = pytest.mark.unit


def test_calibration_ends_with_dp_alone_on_each_engine_in_turn(monkeypatch):
    """Every mode gets its prompt alone and its staggered batch; then each engine runs
    one DP request with nothing else in flight, so DP's single-request point is timed
    as a group's is (alone on the machine), not only with every engine stepping."""
    calls: list[tuple[int, int | None, int, int]] = []  # degree, engine, tokens, in flight
    lock = threading.Lock()
    inflight = [0]

    def ask(url, degree, prompt=probe.PROBE_PROMPT, tokens=probe.PROBE_TOKENS, engine=None):
        with lock:
            inflight[0] += 1
            calls.append((degree, engine, tokens, inflight[0]))
        time.sleep(0.02)  # long enough for concurrent requests to overlap
        with lock:
            inflight[0] -= 1
        return [0] * tokens

    monkeypatch.setattr(probe, "_ask", ask)
    probe.calibrate("http://node", [2], engines=2)
    staggers = probe.CALIBRATE_BATCH
    assert len(calls) == (1 + 2 * staggers) + (1 + staggers) + 2
    assert [c[0] for c in calls[:1 + 2 * staggers]] == [1] * (1 + 2 * staggers)
    assert [c[0] for c in calls[1 + 2 * staggers:-2]] == [2] * (1 + staggers)
    assert max(c[3] for c in calls) > 1  # the staggered batches run concurrently
    assert calls[-2:] == [(1, 0, probe.ALONE_TOKENS, 1), (1, 1, probe.ALONE_TOKENS, 1)]
    assert probe.ALONE_TOKENS >= 2 * probe.CALIBRATE_STEPS  # more than the stagger's tail


def test_a_failed_calibration_request_is_logged_not_raised(monkeypatch, caplog):
    def ask(*args, **kwargs):
        raise RuntimeError("HTTP 503")

    monkeypatch.setattr(probe, "_ask", ask)
    probe.calibrate("http://node", [2], engines=2)  # never raises: the curves are advice
    assert "calibration incomplete" in caplog.text
