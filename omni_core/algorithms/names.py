"""The algorithm names a user may type, known without importing the math (torch).

`omni_core.algorithms.registry` maps exactly these names to functions and losses (a test holds the two equal);
validation reads them from here so that `omniflow validate` stays light. A loss is registered by one line of
`LOSS_MODULES`: its name and the module that defines it (`LOSS`, see `omni_core.algorithms.loss_contract`).
"""

# verl-omni registers one estimator, compute_flow_grpo_outcome_advantage, under both names.
ADV_ESTIMATOR_NAMES = ("flow_grpo", "dance_grpo")  # algorithm.adv_estimator

# actor_rollout_ref.actor.diffusion_loss.loss_mode (and actor_rollout_ref.model.algorithm) -> the loss's module
LOSS_MODULES = {
    "flow_grpo": "omni_core.algorithms.losses.flow_grpo",
}
LOSS_MODE_NAMES = tuple(LOSS_MODULES)
