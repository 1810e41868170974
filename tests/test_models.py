"""Tiny models, the loader and FlowPolicy, on real tiny diffusers pipelines loaded the production way."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from omni_core.models.loader import ModelLoadError, load_pipeline
from omni_core.models.policy import FlowPolicy
from omni_core.models.tiny import build_tiny_pipeline
from omni_core.rollout.sampler import generate
from omni_core.rollout.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SIZE, STEPS, MAX_LEN = 64, 4, 16


def ode_images(policy: FlowPolicy, prompts: list[str], seed: int, guidance_scale: float = 1.0) -> torch.Tensor:
    """Deterministic samples (noise level 0: the Euler ODE step everywhere), one per prompt, as validation draws them."""
    params = SamplingParams(
        n=1,
        seed=seed,
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=guidance_scale,
        noise_level=0.0,
        max_sequence_length=MAX_LEN,
        calculate_log_probs=False,
        fixed_noise=True,
    )
    return generate(policy, prompts, **params.generate_kwargs(global_step=0)).images


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(model_dir.rglob("*.safetensors")):
        tensors |= {f"{f.parent.name}/{k}": v for k, v in load_file(f).items()}
    return tensors


def _velocity_inputs(policy: FlowPolicy, batch: int = 2):
    cond = policy.encode_prompts(["a red cat", "a blue dog"][:batch], max_sequence_length=MAX_LEN)
    gen = torch.Generator().manual_seed(0)
    latents = policy.prepare_latents(batch, SIZE, SIZE, gen)
    t = torch.full((batch,), 700.0)
    return latents, t, cond


# ----------------------------------------------------------------------------- tiny builder
def test_same_build_seed_gives_identical_weights(tiny_sd3_dir, tmp_path):
    again = _weights(build_tiny_pipeline(tmp_path / "a", "sd3", seed=0))
    reference = _weights(tiny_sd3_dir)
    assert again.keys() == reference.keys() and len(again) > 100
    assert all(torch.equal(again[k], reference[k]) for k in reference)
    other = _weights(build_tiny_pipeline(tmp_path / "b", "sd3", seed=1))
    assert not torch.equal(other["transformer/proj_out.weight"], reference["transformer/proj_out.weight"])


def test_tiny_dims(tiny_sd3_dir, tiny_flux_dir):
    sd3 = FlowPolicy(tiny_sd3_dir)
    n_params = sum(p.numel() for p in sd3.base_transformer.parameters())
    assert 2.0e6 < n_params < 2.6e6
    assert sd3.latent_shape(SIZE, SIZE) == (16, 32, 32)
    cond = sd3.encode_prompts(["a cat"], max_sequence_length=MAX_LEN)
    assert cond["prompt_embeds"].shape == (1, 77 + MAX_LEN, 64) and cond["pooled_prompt_embeds"].shape == (1, 64)
    flux = FlowPolicy(tiny_flux_dir)
    assert flux.latent_shape(SIZE, SIZE) == (256, 64)


# ----------------------------------------------------------------------------- loader
def test_loader_freezes_text_encoders_and_vae(tiny_sd3_dir):
    pipe = load_pipeline(tiny_sd3_dir)
    assert type(pipe).__name__ == "StableDiffusion3Pipeline"
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3", "vae"):
        module = getattr(pipe, name)
        assert not module.training and not any(p.requires_grad for p in module.parameters())
    assert type(load_pipeline(tiny_sd3_dir, architecture="sd3")).__name__ == "StableDiffusion3Pipeline"


def test_loader_errors_name_the_path_and_problem(tiny_sd3_dir, tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match=f"{missing}.*does not exist"):
        load_pipeline(missing)
    with pytest.raises(ModelLoadError, match=f"{tmp_path}.*no model_index.json"):
        load_pipeline(tmp_path)

    copy = tmp_path / "copy"
    shutil.copytree(tiny_sd3_dir, copy)
    with pytest.raises(ModelLoadError, match="unsupported architecture 'sdxl'.*FluxPipeline.*StableDiffusion3Pipeline"):
        load_pipeline(copy, architecture="sdxl")
    with pytest.raises(ModelLoadError, match="does not match model_index.json"):
        load_pipeline(copy, architecture="flux")

    index = json.loads((copy / "model_index.json").read_text())
    (copy / "model_index.json").write_text(json.dumps(index | {"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'StableDiffusionXLPipeline'"):
        load_pipeline(copy)
    (copy / "model_index.json").write_text(json.dumps(index))

    weights = next((copy / "transformer").glob("*.safetensors"))
    weights.write_bytes(b"this is not a safetensors file")
    with pytest.raises(ModelLoadError, match=f"{copy}: failed to load StableDiffusion3Pipeline"):
        load_pipeline(copy)

    shutil.rmtree(copy / "vae")
    with pytest.raises(ModelLoadError, match=r"component folder\(s\) missing: \['vae'\]"):
        load_pipeline(copy)


# ----------------------------------------------------------------------------- save / load round trips
@pytest.mark.parametrize("fixture", ["tiny_sd3_dir", "tiny_flux_dir"])
def test_save_load_gives_identical_images(fixture, request, tmp_path):
    policy = FlowPolicy(request.getfixturevalue(fixture))
    images = ode_images(policy, ["a red circle", "two dogs"], seed=3)
    assert images.dtype == torch.uint8 and images.shape == (2, 3, SIZE, SIZE)
    assert images.float().std() > 0  # not a constant image
    policy.pipeline.save_pretrained(tmp_path / "saved")
    reloaded = FlowPolicy(tmp_path / "saved")
    assert torch.equal(ode_images(reloaded, ["a red circle", "two dogs"], seed=3), images)


@pytest.mark.parametrize("fixture,guidance", [("tiny_sd3_dir", 1.0), ("tiny_flux_dir", 3.5)])
def test_ode_sampling_matches_the_diffusers_pipeline(fixture, guidance, request):
    """Our arch adapters mirror the pipelines' __call__: same latents -> the same images."""
    policy = FlowPolicy(request.getfixturevalue(fixture))
    ours = ode_images(policy, ["a red cat"], seed=0, guidance_scale=guidance)
    from omni_core.rollout.sampler import _generators, derive_sample_seed

    latents = policy.prepare_latents(1, SIZE, SIZE, _generators([derive_sample_seed(0, 0, 0, 0)]))
    theirs = policy.pipeline(
        "a red cat",
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        latents=latents,
        max_sequence_length=MAX_LEN,
        output_type="pt",
    ).images
    theirs = (theirs * 255).round().to(torch.uint8)
    assert (ours.int() - theirs.int()).abs().max() <= 1


# ----------------------------------------------------------------------------- policy: LoRA / full
def test_lora_only_adapter_trainable_and_reference_is_the_base_model(tiny_sd3_dir, tmp_path):
    base = FlowPolicy(tiny_sd3_dir)
    policy = FlowPolicy(tiny_sd3_dir, lora_rank=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    trainable = policy.named_trainable_parameters()
    assert trainable and all("lora_" in name for name in trainable)
    assert sum(p.numel() for p in trainable.values()) < 0.1 * sum(p.numel() for p in policy.transformer.parameters())
    assert not any(p.requires_grad for p in policy.pipeline.text_encoder.parameters())

    latents, t, cond = _velocity_inputs(policy)
    v_base = base.velocity(latents, t, cond)
    assert torch.equal(policy.velocity(latents, t, cond), v_base)  # gaussian init: lora_B = 0
    assert torch.equal(policy.velocity(latents, t, cond, use_reference=True), v_base)

    with torch.no_grad():  # move the adapter away from zero, as training would
        for name, p in trainable.items():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    v_trained = policy.velocity(latents, t, cond)
    assert (v_trained - v_base).abs().max() > 1e-4
    assert torch.equal(policy.velocity(latents, t, cond, use_reference=True), v_base)

    # Save in diffusers' LoRA format: FlowPolicy and pipeline.load_lora_weights both read it back.
    policy.save_pretrained(tmp_path / "lora")
    assert (tmp_path / "lora" / "pytorch_lora_weights.safetensors").is_file()
    resumed = FlowPolicy(tiny_sd3_dir, lora_rank=4, lora_adapter_path=tmp_path / "lora")
    assert resumed.lora_config.lora_alpha == 8
    torch.testing.assert_close(resumed.velocity(latents, t, cond), v_trained, rtol=0, atol=1e-6)
    pipe = load_pipeline(tiny_sd3_dir)
    pipe.load_lora_weights(tmp_path / "lora")
    plain = FlowPolicy.__new__(FlowPolicy)  # reuse the forward of `base` with the LoRA-loaded transformer
    plain.__dict__ |= base.__dict__ | {"transformer": pipe.transformer}
    torch.testing.assert_close(plain.velocity(latents, t, cond), v_trained, rtol=0, atol=1e-6)

    state = policy.state_dict_for_checkpoint()
    assert state and all("lora_" in k for k in state)
    fresh = FlowPolicy(tiny_sd3_dir, lora_rank=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    fresh.load_trainable_state(state)
    assert torch.equal(fresh.velocity(latents, t, cond), v_trained)


def test_full_finetuning_reference_is_a_frozen_copy_and_checkpointing_backprops(tiny_sd3_dir, tmp_path):
    policy = FlowPolicy(tiny_sd3_dir, enable_gradient_checkpointing=True)
    assert not policy.is_lora and policy.base_transformer.gradient_checkpointing
    assert len(policy.trainable_parameters()) == len(list(policy.base_transformer.parameters()))
    latents, t, cond = _velocity_inputs(policy, batch=1)
    v0 = policy.velocity(latents, t, cond)
    policy.velocity(latents, t, cond).square().mean().backward()
    assert all(p.grad is not None for p in policy.trainable_parameters()[:5])
    policy.ensure_reference()
    with torch.no_grad():
        policy.base_transformer.proj_out.weight.add_(0.1)
    assert not torch.equal(policy.velocity(latents, t, cond), v0)
    assert torch.equal(policy.velocity(latents, t, cond, use_reference=True), v0)

    state = policy.state_dict_for_checkpoint()
    policy.save_pretrained(tmp_path / "full")
    assert (tmp_path / "full" / "config.json").is_file()
    other = FlowPolicy(tiny_sd3_dir)
    other.load_trainable_state(state)
    assert torch.equal(other.velocity(latents, t, cond), policy.velocity(latents, t, cond))


def test_from_model_config_and_attention_backend_errors(tiny_flux_dir):
    cfg = SimpleNamespace(
        path=str(tiny_flux_dir),
        architecture="flux",
        lora_rank=2,
        lora_alpha=4,
        target_modules="all-linear",
        lora_adapter_path=None,
        enable_gradient_checkpointing=True,
        attn_backend="native",
    )
    policy = FlowPolicy.from_model_config(cfg)
    assert policy.is_lora and policy.lora_config.r == 2 and policy.lora_config.init_lora_weights == "gaussian"
    assert policy.base_transformer.gradient_checkpointing
    # FLUX + LoRA + checkpointing: gradients reach the adapter (lora_B first: lora_A's grad is 0 while B = 0).
    latents, t, cond = _velocity_inputs(policy, batch=1)
    policy.velocity(latents, t, cond, guidance_scale=3.5).square().mean().backward()
    grads = {n: p.grad for n, p in policy.named_trainable_parameters().items()}
    assert all("lora_" in n for n in grads)
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)
    with pytest.raises(ValueError, match="attn_backend='no_such_kernel'"):
        FlowPolicy(tiny_flux_dir, attn_backend="no_such_kernel")


@pytest.mark.parametrize("fixture", ["tiny_sd3_dir", "tiny_flux_dir"])
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_gradient_checkpointing_gives_the_same_gradients_on_every_architecture(fixture, lora_rank, request, one_torch_thread):
    """`model.enable_gradient_checkpointing` recomputes activations in the backward: same gradients, full or LoRA."""
    path = request.getfixturevalue(fixture)
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the same LoRA init both times
        policy = FlowPolicy(path, lora_rank=lora_rank, enable_gradient_checkpointing=checkpointing)
        assert policy.base_transformer.gradient_checkpointing is checkpointing
        policy.transformer.train()
        latents, t, cond = _velocity_inputs(policy, batch=2)
        policy.velocity(latents, t, cond).square().mean().backward()
        grads.append({n: p.grad for n, p in policy.named_trainable_parameters().items()})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(g is not None and torch.isfinite(g).all() for g in grads[1].values())
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=name)
