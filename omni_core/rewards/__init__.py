"""Rewards, one module each: built-in JPEG rewards (`builtin`), the name registry (`registry`), custom
reward files (`custom`), the batch scorer (`manager`) and the built-in names alone (`names`, light:
validation reads it).

Import from the submodules (`from omni_core.rewards.manager import RewardManager`); the package itself
imports nothing, so `omni_core.rewards.names` never pays for torch.
"""
