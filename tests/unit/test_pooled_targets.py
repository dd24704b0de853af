"""``workloads.reports.pooled_targets``: #21's targets over compare rounds, pooled."""

from __future__ import annotations

import numpy as np
import pytest

from workloads.measure.records import RequestRecord, save_records
from workloads.reports.pooled_targets import Run, compare, figures, pooled_slos, report, runs

pytestmark = pytest.mark.unit


def _run(ttft_ms: float, n: int = 10, gap_s: float = 1.0) -> list[RequestRecord]:
    """``n`` requests ``gap_s`` apart, each of 5 tokens 20 ms apart after a first token of
    ``ttft_ms``; the first half in phase "low", the rest in "burst"."""
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


def _tally(good: int) -> Run:
    return Run(good, 100, 10.0, {"burst ttft": np.array([0.1]), "quiet ttft": np.array([0.1]),
                                 "quiet tpot": np.array([0.02]), "all itl": np.array([0.02])})


def test_goodput_pools_every_rounds_requests_over_the_sum_of_their_spans():
    # round 1: Flying slow (every request past 400 ms); round 2: static DP slow
    rounds = [
        {"static-dp": _run(100), "static-tp": _run(100), "flying": _run(500)},
        {"static-dp": _run(500, n=20), "static-tp": _run(100), "flying": _run(100, n=20)},
    ]
    slos = pooled_slos(rounds, "low")
    assert slos == pytest.approx((400.0, 30.0))  # static TP's quiet TTFT 100 ms, TPOT 20
    counted = runs(rounds, slos)
    assert (counted[0]["flying"].good, counted[0]["flying"].tokens) == (0, 50)
    got = figures(counted, [0, 1])
    dp = 10 / (_span(rounds[0]["static-dp"]) + _span(rounds[1]["static-dp"]))
    tp = 20 / (_span(rounds[0]["static-tp"]) + _span(rounds[1]["static-tp"]))
    fl = 20 / (_span(rounds[0]["flying"]) + _span(rounds[1]["flying"]))
    assert got["goodput (req/s)"][:3] == pytest.approx((dp, tp, fl))
    assert got["goodput (req/s)"][3] == pytest.approx(fl / max(dp, tp))
    tokens = 150 / (_span(rounds[0]["flying"]) + _span(rounds[1]["flying"]))
    assert got["throughput (tok/s)"][2] == pytest.approx(tokens)


def test_latency_figures_are_percentiles_of_every_rounds_requests():
    rounds = [
        {"static-dp": _run(100), "static-tp": _run(50), "flying": _run(500)},
        {"static-dp": _run(100), "static-tp": _run(50), "flying": _run(100, n=30)},
    ]
    got = figures(runs(rounds, (400.0, 30.0)), [0, 1])
    # Flying's quiet first tokens: 5 at 500 ms and 15 at 100 ms pooled
    quiet = float(np.percentile([0.5] * 5 + [0.1] * 15, 50)) * 1e3
    assert got["TTFT p50, quiet (ms)"][2] == pytest.approx(quiet)
    assert got["TTFT p50, quiet (ms)"][3] == pytest.approx(quiet / 50.0)  # the better: TP
    burst = float(np.percentile([0.5] * 5 + [0.1] * 15, 90)) * 1e3
    assert got["TTFT p90, burst (ms)"][3] == pytest.approx(burst / 100.0)  # against DP
    assert got["ITL p99 (ms)"][3] == pytest.approx(1.0)


def test_the_interval_resamples_rounds_and_brackets_the_ratio():
    same = [{"static-dp": _tally(10), "static-tp": _tally(8), "flying": _tally(10)}
            for _ in range(4)]
    rows = {r[0]: r for r in compare(same)}
    assert rows["goodput (req/s)"][4:] == pytest.approx((1.0, 1.0, 1.0))  # ratio, low, high
    spread = [{"static-dp": _tally(10), "static-tp": _tally(8), "flying": _tally(g)}
              for g in (6, 9, 12, 13)]
    label, _dp, _tp, fl, ratio, low, high = compare(spread)[0]
    assert label == "goodput (req/s)" and fl == pytest.approx(1.0) and ratio == pytest.approx(1.0)
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
    assert "TTFT p90, burst" in out and "TTFT p90, idle" not in out
    # a trace without the phases: the SLOs from every request, no phase rows
    assert "TTFT p50, quiet" not in report(tmp_path, burst="idle", quiet="none")
    assert "TTFT p90, burst" not in report(tmp_path, burst="idle", quiet="none")


def test_targets_leaves_out_a_round_still_running_and_says_so(tmp_path, capsys):
    """A round without every system's records (its run still going, or failed) is left
    out of both tables with a line on stderr; no complete round, or a directory that is
    no comparison: a one-line error, not a traceback."""
    from workloads.reports.targets import main

    for i in (1, 2, 3):
        for name in ("static-dp", "static-tp", "flying"):
            if i == 3 and name == "static-dp":
                continue  # round 3's static DP has not run yet
            (tmp_path / f"round{i}" / name).mkdir(parents=True)
            save_records(_run(100), tmp_path / f"round{i}" / name / "records.jsonl")
    main([str(tmp_path)])
    captured = capsys.readouterr()
    assert "Every request of 2 rounds pooled" in captured.out
    assert "| target | round 1 | round 2 | median" in captured.out
    assert "round3: not every system's records are there yet" in captured.err
    with pytest.raises(SystemExit, match="no round has every system's records"):
        main([str(_only(tmp_path, 3))])
    with pytest.raises(SystemExit, match="not a workloads.compare output"):
        main([str(tmp_path / "round3")])


def _only(root, i: int):
    """A directory holding only ``root``'s round ``i`` (as round1)."""
    only = root / f"only{i}"
    (only / "round1").mkdir(parents=True)
    for src in (root / f"round{i}").iterdir():
        (only / "round1" / src.name).symlink_to(src)
    return only
