"""The SDE step with log-prob (omni_core.sde): each formula checked against an independent computation."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from omni_core.sde import (
    randn_per_sample,
    sample_sde_windows,
    sde_step_from_sigmas,
    sde_step_with_logprob,
    window_length,
)

B, SHAPE = 3, (4, 5, 6)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, *SHAPE, generator=g)
    v = torch.randn(B, *SHAPE, generator=g)
    sigma = torch.tensor([0.9, 0.6, 0.3])
    sigma_next = torch.tensor([0.8, 0.45, 0.1])
    return v, x, sigma, sigma_next


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
def test_noise_level_zero_is_the_euler_step(sde_type):
    v, x, sigma, sigma_next = _inputs()
    prev, log_prob, mean, std = sde_step_from_sigmas(v, x, sigma, sigma_next, 0.95, 0.0, sde_type=sde_type)
    euler = x + v * (sigma_next - sigma).view(B, 1, 1, 1)
    assert torch.equal(prev, euler) and torch.equal(mean, euler)
    assert torch.equal(log_prob, torch.zeros(B)) and torch.equal(std, torch.zeros(B, 1, 1, 1))


def test_sde_log_prob_equals_torch_normal_and_mean_follows_the_paper():
    v, x, sigma, sigma_next = _inputs()
    a = 0.7
    prev, log_prob, mean, std = sde_step_from_sigmas(v, x, sigma, sigma_next, 0.95, a, generator=torch.Generator().manual_seed(1))

    s = sigma.view(B, 1, 1, 1)
    dt = (sigma_next - sigma).view(B, 1, 1, 1)
    sigma_t = a * torch.sqrt(s / (1 - s))
    # Euler-Maruyama of the paper's dx = [v + sigma_t^2 / (2t) (x + (1 - t) v)] dt + sigma_t dw
    expected_mean = x + (v + sigma_t**2 / (2 * s) * (x + (1 - s) * v)) * dt
    torch.testing.assert_close(mean, expected_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(std, sigma_t)

    normal = torch.distributions.Normal(expected_mean, sigma_t * torch.sqrt(-dt))
    expected = normal.log_prob(prev).mean(dim=(1, 2, 3))
    torch.testing.assert_close(log_prob, expected, rtol=1e-5, atol=1e-5)


def test_the_last_step_to_sigma_zero_is_a_proper_gaussian_step_for_sde_and_dance_sde():
    """flow_grpo's base config trains the last step as an SDE step: sigma_next = 0, so dt = -sigma. Flow-GRPO's std is
    a sqrt(sigma / (1 - sigma)) and its noise std * sqrt(sigma); DanceGRPO's noise is a sqrt(sigma). Both are positive,
    so the step is a Gaussian with a finite log-prob (cps's noise there is 0 * sin(..) = 0: validation refuses it)."""
    v, x, sigma, _ = _inputs()
    zero, a = torch.zeros(B), 0.7
    s = sigma.view(B, 1, 1, 1)
    prev, log_prob, mean, std = sde_step_from_sigmas(v, x, sigma, zero, 0.95, a, generator=torch.Generator().manual_seed(3))
    sigma_t = a * torch.sqrt(s / (1 - s))
    expected_mean = x + (v + sigma_t**2 / (2 * s) * (x + (1 - s) * v)) * (-s)
    torch.testing.assert_close(mean, expected_mean, rtol=1e-6, atol=1e-6)
    expected = torch.distributions.Normal(expected_mean, sigma_t * torch.sqrt(s)).log_prob(prev).mean(dim=(1, 2, 3))
    torch.testing.assert_close(log_prob, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(prev, mean)  # the final latents carry the step's noise

    prev, log_prob, mean, _ = sde_step_from_sigmas(
        v, x, sigma, zero, 0.95, a, generator=torch.Generator().manual_seed(3), sde_type="dance_sde"
    )
    expected = torch.distributions.Normal(mean, a * torch.sqrt(s)).log_prob(prev).mean(dim=(1, 2, 3))
    assert torch.isfinite(log_prob).all()
    torch.testing.assert_close(log_prob, expected, rtol=1e-5, atol=1e-5)


def test_dance_sde_mean_and_log_prob_follow_dancegrpos_score_corrected_step():
    """DanceGRPO's step (arXiv 2505.07818, as verl-omni's scheduler): with x0 = x - sigma v, the score
    -(x - (1 - sigma) x0) / sigma^2 = -(x - (1 - sigma)(x - sigma v)) / sigma^2 corrects the Euler mean by
    -(a^2 / 2) score dt, and the noise is a sqrt(-dt) (written here in the expanded form, not the code's)."""
    v, x, sigma, sigma_next = _inputs()
    a = 0.8
    prev, log_prob, mean, std = sde_step_from_sigmas(
        v, x, sigma, sigma_next, 0.95, a, generator=torch.Generator().manual_seed(2), sde_type="dance_sde"
    )
    s = sigma.view(B, 1, 1, 1)
    dt = (sigma_next - sigma).view(B, 1, 1, 1)
    score = -(s * x + s * (1 - s) * v) / s**2  # x - (1 - s)(x - s v) = s x + s (1 - s) v
    expected_mean = x + v * dt - a**2 / 2 * score * dt
    torch.testing.assert_close(mean, expected_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(std, a * torch.sqrt(-dt))
    expected = torch.distributions.Normal(expected_mean, a * torch.sqrt(-dt)).log_prob(prev).mean(dim=(1, 2, 3))
    torch.testing.assert_close(log_prob, expected, rtol=1e-5, atol=1e-5)
    # Re-scoring the sampled transition gives the same log-prob (the on-policy ratio is exactly 1).
    _, again, _, _ = sde_step_from_sigmas(v, x, sigma, sigma_next, 0.95, a, prev_sample=prev, sde_type="dance_sde")
    assert torch.equal(again, log_prob)
    # At sigma = 1 (where Flow-GRPO's sde needs sigma_max) the step stays finite.
    _, at_one, _, _ = sde_step_from_sigmas(v, x, torch.ones(B), sigma_next, 0.95, a, sde_type="dance_sde")
    assert torch.isfinite(at_one).all()


def test_sde_sigma_one_uses_sigma_max_and_stays_finite():
    v, x, _, _ = _inputs()
    sigma, sigma_next, sigma_max = torch.ones(B), torch.full((B,), 0.9), 0.95
    _, log_prob, _, std = sde_step_from_sigmas(v, x, sigma, sigma_next, sigma_max, 0.7)
    # std = a * sqrt(sigma / (1 - sigma_max)) = 0.7 * sqrt(1 / 0.05) = 3.1305
    torch.testing.assert_close(std.flatten(), torch.full((B,), 0.7 * math.sqrt(1 / 0.05)))
    assert torch.isfinite(log_prob).all()


def test_cps_against_hand_computed_value():
    # x = 1, v = 0.5, sigma = 0.5, sigma_next = 0.25, a = 1/3  (sin(a * pi / 2) = sin(pi / 6) = 0.5)
    # std  = 0.25 * 0.5                                   = 0.125
    # x0   = x - sigma v = 1 - 0.25                        = 0.75
    # x1   = x + (1 - sigma) v = 1 + 0.25                  = 1.25
    # mean = (1 - 0.25) * 0.75 + sqrt(0.0625 - 0.015625) * 1.25
    #      = 0.5625 + 0.2165063509 * 1.25 = 0.5625 + 0.2706329387 = 0.8331329387
    # logp = -(0.9 - 0.8331329387)^2 = -(0.0668670613)^2  = -0.0044712039
    x, v = torch.ones(1, 1), torch.full((1, 1), 0.5)
    prev = torch.full((1, 1), 0.9)
    out, log_prob, mean, std = sde_step_from_sigmas(v, x, 0.5, 0.25, 1.0, 1 / 3, prev_sample=prev, sde_type="cps")
    assert torch.equal(out, prev)
    assert std.item() == pytest.approx(0.125, abs=1e-7)
    assert mean.item() == pytest.approx(0.8331329387, abs=1e-6)
    assert log_prob.item() == pytest.approx(-0.0044712039, abs=1e-7)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_rescoring_a_sampled_transition_gives_the_same_log_prob(sde_type):
    v, x, sigma, sigma_next = _inputs()
    prev, log_prob, _, _ = sde_step_from_sigmas(v, x, sigma, sigma_next, 0.95, 0.7, sde_type=sde_type)
    _, again, _, _ = sde_step_from_sigmas(v, x, sigma, sigma_next, 0.95, 0.7, prev_sample=prev, sde_type=sde_type)
    assert torch.equal(log_prob, again)


def test_math_is_fp32_for_bf16_inputs_and_gradients_flow_through_the_mean():
    v, x, sigma, sigma_next = _inputs()
    v16 = v.to(torch.bfloat16).requires_grad_(True)
    prev, log_prob, mean, _ = sde_step_from_sigmas(v16, x.to(torch.bfloat16), sigma, sigma_next, 0.95, 0.7)
    assert prev.dtype == log_prob.dtype == mean.dtype == torch.float32
    log_prob.sum().backward()
    assert v16.grad is not None and torch.isfinite(v16.grad.float()).all()


def test_per_sample_generators_make_each_row_reproducible_alone():
    seeds = [11, 22, 33]
    batch = randn_per_sample((3, *SHAPE), [torch.Generator().manual_seed(s) for s in seeds])
    alone = randn_per_sample((1, *SHAPE), [torch.Generator().manual_seed(22)])
    assert torch.equal(batch[1], alone[0])


def test_scheduler_wrapper_looks_up_per_sample_sigmas():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(6)
    v, x, _, _ = _inputs()
    idx = torch.tensor([0, 2, 4])
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    got = sde_step_with_logprob(scheduler, v, scheduler.timesteps[idx], x, noise_level=0.7, generator=g1)
    want = sde_step_from_sigmas(v, x, scheduler.sigmas[idx], scheduler.sigmas[idx + 1], scheduler.sigmas[1], 0.7, generator=g2)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="not in the scheduler"):
        sde_step_with_logprob(scheduler, v, torch.tensor([123.4, 500.0, 1.0]), x)


def test_sde_windows():
    assert torch.equal(sample_sde_windows(10, 4, None, None), torch.zeros(4, dtype=torch.long))
    assert window_length(10, None) == 9 and window_length(10, 3) == 3
    starts = sample_sde_windows(10, 200, 3, (2, 7), torch.Generator().manual_seed(0))
    assert starts.min() >= 2 and starts.max() <= 4 and set(starts.tolist()) == {2, 3, 4}
    default = sample_sde_windows(10, 200, 2, None, torch.Generator().manual_seed(0))
    assert default.max() <= 7  # the window stays inside [0, num_steps - 1): the last step is ODE
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    batch = sample_sde_windows(10, 3, 2, (0, 9), gens)
    assert batch[2] == sample_sde_windows(10, 1, 2, (0, 9), [torch.Generator().manual_seed(3)])[0]
    with pytest.raises(ValueError, match="sde_window_size=5"):
        sample_sde_windows(10, 2, 5, (0, 4))
    with pytest.raises(ValueError, match="sde_window_range"):
        sample_sde_windows(10, 2, 1, (3, 11))
