"""``workloads.reports.pooled_goodput``: #21's goodput targets over compare rounds pooled."""

from __future__ import annotations

import pytest

from workloads.measure.records import RequestRecord, save_records
from workloads.reports.pooled_goodput import Tally, compare, figures, pooled_slos, report, tallies

pytestmark = pytest.mark.unit


def _run(ttft_ms: float, n: int = 10, gap_s: float = 1.0) -> list[RequestRecord]:
    """``n`` requests ``gap_s`` apart, each of 5 tokens 20 ms apart after a first token of
    ``ttft_ms``; the first half in phase "low"."""
    out = []
    for i in range(n):
        ttft = ttft_ms / 1e3
        out.append(RequestRecord(
            index=i, arrival_s=i * gap_s, prompt_len=20, output_len=5,
            phase="low" if i < n // 2 else "burst", send_s=i * gap_s, ttft_s=ttft,
            itl_s=[0.02] * 4, tpot_s=0.02, e2e_s=ttft + 0.08, output_tokens=5, success=True))
    return out


def _span(records: list[RequestRecord]) -> float:
    return records[-1].end_s - records[0].send_s


def test_goodput_pools_every_rounds_requests_over_the_sum_of_their_spans():
    # round 1: Flying slow (every request past 400 ms); round 2: static DP slow
    rounds = [
        {"static-dp": _run(100), "static-tp": _run(100), "flying": _run(500)},
        {"static-dp": _run(500, n=20), "static-tp": _run(100), "flying": _run(100, n=20)},
    ]
    slos = pooled_slos(rounds, "low")
    assert slos == pytest.approx((400.0, 30.0))  # static TP's quiet TTFT 100 ms, TPOT 20
    counted = tallies(rounds, slos)
    assert counted[0]["flying"] == Tally(0, 50, pytest.approx(_span(rounds[0]["flying"])))
    got = figures(counted, [0, 1])
    dp = 10 / (_span(rounds[0]["static-dp"]) + _span(rounds[1]["static-dp"]))
    tp = 20 / (_span(rounds[0]["static-tp"]) + _span(rounds[1]["static-tp"]))
    fl = 20 / (_span(rounds[0]["flying"]) + _span(rounds[1]["flying"]))
    assert got["goodput"][:3] == pytest.approx((dp, tp, fl))
    assert got["goodput"][3] == pytest.approx(fl / max(dp, tp))
    tokens = 150 / (_span(rounds[0]["flying"]) + _span(rounds[1]["flying"]))
    assert got["throughput"][2] == pytest.approx(tokens)


def test_the_interval_resamples_rounds_and_brackets_the_ratio():
    same = [{"static-dp": Tally(10, 100, 10.0), "static-tp": Tally(8, 100, 10.0),
             "flying": Tally(10, 100, 10.0)} for _ in range(4)]
    rows = {r[0]: r for r in compare(same)}
    assert rows["goodput"][4:] == pytest.approx((1.0, 1.0, 1.0))  # ratio, low, high
    spread = [{"static-dp": Tally(10, 100, 10.0), "static-tp": Tally(8, 100, 10.0),
               "flying": Tally(g, 100, 10.0)} for g in (6, 9, 12, 13)]
    label, _dp, _tp, fl, ratio, low, high = compare(spread)[0]
    assert label == "goodput" and fl == pytest.approx(1.0) and ratio == pytest.approx(1.0)
    assert 0.6 <= low < ratio < high <= 1.3
    assert compare([]) == []


def test_targets_prints_the_pooled_table_after_the_rounds(tmp_path, capsys):
    from workloads.reports.targets import main

    for i, flying in enumerate((100, 500, 100), start=1):
        for name, ttft in (("static-dp", 100), ("static-tp", 100), ("flying", flying)):
            (tmp_path / f"round{i}" / name).mkdir(parents=True)
            save_records(_run(ttft), tmp_path / f"round{i}" / name / "records.jsonl")
    main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "Every request of 3 rounds pooled" in out and "TTFT <= 400 ms" in out
    line = next(x for x in out.splitlines() if x.startswith("| goodput (req/s)"))
    fast, slow = _span(_run(100)), _span(_run(500))
    ratio = (20 / (2 * fast + slow)) / (30 / (3 * fast))  # 20 of Flying's 30 within SLO
    assert f"| {ratio:.2f} |" in line, line
    assert report(tmp_path / "round1") == ""  # not a directory of rounds
