"""Flow-GRPO algorithm pieces, one module each: the math (`flow_grpo`), the PPO update step (`update`),
the name -> function registries (`registry`) and the names alone (`names`, light: validation reads it).

Import from the submodules (`from omni_core.algorithms.flow_grpo import policy_loss`); the package
itself imports nothing, so `omni_core.algorithms.names` never pays for torch.
"""
