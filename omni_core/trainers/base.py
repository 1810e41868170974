"""`PolicyGradientDiffusionTrainerV1`: the v1 controller with verl-omni's lifecycle; a mode is its rollout feed.

`init(train_records, val_records)` -> `_setup()` (dataloader, the training actor on Ray, checkpoint
resume; the tokenizer stays with `prepare_dataset`, which checked the prompts against it);
`init_agent_loop()` starts the rollout workers and gives them the weights; `fit(agent_loop_manager)` runs every
epoch through `fit_epoch(epoch)`, which is a function of (config, epoch, checkpoint): it can run on
any Ray worker, fail, and be retried. It
finds the run's actors by name, restores the controller state from the last checkpoint written
before the failure (reloading the actor if its weights moved past it), clears stale TransferQueue
rows and continues. One step (sync mode) follows docs/design.md section 1:

  prompts -> TQ (pending) -> rollout workers sample + score -> replay buffer (complete groups, oldest
  first) -> advantages -> old log-probs + PPO update in the training actor -> checkpoint -> weights to
  the rollout side -> validation -> metrics -> clear the step's rows.

A trainer mode (`modes.py`) is its rollout feed (`rollout_feed.py`): how the step's batch is sampled, when the
rollout side gets new weights, and what a checkpoint keeps of the queue; the steps above call it. A separate_async
step runs the sampling-to-update part `parameter_sync_step` times (the feed's `local_updates`, verl-omni's local
updates), each on its share of the step's prompt groups. The
controller's log lines go to `log_callback` as they happen (the Prefect layer forwards them to the run's log; omni_core knows nothing of Prefect), and
`close()` stops the run's actors and clears its TransferQueue rows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import ray
import torch

from omni_core import checkpoint as ckpt
from omni_core.agent_loop import AgentLoopManager, rollout_threads
from omni_core.algorithms.diffusion_dpo import preference_pairs, preferred
from omni_core.algorithms.flow_grpo import group_index_from_uids
from omni_core.algorithms.registry import compute_advantages
from omni_core.algorithms.zero_std_filter import SEED_PROMPT_INDEX, groups_to_train, mini_batches_per_update
from omni_core.checkpoint.compat import check_resume_config
from omni_core.config import ConfigError, OmniFlowConfig, to_yaml
from omni_core.data.dataloader import PromptDataLoader
from omni_core.data.prompts import PromptRecord
from omni_core.distributed.run_control import kill_run_actors, raise_if_stop_requested, start_run_control
from omni_core.distributed.worker_logs import ActorLogs
from omni_core.distributed.worker_pool import actor_options, create_pool, pool_wait_s, remove_pool
from omni_core.faults import is_out_of_memory, out_of_memory_error
from omni_core.records import EpochResult, LocalUpdate, RunInfo
from omni_core.reports.images import save_image_grid
from omni_core.resources import resource_plan, rollout_worker_count, standalone_rollout, uses_hybrid_engine
from omni_core.rewards.failures import check_failure_share
from omni_core.rollout.group_refill import group_refill_metrics
from omni_core.rollout.request import RolloutRequest
from omni_core.rollout.sampler import derive_sample_seed
from omni_core.rollout.sampling_params import SamplingParams
from omni_core.tq import client as tqc
from omni_core.tq.replay_buffer import SampledBatch, merge_batches
from omni_core.tracking import Timer, TrackerRun, Tracking, data_metrics, timing_metrics, tracker_run_id
from omni_core.trainers import run_length
from omni_core.validation.paths import checkpoint_folder_problems
from omni_core.workers.training_ranks import TrainingRanks

if TYPE_CHECKING:
    from omni_core.trainers.rollout_feed import RolloutFeed

logger = logging.getLogger("omni_core.trainer")

# Every wait is bounded (docs/design.md section 7).
ACTOR_CALL_TIMEOUT_S = 1800.0
ACTOR_RESTART_TIMEOUT_S = 600.0
# How long a log drain waits for the actors' buffers: after a step (idle actors answer in milliseconds; a busy
# separate_async rollout worker answers at a later drain) and at the end of an epoch.
LOG_DRAIN_WAIT_S = 1.0
LOG_DRAIN_WAIT_AT_EPOCH_END_S = 5.0


def step_advantages(algorithm: Any, rewards: torch.Tensor, failed: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """A training step's advantages `[B]` from its rewards, failure flags and prompt groups (each `[B]`), as `step`
    computes them: `algorithm.adv_estimator` over the samples whose reward did not fail; a failed sample gets advantage
    0 (no policy gradient) and stays out of the group statistics."""
    advantages = torch.zeros_like(rewards)
    ok = ~failed
    advantages[ok] = compute_advantages(algorithm, rewards[ok], group[ok])
    return advantages


def prompt_groups(trajectory_keys: list[str]) -> torch.Tensor:
    """The GRPO group id `[B]` of each trajectory key: its prompt uid, numbered in order of first appearance."""
    return group_index_from_uids([tqc.uid_of_key(key) for key in trajectory_keys])


def cpu_threads(parallel_workers: int, cores_taken: int = 0) -> int:
    """torch threads per busy worker so that busy threads add up to the cores left after `cores_taken` (Ray
    would set 1)."""
    return max(1, ((os.cpu_count() or 1) - cores_taken) // max(1, parallel_workers))


class PolicyGradientDiffusionTrainerV1:
    """Base v1 trainer; see the module docstring for the lifecycle. A mode sets `mode` and `feed_cls`."""

    mode: str = "base"
    feed_cls: type[RolloutFeed]

    def __init__(self, config: OmniFlowConfig, run: RunInfo):
        self.config = config
        self.run = run
        self.actor: Any = None  # rank 0 of `ranks`
        self.ranks: TrainingRanks | None = None
        self.agent_loop: AgentLoopManager | None = None
        self.dataloader: PromptDataLoader | None = None
        self.val_records: list[PromptRecord] = []
        self.global_step = 0
        self.resume_from: str | None = None
        self.tracking: Tracking | None = None
        self._val_grids: list[tuple[int, str, dict[str, float]]] = []
        # Called after every step with (global_step, total_steps, metrics); the Prefect layer updates
        # its progress artifact here (omni_core itself knows nothing of Prefect).
        self.step_callback: Callable[[int, int, dict[str, float]], None] | None = None
        # Called with (logging level, message) for every controller and worker log line, as it happens;
        # the Prefect layer sends them to the run's log. Without it they go to the `omni_core.trainer` logger.
        self.log_callback: Callable[[int, str], None] | None = None
        self._actor_logs = ActorLogs()  # the actors' own `omni_core` log records (omni_core.distributed.worker_logs)
        self._run_control: Any = None  # `omni_core.distributed.run_control.RunControl`, created by `init` (the flow process)
        self.feed = self.feed_cls(self)

    # ------------------------------------------------------------------------ sizes
    @property
    def steps_per_epoch(self) -> int:
        assert self.dataloader is not None
        return self.dataloader.steps_per_epoch

    @property
    def total_training_steps(self) -> int:
        return run_length.total_training_steps(self.config.trainer, self.steps_per_epoch)

    @property
    def end_epoch(self) -> int:
        """The epoch after the last one to run: epochs `start_epoch .. end_epoch - 1` remain.

        Not `trainer.total_epochs`: `trainer.total_training_steps` may end training mid-epoch, and a
        `val_only` run makes one epoch call that validates and trains nothing.
        """
        if self.config.trainer.val_only:
            return self.start_epoch + 1
        return -(-self.total_training_steps // self.steps_per_epoch)

    @property
    def start_epoch(self) -> int:
        return self.global_step // self.steps_per_epoch

    # ------------------------------------------------------------------------ init (flow process)
    def init(self, train_records: list[PromptRecord], val_records: list[PromptRecord]) -> None:
        """verl-omni's `init()`: `_setup()` (the rollout side gets its weights in `init_agent_loop`)."""
        self._setup(train_records, val_records)

    def _setup(self, train_records: list[PromptRecord], val_records: list[PromptRecord]) -> None:
        self._init_dataloader(train_records, val_records)
        # How the flow process asks a running epoch to stop. This handle owns the actor (it lives as long as the
        # trainer); a retried init keeps it (a second handle from get_if_exists would not own it).
        if self._run_control is None:
            self._run_control = start_run_control(self.run.names)
        self._init_training_actor()
        self._load_checkpoint()

    def restore_context(
        self, train_records: list[PromptRecord], val_records: list[PromptRecord], resume_from: str | None
    ) -> None:
        """Rebuild the controller in another process (a `fit_epoch` task): data, resume point, actors by name."""
        self._init_dataloader(train_records, val_records)
        self.resume_from = resume_from
        self.attach()

    def _init_dataloader(self, train_records: list[PromptRecord], val_records: list[PromptRecord]) -> None:
        data = self.config.data
        self.dataloader = PromptDataLoader(train_records, data.train_batch_size, shuffle=data.shuffle, seed=data.seed)
        self.val_records = val_records

    def _init_training_actor(self) -> None:
        if self.ranks is not None:
            return  # a retried init_trainer: keep the ranks (and their owning handles) of the failed try; `_restore` resets them
        names, plan = self.run.names, resource_plan(self.config)
        pool = create_pool(plan, names, pool_wait_s(self.config))
        options = [actor_options(pool, slot, plan) for slot in plan.training]
        # get_if_exists (in `create`): actors of this run started by another handle are reused instead of failing
        # on "name already taken".
        # separate_async: the rollout workers keep sampling while the ranks train, so the ranks get the other cores.
        standalone = standalone_rollout(self.config)
        busy_elsewhere = len(plan.rollout) * rollout_threads(standalone) if standalone else 0
        threads = cpu_threads(len(plan.training), busy_elsewhere)
        colocated = None
        if uses_hybrid_engine(self.config):  # each rank is also a rollout worker (verl's hybrid engine)
            colocated = {"rollout_threads": rollout_threads(standalone), "prompt_embeddings": self.run.prompt_embeddings}
        # The learning-rate schedule counts updates: separate_async runs parameter_sync_step of them per step (verl-omni).
        updates = self.total_training_steps * self.feed.local_updates
        self.ranks = TrainingRanks.create(self.config, names, plan, options, updates, threads, colocated)
        self.actor = self.ranks.leader
        self._start_agent_loop()  # the rollout workers load their model while the ranks load theirs

    def _start_agent_loop(self) -> None:
        """Start the rollout workers without waiting for them (`init_agent_loop` waits). A retried init keeps the
        workers (and their owning handles) its failed try started. Hybrid engine: the workers are the ranks. Offline
        samples: there are none."""
        if self.agent_loop is not None or not rollout_worker_count(self.config):
            return
        if uses_hybrid_engine(self.config):
            assert self.ranks is not None, "the hybrid engine's rollout workers are the training ranks: start them first"
            self.agent_loop = AgentLoopManager.in_training_ranks(self.ranks.handles, self.run.names)
            return
        plan = resource_plan(self.config)
        pool = create_pool(plan, self.run.names, pool_wait_s(self.config))
        options = [actor_options(pool, slot, plan) for slot in plan.rollout]
        self.agent_loop = AgentLoopManager.start(
            self.config.model_dump(mode="json"),
            self.run.names,
            options,
            rollout_threads(standalone_rollout(self.config)),  # never follows agent.num_workers (see agent_loop)
            self.run.prompt_embeddings,
        )

    def _load_checkpoint(self) -> None:
        """Resume point of the run (`trainer.resume_mode`); the actor is reset to it.

        Holding the folder's RunLock (the flow takes it before this stage): `.tmp_*` leftovers of a killed save
        are removed, the resume point is the newest checkpoint whose files match their manifest's sha256 (hashed
        once here, never per epoch), and it must fit the current config (`checkpoint.compat`: changed model /
        LoRA / dtype / world size are refused, changed optimizer hyperparameters are applied and logged).
        """
        t = self.config.trainer
        problems = checkpoint_folder_problems(self.config)
        if problems:
            raise ConfigError(problems)
        path = ckpt.resume_point(
            t.checkpoint_dir, t.resume_mode, t.resume_from_path, log_fn=lambda m: self.log(m, logging.WARNING)
        )
        if path is not None:
            for line in check_resume_config(path, self.config.model_dump(mode="json")):
                self.log(line, logging.WARNING)
            self.feed.check_resume(str(path))
        self.resume_from = str(path) if path else None
        self._restore(self.resume_from)

    def init_agent_loop(self) -> AgentLoopManager | None:
        """verl-omni's `init_agent_loop_manager()`: the rollout workers, given the current weights (None: offline
        samples, no rollout workers)."""
        self._start_agent_loop()
        if self.agent_loop is None:
            return None
        self.agent_loop.wait_ready()
        self.feed.publish_weights(self.global_step)
        return self.agent_loop

    # ------------------------------------------------------------------------ attach / close (any process)
    def attach(self) -> None:
        """Find the run's actors by name (a `fit_epoch` task on a Ray worker) and join the TQ."""
        names, t = self.run.names, self.config.trainer
        self.ranks = TrainingRanks.attach(names, t.n_gpus_per_node * t.nnodes, self.config.actor_rollout_ref.actor.strategy)
        self.actor = self.ranks.leader
        workers = rollout_worker_count(self.config)
        self.agent_loop = AgentLoopManager.attach(names, workers, uses_hybrid_engine(self.config)) if workers else None
        tqc.attach()

    def close(self) -> None:
        """Stop the run's actors and drop its TransferQueue rows (a shared controller keeps none of a
        finished run). Safe after a partial `init` and in a `finally` (with Ray up): what was never started
        is skipped."""
        for partition in (self.run.train_partition, self.run.val_partition):
            try:
                tqc.clear_partition(partition)
            except Exception as exc:  # the TQ may already be gone (e.g. its controller died)
                logger.debug("could not clear %s: %s", partition, exc)
        if self.agent_loop is not None:
            self.agent_loop.close()
        if self.ranks is not None:
            self.ranks.kill()
            remove_pool(self.run.names)
        kill_run_actors(self.run.names)  # the run's control actor, and any actor a failed start left behind
        self.actor, self.ranks, self.agent_loop, self._run_control = None, None, None, None

    # ------------------------------------------------------------------------ restore / save
    def _latest_of_this_run(self) -> str | None:
        """The newest checkpoint written by this run, else the run's resume point.

        Read from each checkpoint's controller state, not `latest`: a folder may also hold older runs'
        checkpoints. Not re-hashed: this run wrote and sealed them (the resume point was hashed at start).
        """
        steps = ckpt.complete_steps(self.config.trainer.checkpoint_dir)
        for step in sorted(steps, reverse=True):
            if ckpt.run_id_of(steps[step]) == self.run.run_id:
                return str(steps[step])
        return self.resume_from

    def _await_actors(self, timeout_s: float = ACTOR_RESTART_TIMEOUT_S) -> None:
        """Wait (bounded) for actors that Ray is restarting after a crash (they reload the base model)."""
        deadline = time.monotonic() + timeout_s
        for handle in self._actor_handles():
            while True:
                try:
                    ray.get(handle.get_version.remote(), timeout=max(1.0, deadline - time.monotonic()))
                    break
                except ray.exceptions.ActorUnavailableError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1.0)

    def _restore(self, path: str | None) -> None:
        """Controller state from `path` (None: a fresh start); a rank whose weights differ reloads, and the ranks
        form their group again if one of them was restarted."""
        assert self.dataloader is not None and self.ranks is not None
        self._await_actors()
        if path is None:
            self.global_step = 0
            self.dataloader.load_state_dict({**self.dataloader.state_dict(), "epoch": 0, "position": 0})
            target = 0
        else:
            state = ckpt.read_state(path, "controller")
            self.global_step = int(state["global_step"])
            self.dataloader.load_state_dict(ckpt.read_state(path, "dataloader"))
            ckpt.restore_rng_state(ckpt.read_state(path, "rng"))
            target = self.global_step
        for line in self.ranks.restore(path, target, ACTOR_CALL_TIMEOUT_S):
            self.log(line, logging.WARNING)

    def _attach_transfer_queue(self) -> None:
        """Every process of the run (this one, the training actor, the rollout workers) on the cluster's
        current TransferQueue: after `restart_transfer_queue` their clients still talk to the dead one."""
        tqc.attach()
        ray.get([h.attach_transfer_queue.remote() for h in self._actor_handles()], timeout=ACTOR_CALL_TIMEOUT_S)

    def _actor_handles(self) -> list[Any]:
        """The training ranks, then the rollout workers that are processes of their own (not the hybrid engine's)."""
        assert self.ranks is not None
        separate = self.agent_loop is not None and not self.agent_loop.colocated
        return [*self.ranks.handles, *(self.agent_loop.workers if separate else [])]

    def _save_checkpoint(self) -> str:
        t = self.config.trainer
        root = t.checkpoint_dir
        # Checks free space first (the last checkpoint's size; the actor checks its state dicts' size) and
        # turns ENOSPC into a DiskFullError naming the folder; the temp folder is removed either way.
        assert self.ranks is not None and self.dataloader is not None
        with ckpt.CheckpointWriter(root, self.global_step) as writer:
            self.feed.save(writer, self.global_step)
            self.ranks.save(str(writer.tmp), ACTOR_CALL_TIMEOUT_S)
            writer.write_state("dataloader", self.dataloader.state_dict())
            writer.write_state("controller", {"global_step": self.global_step, "run_id": self.run.run_id})
            writer.write_state("rng", ckpt.capture_rng_state())
            writer.write_config(to_yaml(self.config))
            path = writer.commit()
        # Never delete the checkpoint a running epoch may restart from (its start).
        epoch_start = (self.global_step - 1) // self.steps_per_epoch * self.steps_per_epoch
        ckpt.apply_retention(root, t.max_actor_ckpt_to_keep, protect={epoch_start}, run_id=self.run.run_id)
        self.log(f"checkpoint saved: {path}")
        return str(path)

    # ------------------------------------------------------------------------ fit
    def fit(self, agent_loop_manager: AgentLoopManager | None = None) -> list[EpochResult]:
        """The whole training loop in this process (library use; the flow runs `fit_epoch` per epoch)."""
        if agent_loop_manager is not None:
            self.agent_loop = agent_loop_manager
        return [self.fit_epoch(epoch) for epoch in range(self.start_epoch, self.end_epoch)]

    def fit_epoch(self, epoch: int) -> EpochResult:
        """Train epoch `epoch` from the last checkpoint written before now; save at its end."""
        self._val_grids = []
        start_from = self._latest_of_this_run()
        self._restore(start_from)
        self._actor_logs.install(self._log_actors())
        self._attach_transfer_queue()
        for partition in (self.run.train_partition, self.run.val_partition):
            stale = tqc.clear_partition(partition)
            if stale and not self.feed.keeps_queued(start_from):
                self.log(f"cleared {stale} stale TransferQueue rows of {partition}", logging.WARNING)
        self.feed.publish_weights(self.global_step)
        self.feed.restore(start_from)
        result = EpochResult(epoch=epoch, global_step=self.global_step, checkpoint=None)
        self.tracking = Tracking(
            self.config.trainer.logger,
            self.run.log_dir,
            self.total_training_steps,
            console_sink=self.log if self.log_callback is not None else None,
            resume_step=self.global_step,  # a retried epoch replaces the records its failed try wrote
            started_at=self.run.started_at,
            run=self._tracker_run() if {"wandb", "mlflow"} & set(self.config.trainer.logger) else None,
        )
        try:
            if self.config.trainer.val_only:
                result.val_metrics = self._validate()
                self.tracking.log(result.val_metrics, step=self.global_step)
                return result
            if self.global_step == 0 and epoch == 0 and self.config.trainer.val_before_train:
                result.val_metrics = self._validate()
                self.tracking.log(result.val_metrics, step=0)
            last_step = min((epoch + 1) * self.steps_per_epoch, self.total_training_steps)
            while self.global_step < last_step:
                raise_if_stop_requested(self.run.names, f"before step {self.global_step + 1}")
                try:
                    metrics = self.step()
                except Exception as exc:
                    if is_out_of_memory(exc):  # the same settings would fail the same way: say what to change
                        raise out_of_memory_error(self.config, exc, f"step {self.global_step}") from exc
                    # A stop kills the run's actors when a step does not end in time: the call that failed is the stop.
                    raise_if_stop_requested(self.run.names, f"during step {self.global_step + 1}")
                    raise
                result.step_metrics.append(metrics)
            result.checkpoint = self._save_checkpoint()
            if self.global_step >= self.total_training_steps:
                self.tracking.log_model(result.checkpoint, self.global_step)  # mlflow: the final model as an artifact
            self._drain_worker_logs(LOG_DRAIN_WAIT_AT_EPOCH_END_S, check=False)  # the checkpoint's lines too
        except BaseException:
            self.tracking.close(failed=True)  # wandb exit code 1, mlflow status FAILED
            with contextlib.suppress(Exception):  # what the actors logged before the failure, never a second error
                self._drain_worker_logs(check=False)
            raise
        finally:
            self.tracking.close()
            result.global_step = self.global_step
            result.val_grids = self._val_grids
        return result

    def step(self) -> dict[str, float]:
        """One training step (see the module docstring); returns its metrics."""
        assert self.dataloader is not None and self.tracking is not None
        self.global_step += 1
        step, timer = self.global_step, Timer()
        t = self.config.trainer
        with timer("step"):
            # One update, or separate_async's parameter_sync_step local updates (verl-omni's `step`): each samples
            # its share of the step's prompt groups and trains them with their own advantages and optimizer steps.
            k = self.feed.local_updates
            parts: list[tuple[SampledBatch, torch.Tensor, torch.Tensor, torch.Tensor]] = []
            actor_metrics: dict[str, float] = {}
            for u in range(k):
                batch, rewards, advantages, failed = self._local_update(step, LocalUpdate(u, k), timer, actor_metrics)
                parts.append((batch, rewards, advantages, failed))
            batch = parts[0][0] if k == 1 else merge_batches([part[0] for part in parts])
            keys = batch.trajectory_keys
            rewards, advantages, failed = (torch.cat([part[i] for part in parts]) for i in (1, 2, 3))
            group, ok = prompt_groups(keys), ~failed
            metrics: dict[str, float] = {**actor_metrics, **data_metrics(rewards[ok], advantages[ok], group[ok])}
            metrics["training/rollout_failure/failed_groups"] = float(len(batch.failed_uids))
            metrics["training/rollout_failure/failed_samples"] = float(failed.sum())
            metrics.update(group_refill_metrics(batch))  # drop_incomplete_groups: evicted / refilled / dropped groups
            if t.save_freq > 0 and step % t.save_freq == 0 and step % self.steps_per_epoch:
                with timer("save_checkpoint"):
                    self._save_checkpoint()
            with timer("update_weights"):
                self.feed.after_step(step)
            if t.test_freq > 0 and (step % t.test_freq == 0 or step == self.total_training_steps):
                with timer("testing"):
                    metrics.update(self._validate())
            tqc.clear(self.run.train_partition, keys)
        metrics.update(timing_metrics(timer.timing, len(keys)))
        metrics.update(self.feed.metrics(batch, step, timer.timing))
        metrics["training/global_step"] = float(step)
        self._drain_worker_logs()
        self.tracking.log(metrics, step=step)
        if self.step_callback is not None:
            self.step_callback(step, self.total_training_steps, metrics)
        return metrics

    def _local_update(
        self, step: int, local: LocalUpdate, timer: Timer, actor_metrics: dict[str, float]
    ) -> tuple[SampledBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample one update's prompt groups, compute their advantages and train them; returns (batch, rewards,
        advantages, failed) in `batch.trajectory_keys` order. `actor_metrics` gets the update's (the last one's stay,
        as verl-omni's); the timings add up."""
        assert self.ranks is not None
        prompts = self.config.data.train_batch_size // local.count
        with timer("gen"):
            batch = self.feed.sample(step, prompts if local.count > 1 else None)
        if local.index == 0:
            timer.timing.update(self.feed.worker_timing())
        keys = batch.trajectory_keys
        rows = tqc.get_trajectories(self.run.train_partition, keys, select_fields=["rewards", "failed"])
        with timer("adv"):
            # A group is the samples of one prompt uid (a key's `<uid>_<session>_<index>`), never a position in a
            # request: separate_async trains groups of several requests at once, whose positions repeat.
            rewards, failed = rows["rewards"].float(), rows["failed"].bool()
            # Too many failed rewards: fail the step before any update (RewardFailureError, not retried).
            check_failure_share(
                int(failed.sum()), len(keys), self.config.reward.max_failure_ratio, list(batch.failed_uids.values()), step=step
            )
            advantages = step_advantages(self.config.algorithm, rewards, failed, prompt_groups(keys))
            trained_keys, values = keys, advantages
            staleness = self.feed.staleness_of(batch, step)
            if self.config.algorithm.paired_preference:  # Diffusion-DPO: each group's (chosen, rejected) pair
                trained_keys, values = self._preference_pairs(keys, rewards, failed, step)
            elif self.config.algorithm.filter_zero_std_groups:  # flow_grpo: only groups with a reward spread
                kept = self._groups_with_a_signal(rewards, failed, keys, step, local, actor_metrics)
                trained_keys, values = [keys[i] for i in kept.tolist()], advantages[kept]
                staleness = None if staleness is None else staleness[kept]
        update = self.ranks.train_step(
            self.run.train_partition,
            trained_keys,
            values,
            step,
            ACTOR_CALL_TIMEOUT_S,
            staleness=staleness,
            local=local,
        )
        for name in ("old_log_prob", "update_actor"):
            timer.timing[name] = timer.timing.get(name, 0.0) + update.pop(f"timing_s/{name}")
        actor_metrics.update(update)
        return batch, rewards, advantages, failed

    def _groups_with_a_signal(
        self,
        rewards: torch.Tensor,
        failed: torch.Tensor,
        keys: list[str],
        step: int,
        local: LocalUpdate,
        metrics: dict[str, float],
    ) -> torch.Tensor:
        """`algorithm.filter_zero_std_groups`: the indices (into `keys`) of the samples the update trains, those of the
        groups whose rewards differ, padded with randomly drawn others (seeded by the step, so a resumed or retried step
        draws the same) to a whole number of samples per mini-batch and rank (`omni_core.algorithms.zero_std_filter`).
        The filter's counts add up over the step's local updates in `metrics`."""
        actor = self.config.actor_rollout_ref.actor
        mini_batches = mini_batches_per_update(self.config.data.train_batch_size, actor.ppo_mini_batch_size)
        assert self.ranks is not None
        seed = derive_sample_seed(actor.data_loader_seed, step, SEED_PROMPT_INDEX, local.index)
        kept, counts = groups_to_train(
            rewards, failed, prompt_groups(keys), mini_batches * len(self.ranks.handles), torch.Generator().manual_seed(seed)
        )
        for name, value in counts.items():
            metrics[name] = metrics.get(name, 0.0) + value
        if not len(kept):
            self.log(
                f"step {step}: every prompt group's samples got equal rewards (algorithm.filter_zero_std_groups left "
                f"out all {int(counts['training/zero_std_filter/dropped_groups'])}), so this update trains nothing; if "
                "this happens at most steps, use a reward that tells the samples apart or raise actor_rollout_ref.rollout.n",
                logging.WARNING,
            )
        return kept

    def _preference_pairs(
        self, keys: list[str], rewards: torch.Tensor, failed: torch.Tensor, step: int
    ) -> tuple[list[str], torch.Tensor]:
        """The keys of each prompt group's (chosen, rejected) pair, laid out `[w0, l0, w1, l1, ...]`, and the rewards the
        loss sees (`omni_core.algorithms.diffusion_dpo.preference_pairs`). A step in which no pair has a preference
        (every group's rewards tie: common with a reward of few values once the policy is good) trains nothing: the
        tied pairs have no gradient and the update makes no optimizer step; the log says so."""
        order, pair_rewards = preference_pairs(rewards, failed, prompt_groups(keys))
        if not bool(preferred(pair_rewards).any()):
            self.log(
                f"step {step}: the samples of every prompt group got equal rewards (values seen: "
                f"{sorted(set(rewards.tolist()))[:6]}), so no (chosen, rejected) pair has a preference and this step "
                "trains nothing; if this happens at most steps, use a reward that tells the samples apart or raise "
                "actor_rollout_ref.rollout.n",
                logging.WARNING,
            )
        return [keys[i] for i in order.tolist()], pair_rewards

    def _validate(self) -> dict[str, float]:
        """Validation images at noise 0 (`rollout.val_kwargs`); mean reward per data_source."""
        if not self.val_records:
            return {}
        params = SamplingParams.for_validation(self.config.actor_rollout_ref.rollout)
        request = RolloutRequest.of_records(
            self.run.val_partition, self.global_step, params, self.val_records, uid_prefix=f"val-{self.global_step:06d}"
        )
        request = self.feed.validation_request(request, self.global_step)
        if self.config.actor_rollout_ref.actor.ema.enable:  # sample with the moving average of the weights
            request = self._with_ema_weights(request)
        try:
            batch = self.feed.rollout(request, self.config.data.val_batch_size)
        finally:
            if request.weights_ema:
                self.feed.after_ema_validation(self.global_step)
        rows = tqc.get_trajectories(
            self.run.val_partition,
            batch.trajectory_keys,
            select_fields=["rewards", "failed", "data_source", "images", "prompt_index", "sample_index"],
        )
        tqc.clear(self.run.val_partition, batch.trajectory_keys)
        n = params.n
        metrics: dict[str, float] = {}
        for source in sorted(set(rows["data_source"])):
            mask = torch.tensor([s == source for s in rows["data_source"]]) & ~rows["failed"].bool()
            if mask.any():
                metrics[f"val-core/{source}/reward/mean@{n}"] = rows["rewards"][mask].float().mean().item()
        self._save_val_grid(rows, n, metrics)
        self._drain_worker_logs()
        return metrics

    def _with_ema_weights(self, request: RolloutRequest) -> RolloutRequest:
        """`actor.ema`: the request samples with the average of this step's weights (the hybrid engine's ranks load
        their own; separate workers fetch it from rank 0)."""
        assert self.ranks is not None and self.agent_loop is not None
        weights = None if self.agent_loop.colocated else self.ranks.ema_weights_ref()
        return replace(request, weights=weights, weights_version=self.global_step, weights_ema=True)

    def _save_val_grid(self, rows: dict[str, Any], n: int, metrics: dict[str, float]) -> None:
        """`<checkpoint_dir>/validation/global_step_<N>.png`, next to the checkpoint of that step."""
        order = sorted(
            range(len(rows["prompt_index"])), key=lambda i: (int(rows["prompt_index"][i]), int(rows["sample_index"][i]))
        )
        images = torch.stack([torch.as_tensor(rows["images"][i]) for i in order])
        path = self.config.trainer.checkpoint_dir / "validation" / f"global_step_{self.global_step}.png"
        save_image_grid(images, path, ncols=n)
        count = self.config.trainer.log_val_generations
        if count and self.tracking is not None:  # verl's log_val_generations: sample 0 of the first prompts
            first = [k for k, i in enumerate(order) if int(rows["sample_index"][i]) == 0][:count]
            captions = [self.val_records[int(rows["prompt_index"][order[k]])].prompt for k in first]
            self.tracking.log_images(self.global_step, images[first], captions)
        self._val_grids.append((self.global_step, str(path.resolve()), dict(metrics)))
        self.log(f"validation images: {path}")

    def _tracker_run(self) -> TrackerRun:
        """The `wandb` / `mlflow` backends' run: one per checkpoint folder, so epochs, retries and resumes continue it."""
        t = self.config.trainer
        run_id = tracker_run_id(t.project_name, t.experiment_name, t.checkpoint_dir)
        return TrackerRun(t.project_name, t.experiment_name, run_id, self.config.model_dump(mode="json"), t.checkpoint_dir)

    # ------------------------------------------------------------------------ logs
    def log(self, message: str, level: int = logging.INFO) -> None:
        """One controller log line: to `log_callback` when set, else the `omni_core.trainer` logger."""
        if self.log_callback is not None:
            self.log_callback(level, message)
        else:
            logger.log(level, message)

    def _log_actors(self) -> list[Any]:
        return [*(self.ranks.handles if self.ranks else []), *(self.agent_loop.workers if self.agent_loop else [])]

    def _drain_worker_logs(self, wait_s: float = LOG_DRAIN_WAIT_S, check: bool = True) -> None:
        """The rollout results' lines, then what the actors logged through `omni_core` loggers since the last
        drain. `check=False` (the end of an epoch, maybe failing): no liveness check that could raise again."""
        lines = self.agent_loop.drain_logs() if check and self.agent_loop is not None else []
        for level, line in [*lines, *self._actor_logs.collect(self._log_actors(), wait_s)]:
            self.log(line, level)
