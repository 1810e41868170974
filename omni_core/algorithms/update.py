"""One actor training step of Flow-GRPO: PPO epochs x mini-batches x micro-batches x window steps.

Owns the update schedule (verl-omni's ``TrainingWorker.train_mini_batch`` +
``_run_forward_backward_batch``) and the optimizer / LR-scheduler builders. The model-specific part,
a transformer forward for window step ``j`` followed by re-scoring the stored transition
``latents[:, j] -> latents[:, j + 1]`` with the SDE, is the caller's ``step_fn``; the loss is the registered
``cfg.loss_mode`` (:mod:`omni_core.algorithms.loss_contract`): this loop hands it one ``LossInputs`` record with
the fields it declared, and keeps its groups (``group_size`` adjacent samples, e.g. pairs) in one micro-batch.

Schedule (for each call, i.e. once per training step):

    for epoch in ppo_epochs:                      # shuffled with a seeded generator if cfg.shuffle
        for mini_batch in batch:                  # mini_batch_size samples (= ppo_mini_batch_size x n)
            share = mini_batch.chunk(dp_size)[dp_rank]   # data parallel: this rank's slice (all of it on one rank)
            for micro_batch in share:             # micro_batch_size samples
                for j in window steps:            # W
                    loss_j = loss(inputs_j) / (n_micro * W)   # n_micro: micro-batches of the share
                                                  # flow_grpo: policy loss + kl_coef * KL (of means or velocities)
                    loss_j.backward()             # at once: activations of one step only
            (ranks average their gradients)       # DDP, on the share's last backward
            clip_grad_norm_; optimizer.step(); zero_grad
    lr_scheduler.step()                           # once per training step, as verl-omni

With a loss's ``group_size`` g > 1 the permutation moves whole groups (samples ``g*k .. g*k+g-1``). Every rank
draws the same permutation (same seed), so the ranks' slices of a mini-batch are disjoint and
together the whole mini-batch: the averaged gradient is the single-rank gradient of that mini-batch.

Off-policy batches (separate_async) carry each sample's staleness in model versions: the update then also reports
the importance ratio ``exp(logp_now - logp_old)`` per staleness level (``ratio_by_level``), which shows how far the
stale samples drifted from the policy that trains them (in bypass mode the old log-prob is the rollout's).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from omni_core.algorithms.loss_contract import DATA_INPUTS, OPTIONAL_INPUTS, LossInputs, LossSettings, check_declared
from omni_core.algorithms.registry import get_policy_loss
from omni_core.algorithms.rollout_correction import RolloutCorrection

__all__ = [
    "NonFiniteTrainingError",
    "PPOUpdateConfig",
    "StepOutput",
    "build_lr_scheduler",
    "build_optimizer",
    "local_schedule",
    "nonfinite_metrics",
    "ppo_update",
    "ratio_by_level",
]

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What ``step_fn(micro_batch, j)`` returns for window step ``j`` of a micro-batch of ``b``.

    Attributes:
        log_prob: ``[b]`` fp32 log-prob of ``latents[:, j + 1]`` given ``latents[:, j]`` under the
            current policy (with grad).
        prev_sample_mean: ``[b, *latent]`` mean of that Gaussian transition (with grad).
        std_dev_t: the transition's std factor (scalar, ``[b]`` or broadcastable), for the KL.
        ref_prev_sample_mean: ``[b, *latent]`` transition mean under the reference policy (no
            grad), or None when the KL term is off or compares velocities.
        velocity: ``[b, *latent]`` the current policy's predicted velocity (with grad), for ``kl_type="velocity"``.
        ref_velocity: ``[b, *latent]`` the reference policy's velocity (no grad), for ``kl_type="velocity"``.
        teacher_prev_sample_mean: ``[b, *latent]`` the distillation teacher's transition mean (no grad).
        teacher_velocity: ``[b, *latent]`` the distillation teacher's velocity at ``latents[:, j]`` (no grad).
        latents, next_latents, sigma, next_sigma, final_latents, sqrt_dt: the stored trajectory's, for a loss that
            declares them (see ``LossInputs``).
        forward_latents, forward_sigma, forward_noise, old_velocity: a forward-process loss's point, the noise that
            made it and the old policy's velocity there (``velocity`` / ``ref_velocity`` are then the current /
            reference policy's at that point); such a step has no transition, so ``log_prob``, ``prev_sample_mean`` and ``std_dev_t`` stay None.
    A step function fills the optional fields the active loss declares (``LossInputs``); the others stay None.
    """

    log_prob: Tensor | None = None
    prev_sample_mean: Tensor | None = None
    std_dev_t: Tensor | float | None = None
    ref_prev_sample_mean: Tensor | None = None
    velocity: Tensor | None = None
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
    forward_noise: Tensor | None = None
    old_velocity: Tensor | None = None

    @property
    def device(self) -> torch.device:
        """Where the step's values live (its first tensor's device)."""
        return next(v for v in vars(self).values() if isinstance(v, Tensor)).device


@dataclass
class PPOUpdateConfig:
    """Knobs of one update call, in samples (not prompts). Filled by the caller from the config.

    ``mini_batch_size`` = ``actor.ppo_mini_batch_size x rollout.n``; ``micro_batch_size`` =
    ``actor.ppo_micro_batch_size_per_gpu``; ``kl_coef`` = 0 turns the KL term off; ``kl_type``
    (``actor.kl_loss_type``) is what it compares: ``transition_mean`` or ``velocity``; ``seed`` seeds
    the mini-batch shuffle (``actor.data_loader_seed``); ``loss_options`` are the loss's own keys
    (``actor.diffusion_loss``).
    """

    mini_batch_size: int
    micro_batch_size: int
    ppo_epochs: int
    clip_ratio: float
    adv_clip_max: float
    kl_coef: float
    grad_clip: float
    shuffle: bool
    seed: int
    loss_mode: str = "flow_grpo"
    kl_type: str = "transition_mean"
    distill_coef: float = 0.0  # actor.distill_loss_coef with actor.use_distill_loss: the distillation term's weight
    distill_mode: str = "distill_kl"  # actor.distill_loss_mode
    steps_per_forward: int = 1  # actor.window_steps_per_forward: window steps per forward and backward (steps_fn)
    dp_rank: int = 0  # this process's data-parallel rank, of dp_size (trainer.n_gpus_per_node x trainer.nnodes)
    dp_size: int = 1
    loss_options: Mapping[str, Any] = field(default_factory=dict)
    bypass_correction: RolloutCorrection | None = None  # bypass mode's rollout correction, per window step (RS only)

    def loss_settings(self) -> LossSettings:
        """The scalars the loss reads."""
        return LossSettings(
            self.clip_ratio,
            self.adv_clip_max,
            self.kl_coef,
            self.kl_type,
            self.distill_coef,
            self.distill_mode,
            dict(self.loss_options),
        )

    def group_size(self) -> int:
        """How many adjacent samples the active loss treats as one group (kept in one micro-batch)."""
        return get_policy_loss(self.loss_mode).group_size


StepFn = Callable[[dict[str, Any], int], StepOutput]
# Several window steps of a micro-batch in one forward: one StepOutput per step, in order (`steps_per_forward` > 1).
StepsFn = Callable[[dict[str, Any], list[int]], list[StepOutput]]


def window_chunks(window: int, steps_per_forward: int) -> list[list[int]]:
    """The window steps ``0..window-1`` in consecutive chunks of ``steps_per_forward`` (the last may be shorter): what
    one forward computes, in the update and in the no-grad passes that must match it (the first ratio exactly 1)."""
    return [list(range(i, min(i + steps_per_forward, window))) for i in range(0, window, steps_per_forward)]


class NonFiniteTrainingError(RuntimeError):
    """Several training steps in a row had a non-finite loss or gradient norm (their optimizer steps were
    skipped): the run cannot recover by itself. A config or numerics error that a retry would repeat."""


def nonfinite_metrics(metrics: Mapping[str, float], *, scaled: bool) -> list[str]:
    """The loss and gradient-norm metrics of one ``ppo_update`` result that are not finite.

    With a gradient scaler (fp16 compute) a non-finite gradient norm alone is an overflow that the scaler
    answers by lowering its scale (routine in the first steps); it counts only with a non-finite loss.
    """
    keys = ("actor/pg_loss", "actor/kl_loss", "actor/total_loss")  # total_loss: a loss without a policy-gradient term
    losses = [k for k in keys if k in metrics and not math.isfinite(metrics[k])]
    grad = [] if math.isfinite(metrics["actor/grad_norm"]) else ["actor/grad_norm"]
    return [] if scaled and not losses else losses + grad


def _check_sizes(batch_size: int, cfg: PPOUpdateConfig) -> None:
    mini, micro, ranks = cfg.mini_batch_size, cfg.micro_batch_size, cfg.dp_size
    if mini <= 0 or micro <= 0 or cfg.ppo_epochs <= 0:
        raise ValueError(f"mini_batch_size={mini}, micro_batch_size={micro} and ppo_epochs={cfg.ppo_epochs} must all be positive")
    if not 0 <= cfg.dp_rank < ranks:
        raise ValueError(f"dp_rank={cfg.dp_rank} must be in [0, dp_size={ranks})")
    if batch_size % mini:
        raise ValueError(
            f"batch of {batch_size} samples is not divisible by mini_batch_size={mini} (ppo_mini_batch_size x rollout.n)"
        )
    if mini % ranks:
        raise ValueError(f"mini_batch_size={mini} is not divisible by dp_size={ranks}")
    group = cfg.group_size()
    if (mini // ranks) % group:
        raise ValueError(
            f"loss {cfg.loss_mode!r} trains groups of {group} samples in one micro-batch; each rank's share of a "
            f"mini-batch, {mini // ranks} samples, must be a multiple of {group}"
        )
    if micro % group:
        raise ValueError(
            f"loss {cfg.loss_mode!r} trains groups of {group} samples in one micro-batch; micro_batch_size={micro} "
            f"(actor.ppo_micro_batch_size_per_gpu) must be a multiple of {group}"
        )


def local_schedule(batch_size: int, cfg: PPOUpdateConfig) -> list[list[Tensor]]:
    """This rank's sample indices, per (PPO epoch x mini-batch), in the order `ppo_update` trains them.

    The permutation depends only on `cfg.seed`, so every rank draws the same one and takes its own slice of each
    mini-batch. A caller that holds only some samples reads the indices it needs from here first.
    """
    _check_sizes(batch_size, cfg)
    group = cfg.group_size()  # divides micro, hence the batch: groups are never split
    generator = torch.Generator().manual_seed(cfg.seed)
    shares = []
    for _ in range(cfg.ppo_epochs):
        n_groups = batch_size // group
        groups = torch.randperm(n_groups, generator=generator) if cfg.shuffle else torch.arange(n_groups)
        order = groups if group == 1 else (groups[:, None] * group + torch.arange(group)).flatten()
        shares.extend(mini.chunk(cfg.dp_size)[cfg.dp_rank] for mini in order.split(cfg.mini_batch_size))
    return shares


def _take(batch: Mapping[str, Any], idx: Tensor) -> dict[str, Any]:
    """Rows ``idx`` of every tensor (batch dim first); non-tensor entries pass through unchanged."""
    out: dict[str, Any] = {}
    for key, value in batch.items():
        out[key] = value[idx.to(value.device)] if isinstance(value, Tensor) else value
    return out


def _loss_inputs(
    name: str, needs: frozenset[str], out: StepOutput, micro: Mapping[str, Any], idx: Tensor, j: int, group: int
) -> LossInputs:
    """The record of window step ``j`` of the micro-batch of samples ``idx``: the declared fields only, the step's data
    moved to the device of ``out.log_prob``; a declared field the step function did not return is an error."""
    device = out.device
    values: dict[str, Any] = {}
    for key in needs - DATA_INPUTS:
        values[key] = getattr(out, key)
    if "old_log_prob" in needs:
        values["old_log_prob"] = micro["old_log_probs"][:, j].to(device)
    if "old_prev_sample_mean" in needs:
        values["old_prev_sample_mean"] = micro["old_prev_sample_means"][:, j].to(device)
    if "rollout_weight" in needs:  # decoupled rollout correction's weights [B, W] (None: off, or bypass mode's below)
        values["rollout_weight"] = micro["rollout_weights"][:, j].to(device) if "rollout_weights" in micro else None
    if "rewards" in needs:
        values["rewards"] = micro["rewards"].to(device)
    if "advantages" in needs:
        adv = micro["advantages"]
        values["advantages"] = (adv[:, j] if adv.dim() == 2 else adv).to(device)
    if "pair_index" in needs:
        values["pair_index"] = (idx // group).to(device)
    missing = sorted(key for key, value in values.items() if value is None and key not in OPTIONAL_INPUTS)
    if missing:
        raise ValueError(
            f"loss {name!r} needs {missing} but step_fn returned none; compute them in the step function (a KL term's "
            "reference values, for one) or turn the term that needs them off (kl_coef=0)"
        )
    return LossInputs(**values)


def ratio_by_level(ratio: Tensor, level: Tensor, n_levels: int, clip_ratio: float) -> dict[str, Tensor]:
    """Statistics of the importance ratios ``ratio [b]`` of one (micro-batch, window step) call per staleness level.

    ``level [b]`` is each sample's level index in ``[0, n_levels)``. Returns ``sum``, ``count``, ``clipped`` (how
    many have ``|r - 1| > clip_ratio``, as ``pg_clipfrac`` counts them), ``min`` and ``max``, each ``[n_levels]`` on
    ``ratio``'s device (a level without a sample here: count 0, min +inf, max -inf). Tensors, so that summing them
    over the calls of a step needs no device sync.
    """
    zeros = ratio.new_zeros(n_levels)
    return {
        "sum": zeros.index_add(0, level, ratio),
        "count": zeros.index_add(0, level, torch.ones_like(ratio)),
        "clipped": zeros.index_add(0, level, ((ratio - 1.0).abs() > clip_ratio).to(ratio.dtype)),
        "min": ratio.new_full((n_levels,), math.inf).scatter_reduce(0, level, ratio, "amin"),
        "max": ratio.new_full((n_levels,), -math.inf).scatter_reduce(0, level, ratio, "amax"),
    }


def _add_ratio_stats(total: dict[str, Tensor], stats: dict[str, Tensor]) -> None:
    """Fold one call's ``ratio_by_level`` into the step's running ``total`` (in place)."""
    combine = {"min": torch.minimum, "max": torch.maximum}
    for key, value in stats.items():
        total[key] = combine.get(key, torch.add)(total[key], value) if key in total else value


def _ratio_metrics(levels: Tensor, total: dict[str, Tensor]) -> dict[str, float]:
    """``training/off_policy/ratio/staleness_{level:g}/{mean,min,max,clipfrac}`` of every level this rank trained."""
    stats = {key: value.cpu().tolist() for key, value in total.items()}
    metrics: dict[str, float] = {}
    for i, level in enumerate(levels.tolist()):
        count = stats["count"][i]
        if count == 0:  # another rank's samples only: its figures come from that rank
            continue
        prefix = f"training/off_policy/ratio/staleness_{level:g}"
        metrics[f"{prefix}/mean"] = stats["sum"][i] / count
        metrics[f"{prefix}/min"] = stats["min"][i]
        metrics[f"{prefix}/max"] = stats["max"][i]
        metrics[f"{prefix}/clipfrac"] = stats["clipped"][i] / count
    return metrics


def ppo_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    batch: Mapping[str, Any],
    *,
    step_fn: StepFn,
    cfg: PPOUpdateConfig,
    scaler: torch.amp.GradScaler | None = None,
    no_grad_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    steps_fn: StepsFn | None = None,
) -> dict[str, float]:
    """Run one training step of Flow-GRPO updates on a batch of trajectories.

    Args:
        model: the trained module (its trainable parameters are grad-clipped; set to train mode).
        optimizer: stepped once per mini-batch.
        lr_scheduler: stepped once at the end of the call (or None).
        batch: ``latents [B, W+1, *latent]``, ``timesteps [B, W]``, ``old_log_probs [B, W]`` (or, for a loss that
            declares no old log-probs, ``window``: W), ``advantages [B]`` (or ``[B, W]``), ``old_prev_sample_means
            [B, W, *latent]`` when the loss declares them, optionally ``staleness [B]`` (each sample's, in model
            versions: off-policy batches), plus any conditioning tensors with batch dim first.
        step_fn: ``step_fn(micro_batch, j) -> StepOutput`` for window step ``j`` (see StepOutput).
        cfg: sizes and loss knobs.
        scaler: a gradient scaler for fp16 compute (losses scaled before backward, gradients unscaled
            before clipping; an overflowing step is skipped and the scale lowered), or None.
        no_grad_sync: with data-parallel ranks (`cfg.dp_size > 1`), a context in which a backward does not
            average gradients over the ranks (DDP's `no_sync`): every backward of a mini-batch but its last runs
            in it, so the ranks average once per optimizer step.
        steps_fn: ``steps_fn(micro_batch, [j, ...]) -> [StepOutput, ...]``, several window steps in one forward, for
            ``cfg.steps_per_forward`` > 1 (``window_chunks``): their losses are summed before one backward.

    Returns:
        Means over all (micro-batch, step) calls of the loss's metrics, for flow_grpo ``actor/pg_loss``, ``actor/pg_clipfrac``,
        ``actor/pg_clipfrac_higher``, ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``,
        ``actor/ratio_mean``, ``actor/ratio_std``, ``actor/kl_loss`` (0 when off); the mean over
        mini-batches of ``actor/grad_norm`` (before clipping); ``actor/lr`` used by this step;
        ``actor/skipped_optimizer_steps``, how many optimizer steps were skipped for non-finite
        gradients; ``actor/grad_scale`` after the step when a scaler is given. With ``staleness`` in the batch,
        also ``training/off_policy/ratio/staleness_{level:g}/{mean,min,max,clipfrac}`` over every (sample,
        window step) of each staleness level this rank trained: the ratio ``exp(logp_now - old_log_prob)`` the
        loss sees (before clipping) and the share of it outside ``1 +- clip_ratio``.
    """
    loss_fn = get_policy_loss(cfg.loss_mode)
    settings = cfg.loss_settings()
    needs = check_declared(cfg.loss_mode, loss_fn, settings)  # what the loss reads: nothing else is assembled
    group = loss_fn.group_size
    batch_size = next(v for v in batch.values() if isinstance(v, Tensor)).shape[0]
    window = batch["old_log_probs"].shape[1] if "old_log_probs" in batch else int(batch["window"])
    shares = local_schedule(batch_size, cfg)
    chunks = window_chunks(window, cfg.steps_per_forward)
    if any(len(c) > 1 for c in chunks) and steps_fn is None:
        raise ValueError(f"steps_per_forward={cfg.steps_per_forward} needs steps_fn (several window steps in one forward)")
    params = [p for p in model.parameters() if p.requires_grad]
    lr = float(optimizer.param_groups[0]["lr"])
    if cfg.dp_size > 1 and no_grad_sync is None:
        raise ValueError(f"dp_size={cfg.dp_size} needs no_grad_sync (DDP's no_sync) to average once per mini-batch")

    levels = torch.unique(batch["staleness"]) if "staleness" in batch else None  # sorted
    ratio_stats: dict[str, Tensor] = {}
    sums: dict[str, Tensor] = {}
    n_terms = 0
    grad_norms: list[float] = []
    skipped = 0
    corr_sums: dict[str, float] = {}
    model.train()
    optimizer.zero_grad(set_to_none=True)
    for share in shares:
        micro_batches = share.split(cfg.micro_batch_size)
        for m, micro_idx in enumerate(micro_batches):
            micro = _take(batch, micro_idx)
            # Every backward adds |micro| / (|share| * W) of the micro-batch's mean loss: gradients then equal those
            # of the mean over the rank's share of the mini-batch and its window steps, whatever the micro-batch split
            # (the last micro-batch may be smaller: algorithm.filter_zero_std_groups shrinks the mini-batches); the
            # ranks' average is the mean over the whole mini-batch. Equal micro-batches: 1 / (n_micro * W) exactly.
            scale = len(micro_idx) / (len(share) * window)
            for steps in chunks:
                last = m == len(micro_batches) - 1 and steps[-1] == window - 1
                sync = contextlib.nullcontext() if last or no_grad_sync is None else no_grad_sync()
                with sync:
                    # One forward for the chunk's window steps (`steps_per_forward`), their losses summed, one backward.
                    outs = [step_fn(micro, steps[0])] if len(steps) == 1 else steps_fn(micro, steps)  # type: ignore[misc]
                    total: Tensor | None = None
                    for j, out in zip(steps, outs, strict=True):
                        inputs = _loss_inputs(cfg.loss_mode, needs, out, micro, micro_idx, j, group)
                        if cfg.bypass_correction is not None and "rollout_weight" in needs:
                            assert out.log_prob is not None
                            rollout_j = micro["old_log_probs"][:, j].to(out.log_prob.device)  # bypass: old == rollout
                            weight, corr = cfg.bypass_correction.bypass(out.log_prob.detach().float(), rollout_j.float())
                            inputs.rollout_weight = weight
                            for key, value in corr.items():
                                corr_sums[key] = corr_sums.get(key, 0.0) + value
                        loss, metrics = loss_fn(inputs, settings)
                        total = loss * scale if total is None else total + loss * scale
                        # Kept as tensors: a float() per step would sync the device every step.
                        for key, value in metrics.items():
                            sums[key] = sums[key] + value if key in sums else value
                        n_terms += 1
                        if levels is not None:
                            assert out.log_prob is not None
                            old_j = micro["old_log_probs"][:, j].to(out.log_prob.device)
                            ratio = torch.exp(out.log_prob.detach().float() - old_j.float())
                            level = torch.searchsorted(levels, micro["staleness"]).to(ratio.device, non_blocking=True)
                            _add_ratio_stats(ratio_stats, ratio_by_level(ratio, level, len(levels), cfg.clip_ratio))
                    assert total is not None
                    (scaler.scale(total) if scaler is not None else total).backward()
        grad_norm, applied = _optimizer_step(optimizer, params, cfg.grad_clip, scaler)
        grad_norms.append(grad_norm)
        skipped += not applied
    if lr_scheduler is not None:
        lr_scheduler.step()

    result = {f"actor/{key}": float(value) / max(n_terms, 1) for key, value in sums.items()}
    result.update({f"actor/rollout_corr/{key}": value / max(n_terms, 1) for key, value in corr_sums.items()})
    result["actor/grad_norm"] = sum(grad_norms) / len(grad_norms)
    result["actor/lr"] = lr
    result["actor/skipped_optimizer_steps"] = float(skipped)
    if scaler is not None:
        result["actor/grad_scale"] = float(scaler.get_scale())
    if levels is not None and ratio_stats:
        result.update(_ratio_metrics(levels, ratio_stats))
    return result


def _optimizer_step(
    optimizer: torch.optim.Optimizer, params: list[Tensor], grad_clip: float, scaler: torch.amp.GradScaler | None = None
) -> tuple[float, bool]:
    """Clip, step and zero the grads; returns the pre-clip global grad norm and whether the step was applied.

    A non-finite norm skips the step (as verl's actors do) instead of writing nan into the weights; with
    a scaler (fp16) that is an overflow, after which the scaler lowers its scale.
    """
    max_norm = grad_clip if grad_clip and grad_clip > 0 else math.inf
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2 shards: a DTensor
    applied = math.isfinite(grad_norm)
    if scaler is not None:
        scaler.step(optimizer)  # skips the step itself when the unscaled gradients are not finite
        scaler.update()
    elif applied:
        optimizer.step()
    else:
        logger.warning("grad_norm is %s; skipping this optimizer step", grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, applied


# --------------------------------------------------------------------------------------------------
# Builders, each from one config section (``actor_rollout_ref.actor.optim``), duck-typed.
# --------------------------------------------------------------------------------------------------


def _field(section: Any, name: str) -> Any:
    if isinstance(section, Mapping):
        if name not in section:
            raise KeyError(f"optimizer config has no field {name!r}")
        return section[name]
    if not hasattr(section, name):
        raise AttributeError(f"optimizer config {type(section).__name__} has no field {name!r}")
    return getattr(section, name)


def build_optimizer(optim_cfg: Any, params: Iterable[Tensor]) -> torch.optim.AdamW:
    """AdamW over the trainable ``params``, reading ``lr``, ``betas``, ``weight_decay``."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("build_optimizer got no parameters with requires_grad=True")
    betas = tuple(float(b) for b in _field(optim_cfg, "betas"))
    return torch.optim.AdamW(
        trainable,
        lr=float(_field(optim_cfg, "lr")),
        betas=(betas[0], betas[1]),
        weight_decay=float(_field(optim_cfg, "weight_decay")),
    )


def build_lr_scheduler(
    optim_cfg: Any, optimizer: torch.optim.Optimizer, total_training_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then constant or cosine decay to 0, stepped once per training step.

    Reads ``lr_scheduler_type`` (``constant`` | ``cosine``) and ``lr_warmup_steps`` (-1 or 0 = no
    warm-up). The multiplier after ``s`` scheduler steps follows the HF / verl convention:
    ``s / warmup`` while ``s < warmup`` (so the very first step runs at lr 0), then 1 (constant) or
    ``0.5 * (1 + cos(pi * (s - warmup) / (total - warmup)))`` (cosine, 0 at ``s = total``).
    """
    kind = str(_field(optim_cfg, "lr_scheduler_type"))
    warmup = int(_field(optim_cfg, "lr_warmup_steps"))
    if warmup < -1:
        raise ValueError(f"lr_warmup_steps={warmup} must be -1 (none), 0 (none) or positive")
    warmup = max(warmup, 0)
    if kind not in ("constant", "cosine"):
        raise ValueError(f"unknown lr_scheduler_type {kind!r}; choose one of ['constant', 'cosine']")
    if kind == "cosine" and total_training_steps <= 0:
        raise ValueError(f"cosine schedule needs total_training_steps > 0, got {total_training_steps}")
    decay_steps = max(1, total_training_steps - warmup)

    def multiplier(step: int) -> float:
        if step < warmup:
            return step / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / decay_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
