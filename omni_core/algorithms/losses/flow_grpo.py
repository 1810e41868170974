"""`flow_grpo`, the registered loss: Flow-GRPO's clipped policy loss plus its optional KL penalty, on the contract.

Declares the per-step log-probs, old log-probs and advantages, and, when the KL term is on
(`actor.use_kl_loss`, weight `kl_coef`), what `actor.kl_loss_type` compares: the reverse-SDE transition means with
the step's std (`transition_mean`) or the predicted velocities (`velocity`), each with the reference policy's. The
math is `omni_core.algorithms.flow_grpo`'s:

    L_j = policy_loss(logp_j, old_logp_j, A) + kl_coef * KL_j       (paper Eq. 5-6)
          [+ distill_coef * D_teacher_j]         (actor.use_distill_loss: on-policy distillation, DISTILL_TERMS below)
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from omni_core.algorithms.flow_grpo import kl_loss, policy_loss, velocity_kl_loss
from omni_core.algorithms.loss_contract import LossInputs, LossSettings

__all__ = ["DISTILL_TERMS", "LOSS", "FlowGRPOLoss", "distill_term", "kl_inputs", "with_kl_penalty"]

KL_INPUTS = {
    "transition_mean": frozenset({"prev_sample_mean", "std_dev_t", "ref_prev_sample_mean"}),
    "velocity": frozenset({"velocity", "ref_velocity"}),
}


# The distillation term (actor.use_distill_loss), by actor.distill_loss_mode: what it reads and its value.
# distill_kl: the KL of the current transition to the teacher's (the KL penalty's form, the teacher for the reference);
# distill_fm_mse: the mean squared gap of the flow predictions, mean((v_theta - v_teacher)^2), at the transition's start.
DISTILL_TERMS: dict[str, tuple[frozenset[str], Callable[[LossInputs], Tensor]]] = {
    "distill_kl": (
        frozenset({"prev_sample_mean", "std_dev_t", "teacher_prev_sample_mean"}),
        lambda x: kl_loss(x.prev_sample_mean, x.teacher_prev_sample_mean, x.std_dev_t),
    ),
    "distill_fm_mse": (
        frozenset({"velocity", "teacher_velocity"}),
        lambda x: velocity_kl_loss(x.velocity, x.teacher_velocity),
    ),
}


def distill_inputs(settings: LossSettings) -> frozenset[str]:
    """What the distillation term reads (nothing when it is off)."""
    if settings.distill_coef <= 0:
        return frozenset()
    if settings.distill_mode not in DISTILL_TERMS:
        raise ValueError(f"unknown distill_loss_mode {settings.distill_mode!r}; choose {', '.join(DISTILL_TERMS)}")
    return DISTILL_TERMS[settings.distill_mode][0]


def distill_term(mode: str, x: LossInputs) -> Tensor:
    """The distillation term `mode` (a `DISTILL_TERMS` name) on one (micro-batch, window step); a scalar."""
    reads, term = DISTILL_TERMS[mode]
    missing = sorted(key for key in reads if getattr(x, key) is None)
    assert not missing, f"{mode} needs {missing}"
    return term(x)


def kl_inputs(settings: LossSettings) -> frozenset[str]:
    """What the penalty terms read: the KL to the reference (when `kl_coef` > 0) and the distillation KL to the teacher
    (when `distill_coef` > 0); nothing when both are off. Every policy-gradient loss adds them."""
    distill = distill_inputs(settings)
    if settings.kl_coef <= 0:
        return distill
    if settings.kl_type not in KL_INPUTS:
        raise ValueError(f"unknown kl_type {settings.kl_type!r}; choose transition_mean or velocity")
    return KL_INPUTS[settings.kl_type] | distill


def with_kl_penalty(loss: Tensor, metrics: dict[str, Tensor], x: LossInputs, settings: LossSettings) -> Tensor:
    """``loss + kl_coef * KL + distill_coef * D_teacher`` (the KL `actor.kl_loss_type` names, to the reference policy;
    verl-omni's `use_distill_loss` term, `DISTILL_TERMS[distill_mode]`, to the distillation teacher); records ``kl_loss``
    and, with the teacher, ``<distill_mode>_loss``."""
    if settings.distill_coef > 0:
        distill = distill_term(settings.distill_mode, x)
        loss = loss + settings.distill_coef * distill
        metrics[f"{settings.distill_mode}_loss"] = distill.detach()
    kl = loss.new_zeros(())
    if settings.kl_coef > 0:
        if settings.kl_type == "velocity":
            assert x.velocity is not None and x.ref_velocity is not None
            kl = velocity_kl_loss(x.velocity, x.ref_velocity)
        else:
            assert x.prev_sample_mean is not None and x.ref_prev_sample_mean is not None and x.std_dev_t is not None
            kl = kl_loss(x.prev_sample_mean, x.ref_prev_sample_mean, x.std_dev_t)
        loss = loss + settings.kl_coef * kl
    metrics["kl_loss"] = kl.detach()
    return loss


class FlowGRPOLoss:
    """The PPO-clip surrogate per window step, plus ``kl_coef`` x the KL to the reference when ``kl_coef > 0``."""

    group_size = 1

    def inputs(self, settings: LossSettings) -> frozenset[str]:
        return frozenset({"log_prob", "old_log_prob", "advantages", "rollout_weight"}) | kl_inputs(settings)

    def __call__(self, x: LossInputs, settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
        assert x.log_prob is not None and x.old_log_prob is not None and x.advantages is not None
        loss, metrics = policy_loss(
            x.log_prob,
            x.old_log_prob,
            x.advantages,
            clip_ratio=settings.clip_ratio,
            adv_clip_max=settings.adv_clip_max,
            weights=x.rollout_weight,
        )
        return with_kl_penalty(loss, metrics, x, settings), metrics


LOSS = FlowGRPOLoss()
