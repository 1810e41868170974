"""`grpo_guard`, the registered loss: GRPO-Guard's clipped objective (arXiv 2510.22319) plus the optional KL penalty.

Declares Flow-GRPO's inputs and the transition means of the current and the old policy with the step's std and
`sqrt_dt`: the ratio carries the reverse-SDE mean drift on the step's diffusion scale, and the loss is rescaled by
``1 / sqrt_dt^2`` (`omni_core.algorithms.trust_region.grpo_guard_loss`, where the equation is written out). Keys:
`diffusion_loss.clip_ratio`, `adv_clip_max` (as Flow-GRPO's) and the KL keys of `actor`.
"""

from __future__ import annotations

from torch import Tensor

from omni_core.algorithms.loss_contract import LossInputs, LossSettings
from omni_core.algorithms.losses.flow_grpo import kl_inputs, with_kl_penalty
from omni_core.algorithms.trust_region import grpo_guard_loss

__all__ = ["LOSS", "NEEDS", "GRPOGuardLoss", "transition_args"]

NEEDS = frozenset(
    {
        "log_prob",
        "old_log_prob",
        "advantages",
        "prev_sample_mean",
        "old_prev_sample_mean",
        "std_dev_t",
        "sqrt_dt",
        "rollout_weight",
    }
)


def transition_args(x: LossInputs) -> tuple[Tensor, ...]:
    """The inputs of a loss over the current and the old transition (GRPO-Guard, Flow-DPPO), in their functions'
    order: log-probs, old log-probs, advantages, means, old means, std_dev_t, sqrt_dt."""
    args = (x.log_prob, x.old_log_prob, x.advantages, x.prev_sample_mean, x.old_prev_sample_mean, x.std_dev_t, x.sqrt_dt)
    assert all(a is not None for a in args), "the update loop fills every declared input"
    return args  # type: ignore[return-value]


class GRPOGuardLoss:
    group_size = 1

    def inputs(self, settings: LossSettings) -> frozenset[str]:
        return NEEDS | kl_inputs(settings)

    def __call__(self, x: LossInputs, settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = grpo_guard_loss(
            *transition_args(x),
            clip_ratio=settings.clip_ratio,
            adv_clip_max=settings.adv_clip_max,
            weights=x.rollout_weight,
        )
        return with_kl_penalty(loss, metrics, x, settings), metrics


LOSS = GRPOGuardLoss()
