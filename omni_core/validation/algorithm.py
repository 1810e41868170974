"""The algorithm a run trains with: advantage estimator, loss mode, and the LoRA keys of the policy."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.config.algorithm_names import ADV_ESTIMATOR_NAMES, LOSS_MODE_NAMES, LOSSES, MODEL_ALGORITHM_NAMES, LossEntry
from omni_core.config.schema import DiffusionLossConfig


def algorithm_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    p: list[ConfigProblem] = []
    model, actor = config.actor_rollout_ref.model, config.actor_rollout_ref.actor
    if model.algorithm == "dance_grpo":
        p.append(
            ConfigProblem(
                "actor_rollout_ref.model.algorithm",
                "verl-omni's dance_grpo adapter samples Wan2.2 videos, and video is not supported yet; DanceGRPO on images "
                "is model.algorithm=flow_grpo with actor_rollout_ref.rollout.algo.sde_type=dance_sde (loss_mode and "
                "adv_estimator dance_grpo are Flow-GRPO's under DanceGRPO's name)",
                model.algorithm,
            )
        )
    elif model.algorithm not in MODEL_ALGORITHM_NAMES:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.model.algorithm",
                f"selects the model's sampling adapter (verl-omni's pipeline registry); available: "
                f"{', '.join(MODEL_ALGORITHM_NAMES)} (the loss is actor_rollout_ref.actor.diffusion_loss.loss_mode: "
                f"{', '.join(LOSS_MODE_NAMES)})",
                model.algorithm,
            )
        )
    if actor.diffusion_loss.loss_mode not in LOSS_MODE_NAMES:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.diffusion_loss.loss_mode",
                f"unknown loss mode; available: {', '.join(LOSS_MODE_NAMES)}",
                actor.diffusion_loss.loss_mode,
            )
        )
    defaults = {key: f.default for key, f in DiffusionLossConfig.model_fields.items()}
    p += unread_loss_keys(actor.diffusion_loss.model_dump(), LOSSES, defaults)
    entry = LOSSES.get(actor.diffusion_loss.loss_mode)
    if entry is not None and entry.old_policy_means and config.algorithm.rollout_correction.bypass_mode:
        p.append(
            ConfigProblem(
                "algorithm.rollout_correction.bypass_mode",
                f"loss_mode={actor.diffusion_loss.loss_mode} compares the policy's reverse-SDE transition means with the old "
                "policy's, which the old-log-prob pass computes; bypass mode skips that pass and the rollout does not "
                "record its means. Set bypass_mode=false (sync mode), or train with loss_mode=flow_grpo",
                True,
            )
        )
    if config.algorithm.filter_zero_std_groups and config.algorithm.trainer_type != "policy_gradient":
        p.append(
            ConfigProblem(
                "algorithm.filter_zero_std_groups",
                "is flow_grpo's filter for the policy-gradient losses, where a group whose rewards are all equal has no "
                f"gradient; with trainer_type={config.algorithm.trainer_type} DiffusionNFT still trains such a group (its "
                "optimality probability is 1/2 for each sample) and Diffusion-DPO already trains one (chosen, rejected) "
                "pair per group, whose tie gives no gradient; drop the key",
                True,
            )
        )
    if config.algorithm.adv_estimator not in ADV_ESTIMATOR_NAMES:
        p.append(
            ConfigProblem(
                "algorithm.adv_estimator",
                f"unknown advantage estimator; available: {', '.join(ADV_ESTIMATOR_NAMES)}",
                config.algorithm.adv_estimator,
            )
        )
    if actor.kl_loss_type != "transition_mean" and not actor.use_kl_loss:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.kl_loss_type",
                "chooses what the KL penalty compares, but the penalty is off; set actor_rollout_ref.actor.use_kl_loss=true "
                "(with kl_loss_coef > 0), or drop the key",
                actor.kl_loss_type,
            )
        )
    pipeline = config.actor_rollout_ref.rollout.pipeline
    if actor.detach_uncond_cfg and pipeline.guidance_scale <= 1.0 and pipeline.true_cfg_scale <= 1.0:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.detach_uncond_cfg",
                "detaches the unconditional branch of classifier-free guidance, but this run has no CFG "
                "(rollout.pipeline.guidance_scale and true_cfg_scale are 1.0); set the guidance scale above 1, or drop the key",
                True,
            )
        )
    if model.lora_rank < 0:
        p.append(ConfigProblem("actor_rollout_ref.model.lora_rank", "must be >= 0 (0 = full fine-tuning)", model.lora_rank))
    elif model.lora_rank > 0 and model.lora_alpha <= 0:
        p.append(ConfigProblem("actor_rollout_ref.model.lora_alpha", "must be > 0 when lora_rank > 0", model.lora_alpha))
    if model.lora_adapter_path and model.lora_rank == 0:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.model.lora_adapter_path",
                "needs actor_rollout_ref.model.lora_rank > 0 (the adapter's rank)",
                model.lora_adapter_path,
            )
        )
    return p


def unread_loss_keys(
    loss: Mapping[str, Any], losses: Mapping[str, LossEntry], defaults: Mapping[str, Any]
) -> list[ConfigProblem]:
    """The `diffusion_loss` section's keys that belong to other losses than `loss["loss_mode"]` and are set away from
    their `defaults`: accepted, they would do nothing. `losses` is the registry table (`LOSSES`)."""
    chosen = losses.get(loss["loss_mode"])
    read = set(chosen.options) if chosen else set()
    readers: dict[str, list[str]] = {}
    for name, entry in losses.items():
        for key in entry.options:
            readers.setdefault(key, []).append(name)
    problems = [
        ConfigProblem(
            f"actor_rollout_ref.actor.diffusion_loss.{key}",
            f"is read only by loss_mode {' / '.join(names)}, and this run trains with {loss['loss_mode']}; "
            f"set actor_rollout_ref.actor.diffusion_loss.loss_mode={names[0]}, or drop the key",
            loss[key],
        )
        for key, names in readers.items()
        if key not in read and loss[key] != defaults[key]
    ]
    problems += [
        ConfigProblem(
            f"actor_rollout_ref.actor.diffusion_loss.{key}",
            f"is not read by loss_mode {loss['loss_mode']} (its objective has no such term, as verl-omni's); drop the key",
            loss[key],
        )
        for key in (chosen.unread if chosen else ())
        if loss[key] != defaults[key]
    ]
    return problems
