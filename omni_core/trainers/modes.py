"""The registered trainer modes (verl-omni's `trainer_sync.py` / `trainer_separate_async.py`): hooks only."""

from __future__ import annotations

from omni_core.trainers.base import PolicyGradientDiffusionTrainerV1
from omni_core.trainers.registry import register_diffusion_trainer
from omni_core.trainers.separate_async import PolicyGradientDiffusionTrainerV1SeparateAsync

__all__ = ["PolicyGradientDiffusionTrainerV1Sync", "PolicyGradientDiffusionTrainerV1SeparateAsync"]


@register_diffusion_trainer("sync")
class PolicyGradientDiffusionTrainerV1Sync(PolicyGradientDiffusionTrainerV1):
    """Colocated actor + rollout; weights pushed to the rollout side after every step (staleness 0)."""

    mode = "sync"

    def on_step_end(self) -> None:
        self._push_weights()
