"""Flow-GRPO algorithm pieces: the math (``flow_grpo``), name registries and the update step.

Re-exported lazily: ``omni_core.algorithms.names`` (what validation reads) imports no torch.
"""

from omni_core._lazy import lazy_exports

_EXPORTS = {
    "ADV_ESTIMATORS": "omni_core.algorithms.registry",
    "LOSS_MODES": "omni_core.algorithms.registry",
    "PPOUpdateConfig": "omni_core.algorithms.update",
    "StepOutput": "omni_core.algorithms.update",
    "broadcast_advantages": "omni_core.algorithms.flow_grpo",
    "build_lr_scheduler": "omni_core.algorithms.update",
    "build_optimizer": "omni_core.algorithms.update",
    "compute_flow_grpo_advantages": "omni_core.algorithms.flow_grpo",
    "get_adv_estimator": "omni_core.algorithms.registry",
    "get_policy_loss": "omni_core.algorithms.registry",
    "group_index_from_uids": "omni_core.algorithms.flow_grpo",
    "kl_loss": "omni_core.algorithms.flow_grpo",
    "policy_loss": "omni_core.algorithms.flow_grpo",
    "ppo_update": "omni_core.algorithms.update",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
