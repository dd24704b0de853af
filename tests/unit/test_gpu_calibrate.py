"""GPU profiles calibrated by one GPU's measured kernels (``workloads.sim.gpu_calibrate``)."""

from __future__ import annotations

import pytest

from workloads.sim import gpu_profile
from workloads.sim.gpu_calibrate import MEASURED_DIR, calibrated, load_measured
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
