"""DiffusionNFT's math (`omni_core.algorithms.diffusion_nft`) against the paper's equations, written out here.

Expected values come from Python floats and loops over the equations of arXiv 2509.16117 (Eq. 8, in velocity space:
r ||v+ - v||^2 + (1 - r) ||v- - v||^2) with verl-omni's adaptive weights and scale, never from the implementation's
tensor code. The cases that show what it does: a higher reward gives its sample the larger positive-branch weight, and
one gradient step moves the policy's velocity towards a positive sample's forward-process velocity and away from a
negative one's (negating the optimality probability, r -> 1 - r, fails both).
"""

from __future__ import annotations

import math

import pytest
import torch

from omni_core.algorithms.diffusion_nft import (
    forward_process,
    nft_loss,
    old_policy_decay,
    refresh_old_policy,
    reward_probability,
    select_train_timesteps,
)
from omni_core.algorithms.flow_grpo import compute_flow_grpo_advantages

ADV = [-6.0, -1.0, 0.0, 2.5, 10.0]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # c = 5: clip to [-5, 5], then r = 1/2 + A / (2c)
        ("continuous", [0.0, 0.4, 0.5, 0.75, 1.0]),
        ("positive_only", [0.5, 0.5, 0.5, 0.75, 1.0]),
        ("negative_only", [0.0, 0.4, 0.5, 0.5, 0.5]),
        ("one_only", [0.5, 0.5, 0.5, 0.6, 0.6]),  # A -> 1 where A > 0: r = 1/2 + 1/10
        ("binary", [0.4, 0.4, 0.5, 0.6, 0.6]),  # A -> sign(A)
    ],
)
def test_reward_probability_by_hand(mode, expected):
    got = reward_probability(torch.tensor(ADV), adv_clip_max=5.0, adv_mode=mode)
    assert got.tolist() == pytest.approx(expected, abs=1e-7)


def test_reward_probability_refuses_an_unknown_mode_and_a_non_positive_clip():
    with pytest.raises(ValueError, match="adv_mode 'sigmoid'"):
        reward_probability(torch.tensor(ADV), 5.0, "sigmoid")
    with pytest.raises(ValueError, match="adv_clip_max=0"):
        reward_probability(torch.tensor(ADV), 0.0)


def test_a_higher_reward_gives_the_larger_positive_branch_weight():
    # Two prompts, two samples each; within each group the better sample has r > 1/2 > its partner's.
    rewards = torch.tensor([0.2, 0.9, 0.5, 0.1])
    adv = compute_flow_grpo_advantages(rewards, torch.tensor([0, 0, 1, 1]))
    r = reward_probability(adv, adv_clip_max=5.0).tolist()
    assert r[1] > 0.5 > r[0] and r[2] > 0.5 > r[3]
    assert r[0] + r[1] == pytest.approx(1.0) and r[2] + r[3] == pytest.approx(1.0)  # symmetric around 1/2 in a pair


def test_forward_process_runs_from_the_sample_to_the_noise_with_its_velocity():
    x0, noise = torch.tensor([[1.0, -2.0]]), torch.tensor([[0.5, 0.25]])
    at = lambda t: forward_process(x0, noise, torch.tensor([t]))  # noqa: E731
    assert at(0.0)[0].tolist() == [[1.0, -2.0]] and at(1.0)[0].tolist() == [[0.5, 0.25]]
    assert at(0.3)[0][0].tolist() == pytest.approx([0.7 * 1.0 + 0.3 * 0.5, 0.7 * -2.0 + 0.3 * 0.25])
    assert at(0.3)[1].tolist() == [[0.5 - 1.0, 0.25 + 2.0]]
    h = 1e-2  # d x_t / dt is the velocity (x_t is linear in t)
    assert ((at(0.5 + h)[0] - at(0.5 - h)[0]) / (2 * h))[0].tolist() == pytest.approx(at(0.5)[1][0].tolist(), rel=1e-4)


# Two samples of a 3-element latent at their own timesteps.
X0 = [[0.2, -0.4, 1.0], [0.0, 0.5, -0.3]]
NOISE = [[1.0, 0.3, -0.6], [-0.8, 0.2, 0.4]]
T = [0.3, 0.8]
V_THETA = [[0.9, 0.6, -1.5], [-0.7, -0.5, 0.9]]
V_OLD = [[0.7, 0.8, -1.7], [-0.9, -0.2, 0.6]]
V_REF = [[0.6, 0.5, -1.2], [-0.6, -0.4, 0.5]]
R = [0.9, 0.25]
BETA, CLIP, WMIN = 0.3, 5.0, 1e-5


def _expected(r=R, ref_kl_coef=0.0, floor=WMIN) -> float:
    """Eq. 8 in velocity space with verl-omni's weights: x0_hat - x0 = t (v - v_hat), so each branch's error is
    t^2 mean((v_hat - v)^2) over its adaptive weight t mean|v_hat - v|; times c / beta, mean over samples."""
    total, ref = 0.0, 0.0
    for i in range(2):
        t = T[i]
        v = [NOISE[i][k] - X0[i][k] for k in range(3)]
        v_pos = [BETA * V_THETA[i][k] + (1 - BETA) * V_OLD[i][k] for k in range(3)]
        v_neg = [(1 + BETA) * V_OLD[i][k] - BETA * V_THETA[i][k] for k in range(3)]
        branch = []
        for v_hat in (v_pos, v_neg):
            sq = sum((t * (v_hat[k] - v[k])) ** 2 for k in range(3)) / 3
            w = max(sum(abs(t * (v_hat[k] - v[k])) for k in range(3)) / 3, floor)
            branch.append(sq / w)
        total += r[i] * branch[0] + (1 - r[i]) * branch[1]
        ref += sum((V_THETA[i][k] - V_REF[i][k]) ** 2 for k in range(3)) / 3
    return CLIP * total / 2 / BETA + ref_kl_coef * ref / 2


def _loss(r=R, ref_kl_coef=0.0, floor=WMIN):
    x0, noise, t = torch.tensor(X0), torch.tensor(NOISE), torch.tensor(T)
    x_t, _ = forward_process(x0, noise, t)
    return nft_loss(
        torch.tensor(V_THETA),
        torch.tensor(V_OLD),
        x0,
        x_t,
        t,
        torch.tensor(r),
        mix_beta=BETA,
        adv_clip_max=CLIP,
        adaptive_weight_min=floor,
        ref_velocity=torch.tensor(V_REF),
        ref_kl_coef=ref_kl_coef,
    )


@pytest.mark.parametrize("ref_kl_coef", [0.0, 0.5])
def test_the_loss_is_the_papers_objective_with_adaptive_weights(ref_kl_coef):
    loss, metrics = _loss(ref_kl_coef=ref_kl_coef)
    assert float(loss) == pytest.approx(_expected(ref_kl_coef=ref_kl_coef), rel=1e-5)
    assert float(metrics["reward_prob_mean"]) == pytest.approx(sum(R) / 2)
    old_deviate = sum((V_THETA[i][k] - V_OLD[i][k]) ** 2 for i in range(2) for k in range(3)) / 6
    assert float(metrics["old_deviate"]) == pytest.approx(old_deviate, rel=1e-6)


def test_the_adaptive_weight_has_its_floor():
    x0, noise, t = torch.tensor(X0), torch.tensor(NOISE), torch.tensor(T)
    x_t, v = forward_process(x0, noise, t)
    # The old and current policies predict the forward-process velocity exactly: both errors are ~0 and each weight is
    # the floor, not ~0 (no division by zero).
    loss, _ = nft_loss(v, v, x0, x_t, t, torch.tensor(R), mix_beta=BETA, adv_clip_max=CLIP, adaptive_weight_min=WMIN)
    assert math.isfinite(float(loss)) and abs(float(loss)) < 1e-6
    # A floor above every mean |error| (each is below 10 here): both weights are the floor.
    loss, _ = _loss(floor=10.0)
    assert float(loss) == pytest.approx(_expected(floor=10.0), rel=1e-5)
    assert float(loss) != pytest.approx(_expected(), rel=1e-2)  # the floor changed the value


@pytest.mark.parametrize(("r", "towards"), [(1.0, True), (0.0, False)])
def test_one_gradient_step_moves_towards_a_positive_sample_and_away_from_a_negative_one(r, towards):
    # On-policy (the old policy is the current one): r = 1 pulls the prediction towards the sample's forward-process
    # velocity v; r = 0 pushes it away.
    x0, noise, t = torch.tensor(X0[:1]), torch.tensor(NOISE[:1]), torch.tensor(T[:1])
    x_t, v = forward_process(x0, noise, t)
    v_theta = torch.tensor(V_OLD[:1], requires_grad=True)
    loss, _ = nft_loss(
        v_theta,
        torch.tensor(V_OLD[:1]),
        x0,
        x_t,
        t,
        torch.tensor([r]),
        mix_beta=BETA,
        adv_clip_max=CLIP,
        adaptive_weight_min=WMIN,
    )
    loss.backward()
    stepped = v_theta.detach() - 0.01 * v_theta.grad
    before, after = float((v_theta.detach() - v).norm()), float((stepped - v).norm())
    assert (after < before) == towards, (before, after)


def test_old_policy_decay_schedules_by_hand():
    assert [old_policy_decay(s, "copy") for s in (0, 10, 10_000)] == [0.0, 0.0, 0.0]
    assert old_policy_decay(0, "linear_to_0_5") == 0.0
    assert old_policy_decay(100, "linear_to_0_5") == pytest.approx(0.1)
    assert old_policy_decay(2_000, "linear_to_0_5") == 0.5
    assert [old_policy_decay(s, "delayed_linear_to_0_999") for s in (0, 74, 75)] == [0.0, 0.0, 0.0]
    assert old_policy_decay(76, "delayed_linear_to_0_999") == pytest.approx(0.0075)
    assert old_policy_decay(300, "delayed_linear_to_0_999") == 0.999  # 225 * 0.0075 > 0.999
    assert old_policy_decay(3, "delayed_linear_to_0_999", fixed=0.25) == 0.25  # a fixed decay wins
    with pytest.raises(ValueError, match="old_policy_decay_schedule 'cosine'"):
        old_policy_decay(1, "cosine")
    with pytest.raises(ValueError, match=r"old_policy_decay=1.5"):
        old_policy_decay(1, "copy", fixed=1.5)


def test_refresh_old_policy_copies_or_averages_in_place():
    old = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0])}
    current = {"a": torch.tensor([3.0, 6.0]), "b": torch.tensor([4.0])}
    refresh_old_policy(old, current, 0.25)
    assert old["a"].tolist() == [0.25 * 1 + 0.75 * 3, 0.25 * 2 + 0.75 * 6] and old["b"].tolist() == [3.0]
    refresh_old_policy(old, current, 0.0)
    assert old["a"].tolist() == [3.0, 6.0] and old["a"] is not current["a"]


def test_train_timesteps_are_a_random_subset_per_sample():
    every = select_train_timesteps(10, 3, 1.0, torch.Generator().manual_seed(0))
    assert every.shape == (3, 10) and all(sorted(row.tolist()) == list(range(10)) for row in every)
    half = select_train_timesteps(10, 4, 0.5, torch.Generator().manual_seed(1))
    assert half.shape == (4, 5) and all(len(set(row.tolist())) == 5 for row in half)
    assert len({tuple(row.tolist()) for row in half}) > 1  # each sample draws its own subset
    again = select_train_timesteps(10, 4, 0.5, torch.Generator().manual_seed(1))
    assert torch.equal(half, again)  # the same generator state, the same subsets (a resumed step trains the same)
    assert select_train_timesteps(3, 2, 0.1, torch.Generator().manual_seed(0)).shape == (2, 1)  # at least one
    with pytest.raises(ValueError, match="timestep_fraction=0"):
        select_train_timesteps(10, 1, 0.0, torch.Generator())
