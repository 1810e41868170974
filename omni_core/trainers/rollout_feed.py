"""The rollout feed: how a trainer mode gets each step's training batch, and when the rollout side gets new weights.

The two modes (`trainer.v1.trainer_mode`) compute a step the same way (docs/design.md section 1); what differs is
who samples when, and that is one object, the feed, which the base trainer calls at fixed points:

| call | when | `SyncFeed` (sync) | `AheadFeed` (separate_async, `ahead_feed.py`) |
|---|---|---|---|
| `sample(step)` | a step's start | the step's prompts, sampled now | the oldest ready groups, fed ahead |
| `worker_timing()`, `metrics(...)`, `staleness_of(...)` | a step's end | workers' own time; no staleness | staleness, idle shares |
| `publish_weights(step)` | init, an epoch's start | the workers load them | later requests name them |
| `after_step(step)` | after the update | publish every step | publish every `parameter_sync_step` |
| `validation_request(...)`, `after_ema_validation()` | validation | the workers' weights | this step's weights |
| `check_resume`, `save`, `restore`, `keeps_queued` | checkpoints | nothing queued | the groups sampled ahead |

Every feed waits for a rollout the same way (`rollout`: put the prompts, dispatch, wait on the calls, read the
complete groups); validation uses it in both modes. As verl-omni's `trainer_sync.py` and `trainer_separate_async.py`
(mode hooks on one base trainer), but one object per mode instead of hook overrides scattered over the trainer.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from omni_core import checkpoint as ckpt
from omni_core.rollout import queue_record
from omni_core.rollout.group_refill import (
    IncompleteGroupsError,
    RefilledBatch,
    check_trainable,
    describe_reasons,
    sample_complete_groups,
)
from omni_core.rollout.request import RolloutRequest
from omni_core.rollout.sampling_params import SamplingParams
from omni_core.tq import client as tqc
from omni_core.tq.replay_buffer import ReplayBuffer, SampledBatch
from omni_core.trainers.base import ACTOR_CALL_TIMEOUT_S, PolicyGradientDiffusionTrainerV1


class RolloutFeed:
    """A mode's feed: the training batches, the weight-sync policy and the checkpointed queue (none here).

    It works with its trainer's pieces as they are at each call (the dataloader, the training ranks, the
    rollout workers: `attach` in another process replaces them), and keeps only the feeding state of its own.
    """

    def __init__(self, trainer: PolicyGradientDiffusionTrainerV1):
        self.trainer = trainer
        self._busy_at_sample = 0.0  # the workers' busy seconds when the step's sampling began

    @property
    def config(self) -> Any:
        return self.trainer.config

    @property
    def agent_loop(self) -> Any:
        assert self.trainer.agent_loop is not None
        return self.trainer.agent_loop

    # ---------------------------------------------------------------- the step's batch
    @property
    def local_updates(self) -> int:
        """How many updates one global step runs, each on its share of the step's prompts (1: one update)."""
        return 1

    def sample(self, step: int, prompts: int | None = None) -> SampledBatch:
        """The training batch of `step` (or of one of its local updates: `prompts` of them): complete prompt groups
        in the run's train partition."""
        raise NotImplementedError

    def worker_timing(self) -> dict[str, float]:
        """Timings of the sampling the workers did for this step alone (right after `sample`)."""
        return {}

    def metrics(self, batch: SampledBatch, step: int, timing: dict[str, float]) -> dict[str, float]:
        """Metrics of how the step's batch was sampled (at the step's end, `timing` complete)."""
        return {}

    def staleness_of(self, batch: SampledBatch, step: int) -> torch.Tensor | None:
        """Each trajectory's staleness in model versions, in `batch.trajectory_keys` order (None: on-policy)."""
        return None

    # ---------------------------------------------------------------- weights
    def publish_weights(self, step: int) -> None:
        """The rollout side samples with the ranks' current weights (version `step`) from now on."""
        raise NotImplementedError

    def after_step(self, step: int) -> None:
        """The weight-sync policy, after step `step`'s update."""
        raise NotImplementedError

    def validation_request(self, request: RolloutRequest, step: int) -> RolloutRequest:
        """The validation request of step `step`, naming the weights it samples with when the workers' differ."""
        return request

    def after_ema_validation(self, step: int) -> None:
        """Undo what sampling with the moving average left on the workers."""

    # ---------------------------------------------------------------- checkpoints
    def check_resume(self, checkpoint: str) -> None:
        """Refuse a resume point this mode would train wrongly."""

    def keeps_queued(self, checkpoint: str | None) -> bool:
        """Whether `checkpoint` holds queued rollouts that `restore` puts back."""
        return False

    def save(self, writer: ckpt.CheckpointWriter, step: int) -> None:
        """Write the feed's queue into the checkpoint of step `step`."""

    def restore(self, checkpoint: str | None) -> None:
        """Continue feeding from `checkpoint` (None: a fresh start), after the epoch cleared the TransferQueue."""

    # ---------------------------------------------------------------- one rollout, waited for
    def rollout(
        self, request: RolloutRequest, chunk_size: int | None = None, *, allow_failed_groups: bool = False
    ) -> SampledBatch:
        """Put the request's prompts, dispatch them (in chunks of `chunk_size` prompts when given), and wait
        (bounded) for their complete groups; `allow_failed_groups`: a group whose generation failed (no rows)
        is returned with its reason instead of failing the step (the caller evicts and refills it)."""
        agent_loop = self.agent_loop
        tqc.put_prompts(request.partition, request.uids, request.global_step)
        deadline = time.monotonic() + ACTOR_CALL_TIMEOUT_S
        # Wait on the calls themselves, then read the queue: polling it every 50 ms while the workers compute cost
        # the rollout CPU on a small machine (this process, TransferQueue's controller and the wake-ups of both).
        agent_loop.wait_for(agent_loop.generate_sequences(request, chunk_size), ACTOR_CALL_TIMEOUT_S)
        buffer = ReplayBuffer(
            request.partition,
            poll_interval=0.05,
            timeout_s=max(1.0, deadline - time.monotonic()),
            liveness_check=agent_loop.check_alive,
        )
        step, n = request.global_step, request.params.n
        batch = buffer.sample(len(request.items), step, n)
        self._log_failed_groups(batch, step)
        # Reward failures still write their rows (checked in `step` against reward.max_failure_ratio); missing
        # rows mean the generation itself failed.
        if not allow_failed_groups and len(batch.trajectory_keys) != request.num_samples:
            raise RuntimeError(
                f"step {step}: rollout returned {len(batch.trajectory_keys)} of {request.num_samples} samples; failed groups: "
                f"{batch.failed_uids}"
            )
        return batch

    def _log_failed_groups(self, batch: SampledBatch, step: int) -> None:
        for uid, reason in batch.failed_uids.items():
            self.trainer.log(f"step {step}: prompt group {uid} failed: {reason}", logging.WARNING)

    def _training_params(self) -> SamplingParams:
        arr = self.config.actor_rollout_ref
        return SamplingParams.for_training(arr.rollout, arr.model.algorithm)


class SyncFeed(RolloutFeed):
    """sync: each step samples its own prompts with the current weights (staleness 0), and the workers get the
    trained weights after every step (verl-omni's `trainer_sync.py`: `on_step_end` updates the rollout weights)."""

    def sample(self, step: int, prompts: int | None = None) -> SampledBatch:
        """The step's prompts, sampled now, as complete groups (with `trainer.v1.sampler.drop_incomplete_groups`,
        failed groups refilled or dropped: `_refilling_failed_groups`). One update per step: `prompts` is the batch."""
        trainer = self.trainer
        assert trainer.dataloader is not None
        self._busy_at_sample = self.agent_loop.busy_seconds
        records = trainer.dataloader.next_batch()
        request = RolloutRequest.of_records(trainer.run.train_partition, step, self._training_params(), records, f"{step:06d}")
        if self.config.trainer.v1.sampler.drop_incomplete_groups:
            return self._refilling_failed_groups(request)
        return self.rollout(request, self.config.data.gen_batch_size)

    def worker_timing(self) -> dict[str, float]:
        """`gen_worker`: the workers' own time in `generate` (sampling, rewards, TQ put), a mean over the workers:
        what of timing_s/gen is not dispatch and queue reads (the workers sampled only this step's requests)."""
        agent_loop = self.agent_loop
        agent_loop.check_alive()  # collects their own clocks
        return {"gen_worker": (agent_loop.busy_seconds - self._busy_at_sample) / len(agent_loop.workers)}

    def publish_weights(self, step: int) -> None:
        """Send the ranks' weights to every rollout worker (an object-store ref, fetched once per worker)."""
        trainer = self.trainer
        if trainer.agent_loop is None or trainer.ranks is None or trainer.agent_loop.colocated:
            return  # hybrid engine: the ranks sample with the weights they train
        trainer.agent_loop.update_weights(trainer.ranks.weights_ref(ACTOR_CALL_TIMEOUT_S), step)

    def after_step(self, step: int) -> None:
        self.publish_weights(step)

    def after_ema_validation(self, step: int) -> None:
        """Separate workers sample the next step with the weights they are sent, so send the trained ones back (the
        hybrid engine's ranks put theirs back themselves)."""
        self.publish_weights(step)

    def check_resume(self, checkpoint: str) -> None:
        """Refuse a checkpoint holding prompt groups that separate_async sampled ahead (its dataloader state is past
        them, so a sync run would skip them)."""
        feed = queue_record.feed_state(checkpoint)
        if feed is not None and feed.groups:
            raise ckpt.CheckpointError(
                f"{checkpoint} holds {feed.groups} prompt groups that trainer.v1.trainer_mode=separate_async sampled ahead "
                "and did not train yet; a sync run would skip them. Resume it with trainer.v1.trainer_mode=separate_async, "
                "or resume from a checkpoint of a sync run."
            )

    def _refilling_failed_groups(self, request: RolloutRequest) -> RefilledBatch:
        """`trainer.v1.sampler.drop_incomplete_groups` (verl-omni's exact refill, `omni_core.rollout.group_refill`):
        one prompt per rollout call; a group with a failed sample is evicted and its prompt sampled again, up to
        `max_incomplete_group_refill_rounds` rounds; a prompt failing every round is dropped with a warning, and
        the step trains the complete groups left if the PPO mini-batches divide them (else IncompleteGroupsError)."""
        sampler, step = self.config.trainer.v1.sampler, request.global_step
        rounds = sampler.max_incomplete_group_refill_rounds
        batch = sample_complete_groups(
            request,
            rollout=lambda r: self.rollout(r, 1, allow_failed_groups=True),
            clear_rows=lambda keys: tqc.clear(request.partition, keys),
            max_rounds=rounds,
        )
        prompts = {it.uid: it.record.prompt for it in request.items}
        for uid, reasons in batch.dropped.items():
            self.trainer.log(
                f"step {step}: prompt {uid} ({prompts[uid]!r}) failed {len(reasons)} times (max_incomplete_group_refill_rounds="
                f"{rounds} refills) and is dropped from this step; reasons: {describe_reasons(reasons)}",
                logging.WARNING,
            )
        try:
            n, mini = request.params.n, self.config.actor_rollout_ref.actor.ppo_mini_batch_size
            check_trainable(batch, n, mini, rounds, step)
        except IncompleteGroupsError:
            tqc.clear(request.partition, batch.trajectory_keys)  # nothing of the step is trained
            raise
        return batch
