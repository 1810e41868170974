"""Diffusion-DPO's objective as pure functions (Wallace et al., CVPR 2024, arXiv 2311.12908), as verl-omni defines it
for flow-matching models, and its online pairing.

Online DPO samples ``n`` images per prompt, scores them, and keeps one (chosen, rejected) pair per prompt group: the
highest- and the lowest-reward sample. Both are noised with one shared noise ``eps`` and one shared sigma ``t``:

    x_t      = (1 - t) x0 + t eps,     u = eps - x0                       the forward process, its velocity
    err(x0)  = mean ||v(x_t) - u||^2                                      per sample, over the latent
    D(x0)    = err_theta(x0) - err_ref(x0)                                the policy against the frozen reference
    z        = -beta/2 [ D(x0_w) - D(x0_l) ]                              w: chosen, l: rejected
    loss     = mean_pairs -log sigmoid(z)                                 beta = dpo_beta

Metrics as verl-omni reports them: the implicit accuracy (share of pairs with z > 0), the implicit rewards of the
chosen and rejected samples (``-beta/2 D``) and their margin. A pair whose two rewards tie carries no preference: its
term is multiplied by 0 here (verl-omni trains it as if its first sample were preferred); the loss stays the mean over
all pairs, so with no ties it is verl-omni's value.

The pair's sigma follows the SD3 training recipe verl-omni uses: ``u ~ sigmoid(N(0, 1))`` (logit-normal, drawn with
diffusers' ``compute_density_for_timestep_sampling``), index ``floor(u N)`` into the model scheduler's
``N = num_train_timesteps`` training sigmas (the scheduler as configured, before any inference ``set_timesteps``).

Shapes: latents and velocities ``[b, *latent]`` with the pairs adjacent (``[w0, l0, w1, l1, ...]``), rewards ``[b]``.
Computed in fp32. Ideas credited to verl-omni ``verl_omni/trainer/diffusion/diffusion_algos.py`` (``DPOLoss``) and
``verl_omni/pipelines/utils.py`` (``sample_noise_and_timesteps``); no code is copied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["dpo_loss", "preference_pairs", "preferred", "sample_train_steps"]


def preference_pairs(rewards: Tensor, failed: Tensor, group: Tensor) -> tuple[Tensor, Tensor]:
    """One (chosen, rejected) pair per prompt group, in order of the groups' first appearance.

    ``rewards``, ``failed`` (bool) and ``group`` (the prompt group of each sample) are ``[B]``. Among a group's samples
    whose reward did not fail, the chosen one has the highest reward (the first of equals) and the rejected one the
    lowest (the last of equals), verl-omni's choice. Returns ``order [2G]``, the sample indices laid out
    ``[w0, l0, w1, l1, ...]``, and ``pair_rewards [2G]``, the rewards the loss sees: a group with fewer than two scored
    samples gets 0 for both (a tie: no preference, no gradient)."""
    order: list[int] = []
    pair_rewards: list[float] = []
    values = rewards.detach().float().tolist()
    bad = failed.bool().tolist()
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group.tolist()):
        members.setdefault(int(g), []).append(i)
    for indices in members.values():
        scored = [i for i in indices if not bad[i]]
        if len(scored) < 2:
            order += indices[:2] if len(indices) >= 2 else indices * 2
            pair_rewards += [0.0, 0.0]
            continue
        best = max(values[i] for i in scored)
        worst = min(values[i] for i in scored)
        chosen = next(i for i in scored if values[i] == best)
        rejected = [i for i in scored if values[i] == worst][-1]  # not `chosen`: all tied, it is the last scored
        order += [chosen, rejected]
        pair_rewards += [values[chosen], values[rejected]]
    return torch.tensor(order, dtype=torch.long), torch.tensor(pair_rewards, dtype=torch.float32)


def preferred(rewards: Tensor) -> Tensor:
    """Which pairs of ``rewards [2P]`` (laid out ``[w0, l0, ...]``) have a preference (the chosen reward above the
    rejected one): ``[P]`` bool. A tied pair has none."""
    return rewards[0::2] > rewards[1::2]


def sample_train_steps(num_train_timesteps: int, generator: torch.Generator, count: int) -> Tensor:
    """``count`` indices ``[count]`` into the training schedule by the logit-normal rule (module docstring)."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    u = compute_density_for_timestep_sampling(
        weighting_scheme="logit_normal", batch_size=count, logit_mean=0.0, logit_std=1.0, mode_scale=1.29, generator=generator
    )
    return (u * num_train_timesteps).long().clamp(0, num_train_timesteps - 1)


def dpo_loss(
    velocity: Tensor, ref_velocity: Tensor, x0: Tensor, noise: Tensor, rewards: Tensor, beta: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Diffusion-DPO's loss over the adjacent pairs of one micro-batch (module docstring) and its metrics.

    ``velocity`` carries the gradient; ``ref_velocity`` is the frozen reference's at the same point; ``x0`` the clean
    latents and ``noise`` the pair-shared noise that made the point; ``rewards`` the samples' rewards (a chosen reward
    below its rejected one is an error: the pairing is wrong)."""
    b = velocity.shape[0]
    if b < 2 or b % 2:
        raise ValueError(f"Diffusion-DPO needs adjacent (chosen, rejected) pairs; got a micro-batch of {b} samples")
    if beta <= 0:
        raise ValueError(f"dpo_beta={beta} must be positive")
    r = rewards.detach().float().to(velocity.device)
    if bool((r[0::2] < r[1::2]).any()):
        raise ValueError("a chosen sample's reward is below its rejected sample's: the pairs are not (chosen, rejected)")
    target = noise.float() - x0.float()
    err = ((velocity.float() - target) ** 2).flatten(1).mean(dim=1)
    ref_err = ((ref_velocity.detach().float() - target) ** 2).flatten(1).mean(dim=1)
    diff = err - ref_err
    chosen, rejected = -0.5 * beta * diff[0::2], -0.5 * beta * diff[1::2]
    inside = chosen - rejected
    weight = preferred(r).float()  # a tied pair: no preference, no gradient
    loss = (-F.logsigmoid(inside) * weight).mean()
    with torch.no_grad():
        counted = weight.sum().clamp(min=1.0)
        metrics = {
            "dpo_loss": loss.detach(),
            "implicit_acc": ((inside > 0).float() * weight).sum() / counted,
            "rewards/chosen": (chosen * weight).sum() / counted,
            "rewards/rejected": (rejected * weight).sum() / counted,
            "rewards/margins": (inside * weight).sum() / counted,
            "dpo_tied_pairs": 1.0 - weight.mean(),
        }
    return loss, metrics
