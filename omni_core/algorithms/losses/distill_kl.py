"""`distill_kl`, the registered loss of on-policy distillation (verl-omni's `DistillKLLoss`): the student samples, a
frozen teacher (`distillation.teacher_models.teacher_model`) replays each stored transition, and the student's
reverse-SDE transition mean moves towards the teacher's.

Both transitions are Gaussians with the student's std, so their KL has a closed form, flow_grpo's KL penalty with the
teacher in place of the reference (`omni_core.algorithms.flow_grpo.kl_loss`):

    L_j = mean_{latent}(mu_theta - mu_teacher)^2 / (2 std_dev_t^2)          averaged over the micro-batch

No advantages, no ratio: the rewards are still scored, and monitored only. A student equal to the teacher has loss 0
and gradient 0.
"""

from __future__ import annotations

from torch import Tensor

from omni_core.algorithms.flow_grpo import kl_loss
from omni_core.algorithms.loss_contract import LossInputs, LossSettings
from omni_core.algorithms.losses.flow_grpo import DISTILL_INPUTS

__all__ = ["LOSS", "DistillKLLoss"]


class DistillKLLoss:
    """The transition KL of the student to the teacher at every window step."""

    group_size = 1

    def inputs(self, settings: LossSettings) -> frozenset[str]:
        return DISTILL_INPUTS

    def __call__(self, x: LossInputs, settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
        assert x.prev_sample_mean is not None and x.teacher_prev_sample_mean is not None and x.std_dev_t is not None
        loss = kl_loss(x.prev_sample_mean, x.teacher_prev_sample_mean, x.std_dev_t)
        return loss, {"distill_kl_loss": loss.detach()}


LOSS = DistillKLLoss()
