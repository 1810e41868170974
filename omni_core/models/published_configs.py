"""Published SD3.5-medium, FLUX.1-dev and Qwen-Image architectures, built offline with random weights.

Owns the config values of the published model folders (the ``transformer/config.json``,
``vae/config.json`` and ``scheduler/scheduler_config.json`` of stabilityai/stable-diffusion-3.5-medium
black-forest-labs/FLUX.1-dev and Qwen/Qwen-Image), a shrunken variant of each for CPU self-checks (same classes, a few
layers, small widths), and a builder that writes a whole diffusers pipeline folder with
``save_pretrained``, so that ``FlowPolicy(path)`` loads it the production way. No hub access: every
component is created from its config, as ``omni_core.models.tiny`` does for the tiny test models.

The transformer and the VAE have the published sizes (FLUX.1-dev: ~11.9 B transformer parameters,
~24 GB in bf16; SD3.5-medium: ~2.5 B). The text encoders are tiny (2 layers, built with tiny.py's
tokenizers); only their *output widths* follow what the transformer expects:

- SD3: T5 ``d_model`` = ``joint_attention_dim`` (4096), CLIP projections 768 + 1280 = ``pooled_projection_dim``
  (2048; SD3's ``encode_prompt`` concatenates the two CLIP text embeddings and pads the CLIP hidden
  states up to the T5 width, so the CLIP hidden size itself only has to stay below it);
- FLUX: T5 ``d_model`` = ``joint_attention_dim`` (4096), CLIP hidden = ``pooled_projection_dim`` (768: FLUX
  pools with ``CLIPTextModel.pooler_output``);
- Qwen-Image (~20.4 B transformer parameters): the Qwen2.5-VL hidden size = ``joint_attention_dim`` (3584), with
  tiny.py's Qwen2 tokenizer; its VAE is ``AutoencoderKLQwenImage`` (scale factor 8, 16 latent channels).

So the transformer sees the published sequence widths; the text tokens per prompt are CLIP's 77 (SD3 only)
plus ``max_sequence_length`` T5 tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from omni_core.models.tiny import build_clip_tokenizer, build_qwen2_tokenizer, build_t5_tokenizer, qwen_text_encoder

# The VAE of both models (AutoencoderKL, 16 latent channels, 4 blocks: scale factor 8); they differ
# only in the latent scaling / shift constants.
_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "act_fn": "silu",
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "force_upcast": True,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": True,
}
# CPU self-checks: the same class with 2 small blocks (scale factor 2, as tiny.py's VAE).
_VAE_SHRUNK = {
    "down_block_types": ["DownEncoderBlock2D"] * 2,
    "up_block_types": ["UpDecoderBlock2D"] * 2,
    "block_out_channels": [8, 16],
    "layers_per_block": 1,
    "norm_num_groups": 4,
    "sample_size": 64,
}


@dataclass(frozen=True)
class PublishedModel:
    """One published architecture: where its numbers come from, its classes and configs."""

    name: str
    source: str  # the hub repository whose config files the values are copied from
    pipeline_cls: type
    transformer_cls: type
    transformer: dict[str, Any]
    vae: dict[str, Any]
    scheduler: dict[str, Any]
    # Overrides of ``transformer`` for CPU self-checks: a few layers, small widths, same class and options.
    shrunk: dict[str, Any] = field(default_factory=dict)
    vae_cls: type = AutoencoderKL
    # Overrides of ``vae`` for CPU self-checks.
    vae_shrunk: dict[str, Any] = field(default_factory=lambda: dict(_VAE_SHRUNK))


PUBLISHED: dict[str, PublishedModel] = {
    "sd3.5-medium": PublishedModel(
        name="sd3.5-medium",
        source="stabilityai/stable-diffusion-3.5-medium",
        pipeline_cls=StableDiffusion3Pipeline,
        transformer_cls=SD3Transformer2DModel,
        transformer={
            "sample_size": 128,
            "patch_size": 2,
            "in_channels": 16,
            "num_layers": 24,
            "attention_head_dim": 64,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
            "caption_projection_dim": 1536,
            "pooled_projection_dim": 2048,
            "out_channels": 16,
            "pos_embed_max_size": 384,
            "dual_attention_layers": list(range(13)),  # MMDiT-X: blocks 0..12 also self-attend over the image
            "qk_norm": "rms_norm",
        },
        vae={**_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609},
        scheduler={"num_train_timesteps": 1000, "shift": 3.0},
        shrunk={
            "sample_size": 32,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 64,
            "caption_projection_dim": 32,
            "pooled_projection_dim": 64,
            "pos_embed_max_size": 32,
            "dual_attention_layers": [0],
        },
    ),
    "flux.1-dev": PublishedModel(
        name="flux.1-dev",
        source="black-forest-labs/FLUX.1-dev",
        pipeline_cls=FluxPipeline,
        transformer_cls=FluxTransformer2DModel,
        transformer={
            "patch_size": 1,
            "in_channels": 64,
            "num_layers": 19,
            "num_single_layers": 38,
            "attention_head_dim": 128,
            "num_attention_heads": 24,
            "joint_attention_dim": 4096,
            "pooled_projection_dim": 768,
            "guidance_embeds": True,
            "axes_dims_rope": [16, 56, 56],
        },
        vae={**_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159},
        scheduler={
            "num_train_timesteps": 1000,
            "shift": 3.0,
            "use_dynamic_shifting": True,
            "base_shift": 0.5,
            "max_shift": 1.15,
            "base_image_seq_len": 256,
            "max_image_seq_len": 4096,
        },
        shrunk={
            "num_layers": 1,
            "num_single_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 64,
            "pooled_projection_dim": 32,
            "axes_dims_rope": [4, 6, 6],  # sums to attention_head_dim
        },
    ),
    "qwen-image": PublishedModel(
        name="qwen-image",
        source="Qwen/Qwen-Image",
        pipeline_cls=QwenImagePipeline,
        transformer_cls=QwenImageTransformer2DModel,
        transformer={
            "patch_size": 2,
            "in_channels": 64,
            "out_channels": 16,
            "num_layers": 60,
            "attention_head_dim": 128,
            "num_attention_heads": 24,
            "joint_attention_dim": 3584,
            "guidance_embeds": False,
            "axes_dims_rope": [16, 56, 56],
        },
        vae_cls=AutoencoderKLQwenImage,  # its latents_mean / latents_std are the constructor's defaults
        vae={
            "base_dim": 96,
            "z_dim": 16,
            "dim_mult": [1, 2, 4, 4],
            "num_res_blocks": 2,
            "attn_scales": [],
            "temperal_downsample": [False, True, True],
            "dropout": 0.0,
        },
        vae_shrunk={"base_dim": 8, "dim_mult": [1, 2], "num_res_blocks": 1, "temperal_downsample": [False]},
        scheduler={
            "num_train_timesteps": 1000,
            "shift": 1.0,
            "use_dynamic_shifting": True,
            "base_shift": 0.5,
            "max_shift": 0.9,
            "base_image_seq_len": 256,
            "max_image_seq_len": 8192,
            "shift_terminal": 0.02,
            "time_shift_type": "exponential",
        },
        shrunk={
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "axes_dims_rope": [4, 6, 6],  # sums to attention_head_dim
        },
    ),
}


def published_model(name: str) -> PublishedModel:
    if name not in PUBLISHED:
        raise ValueError(f"unknown published model {name!r}; choose one of {sorted(PUBLISHED)}")
    return PUBLISHED[name]


def transformer_config(name: str, shrink: bool = False) -> dict[str, Any]:
    """The transformer's constructor keywords: the published values, or their shrunken CPU variant."""
    model = published_model(name)
    return {**model.transformer, **(model.shrunk if shrink else {})}


def vae_config(name: str, shrink: bool = False) -> dict[str, Any]:
    model = published_model(name)
    return {**model.vae, **(model.vae_shrunk if shrink else {})}


def _clip(hidden: int, projection: int | None, tokenizer) -> CLIPTextModel:
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=2,  # SD3 reads hidden_states[-2]
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=projection or hidden,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)


def _t5(d_model: int, tokenizer) -> T5EncoderModel:
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_ff=128,
        d_kv=32,
        num_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        feed_forward_proj="gated-gelu",
    )
    return T5EncoderModel(config)


def _components(model: PublishedModel, transformer: dict[str, Any], seed: int) -> dict[str, Any]:
    """Every pipeline component but the transformer and VAE, seeded per component (tiny.py's scheme)."""
    if model.pipeline_cls is QwenImagePipeline:
        tokenizer = build_qwen2_tokenizer()
        torch.manual_seed(seed + 10)
        return {"text_encoder": qwen_text_encoder(tokenizer, transformer["joint_attention_dim"]), "tokenizer": tokenizer}
    clip_tok, t5_tok = build_clip_tokenizer(), build_t5_tokenizer()
    joint, pooled = transformer["joint_attention_dim"], transformer["pooled_projection_dim"]
    if model.pipeline_cls is StableDiffusion3Pipeline:
        proj_l = pooled * 3 // 8  # CLIP-L 768 + CLIP-G 1280 = 2048 at the published size
        torch.manual_seed(seed + 10)
        text_encoder = _clip(min(32, joint // 2), proj_l, clip_tok)
        torch.manual_seed(seed + 11)
        text_encoder_2 = _clip(min(32, joint // 2), pooled - proj_l, clip_tok)
        torch.manual_seed(seed + 12)
        return {
            "text_encoder": text_encoder,
            "tokenizer": clip_tok,
            "text_encoder_2": text_encoder_2,
            "tokenizer_2": build_clip_tokenizer(),
            "text_encoder_3": _t5(joint, t5_tok),
            "tokenizer_3": t5_tok,
        }
    torch.manual_seed(seed + 10)
    text_encoder = _clip(pooled, None, clip_tok)
    torch.manual_seed(seed + 11)
    return {"text_encoder": text_encoder, "tokenizer": clip_tok, "text_encoder_2": _t5(joint, t5_tok), "tokenizer_2": t5_tok}


def count_transformer_parameters(name: str, shrink: bool = False) -> int:
    """Parameters of the transformer, counted on the meta device (no memory, no init)."""
    model = published_model(name)
    with torch.device("meta"):
        module = model.transformer_cls(**transformer_config(name, shrink))
    return sum(p.numel() for p in module.parameters())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_published_pipeline(
    out_dir: str | Path,
    name: str,
    *,
    shrink: bool = False,
    device: str | torch.device = "cpu",
    seed: int = 0,
    save_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Build ``name`` with random weights on ``device`` and save it to ``out_dir`` in ``save_dtype`` safetensors.

    Random init runs on ``device`` (on a GPU the 12 B FLUX transformer initialises in about a second
    instead of minutes on CPU), then every component is moved to CPU in ``save_dtype`` and written with
    ``save_pretrained``. The global RNG state (CPU and CUDA) is restored afterwards. Returns the folder
    and what the build cost: seconds per stage, parameter counts, bytes on disk, the configs used.
    """
    model = published_model(name)
    device = torch.device(device)
    out = Path(out_dir)
    t_config, v_config = transformer_config(name, shrink), vae_config(name, shrink)
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        t0 = time.perf_counter()
        with torch.device(device):
            torch.manual_seed(seed)
            transformer = model.transformer_cls(**t_config)
            torch.manual_seed(seed + 1)
            vae = model.vae_cls(**v_config)
            others = _components(model, t_config, seed)
        _sync(device)
        t1 = time.perf_counter()
    scheduler = FlowMatchEulerDiscreteScheduler(**model.scheduler)
    pipe = model.pipeline_cls(transformer=transformer, vae=vae, scheduler=scheduler, **others)
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            # Cast where the weights are (a GPU halves what crosses to the host), then move. Plain nn.Module.to:
            # diffusers' override only adds a notice about modules kept in fp32 (there are none here).
            torch.nn.Module.to(module, dtype=save_dtype)
            torch.nn.Module.to(module, device="cpu")
    _sync(device)
    t2 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    t3 = time.perf_counter()
    del pipe, transformer, vae, others
    return {
        "path": str(out),
        "source": model.source,
        "shrunk": shrink,
        "device": str(device),
        "save_dtype": str(save_dtype).removeprefix("torch."),
        "init_s": t1 - t0,
        "cast_to_cpu_s": t2 - t1,
        "save_s": t3 - t2,
        "total_s": t3 - t0,
        "disk_bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file()),
        "parameters": params,
        "transformer_config": t_config,
        "vae_config": v_config,
        "scheduler_config": dict(model.scheduler),
    }
