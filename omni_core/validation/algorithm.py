"""The algorithm a run trains with: advantage estimator, loss mode, and the LoRA keys of the policy."""

from __future__ import annotations

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.config.algorithm_names import ADV_ESTIMATOR_NAMES, LOSS_MODE_NAMES, LOSSES
from omni_core.config.schema import DiffusionLossConfig


def algorithm_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    p: list[ConfigProblem] = []
    model, actor = config.actor_rollout_ref.model, config.actor_rollout_ref.actor
    if model.algorithm not in LOSS_MODE_NAMES:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.model.algorithm",
                f"unknown or unsupported algorithm; available: {', '.join(LOSS_MODE_NAMES)}",
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
    p += _unread_loss_keys(actor.diffusion_loss)
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


def _unread_loss_keys(loss: DiffusionLossConfig) -> list[ConfigProblem]:
    """A loss's own key set away from its default while another loss trains: accepted, it would do nothing."""
    chosen = LOSSES.get(loss.loss_mode)
    read = set(chosen.options) if chosen else set()
    p = []
    for name, entry in LOSSES.items():
        for key in entry.options:
            value = getattr(loss, key)
            if key not in read and value != DiffusionLossConfig.model_fields[key].default:
                p.append(
                    ConfigProblem(
                        f"actor_rollout_ref.actor.diffusion_loss.{key}",
                        f"is read only by loss_mode {name}, and this run trains with {loss.loss_mode}; "
                        f"set actor_rollout_ref.actor.diffusion_loss.loss_mode={name}, or drop the key",
                        value,
                    )
                )
    return p
