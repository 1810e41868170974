"""`distill_fm_mse`, the registered flow-matching loss of on-policy distillation (verl-omni's
`DistillFlowMatchingMSELoss`): the student samples, the frozen teacher (`distillation.teacher_models.teacher_model`)
predicts the velocity at the start of each stored transition, and the student's velocity there moves towards it:

    L_j = mean_{latent}(v_theta(x_j, t_j) - v_teacher(x_j, t_j))^2            averaged over the micro-batch

Both predictions are the guided ones the sampler uses (`rollout.pipeline.guidance_scale`). Unlike `distill_kl` the
timesteps weigh alike (no `dt^2 / std^2` factor), and it needs no SDE noise: the student's own transition points only.
verl-omni registers this loss but has no producer for the teacher's velocity; OmniFlow's teacher pass produces it.
"""

from __future__ import annotations

from omni_core.algorithms.losses.distill_kl import PureDistillationLoss

__all__ = ["LOSS"]

LOSS = PureDistillationLoss("distill_fm_mse")
