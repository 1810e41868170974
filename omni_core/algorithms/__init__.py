"""Flow-GRPO algorithm pieces: the math (``flow_grpo``), name registries and the update step."""

from omni_core.algorithms.flow_grpo import (
    broadcast_advantages,
    compute_flow_grpo_advantages,
    group_index_from_uids,
    kl_loss,
    policy_loss,
)
from omni_core.algorithms.registry import (
    ADV_ESTIMATORS,
    LOSS_MODES,
    get_adv_estimator,
    get_policy_loss,
)
from omni_core.algorithms.update import (
    PPOUpdateConfig,
    StepOutput,
    build_lr_scheduler,
    build_optimizer,
    ppo_update,
)

__all__ = [
    "ADV_ESTIMATORS",
    "LOSS_MODES",
    "PPOUpdateConfig",
    "StepOutput",
    "broadcast_advantages",
    "build_lr_scheduler",
    "build_optimizer",
    "compute_flow_grpo_advantages",
    "get_adv_estimator",
    "get_policy_loss",
    "group_index_from_uids",
    "kl_loss",
    "policy_loss",
    "ppo_update",
]
