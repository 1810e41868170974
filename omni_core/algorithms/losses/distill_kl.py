"""`distill_kl`, the registered loss of on-policy distillation (verl-omni's `DistillKLLoss`): the student samples, a
frozen teacher (`distillation.teacher_models.teacher_model`) replays each stored transition, and the student's
reverse-SDE transition mean moves towards the teacher's.

Both transitions are Gaussians with the student's std, so their KL has a closed form, flow_grpo's KL penalty with the
teacher in place of the reference (`omni_core.algorithms.flow_grpo.kl_loss`):

    L_j = mean_{latent}(mu_theta - mu_teacher)^2 / (2 std_dev_t^2)          averaged over the micro-batch

No advantages, no ratio: the rewards are still scored, and monitored only. A student equal to the teacher has loss 0
and gradient 0. `PureDistillationLoss` is also `distill_fm_mse`'s (`omni_core.algorithms.losses.distill_fm_mse`): the
term of `DISTILL_TERMS` alone.
"""

from __future__ import annotations

from torch import Tensor

from omni_core.algorithms.loss_contract import LossInputs, LossSettings
from omni_core.algorithms.losses.flow_grpo import DISTILL_TERMS, distill_term

__all__ = ["LOSS", "PureDistillationLoss"]


class PureDistillationLoss:
    """One distillation term of `DISTILL_TERMS` (the gap to the teacher) at every window step, and nothing else."""

    group_size = 1

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def inputs(self, settings: LossSettings) -> frozenset[str]:
        return DISTILL_TERMS[self.mode][0]

    def __call__(self, x: LossInputs, settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
        loss = distill_term(self.mode, x)
        return loss, {f"{self.mode}_loss": loss.detach()}


LOSS = PureDistillationLoss("distill_kl")
