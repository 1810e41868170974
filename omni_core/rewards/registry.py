"""Reward functions keyed by the names users type, and verl-omni's default scorer.

Each takes ``(image, ground_truth)``. The built-ins (the JPEG rewards, which read only the image) are in
``REWARD_FUNCTIONS``; a name that is not one of them resolves to a reward added from outside the core (a recipe's,
e.g. the procedural GenEval verifier ``procedural_geneval``, which reads the scene its row's
``reward_model.ground_truth`` names): ``omni_core.rewards.plugins``.

``default_compute_score(data_source, solution_image, ground_truth, extra_info)`` dispatches on the
sample's ``data_source`` (the dataset's ``data.reward_fn_key`` column), as verl-omni's
``default_compute_score`` does for ``jpeg_compressibility``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_core.rewards.builtin import jpeg_compressibility, jpeg_incompressibility
from omni_core.rewards.names import DATA_SOURCE_REWARDS, MODEL_REWARD_NAMES, PACKAGED_REWARD_NAMES
from omni_core.rewards.plugins import added_reward_names, find_reward

__all__ = ["REWARD_FUNCTIONS", "default_compute_score", "get_reward_function", "reward_choices"]


# Each takes one image (uint8 HWC numpy / CHW tensor / PIL) and its ground truth; returns a float or {"score", ...}.
REWARD_FUNCTIONS: dict[str, Callable[[Any, Any], Any]] = {
    "jpeg_compressibility": lambda image, ground_truth=None: jpeg_compressibility(image),
    "jpeg_incompressibility": lambda image, ground_truth=None: jpeg_incompressibility(image),
}


def reward_choices() -> str:
    """The reward names this process can resolve, as errors list them: built-ins, then added ones with their module."""
    added = ", ".join(f"{name} ({owner})" for name, owner in sorted(added_reward_names().items())) or "none"
    return (
        f"built-in rewards are {sorted(REWARD_FUNCTIONS)} and {list(PACKAGED_REWARD_NAMES)} (data_source "
        f"{', '.join(DATA_SOURCE_REWARDS)} too), rewards added by recipes or packages: {added}"
    )


def get_reward_function(name: str) -> Callable[[Any, Any], Any]:
    """The built-in or added reward named ``name``; unknown names list the choices."""
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name]
    added = find_reward(name)
    if added is not None:
        return added
    raise ValueError(
        f"unknown reward {name!r}; {reward_choices()}; model rewards {list(MODEL_REWARD_NAMES)} (with model_path); "
        "or give a reward server (server_url) or your own compute_score file (path, or reward.custom_reward_function.path). "
        "A recipe's reward is found through the installed package's `omni_core.rewards` entry points: reinstall "
        "OmniFlow (pip install -e .) if one is missing"
    )


def default_compute_score(
    data_source: str,
    solution_image: Any,
    ground_truth: Any = None,
    extra_info: dict[str, Any] | None = None,
) -> Any:
    """Score one image with the reward (built-in or added) named by its ``data_source``."""
    return get_reward_function(data_source)(solution_image, ground_truth)
