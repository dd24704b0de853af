"""The simulator's cost profiles (first principles and measured), its command and its
check against measured runs (``workloads.sim.validate``), on synthetic inputs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from flying.node.config import FlyingConfig
from flying.node.costs_reader import merge
from scheduler.costs import Costs
from workloads.load.presets import build_preset
from workloads.measure.records import save_records
from workloads.reports.targets import quiet_slos
from workloads.sim import gpu_profile
from workloads.sim.cli import main as simulate_main
from workloads.sim.profile import (
    CPU_FRONTEND_MS,
    PROFILES_DIR,
    from_decision_log,
    from_status,
    load,
)
from workloads.sim.run import policy_settings, simulate
from workloads.sim.validate import system_loop, validate

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", sorted(gpu_profile.PROFILES))
def test_the_shipped_gpu_profiles_are_what_the_generator_writes(name):
    gpu, model, measured = gpu_profile.PROFILES[name]
    built = json.loads(json.dumps(gpu_profile.build(name, gpu, model, measured=measured)
                                  .to_json()))
    assert json.loads((PROFILES_DIR / f"{name}.json").read_text()) == built


def test_first_principles_costs_follow_the_hardware():
    h100, h200 = load("h100-llama3-8b"), load("h200-llama3-8b")
    big = load("h200-llama3-70b")
    for p in (h100, h200, big):
        c = p.costs
        steps = [c.decode(m, 1) for m in (1, *p.degrees)]
        assert steps == sorted(steps, reverse=True)  # memory-bound: more GPUs, less each
        for m in (1, *p.degrees):
            assert c.decode(m, 256) > c.decode(m, 1) and c.prefill(m, 8192) > c.prefill(m, 512)
        consts = p.constants
        assert all("source" in v for v in consts.values())
        assert {k for k, v in consts.items() if v.get("assumption")} >= {
            "hbm_efficiency", "mfu_prefill", "nvlink_efficiency", "step_overhead_s"}
    assert h200.costs.decode(1, 1) < h100.costs.decode(1, 1)  # 4.8 vs 3.35 TB/s
    assert h200.kv_tokens > 1.9 * h100.kv_tokens  # 141 vs 80 GB, same 16 GB of weights
    assert big.constants["gpus_per_engine"]["value"] == 2 and big.max_engines == 4


def _small_kv():
    """The demo profile with pools smaller than the context, as on the CPU."""
    return replace(load("cpu-demo"), kv_tokens=6000)


def test_a_decision_log_gives_back_the_profile_it_was_made_with(tmp_path):
    profile = _small_kv()
    res = simulate(build_preset("cpu-burst", 0), profile, 2,
                   policy_settings("adaptive", FlyingConfig()))
    path = tmp_path / "decisions.jsonl"
    path.write_text("".join(line + "\n" for line in res.decisions))
    got = from_decision_log(path)
    assert got.costs == profile.costs and got.switch == profile.switch
    assert (got.kv_tokens, got.degrees, got.kv_heads, got.max_engines) == (6000, (2,), 4, 2)
    assert got.max_req_len == profile.max_req_len


def test_a_decision_log_gives_back_a_pool_larger_than_the_context(tmp_path):
    """The controller's head line carries the KV pool and one request's limit: a pool
    of ~400k tokens under an 8k context comes back as both."""
    profile = load("h100-llama3-8b")
    res = simulate(build_preset("paper", 0)[:20], profile, 8,
                   policy_settings("adaptive", FlyingConfig()))
    path = tmp_path / "decisions.jsonl"
    path.write_text("".join(line + "\n" for line in res.decisions))
    got = from_decision_log(path)
    assert (got.kv_tokens, got.context_len) == (profile.kv_tokens, profile.context_len)
    assert got.max_req_len == profile.max_req_len and got.degrees == profile.degrees


def test_a_status_document_gives_the_merged_curves_and_the_smallest_pool(tmp_path):
    engines = [
        {"rank": 0, "mode": "dp", "degrees": [2], "total_kv_slots": 16384, "binds": 2,
         "switch_ms_sum": 6.0, "decode_ms": {"1": 7.0, "2": 9.0},
         "curves": {"1": {"decode": [[1, 7.0], [8, 9.0]], "prefill": [[128, 30.0]]},
                    "2": {"decode": [[1, 9.0]], "prefill": []}}},
        {"rank": 1, "mode": "dp", "degrees": [2], "total_kv_slots": 16000, "binds": 2,
         "switch_ms_sum": 2.0, "decode_ms": {"1": 8.0, "2": 11.0},
         "curves": {"1": {"decode": [[1, 8.0]], "prefill": [[128, 34.0]]}},
         "stretch": {"1": 2.0}},
    ]
    engines[0]["stretch"] = {"1": 1.5, "2": 1.2}
    path = tmp_path / "status.json"
    path.write_text(json.dumps({"engines": engines}))
    got = from_status(path, kv_heads=4)
    merged = merge(engines)
    assert merged.stretch == {1: 1.75, 2: 1.2}  # over the engines that ran the mode
    assert got.costs == Costs(merged.decode_ms, merged.curves)  # the quiet points only
    assert got.costs.decode_ms == {1: 7.5, 2: 10.0}
    assert got.kv_tokens == 16000 and got.degrees == (2,) and got.switch.bind_ms == 2.0


def _compare_dir(tmp_path, profile):
    """A ``workloads.compare`` directory whose 'measured' runs are simulations."""
    trace = build_preset("cpu-burst", 0)
    runs = {"static-dp": ("static-dp", FlyingConfig(tp_degrees="none")),
            "static-tp": ("static-tp2", FlyingConfig()), "flying": ("adaptive", FlyingConfig())}
    out = {}
    for system, (name, cfg) in runs.items():
        res = simulate(trace, profile, 2, policy_settings(name, cfg),
                       group_loop=system_loop(system, "flying"))  # as validate runs them
        (tmp_path / system).mkdir()
        save_records(res.records, tmp_path / system / "records.jsonl")
        out[system] = res
    (tmp_path / "flying" / "decisions.jsonl").write_text(
        "".join(line + "\n" for line in out["flying"].decisions))
    (tmp_path / "context.json").write_text(json.dumps(
        {"machine": {"engines (N)": 2}, "goodput_slos_ms": {"ttft": 100.0, "tpot": 20.0}}))
    return out


def test_validate_reproduces_runs_the_simulator_made_and_reports_errors(tmp_path):
    runs = _compare_dir(tmp_path, _small_kv())
    report = validate(tmp_path, frontend_ms=0.0)
    rows = [line for line in report.splitlines() if line.startswith("| static") or
            line.startswith("| flying")]
    assert len(rows) == 12 and all(row.endswith("| +0.0% |") for row in rows), report
    # goodput is scored at workloads.targets' SLOs (from static TP's quiet service), not
    # at the benchmark defaults compare saved, which nothing here meets
    ttft, tpot = quiet_slos(runs["static-tp"].records, "low")
    assert f"goodput SLOs {{'ttft': {round(ttft, 1)}, 'tpot': {round(tpot, 1)}}}" in report
    assert not any(row.endswith("| - |") for row in rows if "goodput" in row), report
    # the default frontend (this machine's 8 ms) adds to every simulated TTFT
    report = validate(tmp_path)
    row = next(line for line in report.splitlines() if line.startswith("| static-dp")
               and "TTFT p50" in line)
    sim, meas = (float(c) for c in row.split("|")[4:6])
    assert sim - meas == pytest.approx(CPU_FRONTEND_MS, abs=0.01)
    # the measured static DP run was twice as slow to its first token
    records = runs["static-dp"].records
    for rec in records:
        rec.ttft_s *= 2
    save_records(records, tmp_path / "static-dp" / "records.jsonl")
    report = validate(tmp_path, frontend_ms=0.0)
    row = next(line for line in report.splitlines() if line.startswith("| static-dp")
               and "TTFT p50" in line)
    assert row.endswith("| -50.0% |")


def test_the_command_prints_and_writes_a_simulated_comparison(tmp_path, capsys):
    out = tmp_path / "out"
    assert simulate_main(["--preset", "cpu-burst", "--profile", "cpu-demo", "--engines", "2",
                          "--policies", "static-dp,static-tp,adaptive", "--out", str(out),
                          "--goodput", "ttft:100", "tpot:20"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# SIMULATED") and "| static-tp |" in printed
    assert "| adaptive | burst |" in printed  # per phase
    for policy in ("static-dp", "static-tp", "adaptive"):
        assert len((out / policy / "records.jsonl").read_text().splitlines()) == 160
        assert json.loads((out / policy / "summary.json").read_text())["simulated"] is True
    assert (out / "simulated.png").stat().st_size > 0
    log = out / "adaptive" / "decisions.jsonl"
    assert simulate_main(["--preset", "cpu-burst", "--profile-from-log", str(log),
                          "--policies", "static-dp", "--rates", "5,40"]) == 0
    sweep = capsys.readouterr().out
    assert sweep.startswith("SIMULATED goodput") and "| 40 |" in sweep


def test_the_commands_help_prints(capsys):
    with pytest.raises(SystemExit) as done:
        simulate_main(["--help"])
    assert done.value.code == 0 and "--flying-tp-gain" in capsys.readouterr().out


@pytest.mark.parametrize("policies, says", [
    ("static-dp,static-tp:2", "'static-tp:2': --flying-policy must be one of"),
    ("static-tp16", "TP degrees [16] not available on 8 engines"),
    (" , ", "names no policy"),
])
def test_a_bad_policy_name_is_a_usage_line_before_anything_runs(policies, says):
    with pytest.raises(SystemExit) as done:
        simulate_main(["--preset", "paper", "--profile", "h100-llama3-8b", "--engines", "8",
                       "--rates", "60", "--policies", policies])
    assert isinstance(done.value.code, str) and says in done.value.code


@pytest.mark.parametrize("argv, says", [
    (["--profile", "no-such-profile", "--rates", "5"], "no profile 'no-such-profile'"),
    (["--profile", "h100-llama3-8b", "--rates", "5,abc"], "argument --rates"),
    (["--profile", "h100-llama3-8b", "--rates", "0"], "argument --rates"),
    (["--profile", "h100-llama3-8b", "--engines", "0"], "argument --engines"),
])
def test_bad_simulator_options_are_one_line_errors(argv, says, capsys):
    with pytest.raises(SystemExit) as done:
        simulate_main(["--preset", "paper", "--no-plot", *argv])
    said = done.value.code if isinstance(done.value.code, str) else capsys.readouterr().err
    assert said and says in said


def test_validate_at_the_logged_stretch_runs_the_steps_that_much_slower(tmp_path):
    """``--stretch logged``: the profile's points times the mean stretch the Flying run's
    log recorded (the default runs them at their best)."""
    _compare_dir(tmp_path, _small_kv())
    log = tmp_path / "flying" / "decisions.jsonl"
    lines = []
    for line in log.read_text().splitlines():
        ev = json.loads(line)
        if ev.get("costs"):
            ev["costs"]["stretch"] = {"1": 2.0}
        lines.append(json.dumps(ev))
    log.write_text("\n".join(lines) + "\n")
    assert "+0.0%" in validate(tmp_path, frontend_ms=0.0)  # the stretch is not read
    report = validate(tmp_path, frontend_ms=0.0, stretch="logged")
    assert "stretch as logged DP: 2, TP-2: 2" in report, report.splitlines()[0]
    row = next(line for line in report.splitlines() if line.startswith("| static-dp")
               and "TPOT p50" in line)
    assert float(row.split("|")[6].strip().rstrip("%")) > 90.0, row


def test_validate_takes_the_curves_the_engines_published_at_the_runs_end(tmp_path):
    """The log's last decision knows the batches run before the last arrival; the status
    document saved at the end knows every one. Validation simulates with the latter
    (``--curves end``, the default) unless told to take the log's."""
    profile = _small_kv()
    _compare_dir(tmp_path, profile)
    doc = profile.costs.to_json()
    slower = {d: {kind: [[x, 2 * ms] for x, ms in pts] for kind, pts in c.items()}
              for d, c in doc["curves"].items()}
    engines = [{"rank": r, "mode": "dp", "degrees": [2], "total_kv_slots": profile.kv_tokens,
                "decode_ms": {d: 2 * ms for d, ms in doc["decode_ms"].items()},
                "curves": slower} for r in range(2)]
    (tmp_path / "flying" / "status.json").write_text(json.dumps({"engines": engines}))

    def tpot_error(report: str) -> float:
        row = next(line for line in report.splitlines() if line.startswith("| static-dp")
                   and "TPOT p50" in line)
        return float(row.split("|")[6].strip().rstrip("%"))

    assert tpot_error(validate(tmp_path, frontend_ms=0.0, curves="log")) == 0.0
    report = validate(tmp_path, frontend_ms=0.0)
    assert "curves from the run's end" in report.splitlines()[0]
    assert tpot_error(report) > 50.0, report


def test_validate_runs_each_systems_groups_as_its_server_ran_them(tmp_path):
    """SGLang's own TP holds every step's tokens; a Flying run's groups as a node's
    (``"flying"``), but as before session 50 (``"normal"``) where its status document
    has no ``overlapped_tp_steps``."""
    from workloads.sim.validate import group_loop_of
    assert group_loop_of(tmp_path) == "flying"  # nothing saved: today's node
    (tmp_path / "flying").mkdir()
    status = tmp_path / "flying" / "status.json"
    status.write_text(json.dumps({"engines": [], "totals": {"binds": 3, "tp_steps": 40}}))
    assert group_loop_of(tmp_path) == "normal"
    status.write_text(json.dumps({"engines": [], "totals": {"binds": 3, "overlapped_tp_steps": 0}}))
    assert group_loop_of(tmp_path) == "flying"
    assert system_loop("static-tp", "normal") == "sglang"
    assert system_loop("flying", "normal") == "normal" and system_loop("static-dp", "flying") == "flying"


def test_validate_holds_arrivals_only_for_a_run_whose_node_could(tmp_path):
    """A Flying run's groups hold arrivals (``scheduler.hold``) in the simulation only
    where its status document has ``held_admissions`` (a node since session 52)."""
    from workloads.sim.validate import held_admissions
    assert held_admissions(tmp_path)  # nothing saved: today's node
    (tmp_path / "flying").mkdir()
    status = tmp_path / "flying" / "status.json"
    status.write_text(json.dumps({"engines": [], "totals": {"overlapped_tp_steps": 9}}))
    assert not held_admissions(tmp_path)
    status.write_text(json.dumps({"engines": [], "totals": {"held_admissions": 0}}))
    assert held_admissions(tmp_path)
