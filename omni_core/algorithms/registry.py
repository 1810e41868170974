"""Name -> function registries for the algorithm pieces a user selects in the config.

Keys are the names users type (``algorithm.adv_estimator``, ``actor.diffusion_loss.loss_mode``); an
unknown name raises ``ValueError`` listing the choices. Thin dicts, as verl-omni's registries. A loss is a
`PolicyLoss` (``omni_core.algorithms.loss_contract``): the ``LOSS`` of the module its
``omni_core.config.algorithm_names.LOSSES`` entry names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import Tensor

from omni_core.algorithms.flow_grpo import compute_flow_grpo_advantages
from omni_core.algorithms.loss_contract import PolicyLoss
from omni_core.config.algorithm_names import ADV_ESTIMATOR_NAMES, LOSSES

__all__ = ["ADV_ESTIMATORS", "LOSS_MODES", "compute_advantages", "get_adv_estimator", "get_policy_loss"]

# verl-omni registers one estimator, compute_flow_grpo_outcome_advantage, under both names.
# DanceGRPO's own code normalises with the per-group std (+1e-8); that is this estimator with
# ``algorithm.global_std=false`` (the eps differs), so the alias is the same function, not a
# separate algorithm.
ADV_ESTIMATORS: dict[str, Callable[..., Any]] = dict.fromkeys(ADV_ESTIMATOR_NAMES, compute_flow_grpo_advantages)

LOSS_MODES: dict[str, PolicyLoss] = {name: importlib.import_module(entry.module).LOSS for name, entry in LOSSES.items()}


def _lookup(table: dict[str, Any], name: str, what: str) -> Any:
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(table)}") from None


def get_adv_estimator(name: str) -> Callable[..., Any]:
    """The advantage estimator registered as ``name`` (``algorithm.adv_estimator``)."""
    return _lookup(ADV_ESTIMATORS, name, "advantage estimator")


def compute_advantages(algorithm: Any, rewards: Tensor, group_index: Tensor) -> Tensor:
    """`algorithm.adv_estimator` on one batch's rewards ``[B]`` with their prompt groups ``[B]``, normalised as the
    `algorithm` config section says (`norm_adv_by_std_in_grpo`, `global_std`, `std_estimator`)."""
    return get_adv_estimator(algorithm.adv_estimator)(
        rewards,
        group_index,
        norm_adv_by_std=algorithm.norm_adv_by_std_in_grpo,
        global_std=algorithm.global_std,
        unbiased=algorithm.std_estimator == "unbiased",
    )


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name`` (``actor_rollout_ref.actor.diffusion_loss.loss_mode``)."""
    return _lookup(LOSS_MODES, name, "loss mode")
