"""Rewards: built-in JPEG rewards, the name registry, custom reward files and the batch scorer."""

from omni_core.rewards.builtin import jpeg_compressibility, jpeg_incompressibility, jpeg_size_kb
from omni_core.rewards.custom import RewardLoadError, load_reward_function
from omni_core.rewards.manager import RewardManager, RewardResult, RewardTerm
from omni_core.rewards.registry import REWARD_FUNCTIONS, default_compute_score, get_reward_function

__all__ = [
    "REWARD_FUNCTIONS",
    "RewardLoadError",
    "RewardManager",
    "RewardResult",
    "RewardTerm",
    "default_compute_score",
    "get_reward_function",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "jpeg_size_kb",
    "load_reward_function",
]
