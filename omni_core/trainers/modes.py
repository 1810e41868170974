"""The registered trainer modes: `sync` and `separate_async` (verl-omni's `trainer_sync.py` / `trainer_separate_async.py`)."""

from __future__ import annotations

from omni_core.trainers.base import PolicyGradientDiffusionTrainerV1
from omni_core.trainers.registry import register_diffusion_trainer


@register_diffusion_trainer("sync")
class PolicyGradientDiffusionTrainerV1Sync(PolicyGradientDiffusionTrainerV1):
    """Colocated actor + rollout; weights pushed to the rollout side after every step (staleness 0)."""

    mode = "sync"


@register_diffusion_trainer("separate_async")
class PolicyGradientDiffusionTrainerV1SeparateAsync(PolicyGradientDiffusionTrainerV1):
    """Standalone rollout workers, weights pushed every `parameter_sync_step` steps, bounded staleness."""

    mode = "separate_async"
