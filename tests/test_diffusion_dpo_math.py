"""Diffusion-DPO's math on small tensors, against the paper's equations written out here (Wallace et al. 2024, eq. 14
in its flow-matching form, as verl-omni's docs/algo/diffusion_dpo.md writes it), and online pairing by hand."""

from __future__ import annotations

import math

import pytest
import torch

from omni_core.algorithms.diffusion_dpo import dpo_loss, preference_pairs, sample_train_steps
from omni_core.algorithms.loss_contract import LossInputs, LossSettings
from omni_core.algorithms.registry import get_policy_loss


def _pairs(seed: int = 0, pairs: int = 3, shape: tuple[int, ...] = (2, 3)):
    g = torch.Generator().manual_seed(seed)
    b = 2 * pairs
    x0 = torch.randn(b, *shape, generator=g)
    noise = torch.randn(pairs, *shape, generator=g).repeat_interleave(2, dim=0)  # shared within a pair
    v = torch.randn(b, *shape, generator=g)
    v_ref = torch.randn(b, *shape, generator=g)
    return x0, noise, v, v_ref


def _paper_loss(x0, noise, v, v_ref, beta: float) -> float:
    """-mean log sigmoid(-beta/2 [(|v_w - u_w|^2 - |vref_w - u_w|^2) - (|v_l - u_l|^2 - |vref_l - u_l|^2)]), |.|^2 the
    mean over the latent, u = eps - x0; one term per pair, written sample by sample."""
    terms = []
    for p in range(x0.shape[0] // 2):
        w, lo = 2 * p, 2 * p + 1

        def err(pred, i):
            return float(((pred[i] - (noise[i] - x0[i])) ** 2).mean())

        delta_w = err(v, w) - err(v_ref, w)
        delta_l = err(v, lo) - err(v_ref, lo)
        z = -beta / 2 * (delta_w - delta_l)
        terms.append(-math.log(1 / (1 + math.exp(-z))))
    return sum(terms) / len(terms)


def test_the_loss_is_the_papers_objective_and_its_metrics_are_verl_omnis():
    x0, noise, v, v_ref = _pairs()
    rewards = torch.tensor([0.9, 0.1, 0.5, 0.4, 2.0, -1.0])
    for beta in (0.5, 2.0, 7.0):
        loss, metrics = dpo_loss(v, v_ref, x0, noise, rewards, beta)
        assert float(loss) == pytest.approx(_paper_loss(x0, noise, v, v_ref, beta), rel=1e-5)
    # The implicit rewards -beta/2 D of the chosen and rejected samples, their margin and the implicit accuracy.
    beta = 2.0
    _, metrics = dpo_loss(v, v_ref, x0, noise, rewards, beta)
    u = noise - x0
    d = ((v - u) ** 2).flatten(1).mean(1) - ((v_ref - u) ** 2).flatten(1).mean(1)
    chosen, rejected = -beta / 2 * d[0::2], -beta / 2 * d[1::2]
    assert float(metrics["rewards/chosen"]) == pytest.approx(float(chosen.mean()), rel=1e-5)
    assert float(metrics["rewards/rejected"]) == pytest.approx(float(rejected.mean()), rel=1e-5)
    assert float(metrics["rewards/margins"]) == pytest.approx(float((chosen - rejected).mean()), rel=1e-5)
    assert float(metrics["implicit_acc"]) == pytest.approx(float((chosen > rejected).float().mean()))
    assert float(metrics["dpo_tied_pairs"]) == 0.0


def test_at_the_reference_the_loss_is_log_2_and_swapping_chosen_and_rejected_flips_the_gradient():
    x0, noise, _, v_ref = _pairs(seed=1)
    rewards = torch.tensor([1.0, 0.0] * 3)
    v = v_ref.clone().requires_grad_(True)
    loss, metrics = dpo_loss(v, v_ref, x0, noise, rewards, beta=5.0)
    assert float(loss.detach()) == pytest.approx(math.log(2.0), rel=1e-6)  # z = 0 for every pair
    assert float(metrics["implicit_acc"]) == 0.0  # z > 0 nowhere
    loss.backward()
    grad = v.grad.clone()
    # Swap each pair's samples (the rejected one now sits first, as the chosen): the same point, the opposite gradient.
    swap = torch.tensor([1, 0, 3, 2, 5, 4])
    v2 = v_ref[swap].clone().requires_grad_(True)
    dpo_loss(v2, v_ref[swap], x0[swap], noise[swap], rewards, beta=5.0)[0].backward()
    assert torch.allclose(v2.grad[swap], -grad, atol=1e-7)
    # The gradient descends the chosen sample's error and ascends the rejected one's: a step against it fits the chosen.
    u = noise - x0
    with torch.no_grad():
        stepped = v_ref - 0.01 * grad
        err_change = ((stepped - u) ** 2).flatten(1).mean(1) - ((v_ref - u) ** 2).flatten(1).mean(1)
    assert (err_change[0::2] < 0).all() and (err_change[1::2] > 0).all()


def test_a_tied_pair_has_no_gradient_and_a_misordered_pair_is_an_error():
    x0, noise, v, v_ref = _pairs(seed=2, pairs=2)
    v = v.requires_grad_(True)
    loss, metrics = dpo_loss(v, v_ref, x0, noise, torch.tensor([0.7, 0.7, 0.9, 0.2]), beta=3.0)
    loss.backward()
    assert torch.equal(v.grad[:2], torch.zeros_like(v.grad[:2])) and v.grad[2:].abs().sum() > 0
    assert float(metrics["dpo_tied_pairs"]) == 0.5
    # The mean runs over both pairs (the tied one adds 0): the untied pair's term over 2.
    assert float(loss) == pytest.approx(_paper_loss(x0[2:], noise[2:], v.detach()[2:], v_ref[2:], 3.0) / 2, rel=1e-5)
    with pytest.raises(ValueError, match="not \\(chosen, rejected\\)"):
        dpo_loss(v, v_ref, x0, noise, torch.tensor([0.1, 0.9, 0.9, 0.2]), beta=3.0)
    with pytest.raises(ValueError, match="pairs"):
        dpo_loss(v[:3], v_ref[:3], x0[:3], noise[:3], torch.tensor([1.0, 0.0, 1.0]), beta=3.0)


def test_the_registered_loss_reads_dpo_beta_and_declares_what_it_reads():
    loss = get_policy_loss("dpo")
    settings = LossSettings(clip_ratio=0.0, adv_clip_max=0.0, options={"dpo_beta": 4.0})
    assert loss.group_size == 2
    assert loss.inputs(settings) == {"rewards", "final_latents", "forward_noise", "velocity", "ref_velocity"}
    x0, noise, v, v_ref = _pairs(seed=3)
    rewards = torch.tensor([3.0, 1.0, 2.0, 0.0, 1.0, 0.5])
    inputs = LossInputs(velocity=v, ref_velocity=v_ref, final_latents=x0, forward_noise=noise, rewards=rewards)
    value, _ = loss(inputs, settings)
    assert float(value) == pytest.approx(_paper_loss(x0, noise, v, v_ref, 4.0), rel=1e-5)


def test_pairs_are_the_best_and_worst_of_each_group_in_order_of_first_appearance():
    # Two groups whose samples interleave (as two rollout workers' rows land in the queue): group 7 first.
    group = torch.tensor([7, 3, 7, 3, 7, 3, 7, 3])
    rewards = torch.tensor([0.2, 5.0, 0.9, 1.0, 0.9, 1.0, 0.1, 4.0])
    failed = torch.zeros(8, dtype=torch.bool)
    order, pair_rewards = preference_pairs(rewards, failed, group)
    # group 7: best 0.9 (first of equals: sample 2), worst 0.1 (sample 6); group 3: best 5.0 (1), worst 1.0 (last: 5)
    assert order.tolist() == [2, 6, 1, 5]
    assert pair_rewards.tolist() == pytest.approx([0.9, 0.1, 5.0, 1.0])


def test_failed_samples_are_never_paired_and_a_group_without_two_scores_is_a_tie():
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    rewards = torch.tensor([9.0, 0.5, 0.1, 0.3, 0.0, 0.7])
    failed = torch.tensor([True, False, False, True, True, False])  # sample 0's 9.0 failed; group 1 keeps one score
    order, pair_rewards = preference_pairs(rewards, failed, group)
    assert order.tolist()[:2] == [1, 2] and pair_rewards.tolist()[:2] == pytest.approx([0.5, 0.1])
    assert len(order) == 4 and set(order.tolist()[2:]) <= {3, 4, 5}
    assert pair_rewards.tolist()[2:] == [0.0, 0.0]  # no preference: the loss gives it no gradient
    # All samples of a group tied: a pair whose rewards are equal (the first and the last sample).
    order, pair_rewards = preference_pairs(torch.ones(3), torch.zeros(3, dtype=torch.bool), torch.zeros(3, dtype=torch.long))
    assert order.tolist() == [0, 2] and pair_rewards.tolist() == [1.0, 1.0]


def test_training_steps_are_drawn_logit_normal():
    """floor(sigmoid(z) N), z ~ N(0, 1) from the generator (SD3's logit-normal rule, mean 0, std 1)."""
    steps = sample_train_steps(1000, torch.Generator().manual_seed(5), 6)
    z = torch.normal(0.0, 1.0, (6,), generator=torch.Generator().manual_seed(5))
    assert steps.tolist() == [int(1000 / (1 + math.exp(-float(x)))) for x in z]
    many = sample_train_steps(1000, torch.Generator().manual_seed(6), 20000).float()
    assert abs(float(many.mean()) - 499.5) < 10  # symmetric about the middle
    inner = math.erf(math.log(3.0) / math.sqrt(2.0))  # P(|z| < logit(0.75) = ln 3) = 0.728
    assert float(((many >= 250) & (many < 750)).float().mean()) == pytest.approx(inner, abs=0.02)


def test_the_update_schedule_keeps_each_pair_in_one_micro_batch_on_one_rank():
    """Shuffled mini-batches over two data-parallel ranks: every micro-batch holds whole pairs, chosen first, and the
    ranks' shares of each mini-batch are disjoint and cover it."""
    from omni_core.algorithms.update import PPOUpdateConfig, local_schedule

    def config(rank: int) -> PPOUpdateConfig:
        return PPOUpdateConfig(8, 2, 2, 0.0, 1.0, 0.0, 1.0, shuffle=True, seed=11, loss_mode="dpo", dp_rank=rank, dp_size=2)

    shares = [local_schedule(16, config(rank)) for rank in (0, 1)]
    assert len(shares[0]) == len(shares[1]) == 4  # 2 epochs x 2 mini-batches of 8 samples (4 pairs)
    for mine, theirs in zip(*shares, strict=True):
        assert len(mine) == len(theirs) == 4
        for micro in (*mine.split(2), *theirs.split(2)):
            assert micro[0] % 2 == 0 and micro[1] == micro[0] + 1  # (chosen 2k, rejected 2k + 1)
        assert not set(mine.tolist()) & set(theirs.tolist())
    epoch = torch.cat([s for rank in shares for s in rank[:2]]).sort().values
    assert epoch.tolist() == list(range(16))  # the first epoch trains every pair once
    assert [s.tolist() for s in shares[0][:2]] != [s.tolist() for s in shares[0][2:]]  # reshuffled by pair
