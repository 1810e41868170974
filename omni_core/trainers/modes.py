"""The registered trainer modes (verl-omni's `trainer_sync.py` / `trainer_separate_async.py`): each is its feed.

A mode differs from the base trainer only in its rollout feed (`rollout_feed.py`): which prompts are sampled
when, with which weights, and what a checkpoint keeps of the queue. The registry maps the name users type in
`trainer.v1.trainer_mode` to the class, and the class to its feed:

| `trainer.v1.trainer_mode` | class | feed |
|---|---|---|
| `sync` | `PolicyGradientDiffusionTrainerV1Sync` | `SyncFeed`: sampled each step, weights pushed after every step |
| `separate_async` | `PolicyGradientDiffusionTrainerV1SeparateAsync` | `AheadFeed`: sampled ahead, weights every `parameter_sync_step` |

Offline samples (`algorithm.sample_source=offline`, sync mode) are not a mode of their own in verl-omni either: its
direct-preference trainer skips the rollout. `PreferenceDataTrainerV1` is the sync trainer with `PreferenceDataFeed`
(the data set's pairs, no rollout workers); `build_diffusion_trainer` picks it.
"""

from __future__ import annotations

from omni_core.trainers.ahead_feed import AheadFeed
from omni_core.trainers.base import PolicyGradientDiffusionTrainerV1
from omni_core.trainers.preference_data_feed import PreferenceDataFeed
from omni_core.trainers.registry import register_diffusion_trainer
from omni_core.trainers.rollout_feed import SyncFeed

__all__ = ["PolicyGradientDiffusionTrainerV1SeparateAsync", "PolicyGradientDiffusionTrainerV1Sync", "PreferenceDataTrainerV1"]


@register_diffusion_trainer("sync")
class PolicyGradientDiffusionTrainerV1Sync(PolicyGradientDiffusionTrainerV1):
    """Colocated actor + rollout; weights pushed to the rollout side after every step (staleness 0)."""

    mode = "sync"
    feed_cls = SyncFeed


@register_diffusion_trainer("separate_async")
class PolicyGradientDiffusionTrainerV1SeparateAsync(PolicyGradientDiffusionTrainerV1):
    """Standalone rollout workers sampling ahead; weights published every `parameter_sync_step` steps."""

    mode = "separate_async"
    feed_cls = AheadFeed


class PreferenceDataTrainerV1(PolicyGradientDiffusionTrainerV1):
    """sync, on offline samples: each step trains the data set's next preference pairs; no rollout workers."""

    mode = "sync"
    feed_cls = PreferenceDataFeed
