"""`flow_dppo`, the registered loss: Flow-DPPO's unclipped ratio objective under an exact Gaussian KL trust region, plus
the optional KL penalty to the reference.

Declares the log-probs, old log-probs, advantages and the transition means of the current and the old policy with the
step's std and `sqrt_dt`; a sample is masked only where its KL to the old transition reaches
`diffusion_loss.kl_mask_threshold` and the update moves it away from the old policy
(`omni_core.algorithms.trust_region.flow_dppo_loss`, where the equation is written out). Keys: `kl_mask_threshold`,
`add_kl_coefficient` (its own), and the KL keys of `actor`. `clip_ratio` and `adv_clip_max` are not read (verl-omni's
objective is unclipped and its advantages unclamped).
"""

from __future__ import annotations

from torch import Tensor

from omni_core.algorithms.loss_contract import LossInputs, LossSettings
from omni_core.algorithms.losses.flow_grpo import kl_inputs, with_kl_penalty
from omni_core.algorithms.losses.grpo_guard import NEEDS, transition_args
from omni_core.algorithms.trust_region import flow_dppo_loss

__all__ = ["LOSS", "FlowDPPOLoss"]


class FlowDPPOLoss:
    group_size = 1

    def inputs(self, settings: LossSettings) -> frozenset[str]:
        return NEEDS | kl_inputs(settings)  # GRPO-Guard's inputs: the same transitions

    def __call__(self, x: LossInputs, settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = flow_dppo_loss(
            *transition_args(x),
            kl_mask_threshold=float(settings.options["kl_mask_threshold"]),
            add_kl_coefficient=bool(settings.options["add_kl_coefficient"]),
            weights=x.rollout_weight,
        )
        return with_kl_penalty(loss, metrics, x, settings), metrics


LOSS = FlowDPPOLoss()
