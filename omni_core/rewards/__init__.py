"""Rewards, one module each: built-in JPEG rewards (`builtin`), the name registry (`registry`), custom
reward files (`custom`), the batch scorer (`manager`) and its term kinds (`terms`), reward-entry kinds and keys
(`entries`), model rewards loaded from local folders (`model_rewards`, tiny ones built by `tiny_clip`), reward
servers (`server_client`, `wire_format`; `server_app` serves OmniFlow's own terms), per-call deadlines
(`deadline`), failure shares (`failures`) and the reward names alone (`names`, light: validation reads it).

Import from the submodules (`from omni_core.rewards.manager import RewardManager`); the package itself
imports nothing, so `omni_core.rewards.names` never pays for torch.
"""
