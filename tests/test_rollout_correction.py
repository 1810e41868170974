"""Rollout correction (`algorithm.rollout_correction`): verl's importance-sampling weights and rejection sampling,
against hand values, and their effect on a real update of the tiny SD3 model.

Light except the last two tests (the tiny model in-process, no Ray)."""

from __future__ import annotations

import math

import pytest
import torch

from omni_core.algorithms.rollout_correction import RolloutCorrection, importance_weights, rejection_mask

# Two samples x two SDE steps of log pi_train - log pi_rollout.
LOG_RATIO = torch.tensor([[0.1, 0.9], [-0.3, -0.2]])


def test_token_weights_are_truncated_at_the_upper_bound():
    w, m = importance_weights(LOG_RATIO, "token", 2.0)
    expected = [[math.exp(0.1), 2.0], [math.exp(-0.3), math.exp(-0.2)]]  # e^0.9 = 2.46 is truncated at 2
    torch.testing.assert_close(w, torch.tensor(expected), rtol=1e-6, atol=0)
    assert m["rollout_is_max"] == pytest.approx(2.0) and m["rollout_is_ratio_fraction_high"] == 0.25


def test_sequence_weights_are_the_product_over_the_steps_and_icepop_zeroes_outside_the_band():
    w, _ = importance_weights(LOG_RATIO, "sequence", 5.0)
    torch.testing.assert_close(w, torch.tensor([[math.exp(1.0)] * 2, [math.exp(-0.5)] * 2]), rtol=1e-6, atol=0)
    w, m = importance_weights(LOG_RATIO, "sequence", "0.7_2.0")  # e^1 = 2.72 above, e^-0.5 = 0.61 below: both zeroed
    assert w.tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert m["rollout_is_ratio_fraction_low"] == 0.5
    w, _ = importance_weights(LOG_RATIO, "token", 2.0, batch_normalize=True)
    assert w.mean().item() == pytest.approx(1.0)


def test_rejection_options_against_hand_values():
    # token_k1 keeps log(L) <= -log_ratio <= log(U): with "0.5_2.0", |log_ratio| <= log 2 = 0.693; 0.9 is rejected.
    keep, m = rejection_mask(LOG_RATIO, "token_k1", "0.5_2.0")
    assert keep.tolist() == [[1.0, 0.0], [1.0, 1.0]]
    assert m["rollout_rs_masked_fraction"] == 0.25 and m["rollout_rs_seq_masked_fraction"] == 0.5
    # "U" alone means L = 1 / U for k1 options.
    assert torch.equal(rejection_mask(LOG_RATIO, "token_k1", 2.0)[0], keep)
    # token_k2: log_ratio^2 / 2 <= 0.1 keeps |log_ratio| <= 0.447.
    assert rejection_mask(LOG_RATIO, "token_k2", 0.1)[0].tolist() == [[1.0, 0.0], [1.0, 1.0]]
    # token_k3: e^x - 1 - x <= 0.05: x = 0.1 -> 0.0052, 0.9 -> 0.560, -0.3 -> 0.0408, -0.2 -> 0.0187.
    assert rejection_mask(LOG_RATIO, "token_k3", 0.05)[0].tolist() == [[1.0, 0.0], [1.0, 1.0]]
    # seq_mean_k1 on each sample's mean of -log_ratio: -0.5 and 0.25; band "0.7_1.5" = [-0.357, 0.405]: sample 0 out.
    assert rejection_mask(LOG_RATIO, "seq_mean_k1", "0.7_1.5")[0].tolist() == [[0.0, 0.0], [1.0, 1.0]]
    # seq_sum_k2 = 0.005 + 0.405 = 0.41 and 0.045 + 0.02 = 0.065; seq_max_k3 = 0.560 and 0.0408.
    assert rejection_mask(LOG_RATIO, "seq_sum_k2", 0.1)[0].tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert rejection_mask(LOG_RATIO, "seq_max_k3", 0.5)[0].tolist() == [[0.0, 0.0], [1.0, 1.0]]
    # Several options: all must pass; one threshold per option.
    both, m = rejection_mask(LOG_RATIO, "token_k2,seq_max_k3", "1.0,0.05")
    assert both.tolist() == [[0.0, 0.0], [1.0, 1.0]] and m["rollout_rs_token_k2_masked_fraction"] == 0.0
    with pytest.raises(ValueError, match="choose comma-separated options"):
        rejection_mask(LOG_RATIO, "seq_mean_k9", 1.0)


def test_bypass_mode_applies_only_the_rejection_mask():
    """Bypass mode (old == rollout): the PPO ratio already is the IS weight, so only RS changes the loss (verl-omni);
    the IS statistics are logged."""
    rc = RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    weights, metrics = rc.bypass(torch.tensor([0.9, 0.1]), torch.tensor([0.0, 0.0]))
    assert weights.tolist() == [0.0, 1.0] and "rollout_is_mean" in metrics
    weights, _ = RolloutCorrection(rollout_is="token").bypass(torch.tensor([0.9]), torch.tensor([0.0]))
    assert weights is None


# ----------------------------------------------------------------------------- through a real update
def _trainer(tiny_sd3_dir, *extra: str):
    from flow_utils import SMALL_ACTOR_STEP

    from omni_core.config import load_config
    from omni_core.workers.policy_trainer import PolicyTrainer

    overrides = [*SMALL_ACTOR_STEP, f"actor_rollout_ref.model.path={tiny_sd3_dir}", "actor_rollout_ref.actor.optim.lr=1e-3"]
    return PolicyTrainer(load_config(overrides=[*overrides, *extra]), total_training_steps=4, text_encoders=True)


def _rollout(trainer):
    from omni_core.rollout.sampler import generate
    from omni_core.rollout.sampling_params import SamplingParams

    params = SamplingParams.for_training(trainer.config.actor_rollout_ref.rollout)
    return generate(trainer.policy, ["a red circle", "a blue square"], prompt_indices=[0, 1], **params.generate_kwargs(1))


def test_a_rejected_sample_trains_as_if_its_advantage_were_zero(tiny_sd3_dir, one_torch_thread):
    """Decoupled mode: sample 0's rollout log-probs are off by 1 from the recomputed ones, so token_k1 with "0.5_2.0"
    rejects its steps: the update equals, bit for bit, the update without correction where sample 0's advantage is 0."""
    advantages = torch.tensor([1.0, -1.0] * 4)
    corrected = _trainer(
        tiny_sd3_dir,
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
    )
    traj = _rollout(corrected)
    traj.log_probs[0] -= 1.0  # the rollout "sampled" sample 0 with other numerics
    metrics = corrected.train_on(traj, advantages, 1)
    window = traj.log_probs.shape[1]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(window / traj.log_probs.numel())
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 8)

    plain = _trainer(tiny_sd3_dir)
    zeroed = advantages.clone()
    zeroed[0] = 0.0
    plain.train_on(_rollout(plain), zeroed, 1)
    a, b = corrected.trainable_state(), plain.trainable_state()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # Without the rejection, sample 0 trains: the weights differ.
    again = _trainer(tiny_sd3_dir)
    again.train_on(_rollout(again), advantages, 1)
    assert not all(torch.equal(a[k], v) for k, v in again.trainable_state().items())


def test_a_truncated_importance_weight_scales_the_samples_term(tiny_sd3_dir, one_torch_thread):
    """Decoupled token IS: sample 0's rollout log-probs are 0.5 below the recomputed ones, so its weight is e^0.5 (under
    the bound 2); the update equals the uncorrected one with sample 0's advantage times e^0.5 (to rounding: Adam's steps
    here are ~1e-3 per weight; a CI run saw one weight of 32,768 off by 1.6e-7, so the bound is 1e-6)."""
    advantages = torch.tensor([1.0, -1.0] * 4)
    corrected = _trainer(tiny_sd3_dir, "algorithm.rollout_correction.rollout_is=token")
    traj = _rollout(corrected)
    traj.log_probs[0] -= 0.5
    metrics = corrected.train_on(traj, advantages, 1)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(0.5), rel=1e-5)

    plain = _trainer(tiny_sd3_dir)
    scaled = advantages.clone()
    scaled[0] *= math.exp(0.5)
    plain.train_on(_rollout(plain), scaled, 1)
    a, b = corrected.trainable_state(), plain.trainable_state()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
