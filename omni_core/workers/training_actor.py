"""`TrainingActor`: the Ray actor shell around one training rank's `PolicyTrainer`.

verl's single-controller design: model state lives in long-lived workers, the controller only sends keys and
advantages. This shell owns what is about being a worker: it reads the step's trajectories from the TransferQueue
itself (latents and embeddings never pass through the controller), writes and reads its part of a checkpoint
(`global_step_N/actor/`), is a member of the ranks' process group, serves the weights to the rollout side, and
answers ping / pid / placement. The training itself (old log-probs, the reference pass, the update, EMA, the
non-finite count) is `workers.policy_trainer.PolicyTrainer`; the hybrid engine's rollout in this process is
`workers.colocated_rollout.ColocatedRollout`.

Several ranks (`trainer.n_gpus_per_node x trainer.nnodes` of these actors) form one `torch.distributed` group
(`join_process_group`, `workers.process_group`): DDP with `actor.strategy=ddp`, FSDP2 shards with `fsdp2`. Each rank
reads only the samples of its slices of the step's mini-batches; rank 0 writes the consolidated checkpoint files and
serves the weights (under fsdp2 every rank takes part in gathering them, and writes its shards).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from omni_core.algorithms.update import NonFiniteTrainingError
from omni_core.checkpoint.compat import export_only_message
from omni_core.checkpoint.files import read_tensors, read_torch_state, write_tensors, write_torch_state
from omni_core.checkpoint.layout import EMA_NAME, OLD_POLICY_NAME, CheckpointError
from omni_core.checkpoint.writer import check_free_space, disk_full_guard
from omni_core.config import OmniFlowConfig, config_from_dict
from omni_core.device import PROCESS_GROUP_BACKENDS
from omni_core.distributed import fsdp2, process_group
from omni_core.faults import is_peer_rank_lost
from omni_core.models.placement import module_placement
from omni_core.records import ONE_UPDATE, LocalUpdate
from omni_core.rollout.request import RolloutRequest
from omni_core.rollout.trajectory import Trajectory
from omni_core.workers.colocated_rollout import ColocatedRollout
from omni_core.workers.policy_trainer import PolicyTrainer, rollout_probs_diff
from omni_core.workers.rollout_worker import RolloutResult

__all__ = ["PROCESS_GROUP_BACKENDS", "PeerRankLostError", "TrainingActor", "rollout_probs_diff"]

logger = logging.getLogger(__name__)


class PeerRankLostError(RuntimeError):
    """A collective of a training step failed because another rank's process went away (gloo raises a plain
    RuntimeError "Connection closed by peer"). Retryable: the retried epoch resets the ranks and re-forms the group."""


def _delegated(name: str, settable: bool = False) -> property:
    """An attribute of the rank's `PolicyTrainer`, read (and written) through the actor."""
    setter = (lambda self, value: setattr(self.trainer, name, value)) if settable else None
    return property(lambda self: getattr(self.trainer, name), setter, doc=f"`PolicyTrainer.{name}`")


class TrainingActor:
    """One training rank: its `PolicyTrainer`, as a Ray actor. Created once per run from the flow process."""

    policy = _delegated("policy")
    optimizer = _delegated("optimizer")
    lr_scheduler = _delegated("lr_scheduler")
    grad_scaler = _delegated("grad_scaler")
    ema = _delegated("ema")
    version = _delegated("version", settable=True)
    nonfinite_streak = _delegated("nonfinite_streak")

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
        """`text_encoders=True` keeps the text encoders (in-process use that also samples with this policy). `rank` of
        `world_size` ranks: the group forms in `join_process_group`. `rollout_threads` (hybrid engine): this rank is
        also rollout worker `rank` (`generate`), on that many threads with the prompts of `prompt_embeddings`."""
        torch.set_num_threads(num_threads)
        self.config: OmniFlowConfig = config_from_dict(config)
        self.rank, self.world_size = rank, world_size
        self.strategy = self.config.actor_rollout_ref.actor.strategy
        self.group_generation: int | None = None
        self.trainer = PolicyTrainer(
            self.config, total_training_steps, text_encoders=text_encoders, rank=rank, world_size=world_size
        )
        self.trainer.gather = self._by_sample
        self.rollout = None
        if rollout_threads is not None:
            self.rollout = ColocatedRollout(self.config, rank, rollout_threads, num_threads, prompt_embeddings)

    # ------------------------------------------------------------------------------- hybrid engine
    def generate(self, request: RolloutRequest) -> RolloutResult:
        """This rank's rollout worker (verl's hybrid engine): sample, score and store `request` in this process,
        with the trained weights as they are now (no push); see `ColocatedRollout.generate`."""
        if self.rollout is None:
            raise RuntimeError("this training rank was started without a colocated rollout (actor_rollout_ref.hybrid_engine)")
        return self.rollout.generate(self.trainer, request, self.get_weights)

    # ------------------------------------------------------------------------------- state
    def get_version(self) -> int:
        return self.trainer.version

    def ping(self) -> int:
        return self.rank

    def pid(self) -> int:
        """The actor's process id (for observability and fault-injection tests)."""
        return os.getpid()

    def placement(self) -> dict[str, Any]:
        """Where the policy's modules are and in what dtype (for the placement tests and the dashboard)."""
        return module_placement(self.trainer.policy)

    def torch_compile_stats(self) -> dict[str, int]:
        """This process's torch.compile counters (`actor.use_torch_compile`): frames compiled, graphs, graph breaks."""
        return self.trainer.policy.torch_compile_stats()

    # ------------------------------------------------------------------------------- data-parallel group
    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0: this node's IP and a free TCP port, where the ranks meet to form their group."""
        return process_group.rendezvous_address()

    def join_process_group(self, address: str, port: int, generation: int, checkpoint: str | None = None) -> int:
        """Form the ranks' `torch.distributed` group anew (every rank calls this at once). A group of an earlier
        generation (before a rank was restarted) is destroyed first. ddp: wrap the transformer in
        DistributedDataParallel. fsdp2: rebuild the policy from the base model, shard it, and load `checkpoint`
        (a global_step_N folder; None: the base model) into the shards. Returns `generation`."""
        trainer = self.trainer
        trainer.ddp = None
        process_group.form_group(address, port, self.rank, self.world_size, trainer.policy.device)
        if self.strategy == "fsdp2":
            trainer.build()  # sharding is in place and one-way: start from whole weights
            fsdp2.shard_transformer(trainer.policy, self.world_size)
            trainer.build_optimizer()  # over the sharded parameters
            trainer.sharded = True
            if checkpoint is not None:
                self._load_sharded(checkpoint)
        else:
            trainer.ddp = process_group.wrap_ddp(trainer.policy.transformer, trainer.policy.device)
        self.group_generation = generation
        return generation

    def _load_sharded(self, checkpoint: str) -> None:
        actor = Path(checkpoint) / "actor"
        if not (actor / fsdp2.DCP_FOLDER).is_dir():
            raise CheckpointError(export_only_message(checkpoint))
        fsdp2.load_sharded(self.trainer.policy, self.trainer.optimizer, actor)
        version = int(read_torch_state(actor, "version")["version"])
        self.trainer.load_state_dict({"lr_scheduler": read_torch_state(actor, "lr_scheduler"), "version": version})

    def local_parameter_elements(self) -> dict[str, int]:
        """Elements of the transformer's parameters this rank holds ("local": 1/world of each under fsdp2) and
        in all ("global")."""
        params = list(self.trainer.policy.transformer.parameters())
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
        if self.trainer.sharded:
            return fsdp2.full_trainable_state(self.trainer.policy, self.rank)
        return self.trainer.policy.state_dict_for_checkpoint()

    def get_ema_weights(self) -> dict[str, torch.Tensor]:
        """The moving average of the weights (`actor.ema`), keyed as `get_weights`: what validation samples with."""
        if self.trainer.ema is None:
            raise RuntimeError("actor_rollout_ref.actor.ema.enable is false: there are no EMA weights")
        return self.trainer.ema.state_dict()

    # ------------------------------------------------------------------------------- checkpoint
    def reset(self, checkpoint: str | None) -> int:
        """Restart from `checkpoint` (a global_step_N folder), or from the base model when None.

        Used at start-up (resume) and by a retried epoch whose weights moved past its checkpoint. A checkpoint
        saved without the optimizer is export-only and refused before anything is loaded. The config's
        optimizer hyperparameters (lr, betas, weight_decay) win over the loaded state's: the controller logs
        a change (`checkpoint.compat`), `PolicyTrainer.load_state_dict` applies it.
        """
        if self.strategy == "fsdp2":
            raise RuntimeError("fsdp2 ranks restore together, in join_process_group(checkpoint=...)")
        if self.rollout is not None:
            self.rollout.invalidate()  # the colocated rollout copy follows the weights loaded here
        if checkpoint is None:
            self.trainer.build()  # a new transformer: the trainer forms the group again (join_process_group) before training
            self.trainer.ddp, self.group_generation = None, None
            return self.trainer.version
        actor = Path(checkpoint) / "actor"
        if not (actor / "optimizer.pt").is_file():
            raise CheckpointError(export_only_message(checkpoint))
        state: dict[str, Any] = {"model": read_tensors(actor, "model")}
        for name in ("optimizer", "lr_scheduler", "grad_scaler"):
            if (actor / f"{name}.pt").is_file():
                state[name] = read_torch_state(actor, name)
        state["version"] = int(read_torch_state(actor, "version")["version"])
        if self.trainer.ema is not None:
            if (actor / f"{EMA_NAME}.safetensors").is_file():
                state["ema"] = read_tensors(actor, EMA_NAME)
            else:  # a checkpoint of a run without EMA: the average starts at its weights
                logger.warning(
                    "%s has no EMA weights (%s.safetensors): the average starts at its trained weights", checkpoint, EMA_NAME
                )
        if self.trainer.old_policy is not None:
            if (actor / f"{OLD_POLICY_NAME}.safetensors").is_file():
                state["old_policy"] = read_tensors(actor, OLD_POLICY_NAME)
            else:  # a checkpoint of a run without one: the old policy starts at its trained weights
                logger.warning(
                    "%s has no old policy (%s.safetensors): it starts at the trained weights", checkpoint, OLD_POLICY_NAME
                )
        self.trainer.load_state_dict(state)
        return self.trainer.version

    def checkpoint_bytes(self) -> int:
        """About what `save` writes: the trainable state twice (safetensors + the diffusers copy) plus the
        optimizer state when saved (tensor bytes; headers and small files are in the writer's margin)."""
        trainer = self.trainer
        model = sum(t.numel() * t.element_size() for t in trainer.policy.state_dict_for_checkpoint().values())
        if trainer.ema is not None:  # ema.safetensors (fp32); the diffusers copy holds the average instead of the weights
            model += sum(t.numel() * t.element_size() for t in trainer.ema.average.values()) // 2
        if trainer.old_policy is not None:  # old_policy.safetensors
            model += sum(t.numel() * t.element_size() for t in trainer.old_policy.values()) // 2
        if "optimizer" not in self.config.actor_rollout_ref.actor.checkpoint.save_contents:
            return 2 * model
        optim = sum(
            v.numel() * v.element_size()
            for state in trainer.optimizer.state.values()
            for v in state.values()
            if torch.is_tensor(v)
        )
        return 2 * model + optim

    def save(self, tmp_dir: str) -> list[str]:
        """Write the actor's part of a checkpoint into `<tmp_dir>/actor/` (safetensors + torch state), after a check
        of free space against `checkpoint_bytes()`; running out of space anyway raises `DiskFullError`."""
        actor = Path(tmp_dir) / "actor"
        needed = self.checkpoint_bytes()
        check_free_space(tmp_dir, needed)
        with disk_full_guard(tmp_dir, needed=needed):
            actor.mkdir(parents=True, exist_ok=True)
            if self.trainer.sharded:
                return self._save_sharded(actor)
            state = self.trainer.state_dict(optimizer="optimizer" in self.config.actor_rollout_ref.actor.checkpoint.save_contents)
            written = [write_tensors(actor, "model", state["model"])]
            for name in (key for key in ("optimizer", "lr_scheduler", "grad_scaler") if key in state):
                written.append(write_torch_state(actor, name, state[name]))
            written.append(write_torch_state(actor, "version", {"version": state["version"]}))
            if "old_policy" in state:
                written.append(write_tensors(actor, OLD_POLICY_NAME, state["old_policy"]))
            # The transformer (or LoRA adapter) in diffusers / peft format, loadable with from_pretrained: the EMA
            # weights when they are kept (what validation samples with and export ships), else the trained weights.
            if "ema" in state:
                written.append(write_tensors(actor, EMA_NAME, state["ema"]))
                self.trainer.policy.save_pretrained(actor / "hf", state=state["ema"])
            else:
                self.trainer.policy.save_pretrained(actor / "hf")
        return [str(p) for p in written]

    def _save_sharded(self, actor: Path) -> list[str]:
        """fsdp2, on every rank: its shards of the model and AdamW state (`actor/dcp/`); rank 0 also writes the
        consolidated model (today's `model.safetensors` and the diffusers export), the LR schedule and the version."""
        policy = self.trainer.policy
        written = [str(p) for p in fsdp2.save_sharded(policy, self.trainer.optimizer, actor)]
        full = fsdp2.full_trainable_state(policy, self.rank)
        if self.rank == 0:
            written.append(str(write_tensors(actor, "model", full)))
            written.append(str(write_torch_state(actor, "lr_scheduler", self.trainer.lr_scheduler.state_dict())))
            written.append(str(write_torch_state(actor, "version", {"version": self.trainer.version})))
            policy.save_pretrained(actor / "hf", state=full)
        return written

    # ------------------------------------------------------------------------------- training
    def local_samples(self, batch_size: int, global_step: int, local: LocalUpdate = ONE_UPDATE) -> list[int]:
        """The step's sample indices this rank trains on (all of them on one rank), sorted."""
        return self.trainer.local_samples(batch_size, global_step, local)

    def train_step(
        self,
        partition: str,
        keys: list[str],
        advantages: torch.Tensor,
        global_step: int,
        staleness: torch.Tensor | None = None,
        local: LocalUpdate = ONE_UPDATE,
    ) -> dict[str, float]:
        """One training step (or one of its local updates, `local`) on the rows `keys` (sorted) of `partition`: old
        log-probs, PPO update. A data-parallel rank reads only the rows of its slices of the mini-batches. `staleness`
        (separate_async): each key's, in model versions, for the importance-ratio metrics per staleness level (see
        `train_on`)."""
        from omni_core.tq.client import get_trajectories

        t0 = time.perf_counter()
        samples = self.local_samples(len(keys), global_step, local) if keys else []  # none: every group filtered out
        traj = Trajectory.from_columns(get_trajectories(partition, [keys[i] for i in samples])) if samples else None
        metrics = self.train_on(traj, advantages, global_step, samples=samples, staleness=staleness, local=local)
        metrics["timing_s/old_log_prob"] += time.perf_counter() - t0 - metrics.pop("_train_s")
        return metrics

    def train_on(
        self,
        traj: Trajectory | None,
        advantages: torch.Tensor,
        global_step: int,
        samples: list[int] | None = None,
        staleness: torch.Tensor | None = None,
        local: LocalUpdate = ONE_UPDATE,
    ) -> dict[str, float]:
        """`PolicyTrainer.train_on`: old log-probs (or the rollout's, in bypass mode) then the update of one step.

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
            return self.trainer.train_on(traj, advantages, global_step, samples, staleness, local)
        except NonFiniteTrainingError:  # raised after the optimizer step was skipped: the weights are the last step's
            raise
        except Exception as exc:
            self.trainer.version = -1
            if self.world_size > 1:
                self.trainer.ddp, self.group_generation = None, None
                if is_peer_rank_lost(exc):
                    raise PeerRankLostError(
                        f"training rank {self.rank}: another rank's process went away during step {global_step} "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
                    ) from exc
            raise

    # The trainer's no-grad passes under their earlier names (tests and benchmarks call them on the actor).
    def _score(self, traj: Trajectory, j: int, use_reference: bool = False) -> Any:
        return self.trainer.score(traj, j, use_reference)

    def _old_log_probs(self, traj: Trajectory) -> torch.Tensor:
        return self.trainer.old_log_probs(traj)

    def _reference_targets(self, traj: Trajectory) -> torch.Tensor:
        """The reference's values the KL term compares with, `[B, W, *latent]` (means, or velocities)."""
        (values,) = self.trainer.reference_predictions(traj).values()
        return values

    def _by_sample(self, own: list[int], values: torch.Tensor, batch_size: int) -> torch.Tensor:
        """The trainer's gather: every rank's values of a step's no-grad pass, by sample."""
        return process_group.gather_by_sample(own, values, batch_size, self.trainer.policy.device, self.rank, self.world_size)
