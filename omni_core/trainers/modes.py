"""The registered trainer modes (verl-omni's `trainer_sync.py` / `trainer_separate_async.py`): hooks only."""

from __future__ import annotations

from omni_core.trainers.base import PolicyGradientDiffusionTrainerV1
from omni_core.trainers.registry import SEPARATE_ASYNC_NOT_IMPLEMENTED, register_diffusion_trainer


@register_diffusion_trainer("sync")
class PolicyGradientDiffusionTrainerV1Sync(PolicyGradientDiffusionTrainerV1):
    """Colocated actor + rollout; weights pushed to the rollout side after every step (staleness 0)."""

    mode = "sync"

    def on_step_end(self) -> None:
        self._push_weights()


@register_diffusion_trainer("separate_async")
class PolicyGradientDiffusionTrainerV1SeparateAsync(PolicyGradientDiffusionTrainerV1):
    """Standalone rollout workers, weights pushed every `parameter_sync_step` steps, bounded staleness.

    Not implemented yet: it refuses to start rather than run sync under another name.
    """

    mode = "separate_async"

    def init(self, *args, **kwargs) -> None:
        raise NotImplementedError(SEPARATE_ASYNC_NOT_IMPLEMENTED)
