"""The contract between the update loop and a policy loss: what a loss may ask for, and the one record it gets.

A loss (one module under `omni_core.algorithms.losses`, registered by name in `omni_core.config.algorithm_names`) is a
`PolicyLoss`: it declares the inputs it needs (`inputs(settings)`, a set of `LossInputs` field names, which may
depend on its settings, e.g. a KL term that is on or off) and how many adjacent samples form one of its groups
(`group_size`: 2 for a loss over pairs). The update loop then computes only the declared inputs, hands the loss one
`LossInputs` per (micro-batch, window step) with every undeclared field None, and keeps each group in one
micro-batch. It never asks which algorithm is running. The idea follows verl-omni's `DiffusionLossFn`
(`required_model_output_keys` / `required_data_keys`); no code is copied.

Inputs on offer, for a micro-batch of ``b`` samples at window step ``j`` (``*latent`` = the latent's shape):

    from the step's data            old_log_prob [b], advantages [b], rewards [b] (a preference loss's: what orders a
                                    pair), pair_index [b], rollout_weight [b] (rollout
                                    correction's weight, multiplied into the per-sample loss; None when off),
                                    old_prev_sample_mean [b, *latent] (the old policy's transition means, from the same
                                    no-grad pass as the old log-probs)
    from the current policy         log_prob [b], prev_sample_mean [b, *latent], std_dev_t (scalar / [b] / broadcastable),
                                    velocity [b, *latent]                       (with gradient)
    from the reference policy       ref_prev_sample_mean [b, *latent], ref_velocity [b, *latent]   (no gradient)
    from the teacher (distillation) teacher_prev_sample_mean [b, *latent], teacher_velocity [b, *latent]
                                    (no gradient: `distillation.teacher_models`; the teacher replays the transition)
    from the stored trajectory      latents [b, *latent] (x_j), next_latents [b, *latent] (x_{j+1}),
                                    sigma [b], next_sigma [b], final_latents [b, *latent] (the window's last latent),
                                    sqrt_dt [b] (sqrt(sigma - next_sigma): the transition std is std_dev_t * sqrt_dt)

A forward-process loss (DiffusionNFT) declares ``forward_latents``: its steps are then not the stored transitions but
forward-process points of the final samples. For step ``j`` of sample ``i`` the step function takes one of the rollout's
schedule sigmas ``t`` (`algorithm.timestep_fraction` of them per sample), fresh noise ``eps`` and

    forward_latents [b, *latent] = (1 - t) final_latents + t eps,      forward_sigma [b] = t,
    velocity / ref_velocity [b, *latent]   the current (with gradient) / reference policy's prediction there,
    old_velocity [b, *latent]              the old policy's (`model.policy_state_adapters` old; no gradient),
    forward_noise [b, *latent] = eps.

A forward-process loss says where its points lie with `forward_sigmas`: "rollout_schedule" (the default: `t` one of
the rollout's schedule sigmas, a fresh `eps` per sample, `timestep_fraction` of the steps) or "train_schedule" (one
point per group, its `t` drawn logit-normal from the model scheduler's training sigmas and its `eps` shared by the
group's samples: Diffusion-DPO's pairs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from torch import Tensor

__all__ = [
    "DATA_INPUTS",
    "FORWARD_PROCESS_INPUTS",
    "FORWARD_SIGMAS",
    "LOSS_INPUTS",
    "OPTIONAL_INPUTS",
    "REFERENCE_INPUTS",
    "TEACHER_INPUTS",
    "LossInputs",
    "LossSettings",
    "PolicyLoss",
    "check_declared",
    "forward_sigmas",
]


@dataclass
class LossInputs:
    """One (micro-batch, window step) of a loss's inputs; a field the loss did not declare is None (shapes above)."""

    log_prob: Tensor | None = None
    old_log_prob: Tensor | None = None
    advantages: Tensor | None = None
    rewards: Tensor | None = None
    pair_index: Tensor | None = None  # [b] long: the group each sample belongs to (its rows are adjacent)
    old_prev_sample_mean: Tensor | None = None
    rollout_weight: Tensor | None = None  # [b]: rollout correction's IS x RS weight of each sample here; None: off
    prev_sample_mean: Tensor | None = None
    std_dev_t: Tensor | float | None = None
    velocity: Tensor | None = None
    ref_prev_sample_mean: Tensor | None = None
    ref_velocity: Tensor | None = None
    teacher_prev_sample_mean: Tensor | None = None
    teacher_velocity: Tensor | None = None
    latents: Tensor | None = None
    next_latents: Tensor | None = None
    sigma: Tensor | None = None
    next_sigma: Tensor | None = None
    final_latents: Tensor | None = None
    sqrt_dt: Tensor | None = None
    forward_latents: Tensor | None = None
    forward_sigma: Tensor | None = None
    old_velocity: Tensor | None = None
    forward_noise: Tensor | None = None


LOSS_INPUTS = frozenset(f.name for f in fields(LossInputs))
# The update loop's (from the step's data); the rest the step function's.
DATA_INPUTS = frozenset({"old_log_prob", "advantages", "rewards", "pair_index", "old_prev_sample_mean", "rollout_weight"})
# Declared inputs that may stay None: the loss then runs without them (rollout correction off).
OPTIONAL_INPUTS = frozenset({"rollout_weight"})
REFERENCE_INPUTS = frozenset({"ref_prev_sample_mean", "ref_velocity"})  # a no-grad pass of the reference policy
TEACHER_INPUTS = frozenset({"teacher_prev_sample_mean", "teacher_velocity"})  # a no-grad pass of the distillation teacher
# Declaring any of these makes the loss a forward-process loss (the step function noises the final samples afresh).
FORWARD_PROCESS_INPUTS = frozenset({"forward_latents", "forward_sigma", "old_velocity", "forward_noise"})
FORWARD_SIGMAS = ("rollout_schedule", "train_schedule")  # a forward-process loss's `forward_sigmas` (above)


@dataclass(frozen=True)
class LossSettings:
    """A loss's scalars: the ones every policy-gradient loss reads, and `options`, the rest of
    `actor_rollout_ref.actor.diffusion_loss` (a loss's own keys, e.g. a preference loss's beta)."""

    clip_ratio: float
    adv_clip_max: float
    kl_coef: float = 0.0  # 0: no KL term
    kl_type: str = "transition_mean"  # actor.kl_loss_type: transition_mean | velocity
    distill_coef: float = 0.0  # actor.distill_loss_coef with actor.use_distill_loss (0: no distillation term)
    distill_mode: str = "distill_kl"  # actor.distill_loss_mode: what the distillation term compares
    options: Mapping[str, Any] = field(default_factory=dict)


class PolicyLoss(Protocol):
    """A registered loss. `__call__` returns the scalar loss of one (micro-batch, window step) and its metrics
    (detached scalar tensors, averaged by the update over the step's calls and reported as ``actor/<key>``)."""

    group_size: int

    def inputs(self, settings: LossSettings) -> frozenset[str]: ...

    def __call__(self, x: LossInputs, settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]: ...


def check_declared(name: str, loss: PolicyLoss, settings: LossSettings) -> frozenset[str]:
    """The inputs `loss` (registered as `name`) declares under `settings`, checked against what is on offer."""
    needs = frozenset(loss.inputs(settings))
    unknown = sorted(needs - LOSS_INPUTS)
    if unknown:
        raise ValueError(f"loss {name!r} declares inputs {unknown} that no one provides; on offer: {sorted(LOSS_INPUTS)}")
    if loss.group_size < 1:
        raise ValueError(f"loss {name!r} declares group_size={loss.group_size}; it must be >= 1")
    if forward_sigmas(loss) not in FORWARD_SIGMAS:
        raise ValueError(f"loss {name!r} declares forward_sigmas={forward_sigmas(loss)!r}; choose one of {FORWARD_SIGMAS}")
    return needs


def forward_sigmas(loss: PolicyLoss) -> str:
    """Where a forward-process loss's points lie (module docstring): its `forward_sigmas`, by default the rollout's."""
    return str(getattr(loss, "forward_sigmas", FORWARD_SIGMAS[0]))
