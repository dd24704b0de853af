"""``workloads.vs_groups_off``'s per-round ratios and its run modes (pure: no server)."""

from __future__ import annotations

import pytest

from workloads.comparisons import vs_groups_off as vgo

pytestmark = pytest.mark.unit


def _round(ttft: float, tpot: float, tok_s: float) -> dict:
    figures = dict.fromkeys((k for k, _ in vgo.ROUND_FIGURES), ttft)
    figures.update(median_tpot_ms=tpot, output_throughput=tok_s)
    return figures


def test_rounds_table_pairs_rounds_and_reports_median_and_range():
    results = {
        "flying": [_round(110, 10, 100), _round(90, 12, 100), _round(100, 11, 100)],
        "groups-off": [_round(100, 10, 100), _round(100, 10, 100), _round(100, 10, 100)],
    }
    rows = {line.split(" | ")[0].strip("| "): line for line in
            vgo.rounds_table(results).splitlines()}
    # TTFT p50 ratios 1.10, 0.90, 1.00: median 1.00, range 0.90-1.10
    assert rows["TTFT p50"] == "| TTFT p50 | 1.10 | 0.90 | 1.00 | 1.00 | 0.90-1.10 |"
    assert rows["TPOT p50"] == "| TPOT p50 | 1.00 | 1.20 | 1.10 | 1.10 | 1.00-1.20 |"
    assert rows["output tok/s"].endswith("| 1.00 | 1.00-1.00 |")


def test_rounds_table_uses_complete_pairs_only():
    results = {"flying": [_round(100, 10, 100), _round(200, 20, 100)],
               "groups-off": [_round(100, 10, 100)]}
    header = vgo.rounds_table(results).splitlines()[0]
    assert "round 1" in header and "round 2" not in header


def test_one_at_a_time_excludes_restart_swapped():
    assert vgo.parse_args(["--one-at-a-time"]).one_at_a_time
    with pytest.raises(SystemExit):
        vgo.parse_args(["--one-at-a-time", "--restart-swapped"])
