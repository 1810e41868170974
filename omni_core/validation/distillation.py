"""On-policy distillation (verl-omni's `distillation.*`, `diffusion_loss.loss_mode=distill_kl|distill_fm_mse`, `actor.use_distill_loss`):
the teacher switch goes with a loss that reads the teacher, and the reverse (verl-omni's `validate_distillation_config`),
on the policy-gradient loop, with a teacher pipeline that exists and samples on the student's noise grid."""

from __future__ import annotations

import json
from pathlib import Path

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.config.algorithm_names import DISTILL_LOSSES
from omni_core.models.architectures import unsupported_pipeline_reason
from omni_core.models.hub import hub_problem, is_hub_id
from omni_core.models.model_index import ModelLoadError, config_differences, pipeline_class_name

TEACHER = "distillation.teacher_models.teacher_model.model_path"


def distillation_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    actor, dist = config.actor_rollout_ref.actor, config.distillation
    loss_mode = actor.diffusion_loss.loss_mode
    pure = loss_mode in DISTILL_LOSSES
    p: list[ConfigProblem] = []
    if dist.enabled and not (pure or actor.use_distill_loss):
        p.append(
            ConfigProblem(
                "distillation.enabled",
                f"builds a teacher that no loss reads (loss_mode={loss_mode}): set actor_rollout_ref.actor.diffusion_loss."
                "loss_mode=distill_kl (or distill_fm_mse), or actor_rollout_ref.actor.use_distill_loss=true, or set it to false",
                True,
            )
        )
    if (pure or actor.use_distill_loss) and not dist.enabled:
        key, value = ("actor_rollout_ref.actor.diffusion_loss.loss_mode", loss_mode) if pure else ("actor_rollout_ref.actor.use_distill_loss", True)
        p.append(
            ConfigProblem(key, f"reads a distillation teacher: set distillation.enabled=true and {TEACHER}", value)
        )
    if pure and actor.use_distill_loss:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.use_distill_loss",
                f"adds the distillation term to a policy-gradient loss; loss_mode={loss_mode} is that term alone: drop the key",
                True,
            )
        )
    if pure and actor.use_kl_loss:
        p.append(
            ConfigProblem(
                "actor_rollout_ref.actor.use_kl_loss",
                f"loss_mode={loss_mode} is the distillation term alone (verl-omni's distillation losses add no reference KL); for "
                "both terms use a policy-gradient loss with actor.use_distill_loss=true and actor.use_kl_loss=true",
                True,
            )
        )
    if dist.enabled and config.algorithm.trainer_type != "policy_gradient":
        p.append(
            ConfigProblem(
                "distillation.enabled",
                "the teacher replays the student's SDE transitions, which the direct-preference loop (DiffusionNFT, DPO) "
                "does not record: use algorithm.trainer_type=policy_gradient (verl-omni's requirement)",
                True,
            )
        )
    if dist.enabled:
        p += _teacher_problems(config)
    return p


def _teacher_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    teacher = config.distillation.teacher_models.teacher_model
    if teacher.model_path is None:
        return [ConfigProblem(TEACHER, "distillation.enabled=true needs the teacher: a diffusers pipeline folder or Hub id", None)]
    if is_hub_id(teacher.model_path):
        reason = hub_problem(teacher.model_path, teacher.revision, TEACHER)
        return [ConfigProblem(TEACHER, reason, teacher.model_path)] if reason else []
    folder = Path(teacher.model_path).expanduser()
    if not (folder / "model_index.json").is_file():
        why = f"no diffusers pipeline at {folder} (model_index.json missing); point it at the teacher's pipeline folder (LoRA merged) or a Hub id"
        return [ConfigProblem(TEACHER, why, teacher.model_path)]
    student = Path(config.actor_rollout_ref.model.path).expanduser()
    theirs_class = _class_name(folder)
    unsupported = unsupported_pipeline_reason(theirs_class)
    if unsupported:
        return [ConfigProblem(TEACHER, f"{folder}: {unsupported}", teacher.model_path)]
    mine_class = _class_name(student)
    if mine_class is not None and mine_class != theirs_class:
        why = f"it holds a {theirs_class} and the student a {mine_class}: the teacher replays the student's transitions, so it must be the student's architecture"
        return [ConfigProblem(TEACHER, why, teacher.model_path)]
    if not is_hub_id(config.actor_rollout_ref.model.path):  # both local: the noise grids must be one (checked again at load)
        mine, theirs = _scheduler_config(student), _scheduler_config(folder)
        if mine is not None and theirs is not None:
            differ = config_differences(mine, theirs)
            if differ:
                return [
                    ConfigProblem(
                        TEACHER,
                        f"its scheduler config differs from the student's in {', '.join(differ[:4])}: the teacher replays the "
                        "student's transitions on the student's noise grid; use a teacher of the same scheduler config",
                        teacher.model_path,
                    )
                ]
    return []


def _class_name(folder: Path) -> str | None:
    try:
        return pipeline_class_name(folder)
    except ModelLoadError:
        return None


def _scheduler_config(folder: Path) -> dict | None:
    path = folder / "scheduler" / "scheduler_config.json"
    return json.loads(path.read_text()) if path.is_file() else None
