"""`RolloutWorker`: one agent-loop worker (a Ray actor) that turns prompts into scored trajectories.

For a `RolloutRequest` it tags the prompt rows `running`, samples `params.n` images per prompt with the
SDE sampler (one batch per prompt group, `generate_groups`, so the rows do not depend on how the request
was split among the workers), scores them with the reward manager inside the worker (verl-omni's
streaming reward), writes one trajectory row per sample into the TransferQueue (`{uid}_{session}_0`)
and tags each prompt `finished`, or `failure` with the reason when any of its samples failed (a failing
reward, even one that fails the whole batch, still writes every row, marked `failed`; only a failed
generation writes none). Log lines (with their level) go back to the controller with the result, so
they reach the Prefect run's log.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from omni_core.config import OmniFlowConfig, config_from_dict
from omni_core.models.placement import module_placement, rollout_policy_kwargs
from omni_core.models.policy import FlowPolicy
from omni_core.records import LogLine
from omni_core.rewards.manager import RewardManager, RewardResult
from omni_core.rollout.request import RolloutRequest
from omni_core.rollout.sampler import generate_groups
from omni_core.rollout.sampling_params import SamplingParams
from omni_core.rollout.trajectory import Trajectory
from omni_core.tq import client as tqc


def nonfinite_reasons(traj: Trajectory, params: SamplingParams, dtype: str) -> list[str | None]:
    """Per sample: why its SDE window is unusable (a non-finite latent or log-prob), or None.

    Reduced-precision rollouts can overflow (flow_grpo issue 177); such a sample fails with the reason
    instead of reaching the loss as NaN.
    """
    reasons: list[str | None] = []
    for i in range(traj.batch_size):
        bad = "latent" if not torch.isfinite(traj.latents[i]).all() else None
        if bad is None and params.calculate_log_probs and not torch.isfinite(traj.log_probs[i]).all():
            bad = "log-prob"
        reasons.append(
            None
            if bad is None
            else f"non-finite {bad} in the SDE window (actor_rollout_ref.rollout.dtype={dtype}); "
            "try actor_rollout_ref.rollout.dtype=float32"
        )
    return reasons


@dataclass
class RolloutResult:
    """What a `generate` call reports back (the data itself is in the TransferQueue)."""

    worker: int
    num_samples: int
    failed: dict[str, str]  # uid -> reason
    seconds: float
    logs: list[LogLine]


class RolloutWorker:
    """Holds a copy of the policy for sampling and the reward functions; writes into the TransferQueue."""

    def __init__(
        self,
        config: dict[str, Any],
        worker_index: int,
        num_threads: int,
        prompt_embeddings: str | None = None,
        policy: FlowPolicy | None = None,
        set_threads: bool = True,
    ):
        """A worker process of its own sets torch's thread count; inside a training rank (the hybrid engine:
        `set_threads=False`) the rank sets it per call. `policy`: sample with it (a view of the rank's trained
        modules) instead of loading a rollout copy."""
        if set_threads:
            torch.set_num_threads(num_threads)
        self.config: OmniFlowConfig = config_from_dict(config)
        self.index = worker_index
        if policy is None:
            # On the run's device, in rollout.dtype, with rollout_attn_backend; prompts from the embedding file.
            kwargs = rollout_policy_kwargs(self.config, prompt_embeddings)
            policy = FlowPolicy.from_model_config(self.config.actor_rollout_ref.model, **kwargs)
            policy.transformer.eval()
            if self.config.actor_rollout_ref.rollout.use_torch_compile:
                policy.enable_torch_compile()
        self.policy = policy
        self.rewards = RewardManager(self.config.reward, device=self.config.trainer.device)  # model rewards: the run's device
        self.version = 0
        self.holds_ema = False  # the weights are the moving average of `version` (a validation request's)
        # The TransferQueue is joined at the first request (the flow starts the workers while it starts the queue).
        self._joined_queue = False

    def ping(self) -> int:
        return self.index

    def pid(self) -> int:
        """The worker's process id (for observability and fault-injection tests)."""
        return os.getpid()

    def get_version(self) -> int:
        return self.version

    def attach_transfer_queue(self) -> None:
        """Join the cluster's TransferQueue (again, after a restart: the client of the dead one is dropped)."""
        tqc.attach()
        self._joined_queue = True

    def placement(self) -> dict[str, Any]:
        """Where this worker's modules are and in what dtype (for the placement tests and the dashboard)."""
        return module_placement(self.policy)

    def torch_compile_stats(self) -> dict[str, int]:
        """This process's torch.compile counters (`rollout.use_torch_compile`): frames compiled, graphs, graph breaks."""
        return self.policy.torch_compile_stats()

    def set_weights(self, weights: dict[str, torch.Tensor], version: int, ema: bool = False) -> int:
        """Follow the trained policy (sync mode: after every step); `ema`: the weights are the moving average of
        `version` (validation with `actor.ema`), which the next request with the trained weights replaces."""
        self.policy.load_trainable_state(weights)
        self.version, self.holds_ema = version, ema
        return version

    def generate(self, request: RolloutRequest) -> RolloutResult:
        """Sample, score and store the request's prompts; never raises for a bad sample (it is tagged `failure`)."""
        start = time.perf_counter()
        partition, params, items = request.partition, request.params, request.items
        uids = request.uids
        named = (request.weights_version, request.weights_ema)
        if request.weights_version is not None and named != (self.version, self.holds_ema):
            # separate_async, and validation with actor.ema: the request names the weights it is sampled with (a
            # ref fetched once per version).
            import ray

            self.set_weights(ray.get(request.weights), request.weights_version, request.weights_ema)
        if not self._joined_queue:
            self.attach_transfer_queue()
        tqc.set_prompt_status(partition, uids, tqc.RUNNING)
        records = [it.record for it in items]
        try:
            # One batch per prompt group, never per request part: bit-identical rows for any worker count. With
            # rollout.use_torch_compile, a validation request (no SDE window kept) runs eager: its batch shape would be
            # compiled for one use per validation (measured on the main job: 28 s cold for 0.03 s saved).
            with self.policy.eager_forwards(not params.record_window):
                traj = generate_groups(
                    self.policy,
                    [r.prompt for r in records],
                    params.negative_prompts([r.negative_prompt for r in records]),
                    prompt_indices=[it.position for it in items],
                    **params.generate_kwargs(request.global_step),
                )
        except Exception as exc:  # the whole batch failed: tag every prompt with the reason
            reason = f"rollout worker {self.index}: {type(exc).__name__}: {exc}"
            return self._fail_all(request, reason, reason + "\n" + traceback.format_exc(), start)
        traj = traj.to("cpu")
        per_sample = [r for r in records for _ in range(params.n)]
        try:
            scored = self.rewards.score(
                traj.images,
                [r.data_source for r in per_sample],
                [r.ground_truth for r in per_sample],
                [r.extra_info for r in per_sample],
                prompts=[r.prompt for r in per_sample],
            )
        except Exception as exc:  # e.g. a data_source without a reward: every sample failed, with the reason
            # The rows are still written (marked failed), so the trainer applies reward.max_failure_ratio to them
            # like to any other reward failure instead of reporting missing samples.
            scored = RewardResult.all_failed(len(per_sample), f"reward: {type(exc).__name__}: {exc}")

        for i, reason in enumerate(nonfinite_reasons(traj, params, self.config.actor_rollout_ref.rollout.dtype)):
            if reason:
                scored.failed[i], scored.scores[i], scored.reasons[i] = True, float("nan"), reason
        n = params.n
        keys = [tqc.trajectory_key(it.uid, s) for it in items for s in range(n)]
        # Training needs the SDE window; a validation row only the images, ids and scores.
        fields: dict[str, Any] = {
            "rewards": scored.scores.float(),
            "failed": scored.failed,
            **traj.to_columns(window=params.record_window),
        }
        fields["data_source"] = [r.data_source for r in per_sample]
        tags = [
            {
                "status": tqc.FAILURE if bool(f) else tqc.SUCCESS,
                "global_steps": request.global_step,
                "model_version": self.version,
            }
            for f in scored.failed
        ]
        tqc.put_trajectories(partition, keys, fields, tags)

        logs: list[LogLine] = []
        failed: dict[str, str] = {}
        for i, it in enumerate(items):
            reasons = [scored.reasons[i * n + s] for s in range(n) if bool(scored.failed[i * n + s])]
            if reasons:
                failed[it.uid] = f"{len(reasons)}/{n} samples failed: {reasons[0]}"
        tqc.set_prompt_status(partition, [u for u in uids if u not in failed], tqc.FINISHED)
        for uid, reason in failed.items():
            tqc.set_prompt_status(partition, [uid], tqc.FAILURE, reason)
            logs.append((logging.WARNING, f"prompt {uid} failed: {reason}"))
        seconds = time.perf_counter() - start
        # Routine: the step's line and metrics (timing_s/gen) already say it; kept for DEBUG logging.
        logs.append(
            (
                logging.DEBUG,
                f"rollout worker {self.index}: {len(keys)} samples for {partition} step {request.global_step} "
                f"in {seconds:.2f}s (weights v{self.version})",
            )
        )
        return RolloutResult(self.index, len(keys), failed, seconds, logs)

    def _fail_all(self, request: RolloutRequest, reason: str, log: str, start: float) -> RolloutResult:
        tqc.set_prompt_status(request.partition, request.uids, tqc.FAILURE, reason)
        failed = {u: reason for u in request.uids}
        return RolloutResult(self.index, 0, failed, time.perf_counter() - start, [(logging.WARNING, log)])
