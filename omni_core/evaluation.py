"""Before / after evaluation of a policy: sample fixed prompts at fixed seeds and score them.

The same base seed gives the same initial noise (and, with the validation noise level, the same
trajectory) for the initial and the trained weights, so the reward difference measures the weights
alone. Sampling goes through the rollout's ``generate`` with the validation settings
(``SamplingParams.for_validation``) and scoring through the training ``RewardManager``, so the numbers
are the ones training optimised. The policy is the rollout's copy (``rollout.dtype`` on ``trainer.device``);
``evaluate_on_ray`` runs the evaluation as a Ray task with a rollout worker's resources, so it samples
where the model runs (the GPU, not the flow process). No Prefect here: ``tasks/evaluate_policy.py`` wires it.

``evaluate_trained_checkpoint`` is ``omniflow evaluate``: a finished checkpoint against its base model, with the
config the run saved next to it, both evaluated in the calling process (the command owns its process and its
device, so neither Ray nor Prefect is started), and a report folder: ``report.json``, ``report.md`` and
``grid.png`` (rows: prompts; the base model's samples on the left, the checkpoint's on the right, same seeds).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from omni_core.checkpoint.layout import EMA_NAME
from omni_core.checkpoint.trained import (
    RefusedError,
    load_checkpoint_weights,
    new_folder_next_to,
    open_trained_checkpoint,
    require_new_folder,
)
from omni_core.config import OmniFlowConfig
from omni_core.config.schema import DataConfig
from omni_core.data.prompts import PromptRecord, load_prompts
from omni_core.data_files import DataFileError, as_file_list
from omni_core.models.hub import model_folder
from omni_core.models.loader import check_pipeline_folder
from omni_core.models.model_index import ModelLoadError
from omni_core.models.placement import rollout_policy_kwargs
from omni_core.models.policy import FlowPolicy
from omni_core.reports.images import save_image_grid
from omni_core.rewards.manager import RewardManager
from omni_core.rollout.sampler import generate
from omni_core.rollout.sampling_params import SamplingParams
from omni_core.validation import prepare_run_config

EVAL_TIMEOUT_S = 6 * 3600.0  # every wait is bounded (docs/design.md section 7)


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
    torch.set_num_threads(threads)  # Ray sets one thread per reserved CPU (docs/design.md section 7)
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


# ------------------------------------------------------------------------------------- omniflow evaluate
REPORT_JSON, REPORT_MD, GRID_PNG = "report.json", "report.md", "grid.png"


@dataclass(frozen=True)
class CheckpointEvaluation:
    """What `evaluate_trained_checkpoint` measured and where it wrote the report.

    `weights`: `"ema"` (the run kept an EMA, which `load_checkpoint_weights` loads) or `"model"` (the trained weights).
    """

    out_dir: Path
    checkpoint: Path
    step: int
    weights: str
    before: EvalReport
    after: EvalReport
    seed: int
    samples_per_prompt: int


def evaluate_trained_checkpoint(
    checkpoint: str | Path,
    overrides: Sequence[str] = (),
    prompts_file: str | Path | None = None,
    seed: int | None = None,
    samples_per_prompt: int | None = None,
    out_dir: str | Path | None = None,
) -> CheckpointEvaluation:
    """Evaluate the base model and `checkpoint`'s weights on the same prompts at the same seeds; write the report.

    `checkpoint`: a `global_step_N` folder or an experiment folder (its newest), verified against its manifest.
    The config is the checkpoint's `config.yaml` with `overrides` (`key.path=value`) on top; the base model is its
    `actor_rollout_ref.model.path`. Prompts: `prompts_file` (.txt / .jsonl / .parquet), else the validation prompts
    (`evaluation_records`). `seed` and `samples_per_prompt` default to `rollout.val_kwargs` (the run's validation).
    `out_dir`: a new or empty folder, default `evaluate-global_step_N` next to the checkpoint (`-2`, `-3`, ... when
    taken). Raises `RefusedError` (nothing written) for arguments it cannot use, `ConfigError` for bad overrides.
    """
    given_out = require_new_folder(out_dir, "--out") if out_dir is not None else None
    ckpt = open_trained_checkpoint(checkpoint)
    out = given_out or new_folder_next_to(ckpt.path, f"evaluate-{ckpt.path.name}")
    # Every rule a run's config meets (`omniflow train`'s own check), on the saved config with the overrides on top.
    config = prepare_run_config(None, overrides, [ckpt.config_file])
    model = config.actor_rollout_ref.model
    try:
        check_pipeline_folder(model_folder(model), model.architecture)
    except ModelLoadError as exc:
        raise RefusedError(
            f"actor_rollout_ref.model.path={model.path} (the base model, from {ckpt.config_file}): {exc}; "
            f"pass actor_rollout_ref.model.path=DIR (or a Hugging Face Hub id)"
        ) from exc
    data = config.data
    try:
        records = (
            load_prompts(prompts_file, prompt_key=data.prompt_key, negative_prompt_key=data.negative_prompt_key)
            if prompts_file is not None
            else evaluation_records(data)
        )
    except DataFileError as exc:
        where = f"--prompts {prompts_file}" if prompts_file is not None else "data.val_files (or data.train_files)"
        raise RefusedError(f"{where}: {exc}; pass --prompts FILE (one prompt per line)") from exc
    val = config.actor_rollout_ref.rollout.val_kwargs
    seed = val.seed if seed is None else seed
    n = val.n if samples_per_prompt is None else samples_per_prompt
    if n < 1:
        raise RefusedError(f"--samples {n}: must be >= 1")
    before = evaluate_policy(config, records, None, seed, n)
    after = evaluate_policy(config, records, ckpt.path, seed, n)
    result = CheckpointEvaluation(out, ckpt.path, ckpt.step, ckpt.hf_weights, before, after, seed, n)
    _write_report(result, config, records)
    return result


def _mean(values: torch.Tensor) -> float | None:
    ok = values[~torch.isnan(values)]
    return float(ok.mean()) if ok.numel() else None


def _finite(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else x


def report_dict(result: CheckpointEvaluation, config: OmniFlowConfig, records: Sequence[PromptRecord]) -> dict:
    """The JSON report: means before / after, and per prompt its samples' rewards (None where a reward failed)."""
    n = result.samples_per_prompt
    per_prompt = []
    for i, record in enumerate(records):
        rows = slice(i * n, (i + 1) * n)
        b, a = result.before.rewards[rows].float(), result.after.rewards[rows].float()
        per_prompt.append(
            {
                "index": record.index,
                "prompt": record.prompt,
                "data_source": record.data_source,
                "before": _mean(b),
                "after": _mean(a),
                "before_samples": [_finite(float(x)) for x in b],
                "after_samples": [_finite(float(x)) for x in a],
            }
        )
    before, after = _finite(result.before.mean_reward), _finite(result.after.mean_reward)
    return {
        "checkpoint": str(result.checkpoint),
        "step": result.step,
        "base_model": config.actor_rollout_ref.model.path,
        "weights": result.weights,
        "seed": result.seed,
        "samples_per_prompt": n,
        "num_prompts": len(records),
        "mean_reward_before": before,
        "mean_reward_after": after,
        "change": None if before is None or after is None else after - before,
        "failed_before": int(torch.isnan(result.before.rewards).sum()),
        "failed_after": int(torch.isnan(result.after.rewards).sum()),
        "reward": config.reward.model_dump(mode="json"),
        "per_prompt": per_prompt,
        "grid": GRID_PNG,
    }


def _fmt(x: float | None) -> str:
    return "failed" if x is None else f"{x:.6f}"


def report_markdown(report: dict) -> str:
    n = report["samples_per_prompt"]
    weights = "EMA weights (the run kept an EMA)" if report["weights"] == EMA_NAME else "trained weights"
    change = report["change"]
    lines = [
        f"# Evaluation of {report['checkpoint']} (step {report['step']})",
        "",
        f"Before: the base model `{report['base_model']}`. After: the checkpoint's {weights}. {report['num_prompts']} "
        f"prompts x {n} samples at seed {report['seed']} (the same noise before and after), scored with the run's "
        f"reward (`reward` in {REPORT_JSON}).",
        "",
        "| | mean reward |",
        "|---|---|",
        f"| before (base model) | {_fmt(report['mean_reward_before'])} |",
        f"| after (checkpoint) | {_fmt(report['mean_reward_after'])} |",
        f"| change | {'n/a' if change is None else f'{change:+.6f}'} |",
        "",
        "| # | prompt | before | after |",
        "|---|---|---|---|",
    ]
    for row in report["per_prompt"]:
        prompt = row["prompt"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {row['index']} | {prompt} | {_fmt(row['before'])} | {_fmt(row['after'])} |")
    lines += [
        "",
        f"![before | after]({GRID_PNG})",
        "",
        f"Rows: the prompts above, in order. Columns 1-{n}: the base model; columns {n + 1}-{2 * n}: the checkpoint; "
        f"column j and column {n} + j share a seed.",
        "",
    ]
    return "\n".join(lines)


def before_after_images(before: torch.Tensor, after: torch.Tensor, samples_per_prompt: int) -> torch.Tensor:
    """`[2B, 3, H, W]`: per prompt its `n` samples before, then its `n` samples after (a grid of `2n` columns)."""
    n = samples_per_prompt
    return torch.cat([torch.cat([b, a]) for b, a in zip(before.split(n), after.split(n), strict=True)])


def _write_report(result: CheckpointEvaluation, config: OmniFlowConfig, records: Sequence[PromptRecord]) -> None:
    """report.json, report.md and grid.png, written aside and renamed into `result.out_dir` (never half a report)."""
    out = result.out_dir
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        report = report_dict(result, config, records)
        (tmp / REPORT_JSON).write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
        (tmp / REPORT_MD).write_text(report_markdown(report))
        images = before_after_images(result.before.images, result.after.images, result.samples_per_prompt)
        save_image_grid(images, tmp / GRID_PNG, ncols=2 * result.samples_per_prompt)
        if out.exists():
            out.rmdir()  # an empty folder given as --out (require_new_folder checked it)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
