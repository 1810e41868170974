"""`PolicyTrainer`: the trained policy, its optimizer and LR schedule, and one training step on given trajectories.

Owns what a training step computes: the old log-probs (in the micro-batch layout of the update, so the first
on-policy ratio is exactly 1 in fp32), the reference policy's predictions the active loss declares
(`omni_core.algorithms.loss_contract`), `ppo_update`, the EMA of the weights and the count of non-finite steps. It
takes trajectories and advantages and gives / takes state dicts; it reads no TransferQueue, starts no Ray actor,
forms no process group and knows no checkpoint folder. A plain Python component (like a torchtune component):
`PolicyTrainer(config, total_training_steps).train_on(traj, advantages, step)` trains in-process.

With several data-parallel ranks the owner of the process group (`workers.training_actor`) wraps the transformer
(`ddp`, or shards it: `sharded`) and sets `gather`, which all-gathers the values of the no-grad passes by sample.

Placement and precision come from `omni_core.models.placement`: fp32 master weights and optimizer state, the
forward/backward under autocast in `actor.fsdp_config.dtype`, and a gradient scaler when that is fp16.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from omni_core.algorithms.diffusion_dpo import preferred, sample_train_steps
from omni_core.algorithms.diffusion_nft import forward_process, old_policy_decay, refresh_old_policy, select_train_timesteps
from omni_core.algorithms.ema import WeightsEMA
from omni_core.algorithms.loss_contract import (
    FORWARD_PROCESS_INPUTS,
    REFERENCE_INPUTS,
    TEACHER_INPUTS,
    check_declared,
    forward_sigmas,
)
from omni_core.algorithms.registry import get_policy_loss
from omni_core.algorithms.rollout_correction import RolloutCorrection
from omni_core.algorithms.update import (
    NonFiniteTrainingError,
    PPOUpdateConfig,
    StepOutput,
    build_lr_scheduler,
    build_optimizer,
    local_schedule,
    nonfinite_metrics,
    ppo_update,
    window_chunks,
)
from omni_core.algorithms.zero_std_filter import mini_batches_per_update
from omni_core.config import OmniFlowConfig
from omni_core.distributed import fsdp2
from omni_core.models import lora
from omni_core.models.placement import training_policy_kwargs
from omni_core.models.policy import FlowPolicy
from omni_core.records import ONE_UPDATE, LocalUpdate
from omni_core.rollout.sampler import TransitionScore, derive_sample_seed, score_window_steps
from omni_core.rollout.trajectory import Trajectory

logger = logging.getLogger(__name__)

# Gather(own sample indices, their values [n, ...], batch size) -> [batch size, ...] with every rank's values.
Gather = Callable[[list[int], torch.Tensor, int], torch.Tensor]

# A forward-process step's noise: the seed of sample `i` at its step `j` is derive_sample_seed(data_loader_seed, global
# step, FORWARD_NOISE_INDEX - i, j), prompt indices no rollout uses (theirs are >= 0), so it is drawn apart from every
# rollout noise and does not depend on the rank or micro-batch that trains the sample. A loss whose points lie on the
# training schedule (Diffusion-DPO) draws one per group `g` (samples g*k .. g*k+k-1) from the seed of "sample" g, step
# j: its noise, then its training-schedule index.
FORWARD_NOISE_INDEX = -2

# The stored trajectory's values a loss may declare, for the rows `part` at window step `j`.
TRAJECTORY_INPUTS: dict[str, Callable[[Trajectory, int], torch.Tensor]] = {
    "latents": lambda part, j: part.latents[:, j],
    "next_latents": lambda part, j: part.latents[:, j + 1],
    "sigma": lambda part, j: part.sigmas[:, j],
    "next_sigma": lambda part, j: part.sigmas[:, j + 1],
    "final_latents": lambda part, j: part.latents[:, -1],
    "sqrt_dt": lambda part, j: (part.sigmas[:, j] - part.sigmas[:, j + 1]).clamp_min(0).sqrt(),
}


def rollout_probs_diff(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> dict[str, float]:
    """verl's `training/rollout_probs_diff_{max,mean}`: |rollout log-prob - recomputed old log-prob| over every
    sample and window step; empty when the rollout did not record its log-probs (`calculate_log_probs=false`)."""
    if not torch.isfinite(rollout_log_probs).all():
        return {}
    diff = (rollout_log_probs.float() - old_log_probs.float()).abs()
    return {"training/rollout_probs_diff_max": diff.max().item(), "training/rollout_probs_diff_mean": diff.mean().item()}


class PolicyTrainer:
    """The trained policy + optimizer + LR schedule (+ EMA) of one rank, and its training step."""

    def __init__(
        self,
        config: OmniFlowConfig,
        total_training_steps: int,
        *,
        text_encoders: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        """`text_encoders=True` keeps the pipeline's text encoders (to sample prompts in-process); `rank` of
        `world_size` data-parallel ranks (the caller forms their group and sets `gather`)."""
        self.config = config
        self.total_training_steps = total_training_steps
        self.text_encoders = text_encoders
        self.rank, self.world_size = rank, world_size
        self.loss = get_policy_loss(config.actor_rollout_ref.actor.diffusion_loss.loss_mode)
        self.correction: RolloutCorrection | None = None  # set below, once the loss's inputs are known
        # What the active loss reads (the update computes nothing else; the reference pass runs only if declared).
        self.needs = check_declared(self.update_config(0).loss_mode, self.loss, self.update_config(0).loss_settings())
        # A forward-process loss (DiffusionNFT) trains on noised final samples, not on the stored transitions.
        self.forward_process = bool(self.needs & FORWARD_PROCESS_INPUTS)
        rc = config.algorithm.rollout_correction
        correction = RolloutCorrection(
            rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize, rc.rollout_rs, rc.rollout_rs_threshold
        )
        # verl's rollout correction: decoupled (weights from the old pass, once per update) or bypass mode (per step).
        self.correction = correction if correction.enabled and "rollout_weight" in self.needs else None
        self.ddp: torch.nn.Module | None = None  # DistributedDataParallel over the transformer (the group's owner sets it)
        self.sharded = False  # the transformer is FSDP2-sharded
        self.gather: Gather | None = None  # all-gather by sample (set with several ranks)
        # Training steps in a row whose loss or grad norm was not finite. Not cleared by `build`: a retried epoch
        # that hits the same fault fails at its first such step; a finite step clears it.
        self.nonfinite_streak = 0
        self._train_schedule: tuple[torch.Tensor, torch.Tensor] | None = None  # the scheduler's (a training-schedule loss)
        self.build()

    # ------------------------------------------------------------------------------- building
    def build(self) -> None:
        """The policy from the base model, the reference when the loss declares one, the optimizer, scaler and EMA."""
        arr = self.config.actor_rollout_ref
        torch.manual_seed(arr.actor.data_loader_seed)  # LoRA init is random
        kwargs = training_policy_kwargs(self.config) | {"text_encoders": self.text_encoders}
        self.policy = FlowPolicy.from_model_config(arr.model, **kwargs)
        if self.needs & REFERENCE_INPUTS:
            self.policy.ensure_reference()  # before any sharding: the reference stays a whole, frozen copy
        if self.needs & TEACHER_INPUTS:  # on-policy distillation: a third, frozen transformer (verl-omni's teacher)
            teacher = self.config.distillation.teacher_models.teacher_model
            self.policy.load_teacher(teacher.model_path, teacher.revision)
        # torch.compile wraps the modules as they are at each forward: FSDP2 later shards the wrapped transformer in
        # place, and a DDP wrapper gets a wrapper of its own at its first forward.
        if arr.actor.use_torch_compile:
            self.policy.enable_torch_compile()
        self.sharded = False
        self.build_optimizer()
        # fp16 gradients underflow without loss scaling; bf16 and fp32 need none.
        fp16 = self.policy.compute_dtype == torch.float16 or self.policy.dtype == torch.float16
        self.grad_scaler = torch.amp.GradScaler(self.policy.device.type) if fp16 else None
        self.version = 0  # the global step whose update produced the current weights
        ema = arr.actor.ema  # the moving average of the trained weights (validation and export use it)
        self.ema = WeightsEMA(self.trainable_state(), ema.decay, ema.start_step, ema.update_interval) if ema.enable else None
        # DiffusionNFT's old policy (model.policy_state_adapters [default, old]): a copy of the trainable state, the
        # trained one's at the start, refreshed after updates by algorithm.old_policy_*.
        keeps_old = "old" in arr.model.policy_state_adapters
        self.old_policy = {k: v.detach().clone() for k, v in self.trainable_state().items()} if keeps_old else None
        # Where the trained values wait while the old policy is swapped in (every forward-process step): made once.
        self._trained_aside = {k: torch.empty_like(v) for k, v in self.old_policy.items()} if keeps_old else None
        self._old_policy_in = False

    def build_optimizer(self) -> None:
        """AdamW and its LR schedule over the current trainable parameters (FSDP2 replaces them with shards)."""
        optim = self.config.actor_rollout_ref.actor.optim
        self.optimizer = build_optimizer(optim, self.policy.trainable_parameters())
        self.lr_scheduler = build_lr_scheduler(optim, self.optimizer, self.total_training_steps)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The trainable state's live tensors (no copy), keyed as `state_dict()["model"]`."""
        if self.policy.is_lora:
            return lora.lora_state(self.policy.transformer)
        return self.policy.base_transformer.state_dict()

    # ------------------------------------------------------------------------------- state dicts
    def state_dict(self, optimizer: bool = True) -> dict[str, Any]:
        """`model` (the trainable state), `version`, `ema` (when kept) and, with `optimizer`, `optimizer`,
        `lr_scheduler` and `grad_scaler` (fp16 compute). Torch's optimizer state holds the live moment tensors:
        deep-copy (or save) the result to keep it past the next step."""
        state: dict[str, Any] = {"model": self.policy.state_dict_for_checkpoint(), "version": self.version}
        if optimizer:
            state |= {"optimizer": self.optimizer.state_dict(), "lr_scheduler": self.lr_scheduler.state_dict()}
            if self.grad_scaler is not None:
                state["grad_scaler"] = self.grad_scaler.state_dict()
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        if self.old_policy is not None:
            state["old_policy"] = dict(self.old_policy)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load the entries of `state` that are there (as `state_dict` names them). The config's optimizer
        hyperparameters win over the loaded ones (`apply_optim_config`). With `model` but no `ema`, a kept average
        starts again at the loaded weights."""
        if "model" in state:
            self.policy.load_trainable_state(state["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        if "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
            self.apply_optim_config()
        if self.grad_scaler is not None and "grad_scaler" in state:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        if "version" in state:
            self.version = int(state["version"])
        if self.ema is not None and "ema" in state:
            self.ema.load_state_dict(state["ema"])
        elif self.ema is not None and "model" in state:
            self.ema = WeightsEMA(self.trainable_state(), self.ema.decay, self.ema.start_step, self.ema.update_interval)
        if self.old_policy is not None and "old_policy" in state:
            refresh_old_policy(self.old_policy, state["old_policy"], 0.0)
        elif self.old_policy is not None and "model" in state:  # no old policy saved: it starts at the loaded weights
            refresh_old_policy(self.old_policy, self.trainable_state(), 0.0)

    @contextlib.contextmanager
    def old_policy_loaded(self) -> Iterator[None]:
        """Within: the policy's trainable tensors hold the old policy (DiffusionNFT); the trained values, kept aside,
        are copied back on exit, bit for bit."""
        if self.old_policy is None or self._trained_aside is None:
            raise RuntimeError("no old policy is kept: set actor_rollout_ref.model.policy_state_adapters=[default,old]")
        if self._old_policy_in:  # the one aside buffer would then hold the old values, not the trained ones
            raise RuntimeError("old_policy_loaded() does not nest")
        live = self.trainable_state()
        refresh_old_policy(self._trained_aside, live, 0.0)
        refresh_old_policy(live, self.old_policy, 0.0)
        self._old_policy_in = True
        try:
            yield
        finally:
            refresh_old_policy(live, self._trained_aside, 0.0)
            self._old_policy_in = False

    def refresh_old_policy(self, global_step: int) -> dict[str, float]:
        """After the update of `global_step`: `old <- d old + (1 - d) trained` every `algorithm.old_policy_update_interval`
        steps, `d` from `old_policy_decay` / `old_policy_decay_schedule`. Its metrics (empty without an old policy)."""
        if self.old_policy is None:
            return {}
        algo = self.config.algorithm
        if global_step % algo.old_policy_update_interval:
            return {"actor/old_policy_refreshed": 0.0}
        decay = old_policy_decay(global_step, algo.old_policy_decay_schedule, algo.old_policy_decay)
        refresh_old_policy(self.old_policy, self.trainable_state(), decay)
        return {"actor/old_policy_refreshed": 1.0, "actor/old_policy_decay": decay}

    def apply_optim_config(self) -> None:
        """Set lr / betas / weight_decay from the config over a loaded optimizer state (whose values were the
        checkpoint's); the scheduler's `base_lrs` follow, and the current lr is the new base lr times the
        schedule's multiplier at its restored step."""
        optim = self.config.actor_rollout_ref.actor.optim
        lr = float(optim.lr)
        self.lr_scheduler.base_lrs = [lr for _ in self.optimizer.param_groups]
        for group, factor in zip(self.optimizer.param_groups, self.lr_scheduler.lr_lambdas, strict=True):
            group["initial_lr"] = lr
            group["lr"] = lr * factor(self.lr_scheduler.last_epoch)
            group["betas"] = (float(optim.betas[0]), float(optim.betas[1]))
            group["weight_decay"] = float(optim.weight_decay)
        self.lr_scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------------------- the no-grad passes
    def update_config(self, global_step: int, local: LocalUpdate = ONE_UPDATE, batch_size: int | None = None) -> PPOUpdateConfig:
        """The update's knobs at `global_step`; `local`: which of the step's local updates (separate_async runs
        `parameter_sync_step` of them, each on its share of the prompts as one mini-batch). `batch_size`: the samples
        the update trains, which `algorithm.filter_zero_std_groups` makes smaller than the step's: the mini-batches
        keep their number (data.train_batch_size / ppo_mini_batch_size) and shrink."""
        actor, n = self.config.actor_rollout_ref.actor, self.config.actor_rollout_ref.rollout.n
        # A prompt's samples in the update: rollout.n, or its one (chosen, rejected) pair (verl-omni's paired update).
        per_prompt = 2 if self.config.algorithm.paired_preference else n
        mini_batch_size = actor.ppo_mini_batch_size // local.count * per_prompt
        if self.config.algorithm.filter_zero_std_groups and batch_size is not None:
            mini_batch_size = batch_size // mini_batches_per_update(self.config.data.train_batch_size, actor.ppo_mini_batch_size)
        return PPOUpdateConfig(
            mini_batch_size=mini_batch_size,
            micro_batch_size=actor.ppo_micro_batch_size_per_gpu,
            ppo_epochs=actor.ppo_epochs,
            clip_ratio=actor.diffusion_loss.clip_ratio,
            adv_clip_max=actor.diffusion_loss.adv_clip_max,
            kl_coef=actor.kl_loss_coef if actor.use_kl_loss else 0.0,
            grad_clip=actor.grad_clip,
            shuffle=actor.shuffle,
            seed=actor.data_loader_seed + local.seed_step(global_step),
            loss_mode=actor.diffusion_loss.loss_mode,
            kl_type=actor.kl_loss_type,
            distill_coef=actor.distill_loss_coef if actor.use_distill_loss else 0.0,
            distill_mode=actor.distill_loss_mode,
            steps_per_forward=actor.window_steps_per_forward,
            dp_rank=self.rank,
            dp_size=self.world_size,
            # A loss's own keys; algorithm.adv_mode is DiffusionNFT's mapping of advantages (its loss reads it).
            loss_options=actor.diffusion_loss.model_dump() | {"adv_mode": self.config.algorithm.adv_mode},
            bypass_correction=self.correction if self.config.algorithm.rollout_correction.bypass_mode else None,
        )

    def score(self, traj: Trajectory, j: int, use_reference: bool = False, use_teacher: bool = False) -> TransitionScore:
        """Window step `j` of `traj` re-scored under the policy (or its reference, or the distillation teacher)."""
        return self.score_steps(traj, [j], use_reference, use_teacher)[0]

    def score_steps(
        self, traj: Trajectory, steps: list[int], use_reference: bool = False, use_teacher: bool = False
    ) -> list[TransitionScore]:
        """Window steps `steps` of `traj` re-scored in one forward (`actor.window_steps_per_forward`); one step is
        exactly `score_transitions`."""
        rollout = self.config.actor_rollout_ref.rollout
        return score_window_steps(
            self.policy,
            traj,
            steps,
            guidance_scale=rollout.pipeline.guidance_scale,
            true_cfg_scale=rollout.pipeline.true_cfg_scale,
            noise_level=rollout.algo.noise_level,
            sde_type=rollout.algo.sde_type,
            use_reference=use_reference,
            use_teacher=use_teacher,
            detach_uncond=self.config.actor_rollout_ref.actor.detach_uncond_cfg,
        )

    def window_chunks(self, window: int) -> list[list[int]]:
        """The window steps each forward computes, in the update and in every no-grad pass (so they match)."""
        return window_chunks(window, self.config.actor_rollout_ref.actor.window_steps_per_forward)

    @torch.no_grad()
    def old_log_probs(self, traj: Trajectory, means: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Old log-probs `[B, W]` in micro-batches of `rollout.log_prob_micro_batch_size_per_gpu` (default: the
        update's own micro-batch, so that the first on-policy ratio is exactly 1 in fp32). With `means` (a dict),
        the same pass's transition means go into `means["old_prev_sample_mean"]`, `[B, W, *latent]` (for a loss that
        compares the current means with the old policy's: GRPO-Guard, Flow-DPPO)."""
        arr = self.config.actor_rollout_ref
        micro = arr.rollout.log_prob_micro_batch_size_per_gpu or arr.actor.ppo_micro_batch_size_per_gpu
        out = torch.empty_like(traj.log_probs)
        old_means = None if means is None else torch.empty(traj.latents[:, 1:].shape, dtype=torch.float32)
        for idx in torch.arange(traj.batch_size).split(micro):
            part = traj.index_select(idx).to(self.policy.device)  # once, not per window step
            for steps in self.window_chunks(traj.window_size):
                for j, scored in zip(steps, self.score_steps(part, steps), strict=True):
                    out[idx, j] = scored.log_prob.float().cpu()
                    if old_means is not None:
                        old_means[idx, j] = scored.prev_sample_mean.float().cpu()
        if means is not None:
            means["old_prev_sample_mean"] = old_means
        bad = (~torch.isfinite(out).all(dim=1)).nonzero().flatten().tolist()
        if bad:
            dtype = arr.actor.fsdp_config.compute_dtype
            raise RuntimeError(
                f"the recomputed old log-probs of samples {bad[:8]} are not finite (training compute dtype "
                f"actor_rollout_ref.actor.fsdp_config.dtype={dtype}); train in float32 or bfloat16, or lower the learning rate"
            )
        return out

    @torch.no_grad()
    def reference_predictions(self, traj: Trajectory) -> dict[str, torch.Tensor]:
        """The reference policy's values the loss declares, each `[B, W, *latent]`: `ref_prev_sample_mean` (its
        transition means) and / or `ref_velocity`, and the distillation teacher's `teacher_prev_sample_mean` or
        `teacher_velocity` (verl-omni's teacher scoring: the teacher replays each stored transition); in micro-batches of
        `ref.log_prob_micro_batch_size_per_gpu` (default: the update's micro-batch), as verl's ref pass. Empty when the
        loss declares none."""
        arr = self.config.actor_rollout_ref
        micro = arr.ref.log_prob_micro_batch_size_per_gpu or arr.actor.ppo_micro_batch_size_per_gpu
        # key -> (the TransitionScore field, which model scores it)
        fields = {
            "ref_prev_sample_mean": ("prev_sample_mean", "reference"),
            "ref_velocity": ("velocity", "reference"),
            "teacher_prev_sample_mean": ("prev_sample_mean", "teacher"),
            "teacher_velocity": ("velocity", "teacher"),
        }
        wanted = [key for key in fields if key in self.needs]
        out = {key: torch.empty(traj.latents[:, 1:].shape, dtype=torch.float32) for key in wanted}
        models = sorted({fields[key][1] for key in wanted})
        for idx in torch.arange(traj.batch_size).split(micro) if wanted else []:
            part = traj.index_select(idx).to(self.policy.device)
            for steps in self.window_chunks(traj.window_size):
                for model in models:
                    scores = self.score_steps(part, steps, use_reference=model == "reference", use_teacher=model == "teacher")
                    for j, scored in zip(steps, scores, strict=True):
                        for key in wanted:
                            if fields[key][1] == model:
                                out[key][idx, j] = getattr(scored, fields[key][0]).float().cpu()
        return out

    # ------------------------------------------------------------------------------- the training step
    def local_samples(self, batch_size: int, global_step: int, local: LocalUpdate = ONE_UPDATE) -> list[int]:
        """The step's sample indices this rank trains on (all of them on one rank), sorted."""
        shares = local_schedule(batch_size, self.update_config(global_step, local, batch_size))
        return sorted({int(i) for share in shares for i in share})

    def first_epoch_samples(self, batch_size: int, global_step: int, local: LocalUpdate = ONE_UPDATE) -> list[int]:
        """This rank's slices of the first PPO epoch's mini-batches, in training order (ranks: a partition)."""
        shares = local_schedule(batch_size, self.update_config(global_step, local, batch_size))
        per_epoch = len(shares) // self.config.actor_rollout_ref.actor.ppo_epochs
        return [int(i) for share in shares[:per_epoch] for i in share]

    def by_sample(self, own: list[int], values: torch.Tensor, batch_size: int) -> torch.Tensor:
        """`[batch_size, ...]` from the `values` of samples `own` (NaN elsewhere) and, with several ranks, every other
        rank's (through `gather`)."""
        if self.world_size > 1:
            assert self.gather is not None, "several ranks need gather (set by the owner of the process group)"
            return self.gather(own, values, batch_size)
        out = torch.full((batch_size, *values.shape[1:]), float("nan"), dtype=values.dtype)
        out[own] = values
        return out

    def train_on(
        self,
        traj: Trajectory | None,
        advantages: torch.Tensor,
        global_step: int,
        samples: list[int] | None = None,
        staleness: torch.Tensor | None = None,
        local: LocalUpdate = ONE_UPDATE,
    ) -> dict[str, float]:
        """Old log-probs (or the rollout's, in bypass mode), the reference pass the loss declares, then the update of
        one training step (`local`: one of its local updates; the moving average folds after the last). `advantages` covers the step's whole batch; `traj` holds its rows `samples` (default: all,
        in order), which include every sample of this rank's slices (`local_samples`). `staleness` (None: on-policy),
        one value per sample of the whole batch, adds the importance-ratio statistics per staleness level. An empty
        batch (`algorithm.filter_zero_std_groups` found no group with a reward spread; `traj` None) makes no update."""
        t0 = time.perf_counter()
        batch_size = advantages.shape[0]
        if batch_size == 0:
            return self._finish_step(self._idle_update({"actor/zero_std_idle_step": 1.0}), global_step, local, t0, t0)
        assert traj is not None
        rows = list(range(batch_size)) if samples is None else list(samples)
        # The batch is indexed by the step's sample number; `row_of` finds a sample's row in `traj` (-1: another rank's).
        row_of = torch.full((batch_size,), -1, dtype=torch.long)
        row_of[rows] = torch.arange(len(rows))
        # The no-grad passes run on this rank's first-epoch slices: a partition of the batch into equal parts (the
        # ranks' forwards pair up, as FSDP2's all-gathers need), in the micro-batches the update's first forwards
        # use (so the first ratio is exactly 1); a gather gives every rank every sample's values.
        own = self.first_epoch_samples(batch_size, global_step, local) if self.world_size > 1 else rows
        part = traj.index_select(row_of[own])
        # A preference loss reads the pairs' rewards (the controller passes them in place of advantages).
        values = "rewards" if "rewards" in self.needs else "advantages"
        batch: dict[str, Any] = {values: advantages.float(), "sample": torch.arange(batch_size)}
        drift: dict[str, float] = {}
        if "old_log_prob" in self.needs or staleness is not None:
            bypass = self.config.algorithm.rollout_correction.bypass_mode
            means: dict[str, torch.Tensor] | None = {} if "old_prev_sample_mean" in self.needs else None
            if bypass and means is not None:  # refused by validation (omni_core.validation.algorithm)
                raise ValueError("the loss compares the old policy's transition means, which bypass mode does not compute")
            old_own = part.log_probs if bypass else self.old_log_probs(part, means)
            drift = {} if bypass else rollout_probs_diff(part.log_probs, old_own)
            batch["old_log_probs"] = self.by_sample(own, old_own.float(), batch_size)
            if means is not None:
                batch["old_prev_sample_means"] = self.by_sample(own, means["old_prev_sample_mean"], batch_size)
            if self.correction is not None and not bypass:  # decoupled: old (recomputed) against the rollout's
                rollout = self.by_sample(own, part.log_probs.float(), batch_size)
                weights, corrected = self.correction.decoupled(batch["old_log_probs"], rollout)
                if weights is not None:
                    batch["rollout_weights"] = weights
                drift.update({f"rollout_corr/{key}": value for key, value in corrected.items()})
        elif self.forward_process and forward_sigmas(self.loss) == "train_schedule":
            batch["window"] = 1  # one forward-process point per group
        elif self.forward_process:  # each sample's forward-process steps: a subset of the rollout's schedule
            fraction = self.config.algorithm.timestep_fraction
            seed = derive_sample_seed(self.config.actor_rollout_ref.actor.data_loader_seed, global_step, FORWARD_NOISE_INDEX, -1)
            batch["train_steps"] = select_train_timesteps(
                traj.window_size, batch_size, fraction, torch.Generator().manual_seed(seed)
            )
            batch["window"] = batch["train_steps"].shape[1]
        else:
            batch["window"] = traj.window_size
        refs = (
            {}
            if self.forward_process
            else {k: self.by_sample(own, v, batch_size) for k, v in self.reference_predictions(part).items()}
        )
        if self.sharded:
            # FSDP2 keeps the root's parameters gathered after a forward; gathered under no_grad they would carry no
            # gradient back to the shards (the root's gradients came out None): gather them again in the update.
            self.policy.transformer.reshard()
        t1 = time.perf_counter()

        # The current micro-batch's rows, selected and moved to the device once for its W window steps (ppo_update
        # passes one dict per micro-batch to each of them).
        selected: dict[str, Any] = {}
        wanted = [key for key in TRAJECTORY_INPUTS if key in self.needs]

        def steps_fn(mb: dict[str, Any], steps: list[int]) -> list[StepOutput]:
            if selected.get("micro_batch") is not mb:
                selected.update(micro_batch=mb, part=traj.index_select(row_of[mb["sample"]]).to(self.policy.device))
            rows_part = selected["part"]
            outs = []
            for j, scored in zip(steps, self.score_steps(rows_part, steps), strict=True):
                out = StepOutput(log_prob=scored.log_prob, prev_sample_mean=scored.prev_sample_mean, std_dev_t=scored.std_dev_t)
                if "velocity" in self.needs:
                    out.velocity = scored.velocity
                for key, ref in refs.items():  # the reference policy's value for the same transition (no gradient)
                    setattr(out, key, ref[mb["sample"], j].to(scored.velocity.device))
                for key in wanted:
                    setattr(out, key, TRAJECTORY_INPUTS[key](rows_part, j))
                outs.append(out)
            return outs

        def step_fn(mb: dict[str, Any], j: int) -> StepOutput:
            return steps_fn(mb, [j])[0]

        def forward_step_fn(mb: dict[str, Any], j: int) -> StepOutput:
            if selected.get("micro_batch") is not mb:
                selected.update(micro_batch=mb, part=traj.index_select(row_of[mb["sample"]]).to(self.policy.device))
            steps = mb["train_steps"][:, j] if "train_steps" in mb else None
            return self.forward_process_step(selected["part"], mb["sample"], steps, j, global_step)

        if staleness is not None:
            batch["staleness"] = staleness.float()
        if values == "rewards" and not bool(preferred(advantages).any()):
            metrics = self._idle_update({"actor/dpo_idle_step": 1.0, "actor/dpo_tied_pairs": 1.0})
        else:
            metrics = self._update(batch, forward_step_fn if self.forward_process else step_fn, global_step, local, steps_fn)
        metrics.update(drift)
        return self._finish_step(metrics, global_step, local, t0, t1)

    def _finish_step(
        self, metrics: dict[str, float], global_step: int, local: LocalUpdate, t0: float, t1: float
    ) -> dict[str, float]:
        """After an update (or a step that made none): the non-finite count, the version, the moving average and the
        old policy after the step's last local update, the timings."""
        self.count_nonfinite(metrics, global_step)
        self.version = global_step
        if self.ema is not None and local.last:
            decay = self.ema.step(self.trainable_state(), global_step)
            metrics["actor/ema_decay"] = 0.0 if decay is None else decay  # 0: the average was not folded this step
        if local.last:
            metrics.update(self.refresh_old_policy(global_step))
        t2 = time.perf_counter()
        metrics["timing_s/old_log_prob"] = t1 - t0
        metrics["timing_s/update_actor"] = t2 - t1
        metrics["_train_s"] = t2 - t0
        return metrics

    def forward_process_step(
        self, part: Trajectory, samples: torch.Tensor, steps: torch.Tensor | None, j: int, global_step: int
    ) -> StepOutput:
        """Step `j` of a forward-process loss for the rows `part` (the step's samples `samples`): each sample's final
        latents noised at its point (`forward_points`), and the old (no gradient, when declared), reference (no gradient,
        when declared) and current policy's velocity there."""
        device = self.policy.device
        x0 = part.latents[:, -1]
        sigma, timestep, noise = self.forward_points(part, samples, steps, j, global_step)
        noise = noise.to(device)
        x_t, _ = forward_process(x0, noise, sigma.to(device))
        rollout = self.config.actor_rollout_ref.rollout
        height, width = part.images.shape[-2:]

        def predict(use_reference: bool = False) -> torch.Tensor:
            return self.policy.velocity(
                x_t,
                timestep,
                part.cond,
                rollout.pipeline.guidance_scale,
                use_reference=use_reference,
                height=height,
                width=width,
                detach_uncond=self.config.actor_rollout_ref.actor.detach_uncond_cfg,
                true_cfg_scale=rollout.pipeline.true_cfg_scale,
            )

        old_velocity = None
        if "old_velocity" in self.needs:
            with torch.no_grad(), self.old_policy_loaded():
                old_velocity = predict()
        ref_velocity = predict(use_reference=True) if "ref_velocity" in self.needs else None
        return StepOutput(
            velocity=predict(),
            old_velocity=old_velocity,
            ref_velocity=ref_velocity,
            final_latents=x0,
            forward_latents=x_t,
            forward_sigma=sigma.to(device),
            forward_noise=noise,
        )

    def forward_points(
        self, part: Trajectory, samples: torch.Tensor, steps: torch.Tensor | None, j: int, global_step: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's forward-process point at step `j`: (sigma `[b]`, timestep `[b]` in scheduler units, noise
        `[b, *latent]`), seeded by sample (`FORWARD_NOISE_INDEX`), so no rank or micro-batch split changes them.
        The rollout's schedule (DiffusionNFT): the sigma of the row's schedule step `steps`, its own noise. The training
        schedule (Diffusion-DPO): one point per group of `loss.group_size` samples, shared by them."""
        base = self.config.actor_rollout_ref.actor.data_loader_seed
        shape = part.latents.shape[2:]

        def generator(index: int) -> torch.Generator:
            return torch.Generator().manual_seed(derive_sample_seed(base, global_step, FORWARD_NOISE_INDEX - index, j))

        if forward_sigmas(self.loss) == "train_schedule":
            if self._train_schedule is None:
                self._train_schedule = self.policy.train_schedule()
            timesteps, sigmas = self._train_schedule
            group = self.loss.group_size
            points: dict[int, tuple[torch.Tensor, int]] = {}
            for g in sorted({int(i) // group for i in samples}):
                gen = generator(g)
                noise_g = torch.randn(shape, generator=gen)
                points[g] = (noise_g, int(sample_train_steps(timesteps.shape[0], gen, 1)[0]))
            chosen = [points[int(i) // group] for i in samples]
            index = torch.tensor([k for _, k in chosen])
            return sigmas[index], timesteps[index], torch.stack([n for n, _ in chosen])
        assert steps is not None, "a rollout-schedule loss trains the steps train_on selected"
        rows = torch.arange(part.batch_size)
        steps = steps.to(part.sigmas.device)
        noise = torch.stack([torch.randn(shape, generator=generator(int(i))) for i in samples])
        return part.sigmas[rows, steps], part.timesteps[rows, steps], noise

    def _idle_update(self, marks: dict[str, float]) -> dict[str, float]:
        """A step with nothing to learn (a preference step in which every pair tied; a step whose groups the zero-std
        filter all left out): no forward and no optimizer step (AdamW's momentum and weight decay would move the
        weights with no signal); the LR schedule moves on as after any step. `marks`: the metrics that say why."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return {
            **marks,
            "actor/lr": lr,
            "actor/grad_norm": 0.0,
            "actor/skipped_optimizer_steps": 0.0,
        }

    def _update(
        self,
        batch: dict[str, Any],
        step_fn: Callable[[dict[str, Any], int], StepOutput],
        global_step: int,
        local: LocalUpdate = ONE_UPDATE,
        steps_fn: Callable[[dict[str, Any], list[int]], list[StepOutput]] | None = None,
    ) -> dict[str, float]:
        """`ppo_update` through the data-parallel wrapper, if any (one rank: the transformer as is)."""
        self.policy.transformer.train()
        no_sync = self.ddp.no_sync if self.ddp is not None else None
        if self.sharded:
            no_sync = lambda: fsdp2.no_gradient_sync(self.policy.transformer)  # noqa: E731
        with self.policy.forward_through(self.ddp):  # DDP's forward, then the averaging backward
            metrics = ppo_update(
                self.policy.transformer,
                self.optimizer,
                self.lr_scheduler,
                batch,
                step_fn=step_fn,
                cfg=self.update_config(global_step, local, batch_size=int(batch["sample"].shape[0])),
                scaler=self.grad_scaler,
                no_grad_sync=no_sync,
                steps_fn=steps_fn,
            )
        self.policy.transformer.eval()
        return metrics

    def count_nonfinite(self, metrics: dict[str, float], global_step: int) -> None:
        """Count a step whose loss or grad norm is not finite (its optimizer steps were skipped); after
        `actor.max_consecutive_nonfinite_steps` in a row, raise `NonFiniteTrainingError` with the likely causes."""
        bad = nonfinite_metrics(metrics, scaled=self.grad_scaler is not None)
        self.nonfinite_streak = self.nonfinite_streak + 1 if bad else 0
        metrics["actor/nonfinite_streak"] = float(self.nonfinite_streak)
        if not bad:
            return
        arr = self.config.actor_rollout_ref
        limit = arr.actor.max_consecutive_nonfinite_steps
        logger.warning("step %d: %s not finite (%d of %d steps in a row allowed)", global_step, bad, self.nonfinite_streak, limit)
        if self.nonfinite_streak < limit:
            return
        raise NonFiniteTrainingError(
            f"step {global_step}: {' and '.join(bad)} not finite for {self.nonfinite_streak} training steps in a row "
            f"(actor_rollout_ref.actor.max_consecutive_nonfinite_steps={limit}); their optimizer steps were skipped, "
            f"so the weights are those of step {global_step - self.nonfinite_streak}. Likely causes: the learning rate "
            f"actor_rollout_ref.actor.optim.lr={arr.actor.optim.lr:g} is too high (try 10x lower, or a warm-up with "
            f"actor_rollout_ref.actor.optim.lr_warmup_steps); training compute in "
            f"actor_rollout_ref.actor.fsdp_config.dtype={arr.actor.fsdp_config.compute_dtype} (float16 overflows: use bfloat16 "
            f"or float32); a rollout in actor_rollout_ref.rollout.dtype={arr.rollout.dtype} that drifts from the trained "
            f"policy (use float32; see training/rollout_probs_diff_max); actor_rollout_ref.actor.grad_clip="
            f"{arr.actor.grad_clip:g}"
        )
