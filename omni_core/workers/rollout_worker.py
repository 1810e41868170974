"""`RolloutWorker`: one agent-loop worker (a Ray actor) that turns prompts into scored trajectories.

For a prompt batch it tags the prompt rows `running`, samples `rollout.n` images per prompt with the
SDE sampler, scores them with the reward manager inside the worker (verl-omni's streaming reward),
writes one trajectory row per sample into the TransferQueue (`{uid}_{session}_0`) and tags each
prompt `finished`, or `failure` with the reason when any of its samples failed. Log lines go back to
the controller with the result, so they reach the Prefect run's log.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from omni_core.config import OmniFlowConfig, config_from_dict
from omni_core.models.policy import FlowPolicy
from omni_core.rewards.manager import RewardManager
from omni_core.rollout.sampler import generate, sampling_kwargs
from omni_core.rollout.trajectory import COND_PREFIX

logger = logging.getLogger(__name__)


@dataclass
class PromptItem:
    """One prompt of a rollout request: its deterministic uid, position and reward inputs."""

    uid: str
    index: int  # position in the step's batch: with the step, it seeds the samples
    prompt: str
    negative_prompt: str | None = None
    data_source: str = "jpeg_compressibility"
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutResult:
    """What a `generate` call reports back (the data itself is in the TransferQueue)."""

    worker: int
    num_samples: int
    failed: dict[str, str]  # uid -> reason
    seconds: float
    logs: list[str]


class RolloutWorker:
    """Holds a copy of the policy for sampling and the reward functions; writes into the TransferQueue."""

    def __init__(self, config: dict[str, Any], worker_index: int, num_threads: int):
        torch.set_num_threads(num_threads)
        self.config: OmniFlowConfig = config_from_dict(config)
        self.index = worker_index
        self.policy = FlowPolicy.from_model_config(self.config.actor_rollout_ref.model)
        self.policy.transformer.eval()
        self.rewards = RewardManager(self.config.reward)
        self.version = 0
        from omni_core.tq.client import attach

        attach()

    def ping(self) -> int:
        return self.index

    def pid(self) -> int:
        """The worker's process id (for observability and fault-injection tests)."""
        return os.getpid()

    def get_version(self) -> int:
        return self.version

    def set_weights(self, weights: dict[str, torch.Tensor], version: int) -> int:
        """Follow the trained policy (sync mode: after every step)."""
        self.policy.load_trainable_state(weights)
        self.version = version
        return version

    def generate(self, partition: str, items: list[PromptItem], global_step: int, validate: bool = False) -> RolloutResult:
        """Sample, score and store `items`; never raises for a bad sample (it is tagged `failure`)."""
        from omni_core.tq import client as tqc

        start = time.perf_counter()
        logs: list[str] = []
        uids = [it.uid for it in items]
        tqc.set_prompt_status(partition, uids, tqc.RUNNING)
        rollout = self.config.actor_rollout_ref.rollout
        try:
            kwargs = sampling_kwargs(rollout, validate)
            n = kwargs.pop("n")
            traj = generate(
                self.policy,
                [it.prompt for it in items],
                [it.negative_prompt or "" for it in items] if rollout.pipeline.guidance_scale > 1.0 else None,
                n=n,
                global_step=0 if validate else global_step,
                prompt_indices=[it.index for it in items],
                **kwargs,
            )
        except Exception as exc:  # the whole batch failed: tag every prompt with the reason
            reason = f"rollout worker {self.index}: {type(exc).__name__}: {exc}"
            logs.append(reason + "\n" + traceback.format_exc())
            tqc.set_prompt_status(partition, uids, tqc.FAILURE, reason)
            return RolloutResult(self.index, 0, {u: reason for u in uids}, time.perf_counter() - start, logs)

        per_sample = [it for it in items for _ in range(n)]
        try:
            scored = self.rewards.score(
                traj.images,
                [it.data_source for it in per_sample],
                [it.ground_truth for it in per_sample],
                [it.extra_info for it in per_sample],
            )
        except Exception as exc:  # e.g. a data_source without a reward: every sample failed, with the reason
            reason = f"reward: {type(exc).__name__}: {exc}"
            logs.append(reason)
            tqc.set_prompt_status(partition, uids, tqc.FAILURE, reason)
            return RolloutResult(self.index, 0, {u: reason for u in uids}, time.perf_counter() - start, logs)
        keys = [tqc.trajectory_key(it.uid, s) for it in items for s in range(n)]
        fields: dict[str, Any] = {
            "rewards": scored.scores.float(),
            "failed": scored.failed,
            "images": traj.images,
            "prompt_index": traj.prompt_index,
            "sample_index": traj.sample_index,
            "sample_seeds": traj.sample_seeds,
        }
        if not validate:  # training needs the window; validation only the images and scores
            fields.update(
                latents=traj.latents,
                log_probs=traj.log_probs,
                timesteps=traj.timesteps,
                sigmas=traj.sigmas,
                sigma_max=traj.sigma_max,
                window_start=traj.window_start,
                **{COND_PREFIX + k: v for k, v in traj.cond.items()},
            )
        fields["data_source"] = [it.data_source for it in per_sample]
        tags = [
            {
                "status": tqc.FAILURE if bool(f) else tqc.SUCCESS,
                "global_steps": global_step,
                "model_version": self.version,
            }
            for f in scored.failed
        ]
        tqc.put_trajectories(partition, keys, fields, tags)

        failed: dict[str, str] = {}
        for i, it in enumerate(items):
            reasons = [scored.reasons[i * n + s] for s in range(n) if bool(scored.failed[i * n + s])]
            if reasons:
                failed[it.uid] = f"{len(reasons)}/{n} samples failed: {reasons[0]}"
        ok = [u for u in uids if u not in failed]
        tqc.set_prompt_status(partition, ok, tqc.FINISHED)
        for uid, reason in failed.items():
            tqc.set_prompt_status(partition, [uid], tqc.FAILURE, reason)
            logs.append(f"prompt {uid} failed: {reason}")
        seconds = time.perf_counter() - start
        logs.append(
            f"rollout worker {self.index}: {len(keys)} {'validation ' if validate else ''}samples for step {global_step} "
            f"in {seconds:.2f}s (weights v{self.version})"
        )
        return RolloutResult(self.index, len(keys), failed, seconds, logs)
