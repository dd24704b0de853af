"""GPU profiles calibrated by one GPU's measured kernels (``workloads.sim.gpu_calibrate``)."""

from __future__ import annotations

import json

import pytest

from workloads.sim import gpu_profile
from workloads.sim.gpu_calibrate import (
    MEASURED_DIR,
    RELAYOUT_DIR,
    calibrated,
    load_measured,
    relayout_fit,
)
from workloads.sim.profile import load

pytestmark = pytest.mark.unit


def test_calibration_keeps_the_measured_points_and_extends_them_by_the_formula():
    formula = lambda x: 0.01 * x  # noqa: E731
    points = {8: 3.0, 64: 4.0}
    assert calibrated(formula, points, 8) == pytest.approx(3.0)
    assert calibrated(formula, points, 64) == pytest.approx(4.0)
    assert calibrated(formula, points, 36) == pytest.approx(3.5)  # linear between
    # below: the formula plus the floor measured at the smallest size
    assert calibrated(formula, points, 1) == pytest.approx(0.01 + (3.0 - 0.08))
    # above: the formula times the ratio measured at the largest size
    assert calibrated(formula, points, 128) == pytest.approx(1.28 * 4.0 / 0.64)


@pytest.mark.parametrize("name", [n for n, (_, _, m) in gpu_profile.PROFILES.items() if m])
def test_a_measured_profile_steps_are_the_measured_kernels_plus_the_modelled_rest(name):
    """At every measured batch, the profile's decode step is the measured kernels plus
    the formula's overhead and all-reduces, and nothing else."""
    gpu, model, measured = gpu_profile.PROFILES[name]
    profile = load(name)
    device, rows = load_measured(MEASURED_DIR / measured)
    assert device.startswith("NVIDIA H")
    assert profile.constants["kernels"]["value"].endswith(measured)
    g = gpu_profile.gpus_per_engine(gpu, model)
    a = gpu_profile.Assumed()
    for m in (1, *profile.degrees):
        row = rows[(model.name, m * g)]
        for b in set(row.decode) & set(gpu_profile.BATCHES):
            modelled = gpu_profile.decode_ms(gpu, model, a, m * g, b) \
                - gpu_profile.decode_kernels_ms(gpu, model, a, m * g, b)
            assert profile.costs.decode(m, b) == pytest.approx(row.decode[b] + modelled,
                                                               abs=1e-3)


def test_measured_kernels_have_a_floor_the_formula_lacks():
    """What the measurement changed: at one request, a TP-8 rank of Llama-3-8B reads an
    eighth of the bytes but its step is not an eighth as long (kernel launches and
    small, latency-bound kernels per layer)."""
    _, rows = load_measured(MEASURED_DIR / "h200.json")
    one, eight = rows[("Llama-3-8B", 1)].decode[1], rows[("Llama-3-8B", 8)].decode[1]
    assert one / eight < 4
    first = load("h200-llama3-8b").costs
    assert first.decode(1, 1) / first.decode(8, 1) > 3


def test_relayout_fit_is_the_line_through_the_measured_moves(tmp_path):
    """Fixed part and per-1k-token part of a move, from this code's rows only."""
    rows = [{"model": "llama3-8b", "degree": m, "direction": "to_dp", "tokens": n,
             "ms": 3.0 + 0.2 * n / 1000, "impl": "current"}
            for m in (2, 8) for n in (1024, 4096)]
    rows += [{"model": "llama3-8b", "degree": 2, "direction": "to_dp", "tokens": 1024,
              "ms": 99.0, "impl": "baseline"},
             {"model": "llama3-8b", "degree": 2, "direction": "to_tp", "tokens": 1024,
              "ms": 99.0, "impl": "current"}]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"device": "X", "rows": rows}))
    device, fixed, per_k = relayout_fit(path, "Llama-3-8B")
    assert device == "X" and fixed == pytest.approx(3.0) and per_k == pytest.approx(0.2)
    with pytest.raises(ValueError):
        relayout_fit(path, "Llama-3-70B")


@pytest.mark.parametrize("name", [n for n, (_, _, m) in gpu_profile.PROFILES.items() if m])
def test_measured_profiles_charge_a_move_the_measured_relayout_plus_nvlink(name):
    """The shipped measured profile's move: the fitted relayout's fixed part, and its
    per-1k part on top of the NVLink term of the first-principles profile."""
    _, model, measured = gpu_profile.PROFILES[name]
    _, fixed, per_k = relayout_fit(RELAYOUT_DIR / measured, model.name)
    switch = load(name).switch
    first_principles = load(name.removesuffix("-measured")).switch
    assert switch.move_ms == pytest.approx(fixed, abs=1e-3) and fixed > 0
    assert switch.move_ms_per_ktok == pytest.approx(
        first_principles.move_ms_per_ktok + per_k, abs=1e-3)
    assert first_principles.move_ms == 0.0
    assert switch.relayout(0) == 0.0
    assert switch.relayout(2000) == pytest.approx(fixed + 2 * switch.move_ms_per_ktok, abs=1e-3)
