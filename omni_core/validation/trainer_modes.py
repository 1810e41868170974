"""Trainer modes: a registered `trainer.v1.trainer_mode`, and each mode's requirements."""

from __future__ import annotations

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.trainers.registry import SEPARATE_ASYNC_NOT_IMPLEMENTED, registered_modes


def trainer_mode_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    # trainer.use_v1=false, and the sampler / separate_async keys away from their defaults, are refused by
    # the `refused` group (REFUSED_WHEN_NOT_DEFAULT).
    p: list[ConfigProblem] = []
    mode = config.trainer.v1.trainer_mode
    modes = registered_modes()
    if mode not in modes:
        p.append(ConfigProblem("trainer.v1.trainer_mode", f"unknown trainer mode; available: {', '.join(modes)}", mode))
    if mode == "separate_async":
        p.extend(_separate_async_problems(config))
    return p


def _separate_async_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    p = [ConfigProblem("trainer.v1.trainer_mode", SEPARATE_ASYNC_NOT_IMPLEMENTED.split("; ")[0] + "; use sync", "separate_async")]
    sa = config.trainer.v1.separate_async
    tbs, mbs = config.data.train_batch_size, config.actor_rollout_ref.actor.ppo_mini_batch_size
    rollout = config.actor_rollout_ref.rollout
    if tbs % sa.parameter_sync_step:
        p.append(
            ConfigProblem(
                "data.train_batch_size",
                f"must be divisible by trainer.v1.separate_async.parameter_sync_step={sa.parameter_sync_step} in separate_async mode",
                tbs,
            )
        )
    if tbs != mbs:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.ppo_mini_batch_size",
                f"must equal data.train_batch_size={tbs} in separate_async mode (one update per sampled batch)",
                mbs,
            )
        )
    if rollout.nnodes <= 0:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.rollout.nnodes",
                "separate_async needs a standalone rollout pool; set actor_rollout_ref.rollout.nnodes >= 1",
                rollout.nnodes,
            )
        )
    return p
