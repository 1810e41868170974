"""The algorithm names a user may type, and each loss's own config keys, known without importing the math (torch).

`LOSSES` is the one table of policy losses: the name `actor_rollout_ref.actor.diffusion_loss.loss_mode` takes, the
module that defines it (its `LOSS`, see `omni_core.algorithms.loss_contract`), and the keys the loss reads besides the
common ones, with their types. The config schema adds those keys under `actor_rollout_ref.actor.diffusion_loss` (their
defaults and descriptions come from `defaults.yaml`, as every key's do), validation refuses one set for a loss that
does not read it, and `omni_core.algorithms.registry` imports the modules. Registering a loss is one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "ADV_ESTIMATOR_NAMES",
    "ADV_MODE_NAMES",
    "DERIVED_SELECTORS",
    "DISTILL_LOSSES",
    "FORWARD_PROCESS_ALGORITHMS",
    "FORWARD_PROCESS_LOSSES",
    "OLD_POLICY_DECAY_SCHEDULES",
    "PAIRED_LOSSES",
    "OLD_POLICY_DECAY_SCHEDULE_NAMES",
    "LOSSES",
    "LOSS_MODE_NAMES",
    "MODEL_ALGORITHM_NAMES",
    "ROLLOUT_RS_OPTIONS",
    "REFUSED_ROLLOUT_RS_OPTIONS",
    "LossEntry",
    "OptionType",
]

# The types a loss's own key may have (the schema maps each to its pydantic type).
OptionType = Literal["positive_float", "non_negative_float", "positive_int", "bool"]


@dataclass(frozen=True)
class LossEntry:
    """One registered loss: `module` defines `LOSS`; `options` are its own keys under `diffusion_loss` -> type;
    `unread` the common `diffusion_loss` keys it does not read (refused when set); `old_policy_means`: it compares
    the current transition means with the old policy's, which the old-log-prob pass computes (not bypass mode)."""

    module: str
    options: dict[str, OptionType] = field(default_factory=dict)
    unread: tuple[str, ...] = ()
    old_policy_means: bool = False


# verl-omni registers one estimator, compute_flow_grpo_outcome_advantage, under both names.
ADV_ESTIMATOR_NAMES = ("flow_grpo", "dance_grpo")  # algorithm.adv_estimator

# actor_rollout_ref.model.algorithm: verl-omni's pipeline adapter of a model (`DiffusionModelBase.register(name,
# algorithm=...)`: how it samples and scores transitions), not the loss. mix_grpo: Flow-GRPO's sampler with MixGRPO's
# window schedule; diffusion_nft: the deterministic ODE over every step, no log-probs (DiffusionNFT's rollout); dpo: the
# same ODE, keeping only the final latents (Diffusion-DPO's rollout).
MODEL_ALGORITHM_NAMES = ("flow_grpo", "mix_grpo", "diffusion_nft", "dpo")

# Model algorithms whose rollout records no SDE transitions: trained by a forward-process loss (`FORWARD_PROCESS_LOSSES`),
# with their own engine (`actor_rollout_ref.model.model_type`) and trainer loop (`algorithm.trainer_type`).
FORWARD_PROCESS_ALGORITHMS = {
    "diffusion_nft": ("diffusion_nft_model", "direct_preference"),
    "dpo": ("diffusion_dpo_model", "direct_preference"),
}
# model.algorithm -> the loss_mode that trains on its rollout (and only on it).
FORWARD_PROCESS_LOSSES = {"diffusion_nft": "diffusion_nft", "dpo": "dpo"}
# The losses over (chosen, rejected) pairs: algorithm.paired_preference=true goes with them, and only with them.
PAIRED_LOSSES = ("dpo",)

# verl-omni's engine and trainer-loop selectors. OmniFlow's engine follows the loss's declared inputs and its loop the
# trainer mode, so each value is implied by model.algorithm (FORWARD_PROCESS_ALGORITHMS); validation
# (`omni_core.validation.direct_preference`) refuses a value that disagrees, naming the one that goes with it.
DERIVED_SELECTORS = ("actor_rollout_ref.model.model_type", "algorithm.trainer_type")

# algorithm.adv_mode (DiffusionNFT): how a clipped group advantage becomes the optimality probability.
ADV_MODE_NAMES = ("continuous", "positive_only", "negative_only", "one_only", "binary")

# algorithm.old_policy_decay_schedule (DiffusionNFT) -> (warm-up steps, ramp per step, largest decay): the decay is 0
# before the warm-up ends, then min((step - warm-up) * ramp, largest). DiffusionNFT's published schedules.
OLD_POLICY_DECAY_SCHEDULES: dict[str, tuple[int, float, float]] = {
    "copy": (0, 0.0, 0.0),
    "linear_to_0_5": (0, 0.001, 0.5),
    "delayed_linear_to_0_999": (75, 0.0075, 0.999),
}
OLD_POLICY_DECAY_SCHEDULE_NAMES = tuple(OLD_POLICY_DECAY_SCHEDULES)

# actor_rollout_ref.actor.diffusion_loss.loss_mode -> the loss
LOSSES: dict[str, LossEntry] = {
    "flow_grpo": LossEntry("omni_core.algorithms.losses.flow_grpo"),
    "dance_grpo": LossEntry("omni_core.algorithms.losses.flow_grpo"),  # verl-omni registers Flow-GRPO's loss under both
    "grpo_guard": LossEntry("omni_core.algorithms.losses.grpo_guard", old_policy_means=True),
    "flow_dppo": LossEntry(
        "omni_core.algorithms.losses.flow_dppo",
        {"kl_mask_threshold": "non_negative_float", "add_kl_coefficient": "bool"},
        unread=("clip_ratio", "adv_clip_max"),
        old_policy_means=True,
    ),
    # DiffusionNFT's forward-process objective: reads adv_clip_max (the optimality probability's scale), not clip_ratio
    # (it has no ratio; verl-omni's recipe sets one, which its loss ignores: refused here, as every unread key).
    "diffusion_nft": LossEntry(
        "omni_core.algorithms.losses.diffusion_nft",
        {"mix_beta": "positive_float", "ref_kl_coef": "non_negative_float", "adaptive_weight_min": "positive_float"},
        unread=("clip_ratio",),
    ),
    # Diffusion-DPO on each prompt group's (chosen, rejected) pair: no ratio, no advantages.
    "dpo": LossEntry("omni_core.algorithms.losses.dpo", {"dpo_beta": "positive_float"}, unread=("clip_ratio", "adv_clip_max")),
    # On-policy distillation: the transition KL to a frozen teacher (distillation.teacher_models); no ratio, no advantages.
    "distill_kl": LossEntry("omni_core.algorithms.losses.distill_kl", unread=("clip_ratio", "adv_clip_max")),
    # ... or the mean squared gap of the velocities to the teacher's at the student's transition points.
    "distill_fm_mse": LossEntry("omni_core.algorithms.losses.distill_fm_mse", unread=("clip_ratio", "adv_clip_max")),
}
# The losses that read the distillation teacher's predictions (distillation.enabled goes with one of them, or with
# actor.use_distill_loss on a policy-gradient loss); each is also an actor.distill_loss_mode, the same term added.
DISTILL_LOSSES = ("distill_kl", "distill_fm_mse")
LOSS_MODE_NAMES = tuple(LOSSES)

# algorithm.rollout_correction.rollout_rs options (verl's rejection-sampling statistics; omni_core.algorithms.rollout_correction).
ROLLOUT_RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
# verl's options that are refused, with the reason (validation/rollout.py names it).
REFUSED_ROLLOUT_RS_OPTIONS = {
    "binary_kl": (
        "verl's KPop filter reads exp(log-prob) as a token's probability in (0, 1) and compares Bernoulli "
        "distributions; a diffusion step's log-prob is a Gaussian log-density, whose exp is no probability (it often "
        "exceeds 1, and clamping it below 1 makes the filter keep or reject by the clamp alone); use token_k2 or "
        "token_k3 (the step's own divergence) or a seq_* option"
    ),
}
