"""``workloads.vs_groups_off``'s per-round ratios, its run modes and the pooled report
(``workloads.reports.pooled``); pure: no server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from workloads.comparisons import vs_groups_off as vgo
from workloads.reports import pooled

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


def _write_rounds(tmp_path, name: str, scale: float, rounds: int = 4) -> None:
    """``rounds`` result files of 50 requests: TTFTs and gaps drawn per round, times
    ``scale``; a round's spread (its own factor) is shared by both systems."""
    rng = np.random.default_rng(7)
    for r in range(rounds):
        slow = 1.0 + 0.2 * r  # round-to-round drift, as on the machine
        ttfts = (rng.uniform(0.04, 0.2, 50) * slow * scale).tolist()
        itls = [(rng.uniform(0.008, 0.03, 9) * slow * scale).tolist() for _ in range(50)]
        result = {"ttfts": ttfts, "itls": itls, "output_lens": [10] * 50}
        (tmp_path / f"{name}.round{r}.jsonl").write_text(json.dumps(result) + "\n")


def test_pooled_ratio_of_a_uniformly_slower_system_is_exact_with_no_spread(tmp_path):
    _write_rounds(tmp_path, "flying", 1.10)
    _write_rounds(tmp_path, "groups-off", 1.00)
    rows = pooled.compare(pooled.load_rounds(tmp_path, "flying"),
                          pooled.load_rounds(tmp_path, "groups-off"), draws=200)
    assert [r[0] for r in rows] == [label for label, _, _ in pooled.FIGURES]
    for label, a, b, ratio, low, high in rows:
        assert ratio == pytest.approx(1.10) and low == pytest.approx(1.10), label
        assert high == pytest.approx(1.10) and a == pytest.approx(1.10 * b), label
    # each figure is the percentile of every round's requests together
    ttfts = np.concatenate([json.loads((tmp_path / f"groups-off.round{r}.jsonl").read_text())["ttfts"]
                            for r in range(4)])
    p90 = next(r for r in rows if r[0] == "TTFT p90")
    assert p90[2] == pytest.approx(np.percentile(ttfts, 90) * 1e3)
    # a request's TPOT (ms) is its mean gap: within the gaps' range over the rounds' drift
    tpot = next(r for r in rows if r[0] == "TPOT p50")
    assert 8.0 < tpot[2] < 30.0 * 1.6


def test_pooled_interval_of_two_different_draws_brackets_their_ratio(tmp_path):
    _write_rounds(tmp_path, "flying", 1.0)
    rng = np.random.default_rng(3)
    for r in range(4):  # the other system: same drift, its own draws
        slow = 1.0 + 0.2 * r
        result = {"ttfts": (rng.uniform(0.04, 0.2, 50) * slow).tolist(),
                  "itls": [(rng.uniform(0.008, 0.03, 9) * slow).tolist() for _ in range(50)],
                  "output_lens": [10] * 50}
        (tmp_path / f"groups-off.round{r}.jsonl").write_text(json.dumps(result) + "\n")
    text = pooled.report(tmp_path)
    assert "Every request of 4 rounds" in text
    for label, _, _, ratio, low, high in pooled.compare(
            pooled.load_rounds(tmp_path, "flying"), pooled.load_rounds(tmp_path, "groups-off")):
        assert low <= ratio <= high and high - low < 0.5, label


def test_pooled_report_is_empty_without_detailed_rounds(tmp_path):
    assert pooled.report(tmp_path) == ""
