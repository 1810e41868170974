"""`separate_async`: a standalone rollout pool that samples ahead while the training ranks update.

verl-omni's `trainer_separate_async.py`, on OmniFlow's pieces. The rollout workers have their own devices
(`actor_rollout_ref.rollout.nnodes x n_gpus_per_node`; placement in `omni_core.resources`). The controller
keeps `trainer.v1.separate_async.num_warmup_batches` prompt batches ahead of training in the TransferQueue:
at step `s` it puts the batches of steps up to `s + num_warmup_batches` and queues each prompt group
(`data.gen_batch_size` prompts when set) on the worker with the fewest requests queued or running, so the
workers take the next groups as they free up. Each request carries the weights it is sampled with (an object-store ref and its version): every
`parameter_sync_step` steps the trainer publishes its weights (LoRA: the adapter only), later requests name
them, and a worker loads a version once, between requests, never inside one. The trainer samples complete
groups from the replay buffer under `trainer.v1.sampler.max_off_policy_threshold` (`drop` / `wait`,
`omni_core.tq.replay_buffer.StalenessRule`) and trains on the log-probs the rollout recorded
(`algorithm.rollout_correction.bypass_mode`): the importance ratio of an off-policy sample is against the
policy that sampled it.

Because a request's weights are fixed when it is put, not when a worker gets to it, which weights sample
which prompt does not depend on timing. With one rollout worker the groups also finish in the order they
were put, so the run is deterministic (same config, same weights, also after a kill and resume). With several,
the replay buffer trains the oldest groups that are ready, and which are ready first depends on timing.

The pipeline runs on across epoch ends. A checkpoint lets the requests already queued finish (they are the
next `num_warmup_batches` steps' groups, which training waits for anyway) and records the finished groups not
trained yet, with the feeding state (`omni_core.rollout.queue_record`); the dataloader state is past them. An
epoch that starts, is retried, or a run that resumes from that checkpoint puts them back into the TransferQueue
and feeds on from there: no prompt is trained twice or skipped, and a group whose staleness passed the
threshold meanwhile is dropped (counted) by the replay buffer as any other.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import ray
import torch

from omni_core import checkpoint as ckpt
from omni_core.records import RunInfo
from omni_core.rollout import queue_record
from omni_core.rollout.request import RolloutRequest
from omni_core.rollout.sampling_params import SamplingParams
from omni_core.rollout.staleness import staleness, staleness_metrics
from omni_core.tq import client as tqc
from omni_core.tq.replay_buffer import ReplayBuffer, SampledBatch, StalenessRule
from omni_core.trainers.base import ACTOR_CALL_TIMEOUT_S, PolicyGradientDiffusionTrainerV1
from omni_core.trainers.registry import register_diffusion_trainer


@register_diffusion_trainer("separate_async")
class PolicyGradientDiffusionTrainerV1SeparateAsync(PolicyGradientDiffusionTrainerV1):
    """Standalone rollout workers sampling ahead; weights published every `parameter_sync_step` steps."""

    mode = "separate_async"

    def __init__(self, config: Any, run: RunInfo):
        super().__init__(config, run)
        self._weights: tuple[Any, int] | None = None  # (ObjectRef of the trainable state, its version)
        self._next_feed = 0  # the step whose prompt batch is put next
        self._refills = 0
        self._busy_at_step_start = 0.0

    @property
    def _async(self) -> Any:
        return self.config.trainer.v1.separate_async

    # -------------------------------------------------------------------- weights
    def _push_weights(self) -> None:
        """Publish the ranks' weights as the version later requests name (one object-store copy per version;
        each worker fetches it when it first samples with it)."""
        if self.ranks is None:
            return
        self._weights = (self.ranks.weights_ref(ACTOR_CALL_TIMEOUT_S), self.global_step)

    def on_step_end(self) -> None:
        if self.global_step % self._async.parameter_sync_step == 0:
            self._push_weights()

    def _with_validation_weights(self, request: RolloutRequest) -> RolloutRequest:
        """Validation samples with the weights of this step, whatever version the workers sample ahead with."""
        assert self.ranks is not None
        return replace(request, weights=self.ranks.weights_ref(ACTOR_CALL_TIMEOUT_S), weights_version=self.global_step)

    def _after_ema_validation(self) -> None:
        """Nothing to undo: every training request names the weights it samples with (the workers swap back)."""

    # -------------------------------------------------------------------- feeding
    def _feed(self, step: int, uid_prefix: str) -> None:
        """Put one prompt batch for `step` (pending, tagged with the weights it will be sampled with) and deal it
        to the workers."""
        assert self.dataloader is not None and self.agent_loop is not None and self._weights is not None
        weights, version = self._weights
        params = SamplingParams.for_training(self.config.actor_rollout_ref.rollout)
        request = RolloutRequest.of_records(self.run.train_partition, step, params, self.dataloader.next_batch(), uid_prefix)
        request = replace(request, weights_version=version, weights=weights)
        tqc.put_prompts(request.partition, request.uids, step, model_version=version)
        self.agent_loop.queue_to_least_busy(request, self.config.data.gen_batch_size or 1)

    def _refill(self, step: int) -> None:
        """Dropped groups left too few: one more prompt batch (the next prompts of the data order)."""
        self._refills += 1
        self._feed(step, f"{step:06d}-refill{self._refills}")
        self._log(f"step {step}: over-stale groups were dropped; one more prompt batch put", logging.WARNING)

    # -------------------------------------------------------------------- one step
    def _sample_training_batch(self, step: int) -> SampledBatch:
        assert self.agent_loop is not None
        self._next_feed = max(self._next_feed, step)  # an epoch's first step: nothing fed ahead yet
        self._busy_at_step_start = self.agent_loop.busy_seconds
        last = min(step + self._async.num_warmup_batches, self.total_training_steps)
        while self._next_feed <= last:
            self._feed(self._next_feed, f"{self._next_feed:06d}")
            self._next_feed += 1
        sampler = self.config.trainer.v1.sampler
        sync_every = self._async.parameter_sync_step
        rule = StalenessRule(
            threshold=float(sampler.max_off_policy_threshold),
            strategy=sampler.max_off_policy_strategy,
            staleness=lambda version: staleness(step, version, sync_every),
            next_step_increment=1.0 / sync_every,
        )
        buffer = ReplayBuffer(
            self.run.train_partition,
            poll_interval=0.05,
            timeout_s=ACTOR_CALL_TIMEOUT_S,
            liveness_check=self.agent_loop.check_alive,
        )
        n = self.config.actor_rollout_ref.rollout.n
        batch = buffer.sample(self.config.data.train_batch_size, step, n, rule, refill=lambda _missing: self._refill(step))
        for uid, reason in batch.failed_uids.items():
            self._log(f"step {step}: prompt group {uid} failed: {reason}", logging.WARNING)
        return batch

    def _sampling_metrics(self, batch: SampledBatch, timing: dict[str, float]) -> dict[str, float]:
        assert self.agent_loop is not None
        sync_every = self._async.parameter_sync_step
        n = self.config.actor_rollout_ref.rollout.n
        per_trajectory = [staleness(self.global_step, v, sync_every) for v in batch.versions.values() for _ in range(n)]
        worst = max([*per_trajectory, *([batch.worst_staleness] if batch.worst_staleness is not None else [])], default=0.0)
        metrics = staleness_metrics(per_trajectory, batch.dropped_samples, worst)
        step_s = timing.get("step", 0.0)
        if step_s > 0:
            self.agent_loop.check_alive()  # collect the busy time of the requests that finished this step
            workers = len(self.agent_loop.workers)
            busy = self.agent_loop.busy_seconds - self._busy_at_step_start
            metrics["perf/idle_share/training"] = min(1.0, timing.get("gen", 0.0) / step_s)
            metrics["perf/idle_share/rollout"] = max(0.0, 1.0 - busy / (workers * step_s))
        return metrics

    def _staleness_of(self, batch: SampledBatch) -> torch.Tensor | None:
        """Each trajectory's staleness (keys are `<uid>_<session>_<index>`, sorted like `trajectory_keys`)."""
        sync_every = self._async.parameter_sync_step
        values = []
        for key in batch.trajectory_keys:
            version = batch.versions.get(tqc.uid_of_key(key))
            values.append(0.0 if version is None else staleness(self.global_step, version, sync_every))
        return torch.tensor(values, dtype=torch.float32)

    # -------------------------------------------------------------------- checkpoint / resume of the queue
    def _save_queued_rollouts(self, writer: ckpt.CheckpointWriter) -> None:
        """Let every queued request finish, then record the groups not trained yet (`queue_record`) and, when later
        requests name weights other than the checkpoint's own, those weights."""
        assert self.agent_loop is not None and self._weights is not None
        self.agent_loop.wait_idle(ACTOR_CALL_TIMEOUT_S)
        ref, version = self._weights
        if self.global_step % self._async.parameter_sync_step == 0:
            version = self.global_step  # published at this step's end (a save_freq checkpoint comes just before)
        weights = None if version == self.global_step else ray.get(ref, timeout=ACTOR_CALL_TIMEOUT_S)
        feed = queue_record.FeedState(next_feed=self._next_feed, weights_version=version, refills=self._refills, groups=0)
        feed = queue_record.save(writer, self.run.train_partition, feed, weights)
        self._log(f"checkpoint holds {feed.groups} prompt groups sampled ahead (next batch: step {feed.next_feed})")

    def _check_queued_rollouts(self, checkpoint: str) -> None:
        """A separate_async run resumes the queue of any checkpoint."""

    def _keeps_queued_rollouts(self, checkpoint: str | None) -> bool:
        return queue_record.feed_state(checkpoint) is not None

    def _restore_queued_rollouts(self, checkpoint: str | None) -> None:
        """Put the checkpoint's queued groups back and continue feeding where it stopped (a fresh start, or a
        checkpoint without a record: feeding starts at the next step with the current weights)."""
        feed = queue_record.feed_state(checkpoint)
        if feed is None or checkpoint is None:
            self._next_feed, self._refills = 0, 0
            return
        groups = queue_record.restore(checkpoint, self.run.train_partition)
        self._next_feed, self._refills = feed.next_feed, feed.refills
        weights = queue_record.saved_weights(checkpoint)
        if weights is not None:
            self._weights = (ray.put(weights), feed.weights_version)
        if groups:
            self._log(f"{groups} prompt groups sampled ahead put back from {checkpoint}")
