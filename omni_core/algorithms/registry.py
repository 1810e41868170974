"""Name -> function registries for the algorithm pieces a user selects in the config.

Keys are the names users type (``algorithm.adv_estimator``, ``actor.diffusion_loss.loss_mode``); an
unknown name raises ``ValueError`` listing the choices. Thin dicts, as verl-omni's registries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omni_core.algorithms.flow_grpo import compute_flow_grpo_advantages, policy_loss
from omni_core.algorithms.names import ADV_ESTIMATOR_NAMES, LOSS_MODE_NAMES

__all__ = ["ADV_ESTIMATORS", "LOSS_MODES", "get_adv_estimator", "get_policy_loss"]

# verl-omni registers one estimator, compute_flow_grpo_outcome_advantage, under both names.
# DanceGRPO's own code normalises with the per-group std (+1e-8); that is this estimator with
# ``algorithm.global_std=false`` (the eps differs), so the alias is the same function, not a
# separate algorithm.
ADV_ESTIMATORS: dict[str, Callable[..., Any]] = dict.fromkeys(ADV_ESTIMATOR_NAMES, compute_flow_grpo_advantages)

LOSS_MODES: dict[str, Callable[..., Any]] = dict.fromkeys(LOSS_MODE_NAMES, policy_loss)


def _lookup(table: dict[str, Callable[..., Any]], name: str, what: str) -> Callable[..., Any]:
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(table)}") from None


def get_adv_estimator(name: str) -> Callable[..., Any]:
    """The advantage estimator registered as ``name`` (``algorithm.adv_estimator``)."""
    return _lookup(ADV_ESTIMATORS, name, "advantage estimator")


def get_policy_loss(name: str) -> Callable[..., Any]:
    """The policy loss registered as ``name`` (``actor_rollout_ref.actor.diffusion_loss.loss_mode``)."""
    return _lookup(LOSS_MODES, name, "loss mode")
