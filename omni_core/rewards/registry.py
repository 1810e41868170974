"""Built-in reward functions keyed by the names users type, and verl-omni's default scorer.

Each built-in takes ``(image, ground_truth)``: the JPEG rewards read only the image; ``procedural_geneval`` (the
rule-based verifier of ``omni_core.procedural``) reads the scene its row's ``reward_model.ground_truth`` names.

``default_compute_score(data_source, solution_image, ground_truth, extra_info)`` dispatches on the
sample's ``data_source`` (the dataset's ``data.reward_fn_key`` column), as verl-omni's
``default_compute_score`` does for ``jpeg_compressibility``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_core.rewards.builtin import jpeg_compressibility, jpeg_incompressibility
from omni_core.rewards.names import MODEL_REWARD_NAMES

__all__ = ["REWARD_FUNCTIONS", "default_compute_score", "get_reward_function"]


def _procedural_geneval(image: Any, ground_truth: Any) -> dict[str, float]:
    from omni_core.procedural.verifier import verifier_reward  # the verifier only where it is used

    return verifier_reward(image, ground_truth)


# Each takes one image (uint8 HWC numpy / CHW tensor / PIL) and its ground truth; returns a float or {"score", ...}.
REWARD_FUNCTIONS: dict[str, Callable[[Any, Any], Any]] = {
    "jpeg_compressibility": lambda image, ground_truth=None: jpeg_compressibility(image),
    "jpeg_incompressibility": lambda image, ground_truth=None: jpeg_incompressibility(image),
    "procedural_geneval": _procedural_geneval,
}


def get_reward_function(name: str) -> Callable[[Any, Any], Any]:
    """The built-in reward registered as ``name``; unknown names list the choices."""
    try:
        return REWARD_FUNCTIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown reward {name!r}; built-in rewards are {sorted(REWARD_FUNCTIONS)}, model rewards "
            f"{list(MODEL_REWARD_NAMES)} (with model_path); or give a reward server (server_url) or your own "
            "compute_score file (path, or reward.custom_reward_function.path)"
        ) from None


def default_compute_score(
    data_source: str,
    solution_image: Any,
    ground_truth: Any = None,
    extra_info: dict[str, Any] | None = None,
) -> Any:
    """Score one image with the built-in reward named by its ``data_source``."""
    return get_reward_function(data_source)(solution_image, ground_truth)
