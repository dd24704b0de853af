"""A group's own prefix cache (``tp_scope._session_cache``) on real SGLang: a request
admitted into a running TP-2 session reuses the KV of an earlier request of that
session with the same prefix, as on each rank of SGLang's own ``--tp-size`` server, and
its tokens stay exact; the session's slots all come back when it ends."""

from __future__ import annotations

import threading
import time

import pytest

from tests.integration.test_switching import TP2, _generate, _status, _wait_idle_status
from tests.reference import greedy_tokens, prompts

pytestmark = pytest.mark.integration


def _beside_a_running_group(server, first_ids, second_ids):
    """A long TP-2 request (400 tokens), and a short one (8) sent once the first runs in
    its group and has been prefilled; returns both answers and when each came."""
    done: dict = {}

    def first() -> None:
        done["first"] = _generate(server, first_ids, 400, TP2)
        done["first_at"] = time.monotonic()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        deadline = time.monotonic() + 60.0
        while not any(e["mode"] != "dp" for e in _status(server)["engines"]):
            assert time.monotonic() < deadline, "the first request never formed a group"
            time.sleep(0.05)
        time.sleep(0.3)  # the first request's prompt is prefilled (and cached) by now
        second = _generate(server, second_ids, 8, TP2)
        second_at = time.monotonic()
    finally:
        thread.join(timeout=300)
    return done["first"], done["first_at"], second, second_at


def test_a_request_joining_a_group_reuses_a_prefix_of_its_session(dp2_server, demo_model_dir):
    prefix = prompts(1, 96, seed=41)[0]
    first_ids, second_ids = [*prefix, 5, 6, 7], [*prefix, 11, 12, 13, 14]
    first, _, second, _ = _beside_a_running_group(dp2_server, first_ids, second_ids)
    assert first["meta_info"]["flying"]["mode"] == "tp"
    assert first["output_ids"] == greedy_tokens(demo_model_dir, first_ids, 400)
    meta = second["meta_info"]
    assert meta["flying"]["mode"] == "tp" and meta["flying"]["ranks"] == [0, 1]
    # the shared prompt came from the group's cache: only the new suffix was prefilled
    assert len(prefix) <= meta["cached_tokens"] < len(second_ids)
    assert second["output_ids"] == greedy_tokens(demo_model_dir, second_ids, 8)
    doc = _wait_idle_status(dp2_server)
    for engine in doc["engines"]:  # the cache's nodes went with the session's slots
        assert engine["free_kv_slots"] == engine["total_kv_slots"], engine


def test_a_request_joins_a_running_group_when_cached_dp_prefixes_fill_the_engines(dp2_server):
    """Admission into a running session takes its DP slots as a bind does: cached DP
    prefixes (evictable) give way. Without that, a member whose free KV is all cached
    prefixes refused the request, admission closed for the session, and the request
    waited for the whole session to drain before it got one of its own."""
    # Both engines' DP pools full of cached 50-token prompts (more than fit: LRU keeps
    # them full), so whatever a bind evicts leaves under 51 slots free, and the joining
    # request needs 56 (112 tokens at 2 per slot).
    for ids in prompts(90, 50, seed=43):
        assert _generate(dp2_server, ids, 1)["meta_info"]["flying"]["mode"] == "dp"
    first_ids, second_ids = prompts(2, 100, seed=44)
    first, first_at, second, second_at = _beside_a_running_group(dp2_server, first_ids, second_ids)
    assert second["meta_info"]["flying"]["mode"] == first["meta_info"]["flying"]["mode"] == "tp"
    assert second_at < first_at - 0.5, "the second request waited for the session to end"
