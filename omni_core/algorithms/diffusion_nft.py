"""DiffusionNFT's objective as pure functions (Zheng et al., arXiv 2509.16117), as verl-omni defines it.

DiffusionNFT trains on the forward (noising) process of the final samples instead of the reverse chain's log-probs, so
the rollout may use any solver. For a prompt's group of clean samples ``x0`` with rewards ``R``:

    A       = (R - mean_group(R)) / (std + eps)                       Flow-GRPO's group advantage (global std by default)
    r       = 1/2 + 1/2 clip(A, -c, c) / c                            optimality probability, c = adv_clip_max (`adv_mode`)
    x_t     = (1 - t) x0 + t eps,   v = eps - x0                      the forward process at t (= sigma), its velocity
    v+      = beta v_theta + (1 - beta) v_old                         implicit positive policy, beta = mix_beta
    v-      = (1 + beta) v_old - beta v_theta                         implicit negative policy
    L       = E[ r ||v+ - v||^2 + (1 - r) ||v- - v||^2 ]              the paper's objective (Eq. 8)

verl-omni writes the two squared errors in x0 space, ``x0_hat = x_t - t v_hat`` (so ``x0_hat - x0 = t (v - v_hat)``),
divides each by its adaptive weight ``w = max(mean|x0_hat - x0|, adaptive_weight_min)`` (no gradient), and by beta,
and scales by c:

    L_pos   = mean((x0_hat+ - x0)^2) / w+        L_neg = mean((x0_hat- - x0)^2) / w-
    loss    = c * mean_i (r_i L_pos_i + (1 - r_i) L_neg_i) / beta  +  ref_kl_coef * mean((v_theta - v_ref)^2)

`old_policy_decay` gives the refresh of the old (rollout) policy after an update: ``old <- d old + (1 - d) theta``
with ``d`` from a named schedule (DiffusionNFT's own: `copy`, `linear_to_0_5`, `delayed_linear_to_0_999`) or fixed.

Shapes: ``x0``, ``noise``, velocities ``[b, *latent]``; ``t``, ``reward_prob`` ``[b]``. Computed in fp32.
Ideas credited to verl-omni ``verl_omni/trainer/diffusion/diffusion_algos.py`` (``DiffusionNFTLoss``) and
``diffusion_trainer_utils.py``; no code is copied.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from omni_core.config.algorithm_names import ADV_MODE_NAMES, OLD_POLICY_DECAY_SCHEDULES

__all__ = [
    "forward_process",
    "nft_loss",
    "old_policy_decay",
    "refresh_old_policy",
    "reward_probability",
    "select_train_timesteps",
]


def reward_probability(advantages: Tensor, adv_clip_max: float, adv_mode: str = "continuous") -> Tensor:
    """The optimality probability ``r [b]`` in [0, 1] of each sample from its group advantage (module docstring).

    ``adv_mode`` (``ADV_MODE_NAMES``) maps the clipped advantage ``A`` first: continuous as is; positive_only /
    negative_only set the other sign to 0 (r = 1/2 there); one_only gives 1 where A > 0, else 0 (r = 1/2 + 1/(2c) or
    1/2: verl-omni's mapping, which leaves r below 1 for c > 1); binary gives sign(A) (r = 1/2 +- 1/(2c))."""
    if adv_mode not in ADV_MODE_NAMES:
        raise ValueError(f"unknown adv_mode {adv_mode!r}; choose one of {list(ADV_MODE_NAMES)}")
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max={adv_clip_max} must be positive")
    a = advantages.detach().float().clamp(-adv_clip_max, adv_clip_max)
    if adv_mode == "positive_only":
        a = a.clamp(min=0.0)
    elif adv_mode == "negative_only":
        a = a.clamp(max=0.0)
    elif adv_mode == "one_only":
        a = (a > 0).float()
    elif adv_mode == "binary":
        a = torch.sign(a)
    return (0.5 + 0.5 * a / adv_clip_max).clamp(0.0, 1.0)


def select_train_timesteps(num_timesteps: int, batch: int, fraction: float, generator: torch.Generator) -> Tensor:
    """Which of the rollout's ``num_timesteps`` schedule steps each of ``batch`` samples trains on: ``[batch, k]``
    indices, ``k = max(1, int(num_timesteps * fraction))``, a random subset per sample from `generator` (in random
    order; with ``fraction`` 1, every step once)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"timestep_fraction={fraction} must be in (0, 1]")
    k = max(1, int(num_timesteps * fraction))
    return torch.stack([torch.randperm(num_timesteps, generator=generator)[:k] for _ in range(batch)])


def _expand(t: Tensor, like: Tensor) -> Tensor:
    return t.float().reshape(-1, *([1] * (like.ndim - 1)))


def forward_process(x0: Tensor, noise: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """``(x_t, v)``: the rectified-flow forward process at ``t [b]`` (sigma in [0, 1]) and its velocity ``noise - x0``."""
    x0, noise = x0.float(), noise.float()
    te = _expand(t, x0)
    return (1.0 - te) * x0 + te * noise, noise - x0


def _per_sample(x: Tensor) -> Tensor:
    return x.mean(dim=tuple(range(1, x.ndim)))


def nft_loss(
    velocity: Tensor,
    old_velocity: Tensor,
    x0: Tensor,
    x_t: Tensor,
    t: Tensor,
    reward_prob: Tensor,
    *,
    mix_beta: float,
    adv_clip_max: float,
    adaptive_weight_min: float,
    ref_velocity: Tensor | None = None,
    ref_kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DiffusionNFT's loss of one forward-process step (module docstring); returns (loss, metrics).

    ``velocity`` is the trained policy's prediction at ``x_t`` (with gradient), ``old_velocity`` the old policy's and
    ``ref_velocity`` the reference's (both detached here; the reference term only with ``ref_kl_coef`` > 0)."""
    if mix_beta <= 0:
        raise ValueError(f"mix_beta={mix_beta} must be positive (it divides the loss)")
    v = velocity.float()
    v_old = old_velocity.detach().float()
    x0, x_t = x0.float(), x_t.float()
    te = _expand(t, x0)
    r = reward_prob.detach().float().reshape(-1)
    positive = mix_beta * v + (1.0 - mix_beta) * v_old
    negative = (1.0 + mix_beta) * v_old - mix_beta * v
    err_pos = x_t - te * positive - x0
    err_neg = x_t - te * negative - x0
    with torch.no_grad():
        w_pos = _per_sample(err_pos.abs().double()).clamp(min=adaptive_weight_min).float()
        w_neg = _per_sample(err_neg.abs().double()).clamp(min=adaptive_weight_min).float()
    loss_pos = _per_sample(err_pos**2) / w_pos
    loss_neg = _per_sample(err_neg**2) / w_neg
    policy = adv_clip_max * (r * loss_pos + (1.0 - r) * loss_neg).mean() / mix_beta
    ref_kl = _per_sample((v - ref_velocity.detach().float()) ** 2).mean() if ref_velocity is not None else v.new_zeros(())
    loss = policy + ref_kl_coef * ref_kl if ref_velocity is not None and ref_kl_coef else policy
    with torch.no_grad():
        metrics = {
            "policy_loss": policy.detach(),
            "positive_loss": loss_pos.mean().detach(),
            "negative_loss": loss_neg.mean().detach(),
            "ref_kl_loss": ref_kl.detach(),
            "old_deviate": ((v - v_old) ** 2).mean().detach(),
            "reward_prob_mean": r.mean(),
            "total_loss": loss.detach(),
        }
    return loss, metrics


def old_policy_decay(step: int, schedule: str, fixed: float | None = None) -> float:
    """The decay ``d`` of the old-policy refresh after training step `step`: `fixed` (algorithm.old_policy_decay) when
    set, else the named schedule's (``OLD_POLICY_DECAY_SCHEDULES``)."""
    if fixed is not None:
        if not 0.0 <= fixed <= 1.0:
            raise ValueError(f"old_policy_decay={fixed} must be in [0, 1]")
        return float(fixed)
    if schedule not in OLD_POLICY_DECAY_SCHEDULES:
        raise ValueError(f"unknown old_policy_decay_schedule {schedule!r}; choose one of {list(OLD_POLICY_DECAY_SCHEDULES)}")
    warmup, ramp, largest = OLD_POLICY_DECAY_SCHEDULES[schedule]
    return 0.0 if step < warmup else min((step - warmup) * ramp, largest)


@torch.no_grad()
def refresh_old_policy(old: Mapping[str, Tensor], current: Mapping[str, Tensor], decay: float) -> None:
    """In place: ``old[k] <- decay * old[k] + (1 - decay) * current[k]`` for every key (a copy when ``decay`` is 0)."""
    for key in old:
        target, source = old[key], current[key].detach().to(old[key].device, old[key].dtype)
        if decay == 0.0:
            target.copy_(source)
        else:
            target.mul_(decay).add_(source, alpha=1.0 - decay)
