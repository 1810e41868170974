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
were put, so the run is deterministic (same config, same weights). With several, the replay buffer trains
the oldest groups that are ready, and which are ready first depends on timing. At the end of an epoch the pipeline drains (the last
batches fed are the epoch's own, and every request is waited for) so that a checkpoint holds no queued
work and a resumed or retried epoch starts as the uninterrupted run did: from a weight sync at its
checkpoint's weights.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from omni_core.records import RunInfo
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
        # The loader's (epoch, position) before each batch put ahead was drawn, by the step it is for: a checkpoint
        # saves the one of the first batch not trained yet, so a resumed run puts those prompts again.
        self._position_before: dict[int, tuple[int, int]] = {}

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

    # -------------------------------------------------------------------- feeding
    def _epoch_last_step(self) -> int:
        epoch_end = (self.global_step // self.steps_per_epoch + 1) * self.steps_per_epoch
        return min(epoch_end, self.total_training_steps)

    def _feed(self, step: int, uid_prefix: str) -> None:
        """Put one prompt batch for `step` (pending, tagged with the weights it will be sampled with) and deal it
        to the workers."""
        assert self.dataloader is not None and self.agent_loop is not None and self._weights is not None
        weights, version = self._weights
        self._position_before.setdefault(step, (self.dataloader.epoch, self.dataloader.position))
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
        last = min(step + self._async.num_warmup_batches, self._epoch_last_step())
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

    def _dataloader_state_to_save(self) -> dict[str, Any]:
        """A checkpoint inside an epoch (`trainer.save_freq`) while batches of later steps are queued: the state
        before the first of them, so a run resumed from it puts their prompts again, sampled with its weights
        (pending, running or finished alike: the TransferQueue does not outlive the run). At an epoch's end
        nothing is queued and this is the dataloader's own state."""
        assert self.dataloader is not None
        self._position_before = {step: at for step, at in self._position_before.items() if step > self.global_step}
        state = self.dataloader.state_dict()
        if self._position_before:
            state["epoch"], state["position"] = self._position_before[min(self._position_before)]
        return state

    def _end_of_epoch(self) -> None:
        """Drain: wait for every request in flight, then clear what no step took (refills beyond the need)."""
        assert self.agent_loop is not None
        self.agent_loop.wait_idle(ACTOR_CALL_TIMEOUT_S)
        left = tqc.clear_partition(self.run.train_partition)
        if left:
            self._log(f"{left} TransferQueue rows put this epoch were not trained (over-stale refills); cleared")
        self._next_feed = 0
