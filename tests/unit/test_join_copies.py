"""What a joining request's copy carries to the other members of a group (pure: a
stand-in for SGLang's ``Req`` with the fields ``join_wire.pickled`` leaves behind)."""

from __future__ import annotations

import pickle
import threading

import pytest

from flying.session import join_wire

pytestmark = pytest.mark.unit


class _Collector:
    """Like SGLang's Prometheus collector under ``--enable-metrics``: holds a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


class _Req:
    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.output_ids = [1, 2, 3]
        self.tokenizer = object()
        self.lock = threading.Lock()
        self.last_node = object()
        self.time_stats = object()
        self.metrics_collector = _Collector()


def test_a_copy_leaves_the_sources_locks_and_metrics_collector_behind():
    """Under ``--enable-metrics`` a running request holds its engine's collector (thread
    locks): pickling it for a join raised and failed the group, and the request taken
    out of DP was answered by nobody (a client waited forever)."""
    reqs = [_Req("a"), _Req("b")]
    before = [(r.tokenizer, r.lock, r.last_node, r.time_stats, r.metrics_collector)
              for r in reqs]
    with pytest.raises(TypeError):
        pickle.dumps(reqs)
    copies = pickle.loads(join_wire.pickled(reqs))
    assert [c.rid for c in copies] == ["a", "b"]
    assert all(c.output_ids == [1, 2, 3] for c in copies)
    assert all(getattr(c, name) is None for c in copies for name in join_wire.NOT_COPIED)
    after = [(r.tokenizer, r.lock, r.last_node, r.time_stats, r.metrics_collector)
             for r in reqs]
    assert after == before  # the source's requests keep their own
