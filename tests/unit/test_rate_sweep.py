"""Goodput against rate over comparison runs, and the policy's prediction error."""

from __future__ import annotations

import json

import pytest

from workloads.measure.records import RequestRecord, save_records
from workloads.reports.rate_sweep import main, sweep
from workloads.reports.targets import RUNS

pytestmark = pytest.mark.unit


def _run_dir(root, rate: float, ttft: dict[str, float], chosen: str = "2xDP"):
    """A compare directory: 10 requests at ``rate`` req/s, each system's TTFT as given
    (s), TPOT 10 ms, 5 tokens; Flying's decision log predicting 0.5 req/s for 2xDP."""
    out = root / f"rate-{rate}"
    for name in RUNS:
        (out / name).mkdir(parents=True)
        recs = [RequestRecord(i, i / rate, 8, 5, send_s=i / rate, ttft_s=ttft[name],
                              tpot_s=0.01, e2e_s=ttft[name] + 0.04, output_tokens=5,
                              success=True) for i in range(10)]
        save_records(recs, out / name / "records.jsonl")
    head = {"config": {}, "node": {}}
    line = {"predictions": {"2xDP": {"goodput": 0.5}, "1xTP2": {"goodput": 0.25}},
            "decision": {"mode": "dp" if chosen == "2xDP" else "tp", "degree": 1 if
                         chosen == "2xDP" else 2, "reason": "x"},
            "slo": {"ttft_ms": 150.0, "tpot_ms": 20.0}}
    (out / "flying" / "decisions.jsonl").write_text(
        "\n".join(json.dumps(x) for x in (head, line, line)) + "\n")
    return out


def test_goodput_per_rate_with_one_set_of_slos_and_the_prediction_error(tmp_path, capsys):
    slow = {"static-dp": 0.1, "static-tp": 0.05, "flying": 0.05}
    fast = {"static-dp": 0.1, "static-tp": 0.3, "flying": 0.1}
    dirs = [_run_dir(tmp_path, 2.0, fast), _run_dir(tmp_path, 1.0, slow, chosen="1xTP2")]
    runs, slos = sweep(dirs, None)
    assert [r["rate"] for r in runs] == [1.0, 2.0]  # sorted by the offered rate
    # SLOs from static TP at the lowest rate: 4 x 50 ms, 1.5 x 10 ms
    assert slos == pytest.approx((200.0, 15.0))
    span = 9 / 1.0 + 0.14  # first send to last end (TTFT 0.1 + 4 tokens)
    assert runs[0]["goodput"]["static-dp"] == pytest.approx(10 / span)
    assert runs[1]["goodput"]["static-tp"] == 0.0  # 300 ms > 200 ms
    # Flying's prediction: the layout each request was placed in (1xTP2 at rate 1)
    assert runs[0]["model"]["predicted"] == pytest.approx(0.25)
    assert runs[1]["model"]["predicted"] == pytest.approx(0.5)
    main([str(d) for d in dirs] + ["--plot", str(tmp_path / "g.png")])
    text = capsys.readouterr().out
    assert "TTFT <= 200 ms" in text and "| 1.00 |" in text
    assert (tmp_path / "g.png").stat().st_size > 0


def test_the_prediction_at_the_running_costs_where_the_log_has_it(tmp_path, capsys):
    """A log that records each layout's ``loaded`` prediction (the model at the costs
    the steps ran at) reports its mean and error beside the quiet one's; a layout
    without it (nothing stretched) counts its quiet prediction; an older log shows
    "-"."""
    fast = {"static-dp": 0.1, "static-tp": 0.1, "flying": 0.1}
    old = _run_dir(tmp_path, 1.0, fast)
    new = _run_dir(tmp_path, 2.0, fast)
    log = new / "flying" / "decisions.jsonl"
    head, *lines = log.read_text().splitlines()
    docs = [json.loads(x) for x in lines]
    docs[0]["predictions"]["2xDP"]["loaded"] = {"goodput": 0.25, "tpot_ms": 30.0}
    log.write_text("\n".join([head, *(json.dumps(d) for d in docs)]) + "\n")
    runs, _ = sweep([old, new], None)
    assert runs[0]["model"]["loaded"] is None and runs[0]["model"]["loaded_error"] is None
    got = runs[1]["model"]
    assert got["predicted"] == pytest.approx(0.5)
    assert got["loaded"] == pytest.approx((0.25 + 0.5) / 2)  # the second line: not stretched
    assert got["loaded_error"] == pytest.approx((got["loaded"] - got["measured"]) / got["measured"])
    main([str(old), str(new)])
    rows = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| 1.00 | 150")
            or x.startswith("| 2.00 | 150")]
    assert rows[0].split(" | ")[4:6] == ["-", "-"]
    assert rows[1].split(" | ")[4] == "0.38"


def test_a_run_still_going_is_left_out_and_named(tmp_path, capsys):
    """The sweep reads the complete directories only and names the other on stderr;
    none complete: a one-line error, not a traceback."""
    done = _run_dir(tmp_path, 1.0, {"static-dp": 0.1, "static-tp": 0.1, "flying": 0.1})
    going = tmp_path / "going"
    (going / "static-dp").mkdir(parents=True)
    save_records([RequestRecord(0, 0.0, 8, 5, send_s=0.0, ttft_s=0.1, tpot_s=0.01,
                                e2e_s=0.14, output_tokens=5, success=True)],
                 going / "static-dp" / "records.jsonl")
    main([str(done), str(going)])
    captured = capsys.readouterr()
    first = captured.out.split("| rate (req/s) | node SLOs")[0]
    assert len([x for x in first.splitlines() if x[:3] in {f"| {i}" for i in range(10)}]) == 1
    assert f"{going}: not every system's records are there yet" in captured.err
    with pytest.raises(SystemExit, match="no directory has every system's records"):
        main([str(going)])
