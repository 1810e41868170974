"""`diffusion_rl_pipeline` end to end, in-process: tiny model built by the pipeline, real Ray and
TransferQueue, Prefect's test harness; the export is loaded the way a user would load it (diffusers
`from_pretrained` / `load_lora_weights`), and the evaluation's images are checked against diffusers' own
pipeline call from the same initial noise."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(600)

MODEL_PATH_KEY = "actor_rollout_ref.model.path="
EVAL_SEED, EVAL_SAMPLES, TILE, PAD = 1234, 2, 32, 2  # flow_overrides samples 32 px images, 4 steps
MAX_LEN = 32  # actor_rollout_ref.rollout.pipeline.max_sequence_length (SD3 pads T5 tokens to it)
VAL_PROMPTS = ["a green dot"]  # flow_prompts' val.txt


def _read(coro):
    return asyncio.run(coro)


async def _child_flow_runs(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    async with get_client() as client:
        return await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
        )


async def _artifacts(flow_run_ids: list) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async with get_client() as client:
        return await client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=flow_run_ids)))


def _grid_tiles(path: str | Path, n: int):
    """The `n` tiles of a one-row grid PNG as uint8 `[n, 3, TILE, TILE]` (lossless, so the evaluated images)."""
    import numpy as np
    import torch
    from PIL import Image

    pixels = torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1)
    return torch.stack([pixels[:, PAD : PAD + TILE, PAD + c * (TILE + PAD) : PAD + c * (TILE + PAD) + TILE] for c in range(n)])


def _plain_images(model_dir: str | Path):
    """The evaluation's samples drawn by diffusers' own `StableDiffusion3Pipeline.__call__` (loaded with
    `from_pretrained`) from the initial noise the evaluation derives for (seed, step 0, prompt, sample)."""
    import torch
    from diffusers import StableDiffusion3Pipeline

    from omni_core.rollout.sampler import derive_sample_seed

    pipe = StableDiffusion3Pipeline.from_pretrained(model_dir, local_files_only=True)
    channels, side = pipe.transformer.config.in_channels, TILE // pipe.vae_scale_factor
    gens = [torch.Generator().manual_seed(derive_sample_seed(EVAL_SEED, 0, 0, s)) for s in range(EVAL_SAMPLES)]
    latents = torch.stack([torch.randn(channels, side, side, generator=g) for g in gens])
    images = pipe(
        VAL_PROMPTS * EVAL_SAMPLES,
        height=TILE,
        width=TILE,
        num_inference_steps=4,
        guidance_scale=1.0,
        latents=latents,
        max_sequence_length=MAX_LEN,  # diffusers defaults to 256
        output_type="pt",
    ).images
    return (images * 255).round().to(torch.uint8)


# ----------------------------------------------------------------------------- fails fast
def test_missing_base_model_fails_before_training(prefect_api, tmp_path):
    from omniflow.flows.pipeline import diffusion_rl_pipeline

    missing = tmp_path / "no-model"
    state = diffusion_rl_pipeline(base_model=str(missing), build_tiny_if_missing=False, return_state=True)
    assert state.is_failed()
    assert "base_model=" in state.message and str(missing) in state.message and "build_tiny_if_missing" in state.message
    assert not missing.exists()
    # Nothing was trained: no main_diffusion_v1 (or any other) subflow ran.
    assert _read(_child_flow_runs(state.state_details.flow_run_id)) == []


def test_existing_model_of_another_arch_is_refused(tiny_sd3_dir):
    from omniflow.tasks.prepare_base_model import prepare_base_model

    from omni_core.models.loader import ModelLoadError

    assert prepare_base_model.fn(str(tiny_sd3_dir), False, "sd3") == str(Path(tiny_sd3_dir).resolve())
    with pytest.raises(ModelLoadError, match=r"base_model=.*arch='flux'"):
        prepare_base_model.fn(str(tiny_sd3_dir), True, "flux")


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def pipeline_run(prefect_api, ray_cluster, transfer_queue, flow_overrides, tmp_path_factory):
    from omniflow.flows.pipeline import diffusion_rl_pipeline

    root = tmp_path_factory.mktemp("pipeline")
    overrides = [o for o in flow_overrides if not o.startswith(MODEL_PATH_KEY)]
    overrides += ["trainer.total_epochs=1", "trainer.val_before_train=false", f"trainer.default_local_dir={root / 'ckpt'}"]
    # The evaluation subflow samples in this process: pin its thread count to the one the tests below
    # re-evaluate with (one_torch_thread), since CPU kernels may round differently per thread count.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        state = diffusion_rl_pipeline(
            base_model=str(root / "tiny"),  # absent: the pipeline builds the tiny model there
            overrides=overrides,
            eval_samples_per_prompt=EVAL_SAMPLES,
            eval_seed=EVAL_SEED,
            return_state=True,
        )
    finally:
        torch.set_num_threads(before)
    assert state.is_completed(), state.message
    return state, state.result(), overrides


def _evaluate(overrides: list[str], model_dir: str):
    from omni_core.config import resolve_config
    from omni_core.evaluation import evaluate_policy, evaluation_records

    cfg = resolve_config(None, [*overrides, MODEL_PATH_KEY + model_dir], [])
    return evaluate_policy(cfg, evaluation_records(cfg.data), None, EVAL_SEED, EVAL_SAMPLES)


def test_pipeline_trains_evaluates_and_exports(pipeline_run):
    _, result, _ = pipeline_run
    assert Path(result.base_model, "model_index.json").is_file()  # built by the pipeline
    assert result.train.global_step == 1 and Path(result.train.final_checkpoint).name == "global_step_1"
    assert math.isfinite(result.reward_before) and math.isfinite(result.reward_after)
    assert result.reward_before != result.reward_after  # one update with lr 1e-3 moves the images
    assert result.export_kind == "full"
    info = json.loads((Path(result.export_dir) / "export_info.json").read_text())
    assert info | {"out_dir": None} == {
        "base_model": result.base_model,
        "checkpoint": result.train.final_checkpoint,
        "step": 1,
        "kind": "full",
        "out_dir": None,
        "linked_files": info["linked_files"],  # the base's unchanged files, hard links (tests/test_export_handoff.py)
        "copied_files": 0,
        "registered_model": None,  # no mlflow tracker
    }
    assert info["linked_files"] > 0


def test_reward_before_is_the_base_model_and_matches_diffusers(pipeline_run, one_torch_thread):
    _, result, overrides = pipeline_run
    report = _evaluate(overrides, result.base_model)  # the base model, loaded afresh
    assert report.mean_reward == result.reward_before
    assert report.images.shape == (EVAL_SAMPLES, 3, TILE, TILE)  # 1 validation prompt x 2 samples
    before = _grid_tiles(result.grid_before, EVAL_SAMPLES)
    assert (before == report.images).all()
    # diffusers' own sampling loop from the same noise: equal up to rounding (test_models shows <= 1).
    assert (_plain_images(result.base_model).int() - before.int()).abs().max() <= 1


def test_export_is_the_trained_model(pipeline_run, one_torch_thread):
    import torch
    from diffusers import DiffusionPipeline, SD3Transformer2DModel
    from safetensors.torch import load_file

    _, result, overrides = pipeline_run
    trained = load_file(str(Path(result.train.final_checkpoint) / "actor" / "model.safetensors"))
    pipe = DiffusionPipeline.from_pretrained(result.export_dir, local_files_only=True)
    assert type(pipe).__name__ == "StableDiffusion3Pipeline"
    transformer = SD3Transformer2DModel.from_pretrained(Path(result.export_dir) / "transformer")
    for exported in (pipe.transformer.state_dict(), transformer.state_dict()):
        assert set(exported) == set(trained) and all(torch.equal(exported[k], v) for k, v in trained.items())
    # Scoring the exported folder as a base model reproduces the pipeline's "after" reward exactly, ...
    report = _evaluate(overrides, result.export_dir)
    assert report.mean_reward == result.reward_after
    after = _grid_tiles(result.grid_after, EVAL_SAMPLES)
    assert (after == report.images).all() and not (after == _grid_tiles(result.grid_before, EVAL_SAMPLES)).all()
    # ... and diffusers alone, from the same noise, draws the same "after" images.
    assert (_plain_images(result.export_dir).int() - after.int()).abs().max() <= 1


def test_grids_and_evaluation_artifact(pipeline_run):
    from PIL import Image

    state, result, _ = pipeline_run
    # One validation prompt (one row) x EVAL_SAMPLES columns of TILE px tiles, PAD px apart and around.
    expected = (EVAL_SAMPLES * TILE + (EVAL_SAMPLES + 1) * PAD, 1 * TILE + 2 * PAD)
    for grid in (result.grid_before, result.grid_after):
        assert Path(grid).parent == Path(result.train.checkpoint_dir) / "evaluation"
        assert Image.open(grid).size == expected
    children = _read(_child_flow_runs(state.state_details.flow_run_id))
    assert len(children) == 2  # main_diffusion_v1 and evaluate
    arts = _read(_artifacts([r.id for r in children]))
    evaluation = [a for a in arts if a.key == "omniflow-evaluation"]
    assert len(evaluation) == 1
    body = evaluation[0].data
    assert body.count("data:image/png;base64,") == 2
    assert f"{result.reward_before:.6f}" in body and f"{result.reward_after:.6f}" in body


# ----------------------------------------------------------------------------- LoRA export, no training run
def test_lora_export_loads_with_load_lora_weights(tiny_sd3_dir, tmp_path, one_torch_thread):
    """A LoRA checkpoint written by the real `TrainingActor.save`, exported, and read by diffusers."""
    import torch
    from diffusers import StableDiffusion3Pipeline

    from omni_core.config import resolve_config
    from omni_core.evaluation import load_policy
    from omni_core.export import export_checkpoint
    from omni_core.workers.training_actor import TrainingActor

    cfg = resolve_config(None, [MODEL_PATH_KEY + str(tiny_sd3_dir), "actor_rollout_ref.model.lora_rank=4"], [])
    actor = TrainingActor(cfg.model_dump(mode="json"), total_training_steps=1, num_threads=1)
    with torch.no_grad():  # move the adapter away from its zero start, as training would
        gen = torch.Generator().manual_seed(0)
        for name, p in actor.policy.named_trainable_parameters().items():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=gen)
    ckpt = tmp_path / "global_step_3"
    actor.save(str(ckpt))

    for _ in range(2):  # a second export replaces the first (written aside, renamed into place)
        info = export_checkpoint(tiny_sd3_dir, ckpt, tmp_path / "export")
    assert (info.kind, info.step) == ("lora", 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "global_step_3"]
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == [
        "README.md",
        "export_info.json",
        "pytorch_lora_weights.safetensors",
    ]

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3_dir, local_files_only=True)
    c = pipe.transformer.config
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(2, c.in_channels, 4, 4, generator=gen),
        timestep=torch.tensor([500.0, 250.0]),
        encoder_hidden_states=torch.randn(2, 7, c.joint_attention_dim, generator=gen),
        pooled_projections=torch.randn(2, c.pooled_projection_dim, generator=gen),
        return_dict=False,
    )
    with torch.no_grad():
        base = pipe.transformer(**inputs)[0]
        pipe.load_lora_weights(tmp_path / "export")
        loaded = pipe.transformer(**inputs)[0]
        trained = actor.policy.transformer(**inputs)[0]
        evaluated = load_policy(cfg, ckpt).transformer(**inputs)[0]  # what the evaluation scores
    assert (trained - base).abs().max() > 1e-4
    # fp32 rounding of the output's scale (the random adapter makes it ~1e3): on an AVX-512 CPU two copies of one
    # model differ by ~1 ulp in some layers (the same layer replayed on a copy of its input agrees bit for bit).
    atol = 8 * torch.finfo(torch.float32).eps * float(trained.abs().max())
    torch.testing.assert_close(loaded, trained, rtol=0, atol=atol)
    torch.testing.assert_close(evaluated, trained, rtol=0, atol=atol)


def test_export_refuses_a_folder_that_is_not_an_earlier_export(tiny_sd3_dir, tmp_path):
    from omni_core.export import export_checkpoint

    ckpt = tmp_path / "global_step_1"
    (ckpt / "actor" / "hf").mkdir(parents=True)
    precious = tmp_path / "mine"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="export_dir=.*not empty"):
        export_checkpoint(tiny_sd3_dir, ckpt, precious)
    assert (precious / "notes.txt").read_text() == "keep me"
