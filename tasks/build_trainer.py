"""Stage 3 — `build_trainer`: verl-omni's `get_diffusion_trainer_cls(trainer.v1.trainer_mode)(config)`."""

from __future__ import annotations

from prefect import task

from omni_core.config import OmniFlowConfig
from omni_core.trainers import get_diffusion_trainer_cls
from omni_core.trainers.base import PolicyGradientDiffusionTrainerV1, RunInfo


@task(name="build_trainer")
def build_trainer(config: OmniFlowConfig, run: RunInfo) -> PolicyGradientDiffusionTrainerV1:
    trainer_cls = get_diffusion_trainer_cls(config.trainer.v1.trainer_mode)
    return trainer_cls(config, run)
