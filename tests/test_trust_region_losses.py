"""GRPO-Guard's and Flow-DPPO's objectives (`omni_core.algorithms.trust_region`) against the equations, by hand.

Each expected value is written out here from the papers' / verl-omni's definitions with Python floats, not with the
implementation's tensor code; the cases that tell each apart from Flow-GRPO are checked too (a drifted mean that
GRPO-Guard's bias term sees while Flow-GRPO's ratio stays 1; a high-KL sample that Flow-DPPO masks and Flow-GRPO
trains).
"""

from __future__ import annotations

import math

import pytest
import torch

from omni_core.algorithms.flow_grpo import policy_loss
from omni_core.algorithms.trust_region import flow_dppo_loss, grpo_guard_loss

# One denoising step of 2 samples with a 2-element latent; sigma = 0.5, sqrt(-dt) = 0.4: the step's scale s*sigma = 0.2.
LOG_PROB, OLD = [0.1, -0.2], [0.0, 0.0]
ADV = [1.0, -1.0]
MEAN, OLD_MEAN = [[0.3, 0.1], [0.0, 0.2]], [[0.1, 0.1], [0.0, 0.0]]
STD, SQRT_DT, CLIP = 0.5, 0.4, 0.2


def _guard(log_prob=LOG_PROB, mean=MEAN, adv=ADV, requires_grad=False):
    lp = torch.tensor(log_prob, requires_grad=requires_grad)
    loss, metrics = grpo_guard_loss(
        lp,
        torch.tensor(OLD),
        torch.tensor(adv),
        torch.tensor(mean),
        torch.tensor(OLD_MEAN),
        STD,
        SQRT_DT,
        clip_ratio=CLIP,
        adv_clip_max=5.0,
    )
    return lp, loss, metrics


def test_grpo_guard_loss_matches_the_equation_by_hand():
    scale = SQRT_DT * STD  # 0.2
    expected_terms = []
    for lp, old, a, mu, mu_old in zip(LOG_PROB, OLD, ADV, MEAN, OLD_MEAN, strict=True):
        bias = sum((m - o) ** 2 for m, o in zip(mu, mu_old, strict=True)) / len(mu) / (2 * scale**2)  # 0.25 both
        r = math.exp((lp - old + bias) * scale)
        clipped = min(max(r, 1 - CLIP), 1 + CLIP)
        expected_terms.append(max(-a * r, -a * clipped))
    expected = sum(expected_terms) / len(expected_terms) / SQRT_DT**2
    _, loss, metrics = _guard()
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert loss.item() == pytest.approx((-math.exp(0.07) + math.exp(0.01)) / 2 / 0.16, rel=1e-6)  # the same, simplified
    assert metrics["ratio_mean_bias"].item() == pytest.approx(0.25, rel=1e-6)


def test_grpo_guard_gradient_is_the_ratio_times_the_scale_over_sqrt_dt_squared():
    """Unclipped: d L / d log_prob_i = -A_i r_i (s sigma) / (B s^2)."""
    lp, loss, _ = _guard(requires_grad=True)
    loss.backward()
    scale = SQRT_DT * STD
    ratios = [math.exp((0.1 + 0.25) * scale), math.exp((-0.2 + 0.25) * scale)]
    expected = [-a * r * scale / (2 * SQRT_DT**2) for a, r in zip(ADV, ratios, strict=True)]
    assert lp.grad.tolist() == pytest.approx(expected, rel=1e-6)


def test_grpo_guard_sees_a_drifted_mean_that_flow_grpo_does_not():
    """On-policy (same log-probs, same means): the ratio is exactly 1 and the loss is -mean(A) / s^2. Same log-probs but a
    drifted mean: Flow-GRPO's ratio stays 1, GRPO-Guard's bias term moves it."""
    _, on_policy, m = _guard(log_prob=OLD, mean=OLD_MEAN, adv=[1.0, 0.5])
    assert m["ratio_mean"].item() == 1.0
    assert on_policy.item() == pytest.approx(-(1.0 + 0.5) / 2 / SQRT_DT**2, rel=1e-6)
    _, _, drifted = _guard(log_prob=OLD, mean=MEAN, adv=[1.0, 0.5])
    assert drifted["ratio_mean"].item() == pytest.approx(math.exp(0.25 * 0.2), rel=1e-6)
    _, grpo = policy_loss(torch.tensor(OLD), torch.tensor(OLD), torch.tensor([1.0, 0.5]), clip_ratio=CLIP, adv_clip_max=5.0)
    assert grpo["ratio_mean"].item() == 1.0


# Flow-DPPO: std_dev_t = 1, sqrt_dt = 0.5 (sigma 0.5, 2 sigma^2 = 0.5), a 1-element latent: KL_i = d_i^2 / 0.5.
DPPO_LOG_RATIO = [0.1, -0.1, 0.1, -0.1, -0.1]
DPPO_ADV = [1.0, -1.0, 1.0, -1.0, 1.0]
DPPO_DRIFT = [0.1, 0.1, 1.0, 1.0, 1.0]  # KL 0.02, 0.02, 2, 2, 2 against a threshold of 1


def _dppo(threshold=1.0, add_kl_coefficient=True):
    old_mean = torch.zeros(5, 1)
    return flow_dppo_loss(
        torch.tensor(DPPO_LOG_RATIO),
        torch.zeros(5),
        torch.tensor(DPPO_ADV),
        torch.tensor(DPPO_DRIFT).unsqueeze(1),
        old_mean,
        1.0,
        0.5,
        kl_mask_threshold=threshold,
        add_kl_coefficient=add_kl_coefficient,
    )


def test_flow_dppo_masks_only_high_kl_samples_that_move_away_from_the_old_policy():
    """Sample 2 (KL 2, r > 1, A > 0) and 3 (KL 2, r < 1, A < 0) are masked; 4 (KL 2, r < 1, A > 0) moves back toward the
    old policy and is kept; 0 and 1 are inside the trust region."""
    loss, metrics = _dppo()
    kept = [0, 1, 4]
    expected = sum(-DPPO_ADV[i] * math.exp(DPPO_LOG_RATIO[i]) for i in kept) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["masked_fraction"].item() == pytest.approx(2 / 5)
    assert metrics["pos_rm_fraction"].item() == pytest.approx(1 / 5) and metrics["neg_rm_fraction"].item() == pytest.approx(1 / 5)
    assert metrics["kl_mask_fraction"].item() == pytest.approx(3 / 5)
    assert metrics["kl_new_old_max"].item() == pytest.approx(1.0**2 / (2 * 0.5**2), rel=1e-6)
    assert metrics["kl_new_old_mean"].item() == pytest.approx((0.02 * 2 + 2.0 * 3) / 5, rel=1e-6)


def test_flow_dppo_without_masking_is_the_unclipped_objective_and_differs_from_flow_grpo():
    loss, metrics = _dppo(threshold=100.0)
    unclipped = sum(-a * math.exp(r) for a, r in zip(DPPO_ADV, DPPO_LOG_RATIO, strict=True)) / 5
    assert loss.item() == pytest.approx(unclipped, rel=1e-6) and metrics["masked_fraction"].item() == 0.0
    # Flow-GRPO with the same ratios trains samples 2 and 3 too (e^0.1 and e^-0.1 are inside its clip range of 0.2):
    # where Flow-DPPO masks them, the losses differ by their two terms.
    masked, _ = _dppo()
    assert unclipped - masked.item() == pytest.approx((-math.exp(0.1) + math.exp(-0.1)) / 5, rel=1e-6)
    _, grpo = policy_loss(torch.tensor(DPPO_LOG_RATIO), torch.zeros(5), torch.tensor(DPPO_ADV), clip_ratio=0.2, adv_clip_max=5.0)
    assert grpo["pg_clipfrac"].item() == 0.0


def test_flow_dppo_kl_without_the_coefficient_is_half_the_squared_drift():
    _, metrics = _dppo(threshold=0.4, add_kl_coefficient=False)  # KL = d^2 / 2: 0.005, 0.005, 0.5, 0.5, 0.5
    assert metrics["kl_new_old_max"].item() == pytest.approx(0.5)
    assert metrics["masked_fraction"].item() == pytest.approx(2 / 5)
