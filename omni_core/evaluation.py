"""Before / after evaluation of a policy: sample fixed prompts at fixed seeds and score them.

The same base seed gives the same initial noise (and, with the validation noise level, the same
trajectory) for the initial and the trained weights, so the reward difference measures the weights
alone. Sampling goes through the rollout's ``generate`` with the validation settings
(``SamplingParams.for_validation``) and scoring through the training ``RewardManager``, so the numbers
are the ones training optimised. The policy is the rollout's copy (``rollout.dtype`` on ``trainer.device``);
``evaluate_on_ray`` runs the evaluation as a Ray task with a rollout worker's resources, so it samples
where the model runs (the GPU, not the flow process). No Prefect here: ``tasks/evaluate_policy.py`` wires it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from omni_core.checkpoint.files import read_tensors
from omni_core.checkpoint.layout import ACTOR_DIR, EMA_NAME
from omni_core.config import OmniFlowConfig
from omni_core.config.schema import DataConfig
from omni_core.data.prompts import PromptRecord, load_prompts
from omni_core.data_files import as_file_list
from omni_core.models.placement import rollout_policy_kwargs
from omni_core.models.policy import FlowPolicy
from omni_core.rewards.manager import RewardManager
from omni_core.rollout.sampler import generate
from omni_core.rollout.sampling_params import SamplingParams

MODEL_NAME = "model"  # <checkpoint>/actor/model.safetensors
EVAL_TIMEOUT_S = 6 * 3600.0  # every wait is bounded (DESIGN.md section 7)


@dataclass
class EvalReport:
    """Outcome of one evaluation of ``P`` prompts x ``n`` samples (``B = P * n``, grouped prompt by prompt).

    Attributes:
        mean_reward: mean over the samples that scored (NaN if none did).
        rewards: ``[B]`` float32, NaN where a reward failed.
        images: ``[B, 3, H, W]`` uint8.
        prompts: the ``P`` prompt strings, in row order.
    """

    mean_reward: float
    rewards: torch.Tensor
    images: torch.Tensor
    prompts: list[str]


def evaluation_records(data: DataConfig) -> list[PromptRecord]:
    """The validation prompts (`data.val_files`, at most `data.val_max_samples`), read as `prepare_dataset` reads
    them; with `data.val_files: null` (no validation during training) the training prompts, same cap."""
    return load_prompts(
        as_file_list(data.val_files or data.train_files),
        prompt_key=data.prompt_key,
        negative_prompt_key=data.negative_prompt_key,
        max_samples=data.val_max_samples,
    )


def _as_records(prompts: Sequence[str | PromptRecord]) -> list[PromptRecord]:
    # A bare string scores with the default data source, as a text prompt file would.
    return [p if isinstance(p, PromptRecord) else PromptRecord(prompt=p, index=i) for i, p in enumerate(prompts)]


def load_policy(config: OmniFlowConfig, checkpoint: str | Path | None) -> FlowPolicy:
    """The rollout copy of ``actor_rollout_ref.model`` (``trainer.device`` resolved, ``rollout.dtype``), with
    the checkpoint's weights loaded if given: ``<checkpoint>/actor/ema.safetensors`` when the run kept an EMA
    (``actor.ema``: what its validation sampled with and its export ships), else ``actor/model.safetensors``.
    Text encoders stay: any prompt may be evaluated."""
    policy = FlowPolicy.from_model_config(config.actor_rollout_ref.model, **rollout_policy_kwargs(config, None))
    if checkpoint is not None:
        load_checkpoint_weights(policy, checkpoint)
    policy.transformer.eval()
    return policy


def load_checkpoint_weights(policy: FlowPolicy, checkpoint: str | Path) -> None:
    """Load a training checkpoint's weights into `policy`: `actor/ema.safetensors` when the run kept an EMA, else
    `actor/model.safetensors` (the files TrainingActor.save writes: full state, or the LoRA adapter)."""
    actor = Path(checkpoint) / ACTOR_DIR
    name = EMA_NAME if (actor / f"{EMA_NAME}.safetensors").is_file() else MODEL_NAME
    policy.load_trainable_state(read_tensors(actor, name))


def evaluate_policy(
    config: OmniFlowConfig,
    prompts: Sequence[str | PromptRecord],
    checkpoint: str | Path | None,
    seed: int,
    samples_per_prompt: int,
) -> EvalReport:
    """Sample ``samples_per_prompt`` images per prompt at base seed ``seed`` and score them.

    ``checkpoint=None`` evaluates the initial weights of ``actor_rollout_ref.model``; otherwise the
    trained weights of that checkpoint folder. Prompts given as ``PromptRecord`` carry their data source,
    ground truth and dataset index (which, with ``seed``, fixes each sample's noise).
    """
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt={samples_per_prompt} must be >= 1")
    records = _as_records(prompts)
    if not records:
        raise ValueError("evaluate_policy: no prompts; set data.val_files (or data.train_files)")
    params = SamplingParams.for_validation(config.actor_rollout_ref.rollout).replace(n=samples_per_prompt, seed=seed)
    policy = load_policy(config, checkpoint)
    traj = generate(
        policy,
        [r.prompt for r in records],
        params.negative_prompts([r.negative_prompt for r in records]),
        prompt_indices=[r.index for r in records],
        **params.generate_kwargs(global_step=0),
    )
    per_sample = [r for r in records for _ in range(samples_per_prompt)]
    scored = RewardManager(config.reward, device=config.trainer.device).score(
        traj.images,
        [r.data_source for r in per_sample],
        [r.ground_truth for r in per_sample],
        [r.extra_info for r in per_sample],
        prompts=[r.prompt for r in per_sample],
    )
    ok = scored.scores[~scored.failed]
    mean = float(ok.mean()) if ok.numel() else float("nan")
    return EvalReport(mean_reward=mean, rewards=scored.scores, images=traj.images, prompts=[r.prompt for r in records])


def _evaluate_in_worker(config: OmniFlowConfig, records: list[PromptRecord], checkpoint, seed, samples_per_prompt, threads):
    torch.set_num_threads(threads)  # Ray sets one thread per reserved CPU (DESIGN.md section 7)
    return evaluate_policy(config, records, checkpoint, seed, samples_per_prompt)


def evaluate_on_ray(
    config: OmniFlowConfig,
    prompts: Sequence[str | PromptRecord],
    checkpoint: str | Path | None,
    seed: int,
    samples_per_prompt: int,
    timeout_s: float = EVAL_TIMEOUT_S,
) -> EvalReport:
    """``evaluate_policy`` as a Ray task with a rollout worker's device share (Ray must be connected)."""
    import ray

    from omni_core.resources import evaluation_resources

    remote = ray.remote(_evaluate_in_worker).options(**evaluation_resources(config))
    args = (config, _as_records(prompts), None if checkpoint is None else str(checkpoint), seed, samples_per_prompt)
    return ray.get(remote.remote(*args, os.cpu_count() or 1), timeout=timeout_s)
