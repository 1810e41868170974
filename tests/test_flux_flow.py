"""FLUX (FluxPipeline): distilled guidance and true CFG kept apart as diffusers keeps them (`guidance_scale` feeds only the
guidance embedding, `true_cfg_scale` is CFG with negative prompts), rollout equal to the pipeline with true CFG,
on-policy ratio exactly 1 through true CFG, and the whole main flow on the tiny FLUX model."""

from __future__ import annotations

import pytest
import torch

from omni_core.models.policy import FlowPolicy
from omni_core.rollout.sampler import _generators, derive_sample_seed, generate, score_transitions
from omni_core.rollout.sampling_params import SamplingParams
from omni_core.rollout.trajectory import Trajectory

SIZE, STEPS, MAX_LEN, GUIDANCE = 32, 4, 16, 3.5


@pytest.fixture(scope="module")
def flux_policy(tiny_flux_dir):
    return FlowPolicy(tiny_flux_dir)


def _ode(policy: FlowPolicy, negative: str | None, guidance_scale: float, true_cfg_scale: float):
    params = SamplingParams(
        n=1,
        seed=0,
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=guidance_scale,
        true_cfg_scale=true_cfg_scale,
        noise_level=0.0,
        max_sequence_length=MAX_LEN,
        calculate_log_probs=False,
        fixed_noise=True,
    )
    negs = params.negative_prompts([negative])  # None without a scale above 1; a missing negative prompt is ""
    return generate(policy, ["a red cat"], negs, **params.generate_kwargs(global_step=0))


def test_guidance_scale_feeds_only_the_guidance_embedding(flux_policy, one_torch_thread):
    with_negative = _ode(flux_policy, "blurry", GUIDANCE, 1.0)
    assert "negative_prompt_embeds" not in with_negative.cond  # no CFG: one forward per step
    assert torch.equal(with_negative.images, _ode(flux_policy, None, GUIDANCE, 1.0).images)
    assert not torch.equal(with_negative.images, _ode(flux_policy, None, 1.0, 1.0).images)  # the embedding is fed


@pytest.mark.parametrize("negative", ["blurry", None])
def test_true_cfg_matches_the_diffusers_pipeline(flux_policy, negative, one_torch_thread):
    ours = _ode(flux_policy, negative, GUIDANCE, 2.0)
    assert "negative_prompt_embeds" in ours.cond
    latents = flux_policy.prepare_latents(1, SIZE, SIZE, _generators([derive_sample_seed(0, 0, 0, 0)]))
    theirs = flux_policy.pipeline(
        "a red cat",
        negative_prompt=negative or "",  # SamplingParams: a missing negative prompt is ""
        true_cfg_scale=2.0,
        guidance_scale=GUIDANCE,
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        latents=latents,
        max_sequence_length=MAX_LEN,
        output_type="pt",
    ).images
    theirs = (theirs * 255).round().to(torch.uint8)
    assert (ours.images.int() - theirs.int()).abs().max() <= 1
    assert not torch.equal(ours.images, _ode(flux_policy, negative, GUIDANCE, 1.0).images)


def test_rescoring_through_true_cfg_gives_ratio_exactly_one(flux_policy, one_torch_thread):
    kwargs = dict(n=2, seed=7, global_step=3, height=SIZE, width=SIZE, num_inference_steps=STEPS, noise_level=0.7)
    traj = generate(
        flux_policy,
        ["a red circle", "two dogs"],
        ["blurry", ""],
        guidance_scale=GUIDANCE,
        true_cfg_scale=2.0,
        sde_window_size=2,
        sde_window_range=(0, 3),
        max_sequence_length=MAX_LEN,
        **kwargs,
    )
    traj = Trajectory.from_columns(traj.to_columns())
    for j in range(traj.window_size):
        score = score_transitions(flux_policy, traj, j, guidance_scale=GUIDANCE, true_cfg_scale=2.0, noise_level=0.7)
        ratio = torch.exp(score.log_prob - traj.log_probs[:, j])
        assert torch.equal(ratio, torch.ones_like(ratio)), f"step {j}: ratio {ratio.tolist()}"
        # the same samples re-scored without true CFG are another policy: the ratio moves
        plain = score_transitions(flux_policy, traj, j, guidance_scale=GUIDANCE, noise_level=0.7)
        assert not torch.equal(plain.log_prob, score.log_prob)


@pytest.mark.timeout(600)
def test_main_flow_trains_and_exports_flux(prefect_api, ray_cluster, transfer_queue, flow_overrides, tiny_flux_dir, tmp_path):
    from diffusers import FluxPipeline
    from flow_utils import train_one_epoch_and_export

    # One step, a checkpoint, a finite reward, a first ratio of exactly 1 through true CFG, the trained export.
    train_one_epoch_and_export(
        flow_overrides,
        tiny_flux_dir,
        tmp_path,
        FluxPipeline,
        [
            f"actor_rollout_ref.rollout.pipeline.guidance_scale={GUIDANCE}",
            "actor_rollout_ref.rollout.pipeline.true_cfg_scale=2.0",
        ],
    )
