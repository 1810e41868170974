"""Stage 3 — `build_trainer`: verl-omni's `get_diffusion_trainer_cls(trainer.v1.trainer_mode)(config)`."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from omni_core.config import OmniFlowConfig
from omni_core.records import RunInfo
from omni_core.trainers import build_diffusion_trainer
from omni_core.trainers.base import PolicyGradientDiffusionTrainerV1


@task(name="build_trainer", cache_policy=NO_CACHE)
def build_trainer(config: OmniFlowConfig, run: RunInfo) -> PolicyGradientDiffusionTrainerV1:
    return build_diffusion_trainer(config, run)
