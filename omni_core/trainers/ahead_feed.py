"""`separate_async`'s rollout feed: a standalone rollout pool that samples ahead while the training ranks update.

verl-omni's `trainer_separate_async.py`, on OmniFlow's pieces. The rollout workers have their own devices
(`actor_rollout_ref.rollout.nnodes x n_gpus_per_node`; placement in `omni_core.resources`). The feed keeps
`trainer.v1.separate_async.num_warmup_batches` prompt batches ahead of training in the TransferQueue: at step `s` it
puts the batches of steps up to `s + num_warmup_batches` and queues each prompt group (`data.gen_batch_size` prompts
when set) on the worker with the fewest requests queued or running, so the workers take the next groups as they
free up. Each request carries the weights it is sampled with (an object-store ref and its version): every
`parameter_sync_step` steps the trainer publishes its weights (LoRA: the adapter only), later requests name them,
and a worker loads a version once, between requests, never inside one. The trainer samples complete groups from the
replay buffer under `trainer.v1.sampler.max_off_policy_threshold` (`drop` / `wait`, on verl's span: global steps
since the prompt was submitted, `omni_core.tq.replay_buffer.StalenessRule`) and trains on the log-probs the rollout
recorded
(`algorithm.rollout_correction.bypass_mode`): the importance ratio of an off-policy sample is against the policy
that sampled it.

Because a request's weights are fixed when it is put, not when a worker gets to it, which weights sample which
prompt does not depend on timing (`AheadSchedule`, plain bookkeeping). With one rollout worker the groups also
finish in the order they were put, so the run is deterministic (same config, same weights, also after a kill and
resume). With several, the replay buffer trains the oldest groups that are ready, and which are ready first
depends on timing.

The pipeline runs on across epoch ends. A checkpoint lets the requests already queued finish (they are the next
`num_warmup_batches` steps' groups, which training waits for anyway) and records the finished groups not trained
yet, with the feeding state (`omni_core.rollout.queue_record`); the dataloader state is past them. An epoch that
starts, is retried, or a run that resumes from that checkpoint puts them back into the TransferQueue and feeds on
from there: no prompt is trained twice or skipped, and a group whose staleness passed the threshold meanwhile is
dropped (counted) by the replay buffer as any other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import ray
import torch

from omni_core import checkpoint as ckpt
from omni_core.rollout import queue_record
from omni_core.rollout.request import RolloutRequest
from omni_core.rollout.staleness import span, staleness, staleness_metrics
from omni_core.tq import client as tqc
from omni_core.tq.replay_buffer import ReplayBuffer, SampledBatch, StalenessRule
from omni_core.trainers.base import ACTOR_CALL_TIMEOUT_S, PolicyGradientDiffusionTrainerV1
from omni_core.trainers.rollout_feed import RolloutFeed


@dataclass
class AheadSchedule:
    """Which step's prompt batch is put when, and which weight version it names: the feed's state, no I/O.

    `warmup_batches` (`num_warmup_batches`) batches run ahead of training; the weights are published after every
    `sync_every`-th step (`parameter_sync_step`); `total_steps` ends the feeding.
    """

    warmup_batches: int
    sync_every: int
    total_steps: int
    next_feed: int = 0  # the step whose prompt batch is put next
    refills: int = 0  # refill batches put so far (their uids stay unique)

    def due(self, step: int) -> list[int]:
        """The steps whose batches are put at the start of step `step`, oldest first (an epoch's first step after a
        fresh start: its own batch too); counted as put."""
        first = max(self.next_feed, step)
        last = min(step + self.warmup_batches, self.total_steps)
        self.next_feed = max(first, last + 1)
        return list(range(first, last + 1))

    def publishes_after(self, step: int) -> bool:
        """Whether the weights trained at `step` are published (later requests name version `step`)."""
        return step % self.sync_every == 0

    def submitted_at(self, due: int) -> int:
        """The step at whose start the batch of step `due` is put (`due`: the run's schedule, no resume)."""
        return max(1, due - self.warmup_batches)

    def span(self, due: int) -> int:
        """verl's span at which the batch of step `due` is trained when every group is ready in time."""
        return span(due, self.submitted_at(due))

    def version_of(self, due: int) -> int:
        """The weight version the batch of step `due` is sampled with: the last published at its put."""
        put = self.submitted_at(due)
        return (put - 1) // self.sync_every * self.sync_every

    @staticmethod
    def staleness(step: int, version: int) -> int:
        """Model versions between `version` and the weights training at `step` (`omni_core.rollout.staleness`)."""
        return staleness(step, version)

    @staticmethod
    def rule(step: int, threshold: int, strategy: str) -> StalenessRule:
        """The replay buffer's off-policy bound at step `step`."""
        return StalenessRule(threshold=threshold, strategy=strategy, step=step)

    def saved_version(self, step: int, published: int) -> int:
        """The version later requests name, as a checkpoint of step `step` records it: `published`, or `step` when
        its weights are published at this step's end (a save_freq checkpoint comes just before)."""
        return step if self.publishes_after(step) else published

    def state(self, weights_version: int) -> queue_record.FeedState:
        return queue_record.FeedState(self.next_feed, weights_version, self.refills, groups=0)

    def load(self, feed: queue_record.FeedState | None) -> None:
        """Continue from a checkpoint's feeding state (None: feeding starts at the next step)."""
        self.next_feed, self.refills = (0, 0) if feed is None else (feed.next_feed, feed.refills)


class AheadFeed(RolloutFeed):
    """Standalone rollout workers sampling ahead; weights published every `parameter_sync_step` steps."""

    def __init__(self, trainer: PolicyGradientDiffusionTrainerV1):
        super().__init__(trainer)
        v1 = trainer.config.trainer.v1
        self._weights: tuple[Any, int] | None = None  # (ObjectRef of the trainable state, its version)
        self._schedule: AheadSchedule | None = None
        self._sync_every = v1.separate_async.parameter_sync_step

    @property
    def schedule(self) -> AheadSchedule:
        """Built on first use: the run's step count needs the trainer's dataloader."""
        if self._schedule is None:
            v1 = self.config.trainer.v1
            self._schedule = AheadSchedule(
                v1.separate_async.num_warmup_batches, self._sync_every, self.trainer.total_training_steps
            )
        return self._schedule

    # ---------------------------------------------------------------- weights
    def publish_weights(self, step: int) -> None:
        """Publish the ranks' weights as the version later requests name (one object-store copy per version; each
        worker fetches it when it first samples with it)."""
        if self.trainer.ranks is None:
            return
        self._weights = (self.trainer.ranks.weights_ref(ACTOR_CALL_TIMEOUT_S), step)

    def after_step(self, step: int) -> None:
        if self.schedule.publishes_after(step):
            self.publish_weights(step)

    def validation_request(self, request: RolloutRequest, step: int) -> RolloutRequest:
        """Validation samples with the weights of this step, whatever version the workers sample ahead with."""
        assert self.trainer.ranks is not None
        return replace(request, weights=self.trainer.ranks.weights_ref(ACTOR_CALL_TIMEOUT_S), weights_version=step)

    # after_ema_validation: nothing to undo, every training request names the weights it samples with.

    # ---------------------------------------------------------------- the step's batch
    @property
    def local_updates(self) -> int:
        """verl-omni's separate_async step: `parameter_sync_step` local updates, each on `train_batch_size /
        parameter_sync_step` prompt groups sampled from the replay buffer with their own advantages."""
        return self._sync_every

    def sample(self, step: int, prompts: int | None = None) -> SampledBatch:
        """Put the batches due (`AheadSchedule.due`; at a step's first call only), then the oldest `prompts` complete
        groups (default: `train_batch_size`) within the staleness bound."""
        self._busy_at_sample = self.agent_loop.busy_seconds
        for due in self.schedule.due(step):
            self._put(due, step, f"{due:06d}")
        sampler = self.config.trainer.v1.sampler
        rule = self.schedule.rule(step, int(sampler.max_off_policy_threshold), sampler.max_off_policy_strategy)
        buffer = ReplayBuffer(
            self.trainer.run.train_partition,
            poll_interval=0.05,
            timeout_s=ACTOR_CALL_TIMEOUT_S,
            liveness_check=self.agent_loop.check_alive,
        )
        n = self.config.actor_rollout_ref.rollout.n
        size = prompts or self.config.data.train_batch_size
        batch = buffer.sample(size, step, n, rule, refill=lambda _missing: self._refill(step))
        self._log_failed_groups(batch, step)
        return batch

    def _put(self, step: int, submitted: int, uid_prefix: str, first_position: int = 0) -> None:
        """Put one prompt batch for `step` at step `submitted` (pending, tagged with the step it was submitted at and
        the weights it will be sampled with) and deal it to the workers."""
        trainer = self.trainer
        assert trainer.dataloader is not None and self._weights is not None
        weights, version = self._weights
        request = RolloutRequest.of_records(
            trainer.run.train_partition,
            step,
            self._training_params(),
            trainer.dataloader.next_batch(),
            uid_prefix,
            first_position,
        )
        request = replace(request, weights_version=version, weights=weights)
        tqc.put_prompts(request.partition, request.uids, submitted, model_version=version)
        self.agent_loop.queue_to_least_busy(request, self.config.data.gen_batch_size or 1)

    def _refill(self, step: int) -> None:
        """Dropped groups left too few: one more prompt batch (the next prompts of the data order)."""
        self.schedule.refills += 1
        # Seeded past the positions of the step's own batch (and of earlier refills of this run): new noise.
        refill = self.schedule.refills
        self._put(step, step, f"{step:06d}-refill{refill}", refill * self.config.data.train_batch_size)
        self.trainer.log(f"step {step}: over-stale groups were dropped; one more prompt batch put", logging.WARNING)

    def metrics(self, batch: SampledBatch, step: int, timing: dict[str, float]) -> dict[str, float]:
        """verl-omni's staleness metrics of the trained trajectories, and how idle each side was this step."""
        n = self.config.actor_rollout_ref.rollout.n
        per_trajectory = [self.schedule.staleness(step, v) for v in batch.versions.values() for _ in range(n)]
        metrics = staleness_metrics(per_trajectory, batch.evicted_spans)
        step_s = timing.get("step", 0.0)
        if step_s > 0:
            agent_loop = self.agent_loop
            agent_loop.check_alive()  # collect the busy time of the requests that finished this step
            busy = agent_loop.busy_seconds - self._busy_at_sample
            metrics["perf/idle_share/training"] = min(1.0, timing.get("gen", 0.0) / step_s)
            metrics["perf/idle_share/rollout"] = max(0.0, 1.0 - busy / (len(agent_loop.workers) * step_s))
        return metrics

    def staleness_of(self, batch: SampledBatch, step: int) -> torch.Tensor | None:
        """Each trajectory's staleness (keys are `<uid>_<session>_<index>`, sorted like `trajectory_keys`)."""
        values = []
        for key in batch.trajectory_keys:
            version = batch.versions.get(tqc.uid_of_key(key))
            values.append(0.0 if version is None else float(self.schedule.staleness(step, version)))
        return torch.tensor(values, dtype=torch.float32)

    # ---------------------------------------------------------------- checkpoint / resume of the queue
    def save(self, writer: ckpt.CheckpointWriter, step: int) -> None:
        """Let every queued request finish, then record the groups not trained yet (`queue_record`) and, when later
        requests name weights other than the checkpoint's own, those weights."""
        assert self._weights is not None
        self.agent_loop.wait_idle(ACTOR_CALL_TIMEOUT_S)
        ref, published = self._weights
        version = self.schedule.saved_version(step, published)
        weights = None if version == step else ray.get(ref, timeout=ACTOR_CALL_TIMEOUT_S)
        feed = queue_record.save(writer, self.trainer.run.train_partition, self.schedule.state(version), weights)
        self.trainer.log(f"checkpoint holds {feed.groups} prompt groups sampled ahead (next batch: step {feed.next_feed})")

    # check_resume: a separate_async run resumes the queue of any checkpoint.

    def keeps_queued(self, checkpoint: str | None) -> bool:
        return queue_record.feed_state(checkpoint) is not None

    def restore(self, checkpoint: str | None) -> None:
        """Put the checkpoint's queued groups back and continue feeding where it stopped (a fresh start, or a
        checkpoint without a record: feeding starts at the next step with the current weights)."""
        feed = queue_record.feed_state(checkpoint)
        self.schedule.load(feed)
        if feed is None or checkpoint is None:
            return
        groups = queue_record.restore(checkpoint, self.trainer.run.train_partition)
        weights = queue_record.saved_weights(checkpoint)
        if weights is not None:
            self._weights = (ray.put(weights), feed.weights_version)
        if groups:
            self.trainer.log(f"{groups} prompt groups sampled ahead put back from {checkpoint}")
