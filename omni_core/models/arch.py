"""What differs between the supported pipelines: latent layout, timestep schedule, text conditioning,
the transformer call, the guidance semantics and VAE decoding.

``FlowPolicy`` is written once against ``ArchAdapter``; each adapter mirrors the corresponding diffusers
pipeline's ``__call__`` (StableDiffusion3Pipeline, FluxPipeline, QwenImagePipeline) step by step, so that
rollout through OmniFlow gives the images the diffusers pipeline would give for the same latents.

Latent layouts (fp32, batch first): SD3 ``[B, C, h, w]`` (C = 16, h = H / vae_scale_factor); FLUX and
Qwen-Image are stored *packed* as ``[B, N, C*4]`` with ``N = (h/2)*(w/2)`` (2x2 latent patches folded into
channels), the layout their transformers consume (Qwen-Image's VAE adds a frame axis when unpacked).

Guidance (``cfg_scale``, ``needs_negative_prompt``, ``combine_cfg``), as the pipelines define it:
SD3's ``guidance_scale`` is classifier-free guidance; FLUX's ``guidance_scale`` only feeds the guidance
embedding of a guidance-distilled transformer and its ``true_cfg_scale`` is CFG with negative prompts;
Qwen-Image's ``true_cfg_scale`` is CFG with a norm-preserving rescale.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import DiffusionPipeline, FluxPipeline, QwenImagePipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from omni_core.models.architectures import BY_PIPELINE, Architecture


def _shift_mu(scheduler, image_seq_len: int) -> float:
    cfg = scheduler.config
    return calculate_shift(
        image_seq_len,
        cfg.get("base_image_seq_len", 256),
        cfg.get("max_image_seq_len", 4096),
        cfg.get("base_shift", 0.5),
        cfg.get("max_shift", 1.15),
    )


class ArchAdapter:
    """Base: pixel size -> latent grid; shared decode to uint8. ``architecture`` is the pipeline's entry in
    ``ARCHITECTURES`` (its guidance rules)."""

    #: key names of the cond dict (positive; the negatives are prefixed with ``negative_``)
    cond_keys = ("prompt_embeds", "pooled_prompt_embeds")
    #: CFG runs only when negative prompts are given (FluxPipeline / QwenImagePipeline: ``has_neg_prompt``);
    #: False: the pipeline encodes ``""`` negatives itself (StableDiffusion3Pipeline)
    needs_negative_prompt = True

    def __init__(self, pipe: DiffusionPipeline):
        self.pipe = pipe
        self.architecture: Architecture = BY_PIPELINE[type(pipe).__name__]

    # Read when needed: a pipeline loaded only to embed prompts has no VAE.
    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipe.vae_scale_factor)

    @property
    def latent_channels(self) -> int:
        return int(self.pipe.vae.config.latent_channels)

    def latent_hw(self, height: int, width: int) -> tuple[int, int]:
        f = self.vae_scale_factor
        if height % f or width % f:
            raise ValueError(f"height={height}, width={width} must be divisible by the VAE scale factor {f}")
        return height // f, width // f

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        raise NotImplementedError

    def noise_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Per-sample shape of the Gaussian noise drawn for a new sample (before any packing)."""
        return self.latent_shape(height, width)

    def noise_to_latents(self, noise: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return noise

    def to_spatial(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return latents

    def image_seq_len(self, height: int, width: int) -> int:
        raise NotImplementedError

    def set_timesteps(self, scheduler, num_steps: int, height: int, width: int) -> None:
        raise NotImplementedError

    def encode(self, prompts, negative_prompts, max_sequence_length: int, do_cfg: bool, device) -> dict:
        raise NotImplementedError

    def forward(self, transformer, latents, timesteps, cond: dict, guidance_scale: float, height, width):
        raise NotImplementedError

    def cfg_scale(self, guidance_scale: float, true_cfg_scale: float) -> float:
        """The scale of classifier-free guidance (1.0: none) given the pipeline's two guidance arguments: the one
        the architecture's ``cfg_scale`` names (config validation reads the same entry)."""
        return guidance_scale if self.architecture.cfg_scale == "guidance_scale" else true_cfg_scale

    def combine_cfg(self, uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
        """CFG: ``uncond + scale * (cond - uncond)`` (Imagen's equation 2, as the pipelines write it)."""
        return uncond + scale * (cond - uncond)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Latents -> uint8 images ``[B, 3, H, W]`` (the pipelines' postprocess, without PIL)."""
        vae = self.pipe.vae
        z = self.to_spatial(latents.float(), height, width)
        z = z / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        image = vae.decode(z.to(vae.dtype), return_dict=False)[0].float()
        return ((image / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Images in [-1, 1] ``[B, 3, H, W]`` -> latents in the layout ``latent_shape`` gives, the inverse of ``decode``
        (the pipelines' ``(z - shift) * scaling``): the VAE posterior's mean, so an image always encodes the same."""
        vae = self.pipe.vae
        z = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode().float()
        z = (z - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor
        return self.noise_to_latents(z, height, width)


class SD3Adapter(ArchAdapter):
    """StableDiffusion3Pipeline: spatial latents, three text encoders, timestep in [0, 1000]."""

    needs_negative_prompt = False

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (self.latent_channels, *self.latent_hw(height, width))

    def image_seq_len(self, height: int, width: int) -> int:
        h, w = self.latent_hw(height, width)
        p = self.pipe.transformer.config.patch_size
        return (h // p) * (w // p)

    def set_timesteps(self, scheduler, num_steps: int, height: int, width: int) -> None:
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", False):  # SD3.5-style configs
            kwargs["mu"] = _shift_mu(scheduler, self.image_seq_len(height, width))
        scheduler.set_timesteps(num_steps, device="cpu", **kwargs)

    def encode(self, prompts, negative_prompts, max_sequence_length, do_cfg, device) -> dict:
        pos, neg, pooled, neg_pooled = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=device,
            do_classifier_free_guidance=do_cfg,
            negative_prompt=negative_prompts,
            max_sequence_length=max_sequence_length,
        )
        cond = {"prompt_embeds": pos, "pooled_prompt_embeds": pooled}
        if do_cfg:
            cond |= {"negative_prompt_embeds": neg, "negative_pooled_prompt_embeds": neg_pooled}
        return cond

    def forward(self, transformer, latents, timesteps, cond, guidance_scale, height, width):
        return transformer(
            hidden_states=latents,
            timestep=timesteps,
            encoder_hidden_states=cond["prompt_embeds"],
            pooled_projections=cond["pooled_prompt_embeds"],
            return_dict=False,
        )[0]


class PixelSD3Adapter(SD3Adapter):
    """A StableDiffusion3Pipeline saved without a VAE whose transformer denoises RGB pixels (``in_channels`` 3), e.g.
    the model of the procedural GenEval recipe: latents are images in [-1, 1] (scale factor 1) and decoding maps them
    to uint8 exactly as the VAE image processor's postprocess would."""

    @property
    def vae_scale_factor(self) -> int:
        return 1

    @property
    def latent_channels(self) -> int:
        return int(self.pipe.transformer.config.in_channels)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return ((latents.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return pixels.float().clone()


class FluxAdapter(ArchAdapter):
    """FluxPipeline: packed latents, CLIP pooled + T5 sequence, timestep in [0, 1], guidance embedding.

    ``guidance_scale`` feeds only the guidance embedding (FLUX.1-dev); ``true_cfg_scale > 1`` with negative
    prompts runs true CFG on top (FluxPipeline's ``do_true_cfg``), each branch with the same embedding.
    """

    def _grid(self, height: int | None, width: int | None, num_tokens: int | None = None) -> tuple[int, int]:
        """Latent grid (h, w) before packing; pixel size may be omitted for square images."""
        if height is None or width is None:
            side = math.isqrt(num_tokens)
            if side * side != num_tokens:
                raise ValueError(f"{num_tokens} packed tokens are not square: pass height and width")
            return 2 * side, 2 * side
        f = self.vae_scale_factor * 2  # FluxPipeline: 2 * (H // (vae_scale_factor * 2))
        if height % f or width % f:
            raise ValueError(f"height={height}, width={width} must be divisible by {f} for FLUX")
        return 2 * (height // f), 2 * (width // f)

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        h, w = self._grid(height, width)
        return ((h // 2) * (w // 2), self.latent_channels * 4)

    def image_seq_len(self, height: int, width: int) -> int:
        return self.latent_shape(height, width)[0]

    def noise_to_latents(self, noise: torch.Tensor, height: int, width: int) -> torch.Tensor:
        b, c, h, w = noise.shape
        return FluxPipeline._pack_latents(noise, b, c, h, w)

    def noise_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (self.latent_channels, *self._grid(height, width))

    def to_spatial(self, latents: torch.Tensor, height: int | None, width: int | None) -> torch.Tensor:
        h, w = self._grid(height, width, latents.shape[1])
        f = self.vae_scale_factor
        return FluxPipeline._unpack_latents(latents, h * f, w * f, f)

    def set_timesteps(self, scheduler, num_steps: int, height: int, width: int) -> None:
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", False):
            kwargs["mu"] = _shift_mu(scheduler, self.image_seq_len(height, width))
        scheduler.set_timesteps(sigmas=sigmas, device="cpu", **kwargs)

    def encode(self, prompts, negative_prompts, max_sequence_length, do_cfg, device) -> dict:
        pos, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, device=device, max_sequence_length=max_sequence_length
        )
        cond = {"prompt_embeds": pos, "pooled_prompt_embeds": pooled}
        if do_cfg:
            negs = list(negative_prompts) if negative_prompts is not None else [""] * len(prompts)
            neg, neg_pooled, _ = self.pipe.encode_prompt(
                prompt=negs, prompt_2=None, device=device, max_sequence_length=max_sequence_length
            )
            cond |= {"negative_prompt_embeds": neg, "negative_pooled_prompt_embeds": neg_pooled}
        return cond

    def forward(self, transformer, latents, timesteps, cond, guidance_scale, height, width):
        h, w = self._grid(height, width, latents.shape[1])
        embeds = cond["prompt_embeds"]
        img_ids = FluxPipeline._prepare_latent_image_ids(None, h // 2, w // 2, latents.device, embeds.dtype)
        txt_ids = torch.zeros(embeds.shape[1], 3, device=latents.device, dtype=embeds.dtype)
        guidance = None
        if self.pipe.transformer.config.guidance_embeds:  # guidance-distilled (FLUX.1-dev style)
            guidance = torch.full((latents.shape[0],), float(guidance_scale), device=latents.device)
        return transformer(
            hidden_states=latents,
            timestep=timesteps / 1000,
            guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"],
            encoder_hidden_states=embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]


class QwenImageAdapter(FluxAdapter):
    """QwenImagePipeline: FLUX's packed latents and sigma schedule (dynamic shift, ``mu`` from the packed length),
    one Qwen2.5-VL text encoder read through a chat template, ``img_shapes`` with a frame axis, a VAE with
    per-channel ``latents_mean`` / ``latents_std`` and true CFG rescaled to the conditional prediction's norm.

    Prompt embeddings: the pipeline's ``encode_prompt`` (template, the template's first 34 tokens dropped,
    cut to ``max_sequence_length``) gives a prompt's valid tokens only; they are zero-padded here to
    ``max_sequence_length`` rows with ``prompt_embeds_mask`` (1 valid, 0 padding), so that rows of different
    prompts, and the negative and positive halves of a CFG batch, stack. The transformer masks the padding
    out of attention (the text RoPE positions of valid tokens do not move), so a padded prompt gives the
    image tokens the velocity of the unpadded one up to rounding.
    """

    cond_keys = ("prompt_embeds", "prompt_embeds_mask")

    @property
    def latent_channels(self) -> int:
        return int(self.pipe.vae.config.z_dim)

    def noise_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (1, self.latent_channels, *self._grid(height, width))  # QwenImagePipeline: (B, 1, C, h, w)

    def noise_to_latents(self, noise: torch.Tensor, height: int, width: int) -> torch.Tensor:
        b, _, c, h, w = noise.shape
        return QwenImagePipeline._pack_latents(noise, b, c, h, w)

    def to_spatial(self, latents: torch.Tensor, height: int | None, width: int | None) -> torch.Tensor:
        """Packed ``[B, N, 4C]`` -> the VAE's ``[B, C, 1, h, w]``."""
        h, w = self._grid(height, width, latents.shape[1])
        f = self.vae_scale_factor
        return QwenImagePipeline._unpack_latents(latents, h * f, w * f, f)

    def encode(self, prompts, negative_prompts, max_sequence_length, do_cfg, device) -> dict:
        cond = self._encode(prompts, max_sequence_length, device)
        if do_cfg:
            negs = list(negative_prompts) if negative_prompts is not None else [""] * len(prompts)
            cond |= {"negative_" + k: v for k, v in self._encode(negs, max_sequence_length, device).items()}
        return cond

    def _encode(self, prompts: list[str], max_sequence_length: int, device) -> dict:
        embeds, mask = self.pipe.encode_prompt(prompt=list(prompts), device=device, max_sequence_length=max_sequence_length)
        if mask is None:  # encode_prompt drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        pad = max_sequence_length - embeds.shape[1]
        return {
            "prompt_embeds": F.pad(embeds, (0, 0, 0, pad)),
            "prompt_embeds_mask": F.pad(mask, (0, pad)).to(embeds.dtype),
        }

    def forward(self, transformer, latents, timesteps, cond, guidance_scale, height, width):
        h, w = self._grid(height, width, latents.shape[1])
        guidance = None
        if self.pipe.transformer.config.guidance_embeds:
            guidance = torch.full((latents.shape[0],), float(guidance_scale), device=latents.device)
        return transformer(
            hidden_states=latents,
            timestep=timesteps / 1000,
            guidance=guidance,
            encoder_hidden_states_mask=cond["prompt_embeds_mask"] > 0.5,
            encoder_hidden_states=cond["prompt_embeds"],
            img_shapes=[[(1, h // 2, w // 2)]] * latents.shape[0],
            return_dict=False,
        )[0]

    def combine_cfg(self, uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
        """QwenImagePipeline's true CFG: the linear combination, rescaled per token to the norm of ``cond``."""
        combined = uncond + scale * (cond - uncond)
        return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        vae = self.pipe.vae
        z = self.to_spatial(latents.float(), height, width).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
        image = vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0].float()
        return ((image / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The inverse of ``decode``: one-frame video ``[B, 3, 1, H, W]`` through the VAE, normalised by the VAE's
        ``latents_mean`` / ``latents_std`` (QwenImageEditPipeline's image latents), packed."""
        vae = self.pipe.vae
        z = vae.encode(pixels.unsqueeze(2).to(vae.device, vae.dtype)).latent_dist.mode().float()  # [B, C, 1, h, w]
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
        return self.noise_to_latents(((z - mean) / std).transpose(1, 2), height, width)


def adapter_for(pipe: DiffusionPipeline) -> ArchAdapter:
    """The adapter of a loaded pipeline (its entry's ``adapter``); an SD3 pipeline without a VAE whose transformer
    has 3 input channels is a pixel-space model (``PixelSD3Adapter``)."""
    name = type(pipe).__name__
    if name not in BY_PIPELINE:
        raise ValueError(f"no architecture adapter for {name}; supported: {sorted(BY_PIPELINE)}")
    adapter = BY_PIPELINE[name].adapter_cls()
    transformer = getattr(pipe, "transformer", None)
    if adapter is SD3Adapter and getattr(pipe, "vae", None) is None and transformer is not None:
        if transformer.config.in_channels != 3:
            raise ValueError(
                f"this SD3 pipeline has no VAE but its transformer takes {transformer.config.in_channels} channels: "
                "a pixel-space model needs in_channels=3; a latent model needs its vae folder"
            )
        return PixelSD3Adapter(pipe)
    return adapter(pipe)
