"""Rollout correction (`algorithm.rollout_correction`): importance-sampling weights and rejection sampling, as verl's
`rollout_corr_helper` defines them, on a diffusion batch: plain tensors in, weights and metrics out.

A "token" here is one SDE step of a sample's window: ``log_ratio [B, T]`` is ``log pi_train - log pi_rollout`` per
step (decoupled mode: the recomputed old log-probs against the rollout's, once per step's batch, ``T = W``; bypass
mode: the current policy's against the rollout's, per micro-batch and window step, ``T = 1``). Every exponent is
clamped to +-20 first (verl's safety bound).

Importance sampling (``rollout_is``; the weights multiply the per-sample loss, detached):

    token      w_bt = exp(log_ratio_bt)
    sequence   w_bt = exp(sum_t log_ratio_bt)                     (one weight per sample)
    threshold  "U" (TIS): w <- min(w, U);  "L_U" (IcePop): w <- w if L <= w <= U else 0

Rejection sampling (``rollout_rs``: comma-separated options, all must pass; a rejected step gets weight 0), with
``k1 = -log_ratio``, ``k2 = log_ratio^2 / 2``, ``k3 = exp(log_ratio) - 1 - log_ratio``:

    token_k1           keep where log(L) <= k1 <= log(U)   (threshold "L_U", or "U" meaning L = 1 / U)
    token_k2 / _k3     keep where k <= U
    seq_sum_k* / seq_mean_k* / seq_max_k2 / _k3        the same on each sample's sum / mean / max over its steps

``rollout_rs_threshold`` gives one threshold for all options or one per option, comma-separated. Ideas credited to
verl ``verl/trainer/ppo/rollout_corr_helper.py`` and verl-omni's diffusion use of it; no code is copied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from omni_core.config.algorithm_names import ROLLOUT_RS_OPTIONS

__all__ = ["RS_OPTIONS", "RolloutCorrection", "importance_weights", "rejection_mask"]

SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ROLLOUT_RS_OPTIONS


def _bounds(spec: str | float, k1: bool) -> tuple[float | None, float]:
    """(lower, upper) of one threshold: "U" or "L_U"; a k1 option without a lower bound takes 1 / U."""
    text = str(spec).strip()
    lower_text, _, upper_text = text.rpartition("_")
    upper = float(upper_text)
    lower = float(lower_text) if lower_text else None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"threshold {spec!r} must be U > 0 or L_U with 0 < L <= U")
    if k1 and lower is None:
        lower = 1.0 / upper
    return lower, upper


def importance_weights(
    log_ratio: Tensor, level: str, threshold: str | float, batch_normalize: bool = False
) -> tuple[Tensor, dict[str, float]]:
    """Truncated (TIS) or IcePop importance weights ``[B, T]`` (detached) and their statistics."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is={level!r} must be one of {IS_LEVELS}")
    lower, upper = _bounds(threshold, k1=False)
    lr = log_ratio.detach().float()
    if level == "sequence":
        lr = lr.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    raw = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    weights = raw.clamp(max=upper) if lower is None else torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = {
        "rollout_is_mean": weights.mean().item(),
        "rollout_is_max": weights.max().item(),
        "rollout_is_min": weights.min().item(),
        # verl's effective sample size: 1 / mean(w_normalised^2), w normalised to mean 1
        "rollout_is_eff_sample_size": (1.0 / (weights / weights.mean().clamp_min(1e-12)).square().mean()).item(),
        "rollout_is_ratio_fraction_high": (raw > upper).float().mean().item(),
        "rollout_is_ratio_fraction_low": (raw < lower).float().mean().item() if lower is not None else 0.0,
    }
    if batch_normalize:
        weights = weights / weights.mean().clamp_min(1e-12)
    return weights, metrics


def rejection_mask(log_ratio: Tensor, options: str, threshold: str | float) -> tuple[Tensor, dict[str, float]]:
    """The keep mask ``[B, T]`` (1 keep, 0 reject) of every option in ``options`` together, and the masked fractions."""
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    unknown = [o for o in names if o not in RS_OPTIONS]
    if not names or unknown:
        raise ValueError(f"rollout_rs={options!r}: choose comma-separated options of {list(RS_OPTIONS)}")
    specs = [s for s in str(threshold).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold={threshold!r}: give one threshold, or one per option of rollout_rs={options!r}")
    specs = specs * len(names) if len(specs) == 1 else specs
    lr = log_ratio.detach().float().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1.0 - lr}
    keep = torch.ones_like(lr, dtype=torch.bool)
    metrics: dict[str, float] = {}
    for name, spec in zip(names, specs, strict=True):
        kind = name[-2:]
        lower, upper = _bounds(spec, k1=kind == "k1")
        value = stats[kind]
        if name.startswith("seq_"):
            reduce = name.split("_")[1]
            seq = {"sum": value.sum(-1), "mean": value.mean(-1), "max": value.max(-1).values}[reduce]
            value = seq.unsqueeze(-1).expand_as(lr)
        if kind == "k1":
            assert lower is not None
            ok = (value >= math.log(lower)) & (value <= math.log(upper))
        else:
            ok = value <= upper
        metrics[f"rollout_rs_{name}_masked_fraction"] = (~ok).float().mean().item()
        keep &= ok
    metrics["rollout_rs_masked_fraction"] = (~keep).float().mean().item()
    metrics["rollout_rs_seq_masked_fraction"] = (~keep).any(dim=-1).float().mean().item()
    return keep.float(), metrics


@dataclass(frozen=True)
class RolloutCorrection:
    """`algorithm.rollout_correction`'s IS / RS settings (None: that mechanism is off)."""

    rollout_is: str | None = None
    rollout_is_threshold: str | float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.rollout_is or self.rollout_rs)

    def decoupled(self, old_log_prob: Tensor, rollout_log_prob: Tensor) -> tuple[Tensor | None, dict[str, float]]:
        """Decoupled mode (the old-log-prob pass ran): IS weights times the RS mask, ``[B, W]``, from the recomputed old
        log-probs against the rollout's; None when both are off."""
        return self._weights(old_log_prob - rollout_log_prob, apply_is=True)

    def bypass(self, log_prob: Tensor, rollout_log_prob: Tensor) -> tuple[Tensor | None, dict[str, float]]:
        """Bypass mode, one window step of a micro-batch (``[b]``): the PPO ratio against the rollout already is the
        importance weight, so only the RS mask of the current policy against the rollout applies (verl-omni)."""
        weights, metrics = self._weights((log_prob - rollout_log_prob).unsqueeze(-1), apply_is=False)
        return (None if weights is None else weights.squeeze(-1)), metrics

    def _weights(self, log_ratio: Tensor, apply_is: bool) -> tuple[Tensor | None, dict[str, float]]:
        weights: Tensor | None = None
        metrics: dict[str, float] = {}
        if self.rollout_is:
            is_weights, is_metrics = importance_weights(
                log_ratio, self.rollout_is, self.rollout_is_threshold, self.rollout_is_batch_normalize
            )
            metrics |= is_metrics
            if apply_is:
                weights = is_weights
        if self.rollout_rs:
            assert self.rollout_rs_threshold is not None  # validation
            keep, rs_metrics = rejection_mask(log_ratio, self.rollout_rs, self.rollout_rs_threshold)
            metrics |= rs_metrics
            weights = keep if weights is None else weights * keep
        return weights, metrics
