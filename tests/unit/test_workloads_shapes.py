"""Load shapes, trace lookup and goodput: the definitions other benchmarks use."""

from __future__ import annotations

import numpy as np
import pytest

from workloads.load.arrivals import ArrivalProcess, arrival_times, ramp_rates, retime
from workloads.load.presets import CPU_SHAPES, build_preset
from workloads.load.replay import AZURE_CONV, SAMPLE, TRACES_ENV, trace_path, traces_dir
from workloads.load.slos import parse_slos
from workloads.measure.metrics import render_markdown, summarize
from workloads.measure.records import RequestRecord

pytestmark = pytest.mark.unit

N = 20_000


def _gaps(process: ArrivalProcess) -> np.ndarray:
    return np.diff(arrival_times(process, N, np.random.default_rng(0)))


def test_poisson_and_gamma_have_the_mean_rate_and_the_burstiness_cv():
    # Gamma(k, 1/(rate k)): mean 1/rate, coefficient of variation 1/sqrt(k) (1 for Poisson).
    for process, cv in ((ArrivalProcess("poisson", 4.0), 1.0),
                        (ArrivalProcess("gamma", 4.0, burstiness=0.25), 2.0),
                        (ArrivalProcess("gamma", 4.0, burstiness=4.0), 0.5)):
        gaps = _gaps(process)
        assert gaps.mean() == pytest.approx(0.25, rel=0.05), process
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08), process


def test_constant_and_first_arrival_at_zero():
    times = arrival_times(ArrivalProcess("constant", 2.0), 5, np.random.default_rng(0))
    assert times == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])
    assert arrival_times(ArrivalProcess(), 0, np.random.default_rng(0)) == []


def test_ramp_rates_linear_and_exponential():
    linear = ArrivalProcess("ramp", 1.0, end_rate=5.0)
    assert ramp_rates(linear, 5).tolist() == pytest.approx([1, 2, 3, 4, 5])
    expo = ArrivalProcess("ramp", 1.0, end_rate=16.0, strategy="exponential")
    assert ramp_rates(expo, 5).tolist() == pytest.approx([1, 2, 4, 8, 16])
    gaps = _gaps(ArrivalProcess("ramp", 1.0, end_rate=10.0))
    assert gaps[: N // 10].mean() > 3 * gaps[-N // 10:].mean()  # it does speed up
    with pytest.raises(ValueError):
        ArrivalProcess("ramp", 1.0)
    with pytest.raises(ValueError):
        ArrivalProcess("gamma", 1.0, burstiness=0.0)


def test_retime_keeps_requests_and_is_seeded():
    base = build_preset("cpu-small")
    shaped = retime(base, ArrivalProcess("gamma", 1.5, burstiness=0.25), seed=0)
    assert [(r.prompt_len, r.output_len, r.input_ids) for r in shaped] == [
        (r.prompt_len, r.output_len, r.input_ids) for r in base]
    assert {r.phase for r in shaped} == {"gamma"}
    assert shaped == retime(base, ArrivalProcess("gamma", 1.5, burstiness=0.25), seed=0)
    assert shaped != retime(base, ArrivalProcess("gamma", 1.5, burstiness=0.25), seed=1)


def test_shape_presets_share_cpu_small_requests():
    small = build_preset("cpu-small")
    for name in CPU_SHAPES:
        trace = build_preset(name)
        assert [r.output_len for r in trace] == [r.output_len for r in small], name
        assert trace[0].arrival_s == 0.0


@pytest.mark.parametrize("name", ["cpu-three-peak", "paper-three-peak"])
def test_three_peak_presets_have_exactly_three_bursts(name):
    trace = build_preset(name)
    runs = [trace[0].phase]
    for req in trace[1:]:
        if req.phase != runs[-1]:
            runs.append(req.phase)
    assert runs == ["low", "burst"] * 3 + ["low"]
    phase_s = 10.0 if name.startswith("cpu") else 60.0
    assert 6 * phase_s < trace[-1].arrival_s < 7 * phase_s


def test_traces_dir_flag_env_default_and_missing_public_trace(tmp_path, monkeypatch):
    monkeypatch.delenv(TRACES_ENV, raising=False)
    assert traces_dir().name == "traces" and ".cache" in traces_dir().parts
    monkeypatch.setenv(TRACES_ENV, str(tmp_path))
    assert traces_dir() == tmp_path
    assert traces_dir(tmp_path / "flag") == tmp_path / "flag"
    assert trace_path(SAMPLE).parent.name == "traces"  # bundled, found without the dir
    with pytest.raises(FileNotFoundError, match="AzurePublicDataset"):
        trace_path(AZURE_CONV)
    (tmp_path / AZURE_CONV).write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n")
    assert trace_path(AZURE_CONV) == tmp_path / AZURE_CONV


def _rec(i: int, ttft: float, tokens: int, e2e: float, ok: bool = True) -> RequestRecord:
    return RequestRecord(index=i, arrival_s=float(i), prompt_len=8, output_len=tokens,
                         priority="high" if i == 0 else "normal", send_s=float(i),
                         ttft_s=ttft, e2e_s=e2e, output_tokens=tokens, success=ok,
                         error=None if ok else "boom", itl_s=[0.0] * (tokens - 1))


def test_goodput_is_sglangs_definition():
    # TPOT = (e2e - ttft) / (tokens - 1): r0 10 ms, r1 30 ms, r2 10 ms (TTFT 150 ms), r3 failed.
    records = [_rec(0, 0.05, 11, 0.15), _rec(1, 0.05, 11, 0.35), _rec(2, 0.15, 11, 0.25),
               _rec(3, 0.05, 11, 0.15, ok=False)]
    summary = summarize(records, slos=parse_slos(["ttft:100", "tpot:20"]))
    good = summary["overall"]["goodput"]
    makespan = summary["throughput"]["makespan_s"]
    assert makespan == pytest.approx(3.15)
    assert good["slo_attainment"] == pytest.approx(1 / 4)
    assert good["request_goodput"] == pytest.approx(1 / makespan)
    # Failed requests meet no SLO (SGLang skips them) but count in the denominator.
    assert good["slo_attainment_by_metric"] == pytest.approx({"ttft": 2 / 4, "tpot": 2 / 4})
    assert summary["by_priority"]["high"]["goodput"]["slo_attainment"] == 1.0
    assert "goodput (ttft <= 100 ms, tpot <= 20 ms): 0.32 req/s" in render_markdown(summary)
    assert "goodput" not in summarize(records, slos=None)["overall"]
    with pytest.raises(ValueError):
        parse_slos(["itl:5"])
