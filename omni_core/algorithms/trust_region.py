"""The policy objectives of GRPO-Guard and Flow-DPPO as pure functions: plain tensors in, a loss and metrics out.

Both share Flow-GRPO's rollout and log-probs and add the reverse-SDE transition means of the rollout policy
(``old_mean``) and of the current one (``mean``) at one denoising step, whose Gaussian transition has the std
``std_dev_t * sqrt_dt`` (``sqrt_dt = sqrt(-dt)``, ``dt`` the step's sigma difference). Shapes: ``log_prob``,
``old_log_prob``, ``advantages`` ``[b]``; ``mean``, ``old_mean`` ``[b, *latent]``; ``std_dev_t`` and ``sqrt_dt``
scalars or ``[b]`` / broadcastable. Computed in fp32.

GRPO-Guard (arXiv 2510.22319), as verl-omni's ``GRPOGuardLoss`` defines it: with ``s = mean(sqrt_dt)`` and
``sigma = mean(std_dev_t)`` (one scale per step),

    bias_i  = mean_latent((mean_i - old_mean_i)^2) / (2 (s sigma)^2)         the reverse-SDE mean drift
    r_i     = exp((log_prob_i - old_log_prob_i + bias_i) * s sigma)
    L       = mean_i max(-A_i r_i, -A_i clip(r_i, 1 - eps, 1 + eps)) / s^2    A clipped to +-adv_clip_max

Flow-DPPO, as verl-omni's ``FlowDPPOLoss``: the unclipped ratio objective under an exact Gaussian KL trust region,

    r_i     = exp(log_prob_i - old_log_prob_i)
    KL_i    = mean_latent((mean_i - old_mean_i)^2 / (2 (std_dev_t sqrt_dt)^2))   (add_kl_coefficient; else / 2)
    masked  = KL_i >= kl_mask_threshold and the update moves away from the old policy (r > 1 with A > 0, r < 1 with A < 0)
    L       = mean_i [not masked_i] * (-A_i r_i)

Ideas credited to verl-omni ``verl_omni/trainer/diffusion/diffusion_algos.py``; no code is copied.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["flow_dppo_loss", "grpo_guard_loss"]


def _per_sample(x: Tensor) -> Tensor:
    """Mean over every dimension but the first: ``[b, ...] -> [b]``."""
    return x.mean(dim=tuple(range(1, x.ndim))) if x.ndim > 1 else x


def _as_float(x: Tensor | float) -> Tensor:
    return torch.as_tensor(x, dtype=torch.float32)


def grpo_guard_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mean: Tensor,
    old_mean: Tensor,
    std_dev_t: Tensor | float,
    sqrt_dt: Tensor | float,
    *,
    clip_ratio: float,
    adv_clip_max: float,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO-Guard's clipped objective of one denoising step (module docstring); returns (loss, metrics). `weights`:
    rollout correction's per-sample weights (detached), multiplied into each term before the mean."""
    lp, old = log_prob.float(), old_log_prob.detach().float()
    adv = advantages.detach().float().clamp(-adv_clip_max, adv_clip_max)
    s = _as_float(sqrt_dt).to(lp.device).mean()
    scale = s * _as_float(std_dev_t).to(lp.device).mean()
    bias = _per_sample((mean.float() - old_mean.detach().float()).square()) / (2 * scale.square())
    log_ratio = lp - old
    ratio = torch.exp((log_ratio + bias) * scale)
    per_sample = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio))
    if weights is not None:
        per_sample = per_sample * weights.detach().to(per_sample)
    loss = per_sample.mean() / s.square()
    with torch.no_grad():
        metrics = {
            "pg_loss": loss.detach(),
            "ppo_kl": (-log_ratio).mean(),
            "pg_clipfrac": ((ratio - 1.0).abs() > clip_ratio).float().mean(),
            "pg_clipfrac_higher": (ratio - 1.0 > clip_ratio).float().mean(),
            "pg_clipfrac_lower": (1.0 - ratio > clip_ratio).float().mean(),
            "ratio_mean": ratio.mean(),
            "ratio_mean_bias": bias.mean(),
        }
    return loss, metrics


def flow_dppo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mean: Tensor,
    old_mean: Tensor,
    std_dev_t: Tensor | float,
    sqrt_dt: Tensor | float,
    *,
    kl_mask_threshold: float,
    add_kl_coefficient: bool = True,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Flow-DPPO's KL-masked objective of one denoising step (module docstring); returns (loss, metrics). `weights`:
    rollout correction's per-sample weights (detached), multiplied into each term before the mean."""
    lp, old, adv = log_prob.float(), old_log_prob.detach().float(), advantages.detach().float()
    log_ratio = lp - old
    ratio = torch.exp(log_ratio)
    diff_sq = (mean.float() - old_mean.float()).square()
    if add_kl_coefficient:
        std, root = _as_float(std_dev_t).to(lp.device), _as_float(sqrt_dt).to(lp.device)
        if root.ndim == 1 and std.ndim > 1:  # per-sample sqrt_dt [b] against a std of [b, 1, ...]
            root = root.reshape(-1, *([1] * (std.ndim - 1)))
        sigma = std * root
        while sigma.ndim and sigma.ndim < diff_sq.ndim:  # [b] -> [b, 1, ...]
            sigma = sigma.unsqueeze(-1)
        kl = _per_sample(diff_sq / (2 * sigma.square()))
    else:
        kl = _per_sample(diff_sq / 2)
    high = kl >= kl_mask_threshold
    pos, neg = high & (ratio > 1.0) & (adv > 0), high & (ratio < 1.0) & (adv < 0)
    keep = ~(pos | neg)
    per_sample = torch.where(keep, -adv * ratio, torch.zeros_like(ratio))
    if weights is not None:
        per_sample = per_sample * weights.detach().to(per_sample)
    loss = per_sample.mean()
    with torch.no_grad():
        metrics = {
            "pg_loss": loss.detach(),
            "ppo_kl": (-log_ratio).mean(),
            "ratio_mean": ratio.mean(),
            "kl_new_old_mean": kl.mean(),
            "kl_new_old_max": kl.max(),
            "kl_mask_fraction": high.float().mean(),
            "pos_rm_fraction": pos.float().mean(),
            "neg_rm_fraction": neg.float().mean(),
            "masked_fraction": (~keep).float().mean(),
        }
    return loss, metrics
