"""The Flow-GRPO objective as pure, vectorised functions (arXiv 2505.05470), in paper order.

This module owns the math only: group-relative advantages (paper Eq. 4), the clipped per-step policy
loss (Eq. 5-6) and the KL penalty between reverse-SDE transitions (Eq. 6, FG's form) or, as flow_grpo
issue 198 recommends against reward hacking, between the predicted velocities. Tensors and
scalars in, tensors and a metrics dict out; no config objects, no loops over samples. Everything is
computed in fp32 whatever the input dtype (bf16 log-prob differences break the on-policy ratio == 1).

Ideas credited to: flow_grpo ``flow_grpo/stat_tracking.py`` (``PerPromptStatTracker``, ``global_std``)
and ``scripts/train_sd3.py`` (loss, approx-KL and clip-fraction diagnostics, KL to the reference);
verl-omni ``diffusion_algos.compute_flow_grpo_outcome_advantage`` (unbiased torch std, singleton
groups -> 0), ``FlowGRPOLoss`` and ``KLLoss``. No code is copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "broadcast_advantages",
    "compute_flow_grpo_advantages",
    "group_index_from_uids",
    "kl_loss",
    "policy_loss",
    "velocity_kl_loss",
]


# --------------------------------------------------------------------------------------------------
# 1. Group-relative advantage (paper Eq. 4):  A_i = (R_i - mean_{j in G(i)} R_j) / (std + eps)
# --------------------------------------------------------------------------------------------------


def group_index_from_uids(uids: Sequence[str] | Sequence[int] | Tensor) -> Tensor:
    """Map group labels (prompt uid strings, or any ints) to contiguous ids ``0..G-1``.

    Args:
        uids: ``[B]`` labels; equal labels form one group (the ``n`` samples of one prompt).

    Returns:
        LongTensor ``[B]`` of group ids, numbered in order of first appearance.
    """
    if isinstance(uids, Tensor):
        _, inverse = torch.unique(uids, return_inverse=True)
        return inverse.long()
    ids: dict[object, int] = {}
    return torch.tensor([ids.setdefault(u, len(ids)) for u in uids], dtype=torch.long)


def compute_flow_grpo_advantages(
    rewards: Tensor,
    group_index: Tensor | Sequence[str] | Sequence[int],
    *,
    norm_adv_by_std: bool = True,
    global_std: bool = True,
    eps: float = 1e-4,
    unbiased: bool = True,
) -> Tensor:
    """Flow-GRPO outcome advantages, one scalar per sample.

    ``A_i = (R_i - mu_g(i)) / (sigma + eps)`` where ``mu_g`` is the mean reward of sample i's group
    (the ``n`` images of one prompt) and ``sigma`` is the std of the *whole batch* (``global_std``,
    flow_grpo's and verl-omni's default) or of the group. With ``norm_adv_by_std=False`` the
    advantage is ``R_i - mu_g`` (Dr.GRPO). A group with one member has no baseline: its advantage is
    exactly 0 (as verl-omni), and so is every member of a constant-reward group.

    Args:
        rewards: ``[B]`` scalar rewards (any float dtype; computed in fp32).
        group_index: ``[B]`` LongTensor of group ids, or a list of uid strings / ints.
        norm_adv_by_std: divide by ``std + eps``.
        global_std: use the batch std (True) or the per-group std (False; 1.0 for singletons).
        eps: added to the std, 1e-4 as flow_grpo and verl-omni.
        unbiased: Bessel-corrected std (torch default, verl-omni) if True; population std
            (``np.std``, flow_grpo's tracker) if False.

    Returns:
        ``[B]`` fp32 advantages on ``rewards.device``. Use :func:`broadcast_advantages` for ``[B, W]``.
    """
    r = rewards.detach().to(torch.float32).reshape(-1)
    if isinstance(group_index, Tensor):
        idx = group_index_from_uids(group_index.reshape(-1).to(r.device))
    else:
        idx = group_index_from_uids(group_index)
    idx = idx.to(r.device)
    if idx.numel() != r.numel():
        raise ValueError(f"rewards has {r.numel()} samples but group_index has {idx.numel()}")
    n_groups = int(idx.max().item()) + 1 if idx.numel() else 0
    count = torch.zeros(n_groups, device=r.device).index_add_(0, idx, torch.ones_like(r))

    # Shift each group by its first member's reward before averaging: the deviations of a
    # constant-reward group are then exactly 0 (a plain sum/count mean can be off by one ulp),
    # and the shifted sums lose less precision when rewards share a large offset.
    first = torch.full((n_groups,), r.numel(), device=r.device, dtype=torch.long)
    first = first.scatter_reduce(0, idx, torch.arange(r.numel(), device=r.device), reduce="amin")
    shifted = r - r[first][idx]
    shifted_mean = torch.zeros(n_groups, device=r.device).index_add_(0, idx, shifted) / count
    centered = shifted - shifted_mean[idx]  # R_i - mu_g(i)

    if norm_adv_by_std:
        if global_std:
            std = r.std(correction=1 if unbiased else 0) if r.numel() > 1 else r.new_ones(())
        else:
            sq = torch.zeros(n_groups, device=r.device).index_add_(0, idx, centered.square())
            dof = (count - 1) if unbiased else count
            group_std = torch.where(count > 1, (sq / dof.clamp_min(1)).sqrt(), torch.ones_like(sq))
            std = group_std[idx]
        adv = centered / (std + eps)
    else:
        adv = centered
    # Singletons and zero deviations stay exactly 0 even where std is nan or 0 (eps=0, constant group).
    return torch.where((count[idx] > 1) & (centered != 0), adv, torch.zeros_like(adv))


def broadcast_advantages(advantages: Tensor, window: int) -> Tensor:
    """Repeat the outcome advantage over the ``W`` trained denoising steps: ``[B] -> [B, W]``.

    flow_grpo applies the final-image advantage to every trained timestep (``train_sd3.py``).
    """
    return advantages.reshape(-1, 1).expand(-1, window)


# --------------------------------------------------------------------------------------------------
# 2. Clipped surrogate per denoising step (paper Eq. 5-6, policy part)
#    L_t = mean_i max(-A_i r_i,t, -A_i clip(r_i,t, 1-eps, 1+eps)),  r = p_theta(x_{t-1}|x_t) / p_old
# --------------------------------------------------------------------------------------------------


def policy_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_ratio: float,
    adv_clip_max: float,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip loss for one denoising step of a batch of trajectories.

    Args:
        log_prob: ``[B]`` log-probs of the stored transitions under the current policy (grad flows).
        old_log_prob: ``[B]`` log-probs under the policy that sampled them (no grad).
        advantages: ``[B]`` advantages; clamped to ``+-adv_clip_max`` (5.0 in flow_grpo / verl-omni).
        clip_ratio: epsilon of the trust region; tiny (1e-4) because log-probs are averaged over
            latent dims, so a ratio moves much less per update than a per-token LLM ratio.
        adv_clip_max: advantage clamp.
        weights: ``[B]`` rollout correction's weights (detached), multiplied into each sample's term before the
            mean; None: all 1.

    Returns:
        ``(loss, metrics)``: scalar fp32 loss, and detached scalar tensors
        ``pg_loss``; ``pg_clipfrac`` = fraction of samples with ``|r - 1| > clip_ratio`` and its
        split ``pg_clipfrac_higher`` (``r > 1 + eps``) / ``pg_clipfrac_lower`` (``r < 1 - eps``),
        flow_grpo's ``clipfrac_gt_one`` / ``clipfrac_lt_one``; ``ppo_kl`` =
        ``0.5 * mean((logp - old_logp)^2)``, flow_grpo's ``approx_kl`` (a second-order estimate of
        KL(old || new), always >= 0 unlike ``mean(old - new)``); ``ratio_mean``, ``ratio_std``
        (population std, so a micro-batch of one sample gives 0, not nan).
    """
    logp = log_prob.to(torch.float32)
    old = old_log_prob.detach().to(torch.float32)
    adv = advantages.detach().to(torch.float32).clamp(-adv_clip_max, adv_clip_max)
    log_ratio = logp - old
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    per_sample = torch.maximum(unclipped, clipped)
    loss = per_sample.mean() if weights is None else (per_sample * weights.detach().to(per_sample)).mean()

    with torch.no_grad():
        r = ratio.detach()
        higher = (r - 1.0 > clip_ratio).float().mean()
        lower = (1.0 - r > clip_ratio).float().mean()
        metrics = {
            "pg_loss": loss.detach(),
            "pg_clipfrac": higher + lower,
            "pg_clipfrac_higher": higher,
            "pg_clipfrac_lower": lower,
            "ppo_kl": 0.5 * log_ratio.detach().square().mean(),
            "ratio_mean": r.mean(),
            "ratio_std": r.std(correction=0),
        }
    return loss, metrics


# --------------------------------------------------------------------------------------------------
# 3. KL penalty to the reference policy (paper Eq. 6, beta * D_KL(pi_theta || pi_ref))
# --------------------------------------------------------------------------------------------------


def kl_loss(mean_theta: Tensor, mean_ref: Tensor, std_dev_t: Tensor | float) -> Tensor:
    """KL between the current and reference reverse-SDE Gaussian transitions, flow_grpo's form.

    ``KL = mean_{C,H,W}((mu_theta - mu_ref)^2) / (2 * std_dev_t^2)``, then the batch mean.
    Both transitions share the covariance ``(std_dev_t * sqrt(|dt|))^2 I``, so the exact
    per-dimension KL carries a further ``1/|dt|``; flow_grpo drops it on purpose so that late
    (small-dt) steps are not under-weighted (FG issue #22), and verl-omni's ``KLLoss`` does the same.

    Args:
        mean_theta: ``[B, *latent]`` transition mean under the current policy (grad flows).
        mean_ref: ``[B, *latent]`` transition mean under the reference policy (no grad).
        std_dev_t: scalar, ``[B]``, or any shape broadcastable to ``mean_theta``.

    Returns:
        Scalar fp32 tensor.
    """
    mu = mean_theta.to(torch.float32)
    mu_ref = mean_ref.detach().to(torch.float32)
    std = torch.as_tensor(std_dev_t, dtype=torch.float32, device=mu.device)
    if std.dim() == 1 and std.numel() == mu.shape[0] and mu.dim() > 1:
        std = std.reshape(-1, *([1] * (mu.dim() - 1)))  # per-sample std -> [B, 1, 1, ...]
    per_elem = (mu - mu_ref).square() / (2.0 * std.square())
    return per_elem.reshape(mu.shape[0], -1).mean(dim=1).mean()


def velocity_kl_loss(velocity: Tensor, velocity_ref: Tensor) -> Tensor:
    """The KL penalty on the predicted velocities: ``mean_{C,H,W}((v_theta - v_ref)^2)``, then the batch mean.

    The transition means differ by the velocity gap times a per-timestep factor,
    ``mu_theta - mu_ref = (v_theta - v_ref) * (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) * dt`` for the flow SDE,
    so :func:`kl_loss` weighs timesteps by ``dt^2 / std_dev_t^2`` and that factor; this form weighs every
    timestep alike (flow_grpo issue 198's recommendation when the transition KL lets the policy drift).

    Args:
        velocity: ``[B, *latent]`` predicted velocity of the current policy (grad flows).
        velocity_ref: ``[B, *latent]`` the reference policy's velocity (no grad).

    Returns:
        Scalar fp32 tensor.
    """
    v = velocity.to(torch.float32)
    v_ref = velocity_ref.detach().to(torch.float32)
    return (v - v_ref).square().reshape(v.shape[0], -1).mean(dim=1).mean()
