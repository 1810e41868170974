"""The stages of the procedural benchmark as plain functions, each one call for a pipeline task, the Ray tasks
that run the heavy ones (supervised training, evaluation) where the model runs, and its Flow-GRPO run (`rl.yaml` plus
`rl_overrides`).

Layout of a benchmark folder `root`:
  init/                  the random-weight pixel-space SD3 pipeline (`model.build_procedural_pipeline`)
  prompts/seen.jsonl     RL training prompts (seen combinations), `procedural_geneval` rows
  prompts/held_out.jsonl the held-out combinations (never trained on)
  base/                  the supervised base at its plateau (`supervised.pretrain_to_plateau`)
  control/               the matched control (`supervised.continue_supervised`)
  rl/                    the Flow-GRPO run's checkpoints (main_diffusion_v1's trainer.default_local_dir)
  eval/<label>.png       image grids of the same prompts and seeds per model
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from omni_core.checkpoint.trained import open_trained_checkpoint
from omni_core.config import load_config
from omni_core.evaluation import load_checkpoint_weights
from omni_core.models.policy import FlowPolicy
from omni_core.recipes.procedural_geneval.data import DataDesign, write_prompt_file
from omni_core.recipes.procedural_geneval.evaluation import evaluate_scenes
from omni_core.recipes.procedural_geneval.model import IMAGE_SIZE, build_procedural_pipeline
from omni_core.recipes.procedural_geneval.scenes import Scene
from omni_core.recipes.procedural_geneval.supervised import (
    SupervisedResult,
    SupervisedSettings,
    continue_supervised,
    default_device,
    pretrain_to_plateau,
)
from omni_core.reports.images import save_image_grid

__all__ = [
    "grid_scenes",
    "ProceduralData",
    "evaluate_model",
    "prepare_data",
    "rl_config_file",
    "rl_overrides",
]

RL_CONFIG = Path(__file__).with_name("rl.yaml")

# Reward attributes of the RL prompt files: what the verifier's score counts. Not shape: the supervised base never
# learns it at this size (its shape accuracy stays at chance, ~30%), so a shape term only adds noise to the
# advantages and invites the verifier exploit the feasibility study saw; shape is still evaluated and reported.
REWARD_ATTRIBUTES = ("colour", "position")


@dataclass(frozen=True)
class ProceduralData:
    """Where a benchmark's inputs are."""

    root: str
    init_model: str
    seen_prompts: str
    held_out_prompts: str
    n_seen: int
    n_held_out: int


def prepare_data(root: str | Path, design: DataDesign, model_seed: int = 0) -> ProceduralData:
    """Build the random-weight model (once) and write the seen / held-out prompt files of `design`."""
    root = Path(root)
    init = root / "init"
    if not (init / "model_index.json").is_file():
        build_procedural_pipeline(init, seed=model_seed)
    seen, held = design.split()
    return ProceduralData(
        root=str(root),
        init_model=str(init),
        seen_prompts=str(write_prompt_file(root / "prompts" / "seen.jsonl", seen, REWARD_ATTRIBUTES)),
        held_out_prompts=str(write_prompt_file(root / "prompts" / "held_out.jsonl", held, REWARD_ATTRIBUTES)),
        n_seen=len(seen),
        n_held_out=len(held),
    )


def load_model(model_dir: str | Path, checkpoint: str | Path | None = None) -> FlowPolicy:
    """The pipeline in `model_dir`, with a training checkpoint's weights (its EMA when it kept one) if given. A LoRA
    run's checkpoint (`model.lora_rank` > 0: DiffusionNFT's, or a Flow-GRPO run set so) holds an adapter: the one its
    saved config describes (rank, alpha, target modules) is attached first."""
    lora: dict = {}
    if checkpoint is not None:
        ckpt = open_trained_checkpoint(checkpoint)
        if ckpt.is_lora:
            model = load_config([ckpt.config_file]).actor_rollout_ref.model
            lora = {
                "lora_rank": model.lora_rank,
                "lora_alpha": model.lora_alpha,
                "lora_init_weights": model.lora_init_weights,
                "target_modules": model.target_modules,
            }
    policy = FlowPolicy(model_dir, trainable=False, device=default_device(), **lora)
    if checkpoint is not None:
        load_checkpoint_weights(policy, checkpoint)
    return policy


def grid_scenes(design: DataDesign) -> list[Scene]:
    """The prompts of the before / after image grids: for each bias, its seen and held-out corrupted prompts first,
    then a few others (at most 12 rows)."""
    seen, held = design.split()
    picked: list[Scene] = []
    for bias in design.biases:
        picked += [s for s in held if bias.applies_to(s)][:2] + [s for s in seen if bias.applies_to(s)][:2]
    picked += [s for s in seen if not any(b.applies_to(s) for b in design.biases)][:4]
    return list(dict.fromkeys(picked))[:12]


def evaluate_model(
    model_dir: str | Path,
    checkpoint: str | Path | None,
    design: DataDesign,
    grid_path: str | Path,
    samples_per_prompt: int = 2,
    seed: int = 0,
    threads: int | None = None,
) -> dict:
    """Evaluate one model on all scenes (verifier summary) and draw the image grid of `grid_scenes` at the same
    seeds; returns `{"summary": ..., "grid": path}`."""
    if threads:
        torch.set_num_threads(threads)
    _, held = design.split()
    policy = load_model(model_dir, checkpoint)
    summary = evaluate_scenes(policy, held, samples_per_prompt=samples_per_prompt, seed=seed, image_size=IMAGE_SIZE).summary(
        design.biases
    )
    rows = grid_scenes(design)
    grid = evaluate_scenes(policy, held, scenes=rows, samples_per_prompt=4, seed=seed + 1, image_size=IMAGE_SIZE)
    path = save_image_grid(grid.images, Path(grid_path), ncols=4)
    return {"summary": summary, "grid": str(path), "grid_prompts": [s.prompt for s in rows]}


def rl_config_file() -> str:
    """The recipe's Flow-GRPO run as a config file (`rl.yaml`, package data): main_diffusion_v1's `config_files`."""
    return str(RL_CONFIG)


def rl_overrides(data: ProceduralData, model_dir: str | Path, checkpoint_dir: str | Path, steps: int, seed: int) -> list[str]:
    """What one Flow-GRPO run of the benchmark sets on top of `rl.yaml` (8 prompts x 8 samples per step, 2 optimizer
    steps per step, lr 1e-4, clip 1e-4, an SDE window of 3 of 10 steps starting in 0..3, noise level 1.0, KL 0.04 to
    the base; the `procedural_geneval` reward, colour and position, read from the prompt files): the model it starts
    from, its prompts, its length, its checkpoint folder and its seed."""
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={data.seen_prompts}",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={checkpoint_dir}",
        f"actor_rollout_ref.rollout.seed={seed}",
    ]


def reward_curve(log_dir: str | Path) -> list[float]:
    """Mean training reward per step of a run (its metrics.jsonl)."""
    path = Path(log_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [float(r["critic/rewards/mean"]) for r in rows if "critic/rewards/mean" in r]


# ----------------------------------------------------------------------------- Ray tasks
def _threads() -> int:
    return max(1, os.cpu_count() or 1)


def pretrain_on_ray(
    init_dir: str, base_dir: str, design: DataDesign, settings: SupervisedSettings, **ray_options
) -> SupervisedResult:
    import ray

    remote = ray.remote(lambda *a: pretrain_to_plateau(*a, threads=_threads())).options(**ray_options, max_retries=0)
    return ray.get(remote.remote(init_dir, base_dir, design, settings))


def control_on_ray(
    base_dir: str, out_dir: str, design: DataDesign, budget_seconds: float, settings: SupervisedSettings, **ray_options
) -> SupervisedResult:
    import ray

    remote = ray.remote(lambda *a: continue_supervised(*a, threads=_threads())).options(**ray_options, max_retries=0)
    return ray.get(remote.remote(base_dir, out_dir, design, budget_seconds, settings))


def evaluate_on_ray(
    model_dir: str, checkpoint: str | None, design: DataDesign, grid_path: str, samples_per_prompt: int, seed: int, **ray_options
) -> dict:
    import ray

    remote = ray.remote(lambda *a: evaluate_model(*a, threads=_threads())).options(**ray_options, max_retries=0)
    return ray.get(remote.remote(model_dir, checkpoint, design, grid_path, samples_per_prompt, seed))
