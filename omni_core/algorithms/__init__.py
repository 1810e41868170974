"""Flow-GRPO algorithm pieces, one module each: the math (`flow_grpo`), the PPO update step (`update`),
the loss contract (`loss_contract`), the losses (`losses/`) and the name -> function registries (`registry`). The
names alone, light for validation, live in `omni_core.config.algorithm_names`.

Import from the submodules (`from omni_core.algorithms.flow_grpo import policy_loss`); the package itself imports
nothing.
"""
