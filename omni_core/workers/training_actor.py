"""`TrainingActor`: the long-lived holder of the trained transformer, its optimizer and LR schedule.

It runs as a Ray actor (verl's single-controller design: model state lives in workers, the
controller only sends keys and advantages). It reads the step's trajectories from the TransferQueue
itself, so latents and embeddings never pass through the controller, recomputes the old log-probs
in the same micro-batch layout as the update (so the first on-policy ratio is exactly 1 in fp32),
runs `ppo_update`, and saves / loads its part of a checkpoint (`global_step_N/actor/`).

Several ranks (`trainer.n_gpus_per_node x trainer.nnodes` of these actors) form one `torch.distributed` group
(NCCL on cuda, HCCL on npu, gloo on cpu; `join_process_group`). With `actor.strategy=ddp` the transformer is
wrapped in `DistributedDataParallel` (full parameters on each rank); with `fsdp2` it is sharded
(`workers.fsdp2`). Each rank reads from the TransferQueue only the samples of its slices of the step's
mini-batches (`algorithms.update.local_schedule`), recomputes the old log-probs of its first-epoch slices
(shared with the other ranks by an all-gather), and trains; the gradients are averaged once per mini-batch,
so every rank takes the same optimizer step as one rank would on the whole batch. Rank 0 writes the
checkpoint's consolidated files and serves the weights to the rollout side (under fsdp2 every rank takes
part in gathering them, and writes its shards).

Placement and precision come from `omni_core.models.placement`: the transformer on `trainer.device`
(the GPU Ray assigned), fp32 master weights and optimizer state, the forward/backward under autocast in
`actor.fsdp_config.dtype`, and a gradient scaler when that is fp16. Each step reports how far the
rollout's log-probs are from the recomputed old ones (`training/rollout_probs_diff_max|mean`), which is
where a reduced-precision rollout shows its drift.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from omni_core.algorithms.ema import WeightsEMA
from omni_core.algorithms.update import (
    NonFiniteTrainingError,
    PPOUpdateConfig,
    StepOutput,
    build_lr_scheduler,
    build_optimizer,
    local_schedule,
    nonfinite_metrics,
    ppo_update,
)
from omni_core.checkpoint.compat import export_only_message
from omni_core.checkpoint.files import read_tensors, read_torch_state, write_tensors, write_torch_state
from omni_core.checkpoint.layout import EMA_NAME, CheckpointError
from omni_core.checkpoint.writer import check_free_space, disk_full_guard
from omni_core.config import OmniFlowConfig, config_from_dict
from omni_core.device import PROCESS_GROUP_BACKENDS
from omni_core.faults import is_peer_rank_lost
from omni_core.models import lora
from omni_core.models.placement import module_placement, rollout_shares_trained_weights, training_policy_kwargs
from omni_core.models.policy import FlowPolicy
from omni_core.rollout.request import RolloutRequest
from omni_core.rollout.sampler import TransitionScore, score_transitions
from omni_core.rollout.trajectory import Trajectory
from omni_core.workers import fsdp2
from omni_core.workers.rollout_worker import RolloutResult, RolloutWorker

logger = logging.getLogger(__name__)

# A collective that waits this long for a rank fails instead of holding the others (a dead rank's peers
# usually fail at once: gloo sees the closed connection).
PROCESS_GROUP_TIMEOUT_S = 600


class RankRestartedError(RuntimeError):
    """A data-parallel rank was asked to train without a process group: Ray restarted its process mid-epoch.
    An infrastructure failure (`faults.is_retryable`): the retried epoch resets the ranks and forms the group."""


class PeerRankLostError(RuntimeError):
    """A collective of a training step failed because another rank's process went away (gloo raises a plain
    RuntimeError "Connection closed by peer"). Retryable: the retried epoch resets the ranks and re-forms the group."""


def rollout_probs_diff(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor) -> dict[str, float]:
    """verl's `training/rollout_probs_diff_{max,mean}`: |rollout log-prob - recomputed old log-prob| over every
    sample and window step; empty when the rollout did not record its log-probs (`calculate_log_probs=false`)."""
    if not torch.isfinite(rollout_log_probs).all():
        return {}
    diff = (rollout_log_probs.float() - old_log_probs.float()).abs()
    return {"training/rollout_probs_diff_max": diff.max().item(), "training/rollout_probs_diff_mean": diff.mean().item()}


class TrainingActor:
    """The trained policy + optimizer. Created once per run from the flow process (as a Ray actor)."""

    def __init__(
        self,
        config: dict[str, Any],
        total_training_steps: int,
        num_threads: int,
        text_encoders: bool = False,
        rank: int = 0,
        world_size: int = 1,
        rollout_threads: int | None = None,
        prompt_embeddings: str | None = None,
    ):
        """`text_encoders=True` keeps the pipeline's text encoders loaded, for in-process use that also samples
        with this policy (benchmarks/plain_loop.py); the Ray actor reads prompt embeddings from trajectories.
        `rank` of `world_size` data-parallel ranks: the group forms in `join_process_group`. `rollout_threads`
        (verl's hybrid engine): this rank is also rollout worker `rank` (`generate`), sampling on that many torch
        threads with the prompts of the `prompt_embeddings` file."""
        torch.set_num_threads(num_threads)
        self.num_threads, self.rollout_threads, self.prompt_embeddings = num_threads, rollout_threads, prompt_embeddings
        self._rollout: RolloutWorker | None = None  # the colocated rollout worker, made at the first `generate`
        self._rollout_version: int | None = None  # the weights version its own copy holds (None: to refresh)
        self.config: OmniFlowConfig = config_from_dict(config)
        self.total_training_steps = total_training_steps
        self.text_encoders = text_encoders
        self.rank, self.world_size = rank, world_size
        self.strategy = self.config.actor_rollout_ref.actor.strategy
        self.ddp: torch.nn.Module | None = None  # DistributedDataParallel over the transformer (strategy=ddp)
        self.sharded = False  # the transformer is FSDP2-sharded (strategy=fsdp2, once the group formed)
        self.group_generation: int | None = None
        # Training steps in a row whose loss or grad norm was not finite (`train_on`). Not cleared by `reset`:
        # a retried epoch that hits the same fault fails at its first such step; a finite step clears it, and a
        # restarted actor process starts from 0.
        self.nonfinite_streak = 0
        self._build()

    def _build(self) -> None:
        arr = self.config.actor_rollout_ref
        torch.manual_seed(self.config.actor_rollout_ref.actor.data_loader_seed)  # LoRA init is random
        kwargs = training_policy_kwargs(self.config) | {"text_encoders": self.text_encoders}
        self.policy = FlowPolicy.from_model_config(arr.model, **kwargs)
        if arr.actor.use_kl_loss:
            self.policy.ensure_reference()  # before any sharding: the reference stays a whole, frozen copy
        # torch.compile wraps the modules as they are at each forward: FSDP2 later shards the wrapped transformer in
        # place, and the DDP module that join_process_group makes gets a wrapper of its own at its first forward.
        if arr.actor.use_torch_compile:
            self.policy.enable_torch_compile()
        self.sharded = False
        self._build_optimizer()
        # fp16 gradients underflow without loss scaling; bf16 and fp32 need none.
        fp16 = self.policy.compute_dtype == torch.float16 or self.policy.dtype == torch.float16
        self.grad_scaler = torch.amp.GradScaler(self.policy.device.type) if fp16 else None
        self.version = 0  # the global step whose update produced the current weights
        ema = arr.actor.ema  # the moving average of the trained weights (validation and export use it)
        self.ema = WeightsEMA(self._trainable_state(), ema.decay, ema.start_step, ema.update_interval) if ema.enable else None

    def _trainable_state(self) -> dict[str, torch.Tensor]:
        """The trainable state's live tensors (no copy), keyed as `state_dict_for_checkpoint`."""
        if self.policy.is_lora:
            return lora.lora_state(self.policy.transformer)
        return self.policy.base_transformer.state_dict()

    # ------------------------------------------------------------------------------- hybrid engine
    def generate(self, request: RolloutRequest) -> RolloutResult:
        """This rank's rollout worker (verl's hybrid engine): sample, score and store `request` in this process,
        with the trained weights as they are now (no push), on `rollout_threads` torch threads; see
        `RolloutWorker.generate`."""
        if self.rollout_threads is None:
            raise RuntimeError("this training rank was started without a colocated rollout (actor_rollout_ref.hybrid_engine)")
        with self._ema_weights_loaded(request.weights_ema):
            worker = self._colocated_rollout()
            transformer = self.policy.transformer
            was_training = transformer.training
            transformer.eval()
            torch.set_num_threads(self.rollout_threads)
            try:
                return worker.generate(replace(request, weights=None, weights_version=None, weights_ema=False))
            finally:
                torch.set_num_threads(self.num_threads)
                transformer.train(was_training)

    @contextlib.contextmanager
    def _ema_weights_loaded(self, use_ema: bool) -> Iterator[None]:
        """Within (when `use_ema`): the policy holds the EMA weights (flow_grpo's copy_ema_to / copy_temp_to); the
        trained weights are put back on exit, and the colocated rollout copy refreshes either way."""
        if not use_ema:
            yield
            return
        if self.ema is None:
            raise RuntimeError("a request asked for the EMA weights but actor_rollout_ref.actor.ema.enable is false")
        trained = self.policy.state_dict_for_checkpoint()
        self.policy.load_trainable_state(self.ema.average)
        self._rollout_version = None
        try:
            yield
        finally:
            self.policy.load_trainable_state(trained)
            self._rollout_version = None

    def _colocated_rollout(self) -> RolloutWorker:
        """The rollout worker over the current weights: a view of the trained modules where that gives the same
        numbers as a rollout copy (`rollout_shares_trained_weights`), else a `rollout.dtype` copy refreshed here
        whenever the weights changed since it last sampled."""
        threads = self.rollout_threads or 1
        if rollout_shares_trained_weights(self.config, self.prompt_embeddings):
            stale = self._rollout is None or self._rollout.policy.transformer is not self.policy.transformer
            if stale:  # the first call, or `_build` made new modules
                assert self.prompt_embeddings is not None
                view = self.policy.sampling_view(self.prompt_embeddings)
                if self.config.actor_rollout_ref.rollout.use_torch_compile:
                    view.enable_torch_compile()
                config = self.config.model_dump(mode="json")
                self._rollout = RolloutWorker(config, self.rank, threads, policy=view, set_threads=False)
            return self._rollout
        if self._rollout is None:
            config = self.config.model_dump(mode="json")
            self._rollout = RolloutWorker(config, self.rank, threads, self.prompt_embeddings, set_threads=False)
        if self._rollout_version != self.version:
            self._rollout.set_weights(self.get_weights(), self.version)
            self._rollout_version = self.version
        return self._rollout

    def _build_optimizer(self) -> None:
        """AdamW and its LR schedule over the current trainable parameters (FSDP2 replaces them with shards)."""
        optim = self.config.actor_rollout_ref.actor.optim
        self.optimizer = build_optimizer(optim, self.policy.trainable_parameters())
        self.lr_scheduler = build_lr_scheduler(optim, self.optimizer, self.total_training_steps)

    # ------------------------------------------------------------------------------- state
    def get_version(self) -> int:
        return self.version

    def ping(self) -> int:
        return self.rank

    def pid(self) -> int:
        """The actor's process id (for observability and fault-injection tests)."""
        return os.getpid()

    def placement(self) -> dict[str, Any]:
        """Where the policy's modules are and in what dtype (for the placement tests and the dashboard)."""
        return module_placement(self.policy)

    def torch_compile_stats(self) -> dict[str, int]:
        """This process's torch.compile counters (`actor.use_torch_compile`): frames compiled, graphs, graph breaks."""
        return self.policy.torch_compile_stats()

    # ------------------------------------------------------------------------------- data-parallel group
    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0: this node's IP and a free TCP port, where the ranks meet to form their group."""
        import ray

        address = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((address, 0))
            return address, probe.getsockname()[1]

    def join_process_group(self, address: str, port: int, generation: int, checkpoint: str | None = None) -> int:
        """Form the ranks' `torch.distributed` group anew (every rank calls this at once). A group of an earlier
        generation (before a rank was restarted) is destroyed first. ddp: wrap the transformer in
        DistributedDataParallel. fsdp2: rebuild the policy from the base model, shard it, and load `checkpoint`
        (a global_step_N folder; None: the base model) into the shards. Returns `generation`."""
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = None
        if dist.is_initialized():
            dist.destroy_process_group()
        device = self.policy.device
        dist.init_process_group(
            backend=PROCESS_GROUP_BACKENDS[device.type],
            init_method=f"tcp://{address}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
        )
        if self.strategy == "fsdp2":
            self._build()  # sharding is in place and one-way: start from whole weights
            fsdp2.shard_transformer(self.policy, self.world_size)
            self._build_optimizer()  # over the sharded parameters
            self.sharded = True
            if checkpoint is not None:
                self._load_sharded(checkpoint)
        else:
            # Buffers are equal on every rank (same checkpoint); not broadcasting them keeps forwards free of
            # collectives, so ranks may run different numbers of no-grad forwards (old log-probs, reference).
            device_ids = [device.index or 0] if device.type == "cuda" else None
            self.ddp = DistributedDataParallel(self.policy.transformer, device_ids=device_ids, broadcast_buffers=False)
        self.group_generation = generation
        return generation

    def _load_sharded(self, checkpoint: str) -> None:
        actor = Path(checkpoint) / "actor"
        if not (actor / fsdp2.DCP_FOLDER).is_dir():
            raise CheckpointError(export_only_message(checkpoint))
        fsdp2.load_sharded(self.policy, self.optimizer, actor)
        self.lr_scheduler.load_state_dict(read_torch_state(actor, "lr_scheduler"))
        self._apply_optim_config()
        self.version = int(read_torch_state(actor, "version")["version"])

    def local_parameter_elements(self) -> dict[str, int]:
        """Elements of the transformer's parameters this rank holds ("local": 1/world of each under fsdp2) and
        in all ("global")."""
        params = list(self.policy.transformer.parameters())
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
        return {"local": local, "global": sum(p.numel() for p in params)}

    def get_group_generation(self) -> int | None:
        """The generation of the group this rank is in (None: none yet, e.g. after Ray restarted the process)."""
        return self.group_generation

    def attach_transfer_queue(self) -> None:
        """Join the cluster's TransferQueue (again, after a restart: the client of the dead one is dropped)."""
        from omni_core.tq.client import attach

        attach()

    def get_weights(self) -> dict[str, torch.Tensor]:
        """What the rollout side needs to follow the policy (full state, or the LoRA adapter). Sharded: every
        rank must call it (the shards are gathered onto rank 0, which returns them; the others return {})."""
        if self.sharded:
            return fsdp2.full_trainable_state(self.policy, self.rank)
        return self.policy.state_dict_for_checkpoint()

    def get_ema_weights(self) -> dict[str, torch.Tensor]:
        """The moving average of the weights (`actor.ema`), keyed as `get_weights`: what validation samples with."""
        if self.ema is None:
            raise RuntimeError("actor_rollout_ref.actor.ema.enable is false: there are no EMA weights")
        return self.ema.state_dict()

    def reset(self, checkpoint: str | None) -> int:
        """Restart from `checkpoint` (a global_step_N folder), or from the base model when None.

        Used at start-up (resume) and by a retried epoch whose weights moved past its checkpoint. A checkpoint
        saved without the optimizer is export-only and refused before anything is loaded. The config's
        optimizer hyperparameters (lr, betas, weight_decay) win over the loaded state's: the controller logs
        a change (`checkpoint.compat`), this applies it, and the LR schedule's base follows the new lr.
        """
        if self.strategy == "fsdp2":
            raise RuntimeError("fsdp2 ranks restore together, in join_process_group(checkpoint=...)")
        self._rollout_version = None  # the colocated rollout copy (if any) follows the weights loaded here
        if checkpoint is None:
            self._build()  # a new transformer: the trainer forms the group again (join_process_group) before training
            self.ddp, self.group_generation = None, None
            return self.version
        actor = Path(checkpoint) / "actor"
        if not (actor / "optimizer.pt").is_file():
            raise CheckpointError(export_only_message(checkpoint))
        self.policy.load_trainable_state(read_tensors(actor, "model"))
        self.optimizer.load_state_dict(read_torch_state(actor, "optimizer"))
        self.lr_scheduler.load_state_dict(read_torch_state(actor, "lr_scheduler"))
        self._apply_optim_config()
        if self.grad_scaler is not None and (actor / "grad_scaler.pt").is_file():
            self.grad_scaler.load_state_dict(read_torch_state(actor, "grad_scaler"))
        self.version = int(read_torch_state(actor, "version")["version"])
        if self.ema is not None:
            if (actor / f"{EMA_NAME}.safetensors").is_file():
                self.ema.load_state_dict(read_tensors(actor, EMA_NAME))
            else:  # a checkpoint of a run without EMA: the average starts at its weights
                self.ema = WeightsEMA(self._trainable_state(), self.ema.decay, self.ema.start_step, self.ema.update_interval)
                logger.warning(
                    "%s has no EMA weights (%s.safetensors): the average starts at its trained weights", checkpoint, EMA_NAME
                )
        return self.version

    def _apply_optim_config(self) -> None:
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

    def checkpoint_bytes(self) -> int:
        """About what `save` writes: the trainable state twice (safetensors + the diffusers copy) plus the
        optimizer state when saved (tensor bytes; headers and small files are in the writer's margin)."""
        model = sum(t.numel() * t.element_size() for t in self.policy.state_dict_for_checkpoint().values())
        if self.ema is not None:  # ema.safetensors (fp32); the diffusers copy holds the average instead of the weights
            model += sum(t.numel() * t.element_size() for t in self.ema.average.values()) // 2
        if "optimizer" not in self.config.actor_rollout_ref.actor.checkpoint.save_contents:
            return 2 * model
        optim = sum(
            v.numel() * v.element_size() for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)
        )
        return 2 * model + optim

    def save(self, tmp_dir: str) -> list[str]:
        """Write the actor's part of a checkpoint into `<tmp_dir>/actor/` (safetensors + torch state).

        Checks free space against `checkpoint_bytes()` first; a write that still runs out of space raises
        `DiskFullError` naming the folder (the controller's writer then removes the whole temp folder).
        """
        actor = Path(tmp_dir) / "actor"
        needed = self.checkpoint_bytes()
        check_free_space(tmp_dir, needed)
        with disk_full_guard(tmp_dir, needed=needed):
            actor.mkdir(parents=True, exist_ok=True)
            if self.sharded:
                return self._save_sharded(actor)
            contents = self.config.actor_rollout_ref.actor.checkpoint.save_contents
            written = [write_tensors(actor, "model", self.policy.state_dict_for_checkpoint())]
            if "optimizer" in contents:
                written.append(write_torch_state(actor, "optimizer", self.optimizer.state_dict()))
                written.append(write_torch_state(actor, "lr_scheduler", self.lr_scheduler.state_dict()))
                if self.grad_scaler is not None:
                    written.append(write_torch_state(actor, "grad_scaler", self.grad_scaler.state_dict()))
            written.append(write_torch_state(actor, "version", {"version": self.version}))
            # The transformer (or LoRA adapter) in diffusers / peft format, loadable with from_pretrained: the EMA
            # weights when they are kept (what validation samples with and export ships), else the trained weights.
            if self.ema is not None:
                ema_state = self.ema.state_dict()
                written.append(write_tensors(actor, EMA_NAME, ema_state))
                self.policy.save_pretrained(actor / "hf", state=ema_state)
            else:
                self.policy.save_pretrained(actor / "hf")
        return [str(p) for p in written]

    def _save_sharded(self, actor: Path) -> list[str]:
        """fsdp2, on every rank: its shards of the model and AdamW state (`actor/dcp/`); rank 0 also writes the
        consolidated model (today's `model.safetensors` and the diffusers export), the LR schedule and the version."""
        written = [str(p) for p in fsdp2.save_sharded(self.policy, self.optimizer, actor)]
        full = fsdp2.full_trainable_state(self.policy, self.rank)
        if self.rank == 0:
            written.append(str(write_tensors(actor, "model", full)))
            written.append(str(write_torch_state(actor, "lr_scheduler", self.lr_scheduler.state_dict())))
            written.append(str(write_torch_state(actor, "version", {"version": self.version})))
            self.policy.save_pretrained(actor / "hf", state=full)
        return written

    # ------------------------------------------------------------------------------- training
    def _update_config(self, global_step: int) -> PPOUpdateConfig:
        actor, n = self.config.actor_rollout_ref.actor, self.config.actor_rollout_ref.rollout.n
        kl = actor.kl_loss_coef if actor.use_kl_loss else 0.0
        return PPOUpdateConfig(
            mini_batch_size=actor.ppo_mini_batch_size * n,
            micro_batch_size=actor.ppo_micro_batch_size_per_gpu,
            ppo_epochs=actor.ppo_epochs,
            clip_ratio=actor.diffusion_loss.clip_ratio,
            adv_clip_max=actor.diffusion_loss.adv_clip_max,
            kl_coef=kl,
            grad_clip=actor.grad_clip,
            shuffle=actor.shuffle,
            seed=actor.data_loader_seed + global_step,
            loss_mode=actor.diffusion_loss.loss_mode,
            kl_type=actor.kl_loss_type,
            dp_rank=self.rank,
            dp_size=self.world_size,
        )

    def _score(self, traj: Trajectory, j: int, use_reference: bool = False) -> TransitionScore:
        rollout = self.config.actor_rollout_ref.rollout
        return score_transitions(
            self.policy,
            traj,
            j,
            guidance_scale=rollout.pipeline.guidance_scale,
            true_cfg_scale=rollout.pipeline.true_cfg_scale,
            noise_level=rollout.algo.noise_level,
            sde_type=rollout.algo.sde_type,
            use_reference=use_reference,
            detach_uncond=self.config.actor_rollout_ref.actor.detach_uncond_cfg,
        )

    @torch.no_grad()
    def _old_log_probs(self, traj: Trajectory) -> torch.Tensor:
        """Old log-probs `[B, W]` in micro-batches of `rollout.log_prob_micro_batch_size_per_gpu` (default: the
        update's own micro-batch, so that the first on-policy ratio is exactly 1 in fp32)."""
        arr = self.config.actor_rollout_ref
        micro = arr.rollout.log_prob_micro_batch_size_per_gpu or arr.actor.ppo_micro_batch_size_per_gpu
        out = torch.empty_like(traj.log_probs)
        for idx in torch.arange(traj.batch_size).split(micro):
            part = traj.index_select(idx).to(self.policy.device)  # once, not per window step
            for j in range(traj.window_size):
                out[idx, j] = self._score(part, j)[0].float().cpu()
        bad = (~torch.isfinite(out).all(dim=1)).nonzero().flatten().tolist()
        if bad:
            dtype = arr.actor.fsdp_config.dtype
            raise RuntimeError(
                f"the recomputed old log-probs of samples {bad[:8]} are not finite (training compute dtype "
                f"actor_rollout_ref.actor.fsdp_config.dtype={dtype}); train in float32 or bfloat16, or lower the learning rate"
            )
        return out

    @torch.no_grad()
    def _reference_targets(self, traj: Trajectory) -> torch.Tensor:
        """What the KL term compares with, under the reference policy, `[B, W, *latent]`: its transition means, or
        its velocities with `actor.kl_loss_type=velocity`; in micro-batches of `ref.log_prob_micro_batch_size_per_gpu`
        (default: the update's micro-batch), as verl's ref pass."""
        arr = self.config.actor_rollout_ref
        micro = arr.ref.log_prob_micro_batch_size_per_gpu or arr.actor.ppo_micro_batch_size_per_gpu
        velocity = arr.actor.kl_loss_type == "velocity"
        out = torch.empty(traj.latents[:, 1:].shape, dtype=torch.float32)
        for idx in torch.arange(traj.batch_size).split(micro):
            part = traj.index_select(idx).to(self.policy.device)
            for j in range(traj.window_size):
                scored = self._score(part, j, use_reference=True)
                out[idx, j] = (scored.velocity if velocity else scored.prev_sample_mean).float().cpu()
        return out

    def local_samples(self, batch_size: int, global_step: int) -> list[int]:
        """The step's sample indices this rank trains on (all of them on one rank), sorted."""
        shares = local_schedule(batch_size, self._update_config(global_step))
        return sorted({int(i) for share in shares for i in share})

    def train_step(
        self,
        partition: str,
        keys: list[str],
        advantages: torch.Tensor,
        global_step: int,
        staleness: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One training step on the rows `keys` (sorted) of `partition`: old log-probs, PPO update. A data-parallel
        rank reads only the rows of its slices of the mini-batches. `staleness` (separate_async): each key's, in
        model versions, for the importance-ratio metrics per staleness level (see `train_on`)."""
        from omni_core.tq.client import get_trajectories

        t0 = time.perf_counter()
        samples = self.local_samples(len(keys), global_step)
        traj = Trajectory.from_columns(get_trajectories(partition, [keys[i] for i in samples]))
        metrics = self.train_on(traj, advantages, global_step, samples=samples, staleness=staleness)
        metrics["timing_s/old_log_prob"] += time.perf_counter() - t0 - metrics.pop("_train_s")
        return metrics

    def train_on(
        self,
        traj: Trajectory,
        advantages: torch.Tensor,
        global_step: int,
        samples: list[int] | None = None,
        staleness: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """Old log-probs (or the rollout's, in bypass mode) then the PPO update of one training step.

        `advantages` covers the step's whole batch; `traj` holds its rows `samples` (default: all of them, in
        order), which must include every sample of this rank's slices (`local_samples`). `staleness` (None: an
        on-policy batch), like `advantages` one value per sample of the whole batch, adds the importance-ratio
        statistics per staleness level (`training/off_policy/ratio/staleness_*`, see `ppo_update`).

        A step that fails part-way may have updated some parameters (an optimizer step of an earlier
        mini-batch) and, with several ranks, leaves the group's collectives out of step: the rank then reports
        version -1 and no group, so the epoch that retries resets it to its checkpoint and re-forms the group.
        """
        if staleness is not None and staleness.shape != advantages.shape[:1]:  # before the step: nothing to undo
            raise ValueError(
                f"staleness has shape {tuple(staleness.shape)}; pass one value per sample of the step's batch, like "
                f"advantages: ({advantages.shape[0]},)"
            )
        try:
            return self._train_on(traj, advantages, global_step, samples, staleness)
        except NonFiniteTrainingError:  # raised after the optimizer step was skipped: the weights are the last step's
            raise
        except Exception as exc:
            self.version = -1
            if self.world_size > 1:
                self.ddp, self.group_generation = None, None
                if is_peer_rank_lost(exc):
                    raise PeerRankLostError(
                        f"training rank {self.rank}: another rank's process went away during step {global_step} "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
                    ) from exc
            raise

    def _train_on(
        self,
        traj: Trajectory,
        advantages: torch.Tensor,
        global_step: int,
        samples: list[int] | None,
        staleness: torch.Tensor | None = None,
    ) -> dict[str, float]:
        t0 = time.perf_counter()
        batch_size = advantages.shape[0]
        rows = list(range(batch_size)) if samples is None else list(samples)
        # The batch is indexed by the step's sample number; `row_of` finds a sample's row in `traj` (-1: another rank's).
        row_of = torch.full((batch_size,), -1, dtype=torch.long)
        row_of[rows] = torch.arange(len(rows))
        # The no-grad passes run on this rank's first-epoch slices: a partition of the batch into equal parts (the
        # ranks' forwards pair up, as FSDP2's all-gathers need), in the micro-batches the update's first forwards
        # use (so the first ratio is exactly 1); an all-gather gives every rank every sample's values.
        own = self._first_epoch_samples(batch_size, global_step) if self.world_size > 1 else rows
        part = traj.index_select(row_of[own])
        bypass = self.config.algorithm.rollout_correction.bypass_mode
        old_own = part.log_probs if bypass else self._old_log_probs(part)
        drift = {} if bypass else rollout_probs_diff(part.log_probs, old_own)
        old = self._by_sample(own, old_own.float(), batch_size)
        ref_targets = None  # the reference's transition means or velocities (actor.kl_loss_type)
        if self.config.actor_rollout_ref.actor.use_kl_loss:
            ref_targets = self._by_sample(own, self._reference_targets(part), batch_size)
        if self.sharded:
            # FSDP2 keeps the root's parameters gathered after a forward; gathered under no_grad they would carry no
            # gradient back to the shards (the root's gradients came out None): gather them again in the update.
            self.policy.transformer.reshard()
        t1 = time.perf_counter()

        # The current micro-batch's rows, selected and moved to the device once for its W window steps (ppo_update
        # passes one dict per micro-batch to each of them).
        selected: dict[str, Any] = {}

        def step_fn(mb: dict[str, Any], j: int) -> StepOutput:
            if selected.get("micro_batch") is not mb:
                selected.update(micro_batch=mb, part=traj.index_select(row_of[mb["sample"]]).to(self.policy.device))
            part = selected["part"]
            scored = self._score(part, j)
            out = StepOutput(log_prob=scored.log_prob, prev_sample_mean=scored.prev_sample_mean, std_dev_t=scored.std_dev_t)
            if ref_targets is not None:  # the reference policy's value for the same transition (no gradient)
                ref = ref_targets[mb["sample"], j].to(scored.velocity.device)
                if self.config.actor_rollout_ref.actor.kl_loss_type == "velocity":
                    out.velocity, out.ref_velocity = scored.velocity, ref
                else:
                    out.ref_prev_sample_mean = ref
            return out

        # ppo_update slices every tensor by sample; `sample` tells step_fn which samples it got.
        batch = {"old_log_probs": old, "advantages": advantages.float(), "sample": torch.arange(batch_size)}
        if staleness is not None:
            batch["staleness"] = staleness.float()
        self.policy.transformer.train()
        no_sync = self.ddp.no_sync if self.ddp is not None else None
        if self.sharded:
            no_sync = lambda: fsdp2.no_gradient_sync(self.policy.transformer)  # noqa: E731
        with self.policy.forward_through(self.ddp):  # DDP's forward, then the averaging backward (one rank: as is)
            metrics = ppo_update(
                self.policy.transformer,
                self.optimizer,
                self.lr_scheduler,
                batch,
                step_fn=step_fn,
                cfg=self._update_config(global_step),
                scaler=self.grad_scaler,
                no_grad_sync=no_sync,
            )
        metrics.update(drift)
        self.policy.transformer.eval()
        self._count_nonfinite(metrics, global_step)
        self.version = global_step
        if self.ema is not None:
            decay = self.ema.step(self._trainable_state(), global_step)
            metrics["actor/ema_decay"] = 0.0 if decay is None else decay  # 0: the average was not folded this step
        t2 = time.perf_counter()
        metrics["timing_s/old_log_prob"] = t1 - t0
        metrics["timing_s/update_actor"] = t2 - t1
        metrics["_train_s"] = t2 - t0
        return metrics

    def _first_epoch_samples(self, batch_size: int, global_step: int) -> list[int]:
        """This rank's slices of the first PPO epoch's mini-batches, in training order (ranks: a partition)."""
        shares = local_schedule(batch_size, self._update_config(global_step))
        per_epoch = len(shares) // self.config.actor_rollout_ref.actor.ppo_epochs
        return [int(i) for share in shares[:per_epoch] for i in share]

    def _by_sample(self, own: list[int], values: torch.Tensor, batch_size: int) -> torch.Tensor:
        """`[batch_size, ...]` from this rank's `values` of samples `own` and, with several ranks, every other
        rank's (all-gathered; the parts are equal in size)."""
        out = torch.full((batch_size, *values.shape[1:]), float("nan"), dtype=values.dtype)
        if self.world_size == 1:
            out[own] = values
            return out
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RankRestartedError(
                f"training rank {self.rank} of {self.world_size} has no process group (Ray restarted it); the epoch is "
                "retried from its checkpoint, which forms the group again"
            )
        device = self.policy.device  # NCCL gathers device tensors; gloo CPU ones
        index = torch.tensor(own, device=device)
        indices = [torch.empty_like(index) for _ in range(self.world_size)]
        parts = [torch.empty_like(values, device=device) for _ in range(self.world_size)]
        dist.all_gather(indices, index)
        dist.all_gather(parts, values.to(device).contiguous())
        for idx, part in zip(indices, parts, strict=True):
            out[idx.cpu()] = part.cpu()
        return out

    def _count_nonfinite(self, metrics: dict[str, float], global_step: int) -> None:
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
            f"actor_rollout_ref.actor.fsdp_config.dtype={arr.actor.fsdp_config.dtype} (float16 overflows: use bfloat16 "
            f"or float32); a rollout in actor_rollout_ref.rollout.dtype={arr.rollout.dtype} that drifts from the trained "
            f"policy (use float32; see training/rollout_probs_diff_max); actor_rollout_ref.actor.grad_clip="
            f"{arr.actor.grad_clip:g}"
        )
