"""``workloads.comparisons.graded_slos``: with ``--flying-graded-slos`` compare's Flying
run is given the SLOs that ``workloads.targets`` grades the comparison at."""

from __future__ import annotations

import pytest

from workloads.comparisons.compare import parse_args
from workloads.comparisons.graded_slos import graded_slos, slo_args
from workloads.measure.records import RequestRecord, save_records
from workloads.reports.pooled_targets import pooled_slos

pytestmark = pytest.mark.unit


def _records(ttft_ms: float, tpot_ms: float, phase: str = "low", n: int = 4
             ) -> list[RequestRecord]:
    return [RequestRecord(index=i, arrival_s=float(i), prompt_len=8, output_len=4, phase=phase,
                          send_s=float(i), ttft_s=ttft_ms / 1e3, tpot_s=tpot_ms / 1e3,
                          itl_s=[tpot_ms / 1e3] * 3, e2e_s=1.0, output_tokens=4, success=True)
            for i in range(n)]


def _save(out, name: str, records: list[RequestRecord]) -> None:
    (out / name).mkdir(parents=True, exist_ok=True)
    save_records(records, out / name / "records.jsonl")


def test_nothing_is_given_before_static_tp_has_run(tmp_path):
    _save(tmp_path, "static-dp", _records(100.0, 10.0))
    assert graded_slos(tmp_path) is None
    assert slo_args(tmp_path, [], graded=True) == []


def test_a_single_comparison_gives_its_static_tp_quiet_slos(tmp_path):
    """4x static TP's quiet TTFT p50, 1.5x its quiet TPOT p50; its burst requests do not
    count where the trace has a quiet phase, every request where it has none."""
    _save(tmp_path, "static-tp", _records(200.0, 40.0) + _records(9000.0, 400.0, "burst", 9))
    assert graded_slos(tmp_path) == pytest.approx((800.0, 60.0))
    assert slo_args(tmp_path, ["--flying-phase-s", "5"], graded=True) == [
        "--flying-slo-ttft", "800", "--flying-slo-tpot", "60"]
    poisson = tmp_path / "poisson"
    _save(poisson, "static-tp", _records(300.0, 20.0, "poisson"))
    assert graded_slos(poisson) == pytest.approx((1200.0, 30.0))


def test_a_round_is_given_the_rounds_pooled_as_the_targets_pool_them(tmp_path):
    """Round 3 runs Flying first (the order rotates): it gets rounds 1 and 2's static TP,
    pooled as ``workloads.targets`` pools every round's."""
    rounds = [tmp_path / f"round{k}" for k in (1, 2, 3)]
    _save(rounds[0], "static-tp", _records(200.0, 40.0))
    _save(rounds[1], "static-tp", _records(400.0, 40.0))
    rounds[2].mkdir()
    pooled = pooled_slos([{"static-tp": _records(200.0, 40.0) + _records(400.0, 40.0)}], "low")
    assert graded_slos(rounds[2]) == pytest.approx(pooled)
    assert graded_slos(rounds[2]) == pytest.approx((1200.0, 60.0))


def test_slos_set_in_flying_args_are_kept_and_none_are_given_by_default(tmp_path):
    _save(tmp_path, "static-tp", _records(200.0, 40.0))
    assert slo_args(tmp_path, ["--flying-slo-tpot", "25"], graded=True) == []
    assert slo_args(tmp_path, ["--flying-slo-ttft=900"], graded=True) == []
    assert slo_args(tmp_path, [], graded=False) == []
    assert parse_args(["--flying-graded-slos"]).flying_graded_slos
    assert not parse_args([]).flying_graded_slos  # the node derives its own by default
