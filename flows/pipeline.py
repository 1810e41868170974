"""`diffusion_rl_pipeline`: an ML pipeline around the main job, with `main_diffusion_v1` as a subflow.

The stages:

  1. prepare_base_model   build the tiny model if asked and missing, or check the local model folder
  2. main_diffusion_v1    Flow-GRPO fine-tuning of that model (the main job, as a subflow)
  3. evaluate             a subflow: the validation prompts sampled with the initial and the final weights
                          at the same seeds; mean reward before / after and both image grids
  4. export_model         the trained transformer or LoRA adapter in diffusers format

Deployable as `omniflow.flows.pipeline:diffusion_rl_pipeline`; the result is a typed `PipelineResult`.
CLI: `python -m omniflow.flows.pipeline [--base-model DIR] [CONFIG.yaml ...] [key.path=value ...]`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal

from omniflow.flows.library_use import flow_with_embedded_api
from omniflow.flows.main_diffusion_v1 import TrainResult, main_diffusion_v1
from omniflow.flows.runner import shutdown_ray
from omniflow.tasks.evaluate_policy import evaluate_policy
from omniflow.tasks.export_model import export_model
from omniflow.tasks.prepare_base_model import prepare_base_model
from omniflow.tasks.publish_reports import publish_card
from prefect import flow
from pydantic import BaseModel, Field

from omni_core.config import OmniFlowConfig, resolve_config
from omni_core.device import auto_set_device
from omni_core.distributed.ray_cluster import connect_ray
from omni_core.evaluation import evaluation_records
from omni_core.models.architectures import ARCHITECTURES
from omni_core.reports.cards import evaluation_card

# The names of `ARCHITECTURES`, spelled out: a Literal is what gives the Prefect form its choices and type checkers
# the names, and it cannot be computed from the table statically (tests/test_extension_tables.py checks they agree).
ArchName = Literal["sd3", "flux", "qwen-image"]

EVAL_DIR = "evaluation"
EXPORT_DIR = "export"


class EvaluationResult(BaseModel):
    """Mean reward of the validation prompts before and after training, and the two image grids."""

    reward_before: float = Field(description="Mean reward with the initial weights.")
    reward_after: float = Field(description="Mean reward with the trained weights.")
    grid_before: str = Field(description="PNG grid of the initial weights' samples (rows: prompts).")
    grid_after: str = Field(description="PNG grid of the trained weights' samples (rows: prompts).")


class PipelineResult(BaseModel):
    """What `diffusion_rl_pipeline` returns."""

    base_model: str = Field(description="The diffusers folder that was fine-tuned.")
    train: TrainResult = Field(description="The fine-tuning run's result.")
    reward_before: float = Field(description="Mean evaluation reward with the initial weights.")
    reward_after: float = Field(description="Mean evaluation reward with the trained weights.")
    grid_before: str = Field(description="PNG grid of the initial weights' evaluation samples.")
    grid_after: str = Field(description="PNG grid of the trained weights' evaluation samples.")
    export_dir: str = Field(description="Folder of the exported model (diffusers format).")
    export_kind: str = Field(description='"full" (a whole pipeline folder) or "lora" (an adapter file).')


def model_override(base_model: str) -> str:
    return f"actor_rollout_ref.model.path={base_model}"


@flow(name="evaluate", log_prints=True)
def evaluate(
    config: OmniFlowConfig | None,
    overrides: list[str],
    config_files: list[str],
    checkpoint: str,
    out_dir: str,
    seed: Annotated[int, Field(ge=0)] = 1234,
    samples_per_prompt: Annotated[int, Field(ge=1)] = 2,
) -> EvaluationResult:
    """Sample the validation prompts with the initial and the trained weights at the same seeds.

    Args:
        config: The training config (as given to `main_diffusion_v1`).
        overrides: `key.path=value` overrides on top of it, including the model path.
        config_files: YAML config files read when `config` is empty.
        checkpoint: The trained checkpoint folder (`global_step_N`).
        out_dir: Folder for `before.png` and `after.png`.
        seed: Base seed of every sample's noise, shared by both evaluations.
        samples_per_prompt: Samples per validation prompt (grid columns).
    """
    cfg = auto_set_device(resolve_config(config, overrides, config_files))
    records = evaluation_records(cfg.data)
    out = Path(out_dir)
    owns_ray = connect_ray(cfg)  # the evaluation runs where the model runs: a Ray task on the run's device
    try:
        before, grid_before = evaluate_policy(cfg, records, None, seed, samples_per_prompt, str(out / "before.png"), "before")
        after, grid_after = evaluate_policy(cfg, records, checkpoint, seed, samples_per_prompt, str(out / "after.png"), "after")
    finally:
        if owns_ray:
            shutdown_ray()
    card = evaluation_card(before, after, grid_before, grid_after, len(records), samples_per_prompt, seed, checkpoint)
    publish_card("omniflow-evaluation", card)
    return EvaluationResult(reward_before=before, reward_after=after, grid_before=grid_before, grid_after=grid_after)


# Persisted as JSON like main_diffusion_v1's TrainResult: a parent flow reads the PipelineResult of a deployment run.
# Called from plain Python with no Prefect API, it starts the embedded one (flows/library_use.py).
@flow_with_embedded_api(name="diffusion-rl-pipeline", log_prints=True, persist_result=True, result_serializer="json")
def diffusion_rl_pipeline(
    base_model: str = "models/tiny-sd3",
    build_tiny_if_missing: bool = True,
    arch: ArchName = "sd3",
    config: OmniFlowConfig | None = None,
    overrides: list[str] = [],  # noqa: B006  (Prefect parameters are copied per run)
    config_files: list[str] = [],  # noqa: B006
    new_experiment_per_run: bool = False,
    eval_samples_per_prompt: Annotated[int, Field(ge=1, le=64)] = 2,
    eval_seed: Annotated[int, Field(ge=0)] = 1234,
    export_dir: str | None = None,
) -> PipelineResult:
    """Prepare a base model, fine-tune it with Flow-GRPO, evaluate it before / after, export it.

    Args:
        base_model: Diffusers pipeline folder to fine-tune (it overrides `actor_rollout_ref.model.path`).
        build_tiny_if_missing: Build the tiny random-weight test model in `base_model` if that folder
            holds no pipeline; otherwise a missing model fails the run before any training.
        arch: Architecture of the base model (`sd3`: StableDiffusion3Pipeline, `flux`: FluxPipeline, `qwen-image`:
            QwenImagePipeline); the tiny model is built with it, and an existing folder must hold it.
        config: The training config (verl-omni key paths), as for `main_diffusion_v1`.
        overrides: verl-style `key.path=value` strings applied on top of the config.
        config_files: YAML config files read in order when `config` is empty.
        new_experiment_per_run: Train a new experiment named after this run instead of resuming.
        eval_samples_per_prompt: Samples per validation prompt in the before / after evaluation.
        eval_seed: Base seed of the evaluation noise (the same for the initial and trained weights).
        export_dir: Where to export the trained model; default `<checkpoint_dir>/export`.
    """
    base = prepare_base_model(base_model, build_tiny_if_missing, arch)
    train_overrides = [*overrides, model_override(base)]
    train = main_diffusion_v1(
        config=config, overrides=train_overrides, config_files=config_files, new_experiment_per_run=new_experiment_per_run
    )
    if train.final_checkpoint is None:
        raise ValueError(f"training wrote no checkpoint under {train.checkpoint_dir}; set trainer.total_epochs >= 1")
    evaluation = evaluate(
        config,
        train_overrides,
        config_files,
        train.final_checkpoint,
        str(Path(train.checkpoint_dir) / EVAL_DIR),
        eval_seed,
        eval_samples_per_prompt,
    )
    exported = export_model(base, train.final_checkpoint, export_dir or str(Path(train.checkpoint_dir) / EXPORT_DIR))
    return PipelineResult(
        base_model=base,
        train=train,
        reward_before=evaluation.reward_before,
        reward_after=evaluation.reward_after,
        grid_before=evaluation.grid_before,
        grid_after=evaluation.grid_after,
        export_dir=exported.out_dir,
        export_kind=exported.kind,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m omniflow.flows.pipeline [--base-model DIR] [...] [CONFIG.yaml ...] [key.path=value ...]`.

    Runs the pipeline against the embedded Prefect API (or `PREFECT_API_URL`) through the same runner as
    `omniflow train`; Ctrl-C / SIGTERM stop it cleanly.
    """
    import argparse

    from omniflow.flows.runner import run_flow_from_cli, split_files_and_overrides

    parser = argparse.ArgumentParser(prog="python -m omniflow.flows.pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-model", default="models/tiny-sd3", help="diffusers folder (the tiny model is built if absent)")
    parser.add_argument("--arch", choices=list(ARCHITECTURES), default="sd3")
    parser.add_argument("--no-build", action="store_true", help="fail instead of building the tiny model")
    parser.add_argument("--new-experiment", action="store_true", help="new_experiment_per_run=true")
    parser.add_argument("--eval-samples", type=int, default=2, help="samples per validation prompt")
    parser.add_argument("--eval-seed", type=int, default=1234)
    parser.add_argument("--export-dir", default=None, help="default <checkpoint_dir>/export")
    parser.add_argument("args", nargs="*", help="YAML config files, then key.path=value overrides")
    ns = parser.parse_args(argv)
    files, overrides = split_files_and_overrides(ns.args)
    parameters = {
        "base_model": ns.base_model,
        "build_tiny_if_missing": not ns.no_build,
        "arch": ns.arch,
        "overrides": overrides,
        "config_files": files,
        "new_experiment_per_run": ns.new_experiment,
        "eval_samples_per_prompt": ns.eval_samples,
        "eval_seed": ns.eval_seed,
        "export_dir": ns.export_dir,
    }
    return run_flow_from_cli("pipeline", "omniflow.flows.pipeline:diffusion_rl_pipeline", parameters, _report)


def _report(result: PipelineResult) -> None:
    print(f"pipeline: mean reward {result.reward_before:.6f} -> {result.reward_after:.6f} (evaluation, before -> after)")
    print(f"pipeline: grids {result.grid_before} {result.grid_after}")
    print(f"pipeline: checkpoints {result.train.checkpoint_dir}; {result.export_kind} export {result.export_dir}")


if __name__ == "__main__":
    sys.exit(main())
