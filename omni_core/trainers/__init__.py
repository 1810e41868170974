"""v1 diffusion trainers: the base class with its hooks, the registered modes and the registry."""

from omni_core.trainers.base import PolicyGradientDiffusionTrainerV1
from omni_core.trainers.modes import PolicyGradientDiffusionTrainerV1SeparateAsync, PolicyGradientDiffusionTrainerV1Sync
from omni_core.trainers.registry import get_diffusion_trainer_cls, register_diffusion_trainer

__all__ = [
    "PolicyGradientDiffusionTrainerV1",
    "PolicyGradientDiffusionTrainerV1SeparateAsync",
    "PolicyGradientDiffusionTrainerV1Sync",
    "get_diffusion_trainer_cls",
    "register_diffusion_trainer",
]
