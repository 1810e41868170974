"""Qwen-Image (QwenImagePipeline): the tiny offline model, rollout equal to diffusers' pipeline (with and without true
CFG), the norm-preserving CFG, on-policy ratio exactly 1, prompt embeddings, LoRA export, the guidance rules, and
the whole main flow on it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from omni_core.models.policy import FlowPolicy
from omni_core.rollout.sampler import _generators, derive_sample_seed, generate, score_transitions
from omni_core.rollout.trajectory import Trajectory

SIZE, STEPS, MAX_LEN = 32, 4, 32
PROMPTS = ["a red cat", "two blue squares"]


@pytest.fixture(scope="module")
def qwen_policy(tiny_qwen_image_dir):
    return FlowPolicy(tiny_qwen_image_dir)


def _ode_trajectory(policy: FlowPolicy, prompt: str, negative: str | None, true_cfg_scale: float) -> Trajectory:
    """The ODE sample (noise_level 0) of seed 0, every step recorded: `latents[:, -1]` is the final latent."""
    negs = None if negative is None else [negative]
    kwargs = dict(n=1, seed=0, global_step=0, height=SIZE, width=SIZE, num_inference_steps=STEPS, noise_level=0.0)
    return generate(
        policy,
        [prompt],
        negs,
        true_cfg_scale=true_cfg_scale,
        max_sequence_length=MAX_LEN,
        calculate_log_probs=False,
        sde_window_size=STEPS,
        sde_window_range=[0, STEPS],
        **kwargs,
    )


def _ode(policy: FlowPolicy, prompt: str, negative: str | None, true_cfg_scale: float) -> torch.Tensor:
    return _ode_trajectory(policy, prompt, negative, true_cfg_scale).images


# ----------------------------------------------------------------------------- the tiny model
def test_tiny_tokenizer_template_prefix_is_the_34_tokens_the_pipeline_drops(qwen_policy):
    pipe = qwen_policy.pipeline
    template, drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    assert drop == 34
    prefix = template.split("{}")[0]
    ids = pipe.tokenizer(template.format("a red cat")).input_ids
    assert len(pipe.tokenizer(prefix).input_ids) == drop
    assert pipe.tokenizer.convert_ids_to_tokens(ids[drop : drop + 3]) == ["a", "Ġred", "Ġcat"]
    assert type(pipe).__name__ == "QwenImagePipeline" and type(pipe.text_encoder).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert qwen_policy.latent_shape(SIZE, SIZE) == (64, 64)  # (32/2/2)^2 packed tokens of 16 x 2 x 2 channels


def test_make_tiny_model_cli_builds_it(tmp_path):
    from omniflow.flows.cli import main

    assert main(["make-tiny-model", str(tmp_path / "q"), "--arch", "qwen-image"]) == 0
    assert json.loads((tmp_path / "q" / "model_index.json").read_text())["_class_name"] == "QwenImagePipeline"


# ----------------------------------------------------------------------------- rollout == diffusers
@pytest.mark.parametrize("true_cfg_scale,negative", [(1.0, None), (4.0, "blurry")])
def test_ode_sampling_matches_the_diffusers_pipeline(qwen_policy, true_cfg_scale, negative, one_torch_thread):
    traj = _ode_trajectory(qwen_policy, "a red cat", negative, true_cfg_scale)
    ours = traj.images
    latents = qwen_policy.prepare_latents(1, SIZE, SIZE, _generators([derive_sample_seed(0, 0, 0, 0)]))
    call = dict(
        negative_prompt=negative,
        true_cfg_scale=true_cfg_scale,
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        latents=latents,
        max_sequence_length=MAX_LEN,
    )
    theirs = qwen_policy.pipeline("a red cat", output_type="pt", **call).images
    theirs = (theirs * 255).round().to(torch.uint8)
    assert ours.shape == (1, 3, SIZE, SIZE) and ours.float().std() > 0
    assert (ours.int() - theirs.int()).abs().max() <= 1  # uint8 rounding of two float paths
    # The final latent, before the VAE and the rounding to 8 bits: equal to fp32 round-off (measured 2e-6 of a
    # max |latent| of 4.2). Plain CFG without QwenImagePipeline's rescale to the conditional norm moves it by 8e-3,
    # which the 8-bit images hide (at most 1 level).
    final = qwen_policy.pipeline("a red cat", output_type="latent", **call).images
    torch.testing.assert_close(traj.latents[:, -1], final, rtol=0, atol=1e-4)


def test_true_cfg_changes_the_image_and_needs_a_negative_prompt(qwen_policy, one_torch_thread):
    plain = _ode(qwen_policy, "a red cat", None, 1.0)
    assert torch.equal(_ode(qwen_policy, "a red cat", None, 4.0), plain)  # no negative prompt: no CFG (the pipeline's rule)
    assert torch.equal(_ode(qwen_policy, "a red cat", "blurry", 1.0), plain)  # scale 1: no CFG
    assert not torch.equal(_ode(qwen_policy, "a red cat", "blurry", 4.0), plain)


def test_combine_cfg_rescales_to_the_conditional_norm(qwen_policy):
    uncond, cond = torch.tensor([[[1.0, 0.0]]]), torch.tensor([[[0.0, 1.0]]])
    # linear: [1, 0] + 2 * ([0, 1] - [1, 0]) = [-1, 2], norm sqrt(5); rescaled to |cond| = 1: [-1, 2] / sqrt(5)
    got = qwen_policy.arch.combine_cfg(uncond, cond, 2.0)
    torch.testing.assert_close(got, torch.tensor([[[-1.0, 2.0]]]) / math.sqrt(5))
    sd3_like = super(type(qwen_policy.arch), qwen_policy.arch)  # the base class's plain combination
    torch.testing.assert_close(sd3_like.combine_cfg(uncond, cond, 2.0), torch.tensor([[[-1.0, 2.0]]]))


def test_padded_prompt_rows_stack_with_their_mask(qwen_policy):
    cond = qwen_policy.encode_prompts(PROMPTS, ["", "blurry"], MAX_LEN, do_cfg=True)
    assert sorted(cond) == ["negative_prompt_embeds", "negative_prompt_embeds_mask", "prompt_embeds", "prompt_embeds_mask"]
    assert cond["prompt_embeds"].shape == (2, MAX_LEN, 32) and cond["prompt_embeds_mask"].shape == (2, MAX_LEN)
    # After the 34 dropped tokens: the prompt's tokens, then "<|im_end|>", "\n", "<|im_start|>", "assistant", "\n".
    tokens = [len(qwen_policy.pipeline.tokenizer(text).input_ids) for text in [*PROMPTS, "", "blurry"]]
    assert tokens == [3, 6, 0, 6]  # "a", "Ġred", "Ġcat"; "t", "w", "o", "Ġblue", "Ġsquare", "s"; ...
    assert cond["prompt_embeds_mask"].sum(1).tolist() == [3 + 5, 6 + 5]
    assert cond["negative_prompt_embeds_mask"].sum(1).tolist() == [0 + 5, 6 + 5]
    assert cond["prompt_embeds"][0, 8:].abs().sum() == 0 and cond["prompt_embeds"][0, :8].abs().sum() > 0  # zero padding


# ----------------------------------------------------------------------------- log-probs
def test_rescoring_with_unchanged_weights_gives_ratio_exactly_one(tiny_qwen_image_dir, one_torch_thread):
    policy = FlowPolicy(tiny_qwen_image_dir, lora_rank=4, target_modules=["to_q", "to_k", "to_v", "add_q_proj"])
    kwargs = dict(n=2, seed=7, global_step=3, height=SIZE, width=SIZE, num_inference_steps=STEPS, noise_level=0.7)
    traj = generate(
        policy,
        PROMPTS,
        ["blurry", ""],
        true_cfg_scale=4.0,
        sde_window_size=2,
        sde_window_range=(0, 3),
        max_sequence_length=MAX_LEN,
        **kwargs,
    )
    assert "negative_prompt_embeds_mask" in traj.cond  # the CFG path is the one re-scored
    traj = Trajectory.from_columns(traj.to_columns())  # the TransferQueue row schema and back
    for j in range(traj.window_size):
        score = score_transitions(policy, traj, j, guidance_scale=1.0, true_cfg_scale=4.0, noise_level=0.7)
        ratio = torch.exp(score.log_prob - traj.log_probs[:, j])
        assert torch.equal(ratio, torch.ones_like(ratio)), f"step {j}: ratio {ratio.tolist()}"
        assert score.log_prob.requires_grad
        detached = score_transitions(policy, traj, j, guidance_scale=1.0, true_cfg_scale=4.0, noise_level=0.7, detach_uncond=True)
        assert torch.equal(detached.log_prob, score.log_prob)  # detach_uncond changes gradients only


# ----------------------------------------------------------------------------- prompt embeddings
def test_prompt_embeddings_file_equals_a_fresh_encoding(qwen_policy, tiny_qwen_image_dir, tmp_path, one_torch_thread):
    from omni_core.models.prompt_embeddings import PromptEmbeddings, encode_prompt_set

    file = encode_prompt_set(tiny_qwen_image_dir, [*PROMPTS, "blurry"], MAX_LEN, tmp_path / "q.safetensors")
    cached = PromptEmbeddings(file)
    assert cached.architecture == "QwenImagePipeline" and cached.cond_keys == ("prompt_embeds", "prompt_embeds_mask")
    for prompt in PROMPTS:
        got = cached.cond([prompt], ["blurry"], True, "cpu")
        want = qwen_policy.encode_prompts([prompt], ["blurry"], MAX_LEN, do_cfg=True)
        assert list(got) == list(want)
        for k in want:
            assert torch.equal(got[k], want[k]), (prompt, k)
    # A policy without text encoders samples the same images from the file.
    lean = FlowPolicy(tiny_qwen_image_dir, text_encoders=False, prompt_embeddings=file)
    assert torch.equal(_ode(lean, PROMPTS[0], "blurry", 4.0), _ode(qwen_policy, PROMPTS[0], "blurry", 4.0))


# ----------------------------------------------------------------------------- LoRA export
def test_lora_export_loads_with_load_lora_weights(tiny_qwen_image_dir, tmp_path, one_torch_thread):
    from diffusers import QwenImagePipeline

    from omni_core.config import resolve_config
    from omni_core.export import export_checkpoint
    from omni_core.workers.training_actor import TrainingActor

    overrides = [f"actor_rollout_ref.model.path={tiny_qwen_image_dir}", "actor_rollout_ref.model.lora_rank=4"]
    actor = TrainingActor(resolve_config(None, overrides, []).model_dump(mode="json"), total_training_steps=1, num_threads=1)
    with torch.no_grad():  # move the adapter away from its zero start, as training would
        gen = torch.Generator().manual_seed(0)
        for name, p in actor.policy.named_trainable_parameters().items():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=gen)
    ckpt = tmp_path / "global_step_1"
    actor.save(str(ckpt))
    info = export_checkpoint(tiny_qwen_image_dir, ckpt, tmp_path / "export")
    assert info.kind == "lora"

    pipe = QwenImagePipeline.from_pretrained(tiny_qwen_image_dir, local_files_only=True)
    gen = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(2, 16, 64, generator=gen),
        timestep=torch.tensor([0.5, 0.25]),
        encoder_hidden_states=torch.randn(2, 7, 32, generator=gen),
        encoder_hidden_states_mask=torch.ones(2, 7, dtype=torch.bool),
        img_shapes=[[(1, 4, 4)]] * 2,
        return_dict=False,
    )
    with torch.no_grad():
        base = pipe.transformer(**inputs)[0]
        pipe.load_lora_weights(tmp_path / "export")
        loaded = pipe.transformer(**inputs)[0]
        trained = actor.policy.transformer(**inputs)[0]
    assert (trained - base).abs().max() > 1e-4
    atol = 8 * torch.finfo(torch.float32).eps * float(trained.abs().max())
    torch.testing.assert_close(loaded, trained, rtol=0, atol=atol)


# ----------------------------------------------------------------------------- guidance rules
def _guidance_problems(model_dir: Path, *overrides: str) -> list[str]:
    from omni_core.config import resolve_config_and_problems
    from omni_core.validation.guidance import guidance_problems

    config, problems = resolve_config_and_problems(None, [f"actor_rollout_ref.model.path={model_dir}", *overrides], [])
    assert not problems
    return [str(p) for p in guidance_problems(config)]


def test_guidance_rules_per_architecture(tiny_qwen_image_dir, tiny_flux_dir, tiny_sd3_dir, tmp_path):
    key = "actor_rollout_ref.rollout.pipeline."
    assert _guidance_problems(tiny_qwen_image_dir, key + "true_cfg_scale=4") == []
    (problem,) = _guidance_problems(tiny_qwen_image_dir, key + "guidance_scale=4")
    assert (
        problem.startswith(key + "guidance_scale=4.0: QwenImagePipeline's classifier-free guidance is")
        and "true_cfg_scale=4.0" in problem
    )
    (problem,) = _guidance_problems(tiny_sd3_dir, key + "true_cfg_scale=3")
    assert "StableDiffusion3Pipeline has no true CFG" in problem and "guidance_scale=3.0" in problem
    assert _guidance_problems(tiny_flux_dir, key + "guidance_scale=3.5", key + "true_cfg_scale=2") == []
    # A FLUX transformer without guidance embedding (FLUX.1-schnell style): guidance_scale has nothing to feed.
    schnell = tmp_path / "schnell"
    (schnell / "transformer").mkdir(parents=True)
    shutil.copy(tiny_flux_dir / "model_index.json", schnell)
    config = json.loads((tiny_flux_dir / "transformer" / "config.json").read_text()) | {"guidance_embeds": False}
    (schnell / "transformer" / "config.json").write_text(json.dumps(config))
    assert _guidance_problems(schnell, key + "true_cfg_scale=2") == []
    (problem,) = _guidance_problems(schnell, key + "guidance_scale=3.5")
    assert "no guidance embedding" in problem and "true_cfg_scale=3.5" in problem


# ----------------------------------------------------------------------------- the whole flow
@pytest.mark.timeout(600)
def test_main_flow_trains_and_exports_qwen_image(
    prefect_api, ray_cluster, transfer_queue, flow_overrides, tiny_qwen_image_dir, tmp_path
):
    from diffusers import QwenImagePipeline
    from flow_utils import train_one_epoch_and_export

    # One step, a checkpoint, a finite reward, a first ratio of exactly 1 through true CFG, the trained export.
    train_one_epoch_and_export(
        flow_overrides,
        tiny_qwen_image_dir,
        tmp_path,
        QwenImagePipeline,
        ["actor_rollout_ref.rollout.pipeline.true_cfg_scale=2.0"],
    )


def test_published_qwen_image_config_counts_and_its_shrunk_build_samples(tmp_path, one_torch_thread):
    from omni_core.models.published_configs import build_published_pipeline, count_transformer_parameters

    assert 20.4e9 < count_transformer_parameters("qwen-image") < 20.5e9  # Qwen/Qwen-Image: a 20 B MMDiT
    info = build_published_pipeline(tmp_path / "q", "qwen-image", shrink=True, save_dtype=torch.float32)
    assert info["parameters"]["transformer"] == count_transformer_parameters("qwen-image", shrink=True)
    policy = FlowPolicy(tmp_path / "q", trainable=False)
    assert policy.arch.vae_scale_factor == 2 and policy.latent_shape(SIZE, SIZE) == (64, 64)
    assert _ode(policy, "a red cat", "blurry", 4.0).shape == (1, 3, SIZE, SIZE)
