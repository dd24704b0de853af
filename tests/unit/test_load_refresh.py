"""An engine's load snapshot between SGLang's own publishes (``flying.session.load_refresh``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flying.session.load_refresh import LoadRefresh

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _engine(interval: int):
    """A scheduler whose writer counts decode steps as SGLang's does (publishing every
    ``interval``-th), and a refresh on a clock the test moves."""
    writer = SimpleNamespace(publish_counter=0, publish_interval=interval, published=0)
    scheduler = SimpleNamespace(load_snapshot_writer=writer)
    clock = Clock()

    def publish(sched):  # Scheduler.publish_load_snapshot(force=True)
        sched.load_snapshot_writer.publish_counter = 0
        sched.load_snapshot_writer.published += 1

    def step(ms: float) -> bool:
        clock.t += ms / 1000.0
        writer.publish_counter += 1
        if writer.publish_counter >= writer.publish_interval:  # SGLang's own publish
            publish(scheduler)
        return refresh.after_step(scheduler, publish)

    refresh = LoadRefresh(0.25, clock)
    return writer, step


def test_slow_decode_steps_publish_at_the_refresh_interval():
    """300 ms decode steps: SGLang's every-15th publish is 4.5 s apart; with the refresh
    every step publishes (no snapshot is older than one step)."""
    writer, step = _engine(15)
    extra = [step(300.0) for _ in range(30)]
    assert all(extra)
    assert writer.published == 30


def test_fast_steps_keep_sglangs_cadence():
    """10 ms decode steps: SGLang publishes every 150 ms, within the interval: no extra."""
    writer, step = _engine(15)
    extra = [step(10.0) for _ in range(300)]
    assert sum(extra) == 0
    assert writer.published == 20


def test_between_fast_and_slow_at_most_one_extra_per_interval():
    """40 ms steps (15 of them 0.6 s): a publish every 7th step (280 ms), the first past
    0.25 s since the last."""
    writer, step = _engine(15)
    extra = sum(step(40.0) for _ in range(150))  # 6 s
    assert extra == 150 // 7
    assert writer.published == extra  # each resets SGLang's count: its own never comes


def test_no_writer_no_publish():
    refresh = LoadRefresh(0.25, Clock())
    assert not refresh.after_step(SimpleNamespace(), lambda s: pytest.fail("published"))


def test_a_dp_step_of_the_engine_publishes_when_its_snapshot_is_old():
    """The engine's hook on SGLang's ``process_batch_result`` runs SGLang's own, then the
    refresh: a DP step 0.3 s after the last publish publishes (force=True), the next
    step right after it does not."""
    from flying.session.engine import FlyingEngine

    clock = Clock()
    engine = FlyingEngine(dp_rank=0, pool=None, bind_timeout_s=1.0)
    engine.load_refresh = LoadRefresh(0.25, clock)
    forced = []
    writer = SimpleNamespace(publish_counter=0)

    def publish_load_snapshot(force=False):
        forced.append(force)
        writer.publish_counter = 0

    scheduler = SimpleNamespace(load_snapshot_writer=writer,
                                publish_load_snapshot=publish_load_snapshot)

    def original(sched, batch, result):  # SGLang's: a decode step it does not publish
        writer.publish_counter += 1
        return "processed"

    clock.t += 0.3
    assert engine.process_batch_result(scheduler, original, None, None) == "processed"
    assert forced == [True]
    clock.t += 0.01
    engine.process_batch_result(scheduler, original, None, None)
    assert forced == [True]
