"""Rewards: built-in JPEG rewards, the name registry, custom reward files and the batch scorer.

Re-exported lazily: ``omni_core.rewards.names`` (what validation reads) imports no torch.
"""

from omni_core._lazy import lazy_exports

_EXPORTS = {
    "REWARD_FUNCTIONS": "omni_core.rewards.registry",
    "RewardLoadError": "omni_core.rewards.custom",
    "RewardManager": "omni_core.rewards.manager",
    "RewardResult": "omni_core.rewards.manager",
    "RewardTerm": "omni_core.rewards.manager",
    "default_compute_score": "omni_core.rewards.registry",
    "get_reward_function": "omni_core.rewards.registry",
    "jpeg_compressibility": "omni_core.rewards.builtin",
    "jpeg_incompressibility": "omni_core.rewards.builtin",
    "jpeg_size_kb": "omni_core.rewards.builtin",
    "load_reward_function": "omni_core.rewards.custom",
}
__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
