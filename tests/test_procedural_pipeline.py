"""The `procedural-geneval` pipeline flow with tiny budgets, in-process on the session's Prefect API and Ray cluster:
every stage runs (data, pre-training to a plateau, evaluations, Flow-GRPO through main_diffusion_v1 as a nested
subflow, the supervised control), the report and result.json are written, and the control spends the RL stage's wall
time, which it reports."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.timeout(600)

# RL at test size: 2 prompts x 4 samples, one step.
SMALL_RL = [
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "trainer.logger=[console,file]",
    "trainer.concurrency.gpu_limit=null",  # conftest.flow_overrides: the test harness has no lease expiry
]


async def _runs_and_artifacts(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )

    async with get_client() as client:
        children = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
        )
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        names = [(await client.read_flow(c.flow_id)).name for c in children]
    return children, names, artifacts


@pytest.fixture(scope="module")
def short_run(prefect_api, ray_cluster, transfer_queue, tmp_path_factory):
    from omniflow.flows.procedural_geneval import procedural_geneval

    out = tmp_path_factory.mktemp("procedural")
    state = procedural_geneval(
        out_dir=str(out),
        seed=0,
        renders_per_combination=4,
        pretrain_max_seconds=400,  # a bound only: the plateau rule stops it (8 steps), however slow the machine
        pretrain_min_steps=0,
        pretrain_eval_every_steps=4,
        pretrain_patience=1,
        rl_steps=1,
        rl_overrides_extra=SMALL_RL,
        eval_samples_per_prompt=1,
        return_state=True,
    )
    assert state.is_completed(), state.message
    return state, state.result(), out


def test_every_stage_writes_its_output(short_run):
    _, result, out = short_run
    run = Path(result.run_dir)
    assert run.parent.parent == out / "seed_0"
    # The base: a whole pipeline folder with its history; the plateau rule stopped it (patience 1, no minimum).
    base = Path(result.base_dir)
    assert (base / "model_index.json").is_file() and (base / "transformer" / "config.json").is_file()
    assert result.pretrain["stopped"] == "plateau" and len(result.pretrain["history"]) == 2  # metric 0.0 twice: 8 steps
    assert result.pretrain["steps"] == 4 * len(result.pretrain["history"])
    # Flow-GRPO from the base: its checkpoint; the evaluations' grids and the reward curve.
    assert result.rl_run["steps"] == 1 and Path(result.rl_run["checkpoint"], "actor", "model.safetensors").is_file()
    assert len(result.rl_run["reward_curve"]) == 1 and 0.0 <= result.rl_run["reward_curve"][0] <= 1.0
    for name in ("base.png", "rl.png", "control.png", "rl_reward_curve.png"):
        assert (run / "eval" / name).stat().st_size > 0
    saved = json.loads((run / "result.json").read_text())
    assert saved["models"] == result.models and Path(result.report).read_text().startswith("# Procedural GenEval, seed 0")
    # Accuracies per model, bias and split; both biases of the default design are reported.
    for model in ("base", "rl", "control"):
        biases = result.models[model]["biases"]
        assert set(biases) == {"left drawn center", "blue square drawn red"}
        assert biases["left drawn center"]["prompts"] == 24 and biases["blue square drawn red"]["prompts"] == 10
        assert biases["left drawn center"]["samples"] == 24  # one sample per prompt (eval_samples_per_prompt=1)
        assert all(0.0 <= v <= 1.0 for v in result.models[model]["attributes"].values())
    assert set(result.stage_seconds) == {"data", "pretrain", "evaluate_base", "rl", "control", "evaluate_after"}


def test_the_control_spends_the_rl_stage_wall_time_and_reports_it(short_run):
    _, result, _ = short_run
    control = result.control_run
    assert control["budget_seconds"] == result.stage_seconds["rl"] > 0
    # It trains until the budget is spent and stops after the step that spent it: its last step began inside the
    # budget and the stage ended at or past it (both rounded to 0.01 s), however long a step takes on a busy machine.
    assert control["last_step_began"] < control["budget_seconds"] + 0.01
    assert control["seconds"] >= control["budget_seconds"] - 0.01
    assert control["steps"] >= 1
    saved = json.loads((Path(result.run_dir) / "control" / "pretrain.json").read_text())
    assert saved["budget_seconds"] == control["budget_seconds"] and saved["result"]["steps"] == control["steps"]


def test_the_run_shows_in_prefect_as_nested_subflows_with_a_report(short_run):
    state, result, _ = short_run
    children, names, artifacts = asyncio.run(_runs_and_artifacts(state.state_details.flow_run_id))
    assert names == ["main_diffusion_v1"] and children[0].state.is_completed()  # the RL branch: a nested subflow
    report = [a for a in artifacts if a.key == "omniflow-procedural-geneval"]
    assert len(report) == 1 and "| rl |" in report[0].data and "data:image/png;base64" in report[0].data


def test_a_finished_base_is_reused_and_never_overwritten(short_run):
    from omni_core.recipes.procedural_geneval.data import DataDesign
    from omni_core.recipes.procedural_geneval.supervised import SupervisedSettings, pretrain_to_plateau

    _, result, _ = short_run
    base = Path(result.base_dir)
    settings = SupervisedSettings(max_seconds=400, min_steps=0, eval_every_steps=4, patience=1, seed=0)
    design = DataDesign(renders_per_combination=4, split_seed=0)
    before = (base / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    again = pretrain_to_plateau(Path(result.run_dir).parents[1] / "init", base, design, settings)
    assert again.steps == result.pretrain["steps"] and again.history == result.pretrain["history"]
    with pytest.raises(FileExistsError, match="another design or settings"):
        pretrain_to_plateau(base, base, design, SupervisedSettings(lr=1e-3))
    assert (base / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() == before


def test_the_report_shows_the_trained_model_not_the_base_as_rl(short_run, tmp_path):
    """The "rl" row and grid are the RL checkpoint's own evaluation, and they are not the base's: evaluated again here
    from the checkpoint (the same function, threads and seeds as the flow's Ray task), the grid is bit for bit the
    report's `rl.png` and the accuracies its rl row; `base.png` differs. Evaluating the base as "rl" fails both.

    At this size the base learns next to nothing (in the runs measured: every accuracy 0, every RL reward 0, so the
    update's gradient 0 too), so the rows' percentages cannot tell the models apart; the grids can (AdamW's weight
    decay alone moves the weights off the base)."""
    import os

    import torch
    from omniflow.flows.procedural_geneval import design_from

    from omni_core.recipes.procedural_geneval.report import headline
    from omni_core.recipes.procedural_geneval.stages import evaluate_model

    _, result, _ = short_run
    eval_dir = Path(result.run_dir) / "eval"
    grids = {m: np.asarray(Image.open(eval_dir / f"{m}.png")) for m in ("base", "rl")}
    assert grids["base"].shape == grids["rl"].shape and not np.array_equal(grids["base"], grids["rl"])

    design = design_from(0, 0.7, 0.7, 0.0, 24, 4)  # the flow's defaults, renders_per_combination=4 as short_run
    threads = torch.get_num_threads()
    try:  # the Ray task's thread count (stages._threads), so that the kernels round the same way
        again = evaluate_model(result.base_dir, result.rl_run["checkpoint"], design, tmp_path / "rl.png", 1, 0, os.cpu_count())
    finally:
        torch.set_num_threads(threads)
    assert np.array_equal(np.asarray(Image.open(again["grid"])), grids["rl"])
    assert headline(again["summary"]) == result.models["rl"]
