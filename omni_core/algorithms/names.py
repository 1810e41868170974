"""The algorithm names a user may type, known without importing the math (torch).

`omni_core.algorithms.registry` maps exactly these names to functions (a test holds the two equal);
validation reads them from here so that `omniflow validate` stays light.
"""

# verl-omni registers one estimator, compute_flow_grpo_outcome_advantage, under both names.
ADV_ESTIMATOR_NAMES = ("flow_grpo", "dance_grpo")  # algorithm.adv_estimator
LOSS_MODE_NAMES = ("flow_grpo",)  # actor_rollout_ref.actor.diffusion_loss.loss_mode, actor_rollout_ref.model.algorithm
