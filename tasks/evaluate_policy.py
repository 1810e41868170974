"""Pipeline stage 3 — `evaluate_policy`: sample and score the validation prompts with one set of weights
(verl-omni's `_validate()` on a loaded checkpoint, outside the training run), as a Ray task on the run's
device (the `evaluate` flow connects Ray), holding a GPU slot while it runs (`gpu_slots`)."""

from __future__ import annotations

from pathlib import Path

from omniflow.tasks.gpu_slots import gpu_slots
from prefect import task
from prefect.cache_policies import NO_CACHE

from omni_core.config import OmniFlowConfig
from omni_core.data.prompts import PromptRecord
from omni_core.evaluation import evaluate_on_ray
from omni_core.reports import save_image_grid


@task(name="evaluate_policy", cache_policy=NO_CACHE, task_run_name="evaluate_policy-{label}")
def evaluate_policy(
    config: OmniFlowConfig,
    records: list[PromptRecord],
    checkpoint: str | None,
    seed: int,
    samples_per_prompt: int,
    grid_path: str,
    label: str,
) -> tuple[float, str]:
    """(mean reward, grid PNG path): rows of the grid are prompts, columns their samples."""
    with gpu_slots(config, f"evaluate_policy-{label}", gpus=1 if config.trainer.device != "cpu" else 0):
        report = evaluate_on_ray(config, records, checkpoint, seed, samples_per_prompt)
    grid = save_image_grid(report.images, Path(grid_path), ncols=samples_per_prompt)
    print(f"{label}: mean reward {report.mean_reward:.6f} over {report.rewards.numel()} samples -> {grid}")
    return report.mean_reward, str(grid)
