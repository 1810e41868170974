"""Flow-GRPO math (omni_core.algorithms.flow_grpo): hand-computed values and independent formulas."""

from __future__ import annotations

import math

import pytest
import torch

from omni_core.algorithms.flow_grpo import broadcast_advantages, compute_flow_grpo_advantages, kl_loss, policy_loss
from omni_core.algorithms.registry import ADV_ESTIMATORS, LOSS_MODES, get_adv_estimator, get_policy_loss

torch.set_num_threads(1)


# ----------------------------------------------------------------------------------------- advantages


def test_two_groups_of_two_give_exactly_plus_minus_one_with_population_group_std():
    # group 0: [1, 3]   mean 2, population std sqrt(((1-2)^2 + (3-2)^2) / 2) = 1 -> (1-2)/1, (3-2)/1
    # group 1: [10, 14] mean 12, population std sqrt((4 + 4) / 2) = 2         -> (10-12)/2, (14-12)/2
    rewards = torch.tensor([1.0, 3.0, 10.0, 14.0])
    adv = compute_flow_grpo_advantages(rewards, torch.tensor([0, 0, 1, 1]), global_std=False, eps=0.0, unbiased=False)
    assert torch.equal(adv, torch.tensor([-1.0, 1.0, -1.0, 1.0]))


def test_unbiased_group_std_of_a_pair_gives_one_over_sqrt2():
    # unbiased std of [1, 3] = sqrt(2 / (2-1)) = sqrt(2); deviation 1 -> 1/sqrt(2); same for [10, 14]
    adv = compute_flow_grpo_advantages(
        torch.tensor([1.0, 3.0, 10.0, 14.0]), torch.tensor([0, 0, 1, 1]), global_std=False, eps=0.0
    )
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([-s, s, -s, s]))


def test_global_std_uses_the_whole_batch_unbiased_std_plus_eps():
    # group means 1 and 5 -> centered [-1, 1, -1, 1]
    # batch [0, 2, 4, 6]: mean 3, squared deviations 9+1+1+9 = 20, unbiased var 20/3
    rewards = torch.tensor([0.0, 2.0, 4.0, 6.0])
    adv = compute_flow_grpo_advantages(rewards, torch.tensor([0, 0, 1, 1]))
    d = 1.0 / (math.sqrt(20 / 3) + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([-d, d, -d, d]))
    # per-group std differs: each pair has unbiased std sqrt(2) -> 1/(sqrt2 + 1e-4)
    adv_group = compute_flow_grpo_advantages(rewards, torch.tensor([0, 0, 1, 1]), global_std=False)
    g = 1.0 / (math.sqrt(2) + 1e-4)
    torch.testing.assert_close(adv_group, torch.tensor([-g, g, -g, g]))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], 1.0 / (math.sqrt(20 / 3) + 1e-4)),  # the default: unbiased batch std, as verl-omni
        (["algorithm.std_estimator=population"], 1.0 / (math.sqrt(20 / 4) + 1e-4)),  # np.std, as flow_grpo
        (["algorithm.std_estimator=population", "algorithm.global_std=false"], 1.0 / (1.0 + 1e-4)),  # pairs: std 1
        (["algorithm.norm_adv_by_std_in_grpo=false"], 1.0),
    ],
)
def test_the_config_chooses_the_std_estimator(overrides, expected):
    """`compute_advantages` (what the trainer calls) on the batch [0, 2, 4, 6] in groups [0, 0, 1, 1]: centered
    [-1, 1, -1, 1], divided by the std the `algorithm` section names (squared deviations from 3: 20 over 4 samples)."""
    from omni_core.algorithms.registry import compute_advantages
    from omni_core.config import load_config

    algorithm = load_config(overrides=overrides).algorithm
    adv = compute_advantages(algorithm, torch.tensor([0.0, 2.0, 4.0, 6.0]), torch.tensor([0, 0, 1, 1]))
    torch.testing.assert_close(adv, torch.tensor([-expected, expected, -expected, expected]))


def test_norm_off_is_reward_minus_group_mean():
    # [1, 3] - 2 = [-1, 1];  [10, 14] - 12 = [-2, 2]
    adv = compute_flow_grpo_advantages(torch.tensor([1.0, 3.0, 10.0, 14.0]), torch.tensor([0, 0, 1, 1]), norm_adv_by_std=False)
    assert torch.equal(adv, torch.tensor([-1.0, 1.0, -2.0, 2.0]))


@pytest.mark.parametrize("global_std", [True, False])
def test_constant_group_and_singletons_are_exactly_zero(global_std):
    # 0.1 is not representable: a sum/count mean of three 0.1s can miss 0.1 by an ulp.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.2, 0.9])
    uids = ["a", "a", "a", "b", "c", "c"]  # "b" is a singleton
    adv = compute_flow_grpo_advantages(rewards, uids, global_std=global_std)
    assert torch.equal(adv[:4], torch.zeros(4))
    assert adv[4] < 0 < adv[5]
    # with eps = 0 a constant group has std 0: still exactly 0, not 0/0 = nan
    adv = compute_flow_grpo_advantages(rewards, uids, global_std=global_std, eps=0.0)
    assert torch.equal(adv[:4], torch.zeros(4))
    # a batch of one sample (global std undefined) is a singleton too
    assert torch.equal(compute_flow_grpo_advantages(torch.tensor([3.0]), [0]), torch.zeros(1))


def _naive_advantages(rewards, groups, global_std, eps=1e-4):
    """Independent reference: a Python loop over groups with torch's unbiased std."""
    out = torch.zeros_like(rewards)
    batch_std = rewards.std()
    for g in set(groups.tolist()):
        members = [i for i in range(len(groups)) if groups[i] == g]
        values = rewards[members]
        if len(members) == 1:
            continue
        std = batch_std if global_std else values.std()
        for i in members:
            out[i] = (rewards[i] - values.mean()) / (std + eps)
    return out


@pytest.mark.parametrize("global_std", [True, False])
def test_vectorised_advantages_equal_a_naive_loop_and_are_zero_mean_per_group(global_std):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(48, generator=gen) * 3 + 1
    groups = torch.randint(0, 9, (48,), generator=gen) * 7  # sparse, unsorted ids
    adv = compute_flow_grpo_advantages(rewards, groups, global_std=global_std)
    torch.testing.assert_close(adv, _naive_advantages(rewards, groups, global_std), rtol=1e-5, atol=1e-6)
    for g in groups.unique():
        assert abs(adv[groups == g].sum().item()) < 1e-4


def test_uid_strings_equal_int_ids_and_broadcast_to_window():
    rewards = torch.tensor([0.3, 0.5, 0.1, 0.9])
    by_uid = compute_flow_grpo_advantages(rewards, ["p1", "p2", "p1", "p2"])
    by_int = compute_flow_grpo_advantages(rewards, torch.tensor([5, 2, 5, 2]))
    assert torch.equal(by_uid, by_int)
    wide = broadcast_advantages(by_uid, window=3)
    assert wide.shape == (4, 3) and torch.equal(wide[:, 2], by_uid)


def test_advantages_are_fp32_for_bf16_rewards():
    adv = compute_flow_grpo_advantages(torch.tensor([1.0, 2.0], dtype=torch.bfloat16), [0, 0])
    assert adv.dtype == torch.float32


# ----------------------------------------------------------------------------------------- policy loss


def test_clipped_loss_against_hand_values_inside_and_outside_the_clip_range():
    eps = 0.2
    ratio = torch.tensor([1.5, 0.5, 1.5, 0.5, 1.1])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0])
    old = torch.zeros(5)
    logp = ratio.log().requires_grad_(True)
    loss, m = policy_loss(logp, old, adv, clip_ratio=eps, adv_clip_max=5.0)
    # per sample max(-A r, -A clip(r, 0.8, 1.2)):
    #   A=+1 r=1.5: max(-1.5, -1.2) = -1.2 (clipped)     A=+1 r=0.5: max(-0.5, -0.8) = -0.5
    #   A=-1 r=1.5: max( 1.5,  1.2) =  1.5               A=-1 r=0.5: max( 0.5,  0.8) =  0.8 (clipped)
    #   A=+2 r=1.1 (inside): -2.2
    # mean = (-1.2 - 0.5 + 1.5 + 0.8 - 2.2) / 5 = -1.6 / 5 = -0.32
    torch.testing.assert_close(loss, torch.tensor(-0.32))
    # clip fractions count ratios outside [0.8, 1.2]: two above (1.5), two below (0.5) of five
    assert m["pg_clipfrac_higher"].item() == pytest.approx(0.4)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(0.4)
    assert m["pg_clipfrac"].item() == pytest.approx(0.8)
    assert m["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.5 + 0.5 + 1.1) / 5)
    ppo_kl = 0.5 * (2 * math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2 + math.log(1.1) ** 2) / 5
    assert m["ppo_kl"].item() == pytest.approx(ppo_kl, rel=1e-5)
    # clipped samples give no gradient; the others d/dlogp (-A r / 5) = -A r / 5
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -0.1, 0.3, 0.0, -0.44]))


def test_advantage_is_clamped_to_adv_clip_max():
    zeros = torch.zeros(2)
    loss, _ = policy_loss(zeros, zeros, torch.tensor([10.0, 10.0]), clip_ratio=1e-4, adv_clip_max=5.0)
    assert loss.item() == -5.0  # r = 1, A clamped 10 -> 5, loss = -5
    loss, _ = policy_loss(zeros, zeros, torch.tensor([-10.0, 3.0]), clip_ratio=1e-4, adv_clip_max=5.0)
    assert loss.item() == pytest.approx((5.0 - 3.0) / 2)


def test_on_policy_ratio_is_one_with_zero_diagnostics():
    logp = torch.randn(6)
    adv = torch.randn(6)
    loss, m = policy_loss(logp, logp.clone(), adv, clip_ratio=1e-4, adv_clip_max=5.0)
    assert m["ratio_mean"].item() == 1.0 and m["ratio_std"].item() == 0.0
    assert m["ppo_kl"].item() == 0.0 and m["pg_clipfrac"].item() == 0.0
    torch.testing.assert_close(loss, -adv.mean())


# ----------------------------------------------------------------------------------------- KL


def test_kl_against_hand_values_and_zero_for_equal_means():
    mu = torch.zeros(2, 1, 2, 2)
    ref = torch.cat([torch.full((1, 1, 2, 2), 0.5), torch.full((1, 1, 2, 2), 2.0)])
    # per-sample std [0.5, 1.0]: sample 0: 0.25 / (2 * 0.25) = 0.5; sample 1: 4 / (2 * 1) = 2 -> mean 1.25
    assert kl_loss(mu, ref, torch.tensor([0.5, 1.0])).item() == pytest.approx(1.25)
    assert kl_loss(mu, ref, torch.tensor([0.5, 1.0]).view(2, 1, 1, 1)).item() == pytest.approx(1.25)
    # scalar std 0.5: 0.5 and 4 / 0.5 = 8 -> mean 4.25
    assert kl_loss(mu, ref, 0.5).item() == pytest.approx(4.25)
    x = torch.randn(3, 4, 2, 2)
    assert kl_loss(x, x.clone(), 0.3).item() == 0.0


# ----------------------------------------------------------------------------------------- registry


def test_registries_resolve_names_and_list_choices_for_unknown_ones():
    assert get_adv_estimator("flow_grpo") is compute_flow_grpo_advantages
    assert get_adv_estimator("dance_grpo") is ADV_ESTIMATORS["flow_grpo"]
    from omni_core.algorithms.losses import flow_grpo as flow_grpo_loss

    assert get_policy_loss("flow_grpo") is LOSS_MODES["flow_grpo"] is flow_grpo_loss.LOSS
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'gae'.*flow_grpo"):
        get_adv_estimator("gae")
    with pytest.raises(
        ValueError,
        match=r"unknown loss mode 'kto'.*\['dance_grpo', 'diffusion_nft', 'distill_fm_mse', 'distill_kl', 'dpo', 'flow_dppo', 'flow_grpo', 'grpo_guard'\]",
    ):
        get_policy_loss("kto")
