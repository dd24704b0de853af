"""The comparison report on synthetic records: tables, ratios, plots, mode shading."""

from __future__ import annotations

import pytest

from workloads.comparisons.compare import parse_args, run_args
from workloads.load.trace import TraceRequest
from workloads.measure.metrics import summarize
from workloads.measure.records import RequestRecord
from workloads.reports.plots import PLOTS, mode_spans, plot_runs
from workloads.reports.report import (
    RunResult,
    describe_trace,
    load_run,
    render_report,
    save_run,
    write_report,
)
from workloads.reports.timeseries import mode_series

pytestmark = pytest.mark.unit

pytest.importorskip("matplotlib")


def _records(scale: float, modes: list[str | None] | None = None) -> list[RequestRecord]:
    """Ten successful requests, 1 s apart, whose latencies are multiplied by ``scale``."""
    out = []
    for i in range(10):
        ttft, itl = 0.1 * scale, [0.02 * scale] * 4
        mode = modes[i] if modes else None
        out.append(
            RequestRecord(
                index=i,
                arrival_s=float(i),
                prompt_len=20,
                output_len=5,
                phase="burst" if i >= 5 else "low",
                send_s=float(i),
                ttft_s=ttft,
                itl_s=itl,
                tpot_s=0.02 * scale,
                e2e_s=ttft + sum(itl),
                output_tokens=5,
                success=True,
                queue_time_s=0.01 * scale,
                flying={"mode": mode, "degree": 2, "ranks": [0, 1]} if mode else None,
            )
        )
    return out


def _run(name: str, scale: float, modes: list[str | None] | None = None) -> RunResult:
    records = _records(scale, modes)
    return RunResult(
        name=name,
        command=["python", "-m", "flying.node.launch", "--dp-size", "2"],
        ready_s=42.0,
        replay_s=11.0,
        load_before=[0.5, 0.4, 0.3],
        records=records,
        summary=summarize(records),
    )


def _context() -> dict:
    return {
        "title": "test report",
        "command": "python -m workloads.compare --preset cpu-small",
        "machine": {"cores": 2, "torch": "x"},
        "trace": {"requests": 10},
    }


def test_report_has_tables_and_ratios():
    runs = [_run("static-dp", 1.0), _run("static-tp", 2.0), _run("flying", 1.5)]
    text = render_report(runs, _context())
    assert "python -m workloads.compare --preset cpu-small" in text
    for name in ("static-dp", "static-tp", "flying"):
        assert f"### {name}" in text
    assert "### flying / static-dp" in text and "### flying / static-tp" in text
    # TTFT p50: flying 150 ms vs 100 ms (dp) and 200 ms (tp)
    assert "| overall.ttft_ms.p50 | 150.0 | 100.0 | 1.500 |" in text
    assert "| overall.ttft_ms.p50 | 150.0 | 200.0 | 0.750 |" in text
    assert "throughput.output_throughput" in text
    for name in PLOTS:
        assert f"]({name})" in text
    assert "no `meta_info.flying` mode" in text


def test_report_handles_failed_run():
    failed = RunResult(name="static-tp", command=["x"], error="server exited with code 1",
                       log_tail="Traceback: boom")
    text = render_report([_run("static-dp", 1.0), failed, _run("flying", 1.0)], _context())
    assert "Run failed: server exited with code 1" in text and "Traceback: boom" in text
    assert "Not available: needs successful `flying` and `static-tp` runs." in text
    assert "### flying / static-dp" in text


def test_write_report_writes_plots_with_mode_shading(tmp_path):
    modes = ["dp", "dp", "tp", "tp", "dp", "dp", "tp", None, "dp", "dp"]
    runs = [_run("static-dp", 1.0), _run("static-tp", 2.0), _run("flying", 1.0, modes)]
    path = write_report(runs, tmp_path, _context())
    text = path.read_text()
    assert "Engine modes reported by the `flying` run" in text and "tp=3" in text
    for name in PLOTS:
        png = tmp_path / name
        assert png.is_file() and png.stat().st_size > 1000
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_without_queue_times_still_written(tmp_path):
    records = _records(1.0)
    for rec in records:
        rec.queue_time_s = None
    written = plot_runs({"static-dp": records}, tmp_path)
    assert set(written) == set(PLOTS)
    assert all(p.stat().st_size > 0 for p in written.values())


def test_mode_spans_merge_consecutive_buckets():
    modes = ["dp", "dp", "tp", "tp", "dp", "dp", "tp", None, "dp", "dp"]
    series = mode_series(_records(1.0, modes), 1.0)
    spans = mode_spans(series, 1.0)
    # requests last 0.18 s, so request i is in flight only in bucket i
    assert spans == [(2.0, 4.0, "tp"), (6.0, 7.0, "tp")]
    assert mode_spans([(0.0, {"tp": 1}), (1.0, {"tp": 2})], 1.0) == [(0.0, 2.0, "tp")]
    assert mode_spans([], 1.0) == []


def test_save_and_load_run_round_trip(tmp_path):
    run = _run("flying", 1.0, ["tp"] * 10)
    save_run(run, tmp_path / "flying")
    back = load_run(tmp_path / "flying")
    assert back.name == "flying" and back.ready_s == 42.0 and len(back.records) == 10
    assert back.records[0].flying == {"mode": "tp", "degree": 2, "ranks": [0, 1]}
    assert back.summary == run.summary


def test_describe_trace():
    trace = [TraceRequest(i, float(i), 10 + i, 5, phase="low") for i in range(5)]
    facts = describe_trace(trace)
    assert facts["requests"] == 5 and facts["span_s"] == 4.0 and facts["mean_rate_req_s"] == 1.0
    assert facts["prompt_tokens"].startswith("min 10, mean 12, max 14")
    assert describe_trace([]) == {"requests": 0}


def test_run_args_per_system():
    dp = run_args("static-dp", "/m", 2, ["--max-total-tokens", "2048"])
    assert dp[:4] == ["--model-path", "/m", "--dp-size", "2"]
    assert dp[-2:] == ["--max-total-tokens", "2048"]
    tp = run_args("static-tp", "/m", 2)
    assert tp == ["--model-path", "/m", "--tp-size", "2", "--dp-size", "1"]
    fl = run_args("flying", "/m", 4, flying_args=["--flying-bind-timeout-s", "5"])
    assert fl == ["--model-path", "/m", "--dp-size", "4", "--flying-bind-timeout-s", "5"]
    with pytest.raises(ValueError):
        run_args("other", "/m", 2)


def test_parse_args_orders_and_checks_runs():
    assert parse_args(["--runs", "flying,static-dp"]).runs == ["static-dp", "flying"]
    with pytest.raises(SystemExit):
        parse_args(["--runs", "static-xx"])


def test_merge_context_appends_commands_and_refuses_other_traces(tmp_path):
    import json

    from workloads.comparisons.compare import merge_context

    path = tmp_path / "context.json"
    first = {"commands": ["cmd 1"], "started": "t1", "machine": {"model": "/m"},
             "trace": {"requests": 10}}
    assert merge_context(path, first) == first
    path.write_text(json.dumps(first))
    merged = merge_context(path, {**first, "commands": ["cmd 2"], "started": "t2"})
    assert merged["commands"] == ["cmd 1", "cmd 2"] and merged["started"] == "t1"
    with pytest.raises(SystemExit):
        merge_context(path, {**first, "trace": {"requests": 11}})
    with pytest.raises(SystemExit):
        merge_context(path, {**first, "machine": {"model": "/other"}})


def test_goodput_counts_requests_within_both_slos_per_second():
    from workloads.reports.targets import goodput, quiet_slos

    records = _records(1.0)  # TTFT 100 ms, TPOT 20 ms, 10 requests over ~9.2 s
    span = records[-1].end_s - records[0].send_s
    assert goodput(records, 150.0, 25.0) == pytest.approx(10 / span)
    assert goodput(records, 50.0, 25.0) == 0.0  # TTFT over its SLO
    assert goodput(records, 150.0, 10.0) == 0.0  # TPOT over its SLO
    assert quiet_slos(records, "low") == pytest.approx((400.0, 30.0))


def test_rounds_are_reported_per_round_with_their_median(tmp_path, capsys):
    """``workloads.compare --rounds N`` writes round1..N, each a whole comparison;
    ``workloads.targets`` then gives Flying's ratio per round, the median and how many
    rounds meet each goal."""
    from workloads.measure.records import save_records
    from workloads.reports.targets import main, round_dirs

    for i, flying in enumerate((0.8, 1.3, 0.9), start=1):  # Flying's latency scale per round
        for name, scale in (("static-dp", 1.0), ("static-tp", 1.0), ("flying", flying)):
            (tmp_path / f"round{i}" / name).mkdir(parents=True)
            save_records(_records(scale), tmp_path / f"round{i}" / name / "records.jsonl")
    (tmp_path / "roundx").mkdir()  # not a round
    assert [d.name for d in round_dirs(tmp_path)] == ["round1", "round2", "round3"]
    main([str(tmp_path)])
    out = capsys.readouterr().out
    ttft = next(line for line in out.splitlines() if line.startswith("| TTFT p90"))
    assert "| 0.80 | 1.30 | 0.90 | 0.90 | <= 1.1x static DP | yes | 2 of 3 |" in ttft, ttft
    assert "round3: Flying engines" in out


def test_rounds_flag_checks_and_decision_logs():
    assert parse_args([]).rounds == 1
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit):  # each round writes its own log
        parse_args(["--rounds", "2", "--flying-args", "--flying-decision-log /tmp/d.jsonl"])
    assert parse_args(["--rounds", "2", "--flying-args", "--flying-tp-gain 0.2"]).rounds == 2


def test_rounds_rotate_the_systems_and_give_each_flying_run_its_log(tmp_path, monkeypatch):
    from workloads.comparisons import compare

    started = []

    def fake_run_one(name, launch, trace, run_dir, *args, **kwargs):
        started.append((run_dir.parent.name, name, launch))
        return RunResult(name=name, command=launch, error="not started")

    monkeypatch.setattr(compare, "run_one", fake_run_one)
    monkeypatch.setattr(compare, "rebuild_report", lambda out: out / "report.md")
    compare.main(["--model-path", "/m", "--limit", "3", "--rounds", "2",
                  "--runs", "static-dp,flying", "--out", str(tmp_path)])
    assert [(d, n) for d, n, _ in started] == [
        ("round1", "static-dp"), ("round1", "flying"), ("round2", "flying"),
        ("round2", "static-dp")]
    for d, name, launch in started:
        log = str(tmp_path / d / "flying" / "decisions.jsonl")
        assert (log in launch) == (name == "flying"), launch
