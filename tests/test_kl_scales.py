"""`benchmarks/kl_scales.py`: the ratio of the two KL penalties per step, against its formula written out here."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "kl_scales.py"


def _module():
    spec = importlib.util.spec_from_file_location("kl_scales", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ratio_is_two_std_squared_over_the_means_factor_times_dt_squared(tmp_path):
    """Flow-GRPO's SDE: mu = x (1 + s^2 dt / (2 sigma)) + v (1 + s^2 (1 - sigma) / (2 sigma)) dt, s = eta sqrt(sigma /
    (1 - sigma)) (sigma_max in place of 1 at sigma = 1), so velocity / transition_mean = 2 s^2 / (g dt)^2 with
    g = 1 + s^2 (1 - sigma) / (2 sigma)."""
    kl = _module()
    eta = 0.7
    sigmas = kl.schedule(10, 3.0)
    rows = kl.kl_ratios(sigmas, eta, "sde")
    assert [r["step"] for r in rows] == list(range(9))
    for r in rows:
        sigma, dt = r["sigma"], r["dt"]
        denominator = 1 - (float(sigmas[1]) if sigma == 1 else sigma)
        s = eta * math.sqrt(sigma / denominator)
        g = 1 + s * s * (1 - sigma) / (2 * sigma)
        assert r["velocity_over_transition"] == pytest.approx(2 * s * s / (g * dt) ** 2, rel=1e-4)
    out = tmp_path / "kl.json"
    assert kl.main(["--out", str(out)]) == 0
    import json

    data = json.loads(out.read_text())
    assert data["ratio_min"] == pytest.approx(rows[-1]["velocity_over_transition"], rel=1e-6)
    assert data["ratio_max"] == pytest.approx(rows[0]["velocity_over_transition"], rel=1e-6)
