"""``/get_load``'s entries: SGLang's per-engine snapshot plus a running group session."""

from __future__ import annotations

import pytest

from flying.node.load import engine_loads

pytestmark = pytest.mark.unit


def test_dp_engines_report_sglangs_snapshot():
    snaps = [
        {"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 1, "num_used_tokens": 40,
         "num_waiting_uncached_tokens": 7},
        {"dp_rank": 1},
    ]
    status = {"engines": [{"rank": 0, "mode": "dp", "free_kv_slots": 10, "total_kv_slots": 99},
                          {"rank": 1, "mode": "dp"}]}
    loads = engine_loads(snaps, status, 2)
    assert loads[0] == {"dp_rank": 0, "num_reqs": 2, "num_waiting_reqs": 1, "num_tokens": 47,
                        "flying": {"mode": "dp", "session_tokens": 0}}
    assert loads[1]["num_tokens"] == 0


def test_a_bound_engine_counts_its_sessions_tokens_and_pending_binds():
    snaps = [{"dp_rank": r, "num_used_tokens": 5} for r in range(2)]
    bound = {"mode": "tp2", "free_kv_slots": 300, "total_kv_slots": 1000, "pending_binds": 1}
    status = {"engines": [{"rank": 0, **bound}, {"rank": 1, **bound}]}
    for entry in engine_loads(snaps, status, 2):
        assert entry["flying"] == {"mode": "tp2", "session_tokens": 700}
        assert entry["num_tokens"] == 705 and entry["num_waiting_reqs"] == 1


def test_missing_documents_still_give_one_entry_per_engine():
    loads = engine_loads([], {"engines": []}, 2)
    assert [e["dp_rank"] for e in loads] == [0, 1]
    assert all(e["num_tokens"] == 0 and e["flying"]["mode"] == "unknown" for e in loads)
