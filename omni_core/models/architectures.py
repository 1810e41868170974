"""The supported architectures, one entry each: the table every list of names, check and builder derives from.

An entry says what OmniFlow needs to know of one diffusers text-to-image pipeline:

  name                the short name users type (`actor_rollout_ref.model.architecture`, `--arch`, the pipeline
                      flow's `arch`); the pipeline class name is accepted too
  pipeline            the diffusers pipeline class, as `model_index.json`'s `_class_name` writes it
  adapter             its `omni_core.models.arch.ArchAdapter` (latent layout, schedule, conditioning, decode)
  tiny_builder        its random-weight test model in `omni_core.models.tiny` (`seed -> pipeline`)
  published           its published configuration in `omni_core.models.published_configs.PUBLISHED`
  cfg_scale           which pipeline argument is classifier-free guidance (`guidance_scale` or `true_cfg_scale`)
  guidance_embedding  whether `guidance_scale` may feed a guidance embedding of the transformer (a guidance-distilled
                      one, `transformer/config.json` `guidance_embeds`); `none_reason` says why it cannot otherwise
  size_rule           which image sizes the saved model can sample (`model_index.image_size_limits`): "patch_embed"
                      (a learned position table: sides a multiple of VAE factor x `patch_size`, at most
                      `pos_embed_max_size` patches) or "packed_2x2" (2 x 2 latent patches with rotary positions: sides a
                      multiple of 2 x the VAE factor, no maximum)

Light on purpose (no diffusers, no torch): config validation and the CLI read names and guidance rules without
loading a model, so the heavy parts are named here and resolved on use (`pipeline_cls`, `adapter_cls`,
`build_tiny`, `published_model`), as transformers' auto classes name their model classes. A test resolves every
name. Adding an architecture: its adapter in `arch.py`, its builder in `tiny.py`, its published config, one entry here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Architecture:
    """One supported pipeline; the fields are described in the module docstring."""

    name: str
    pipeline: str
    adapter: str
    tiny_builder: str
    published: str
    cfg_scale: Literal["guidance_scale", "true_cfg_scale"]
    guidance_embedding: bool
    size_rule: Literal["patch_embed", "packed_2x2"]
    none_reason: str = ""

    def pipeline_cls(self) -> type:
        return getattr(importlib.import_module("diffusers"), self.pipeline)

    def adapter_cls(self) -> type:
        return getattr(importlib.import_module("omni_core.models.arch"), self.adapter)

    def build_tiny(self, seed: int, **options: Any) -> Any:
        """The tiny random-weight pipeline (not saved; `tiny.build_tiny_pipeline` saves it)."""
        return getattr(importlib.import_module("omni_core.models.tiny"), self.tiny_builder)(seed, **options)

    def published_model(self) -> Any:
        return importlib.import_module("omni_core.models.published_configs").PUBLISHED[self.published]


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture(
            name="sd3",
            pipeline="StableDiffusion3Pipeline",
            adapter="SD3Adapter",
            tiny_builder="tiny_sd3",
            published="sd3.5-medium",
            cfg_scale="guidance_scale",  # StableDiffusion3Pipeline has no true_cfg_scale
            guidance_embedding=False,
            size_rule="patch_embed",
        ),
        Architecture(
            name="flux",
            pipeline="FluxPipeline",
            adapter="FluxAdapter",
            tiny_builder="tiny_flux",
            published="flux.1-dev",
            cfg_scale="true_cfg_scale",
            guidance_embedding=True,  # FLUX.1-dev has one; FLUX.1-schnell has none
            size_rule="packed_2x2",
            none_reason="guidance_embeds=false, FLUX.1-schnell style",
        ),
        Architecture(
            name="qwen-image",
            pipeline="QwenImagePipeline",
            adapter="QwenImageAdapter",
            tiny_builder="tiny_qwen_image",
            published="qwen-image",
            cfg_scale="true_cfg_scale",  # rescaled to the conditional prediction's norm (QwenImageAdapter.combine_cfg)
            guidance_embedding=False,
            size_rule="packed_2x2",
            none_reason="diffusers' QwenImageTransformer2DModel cannot run one",
        ),
    )
}

# The pipeline class name in model_index.json -> its entry.
BY_PIPELINE: dict[str, Architecture] = {a.pipeline: a for a in ARCHITECTURES.values()}

# Pipelines that verl-omni or flow_grpo recipes train and OmniFlow does not (yet): why, for the refusal before anything
# loads. Any other class is refused with the list of supported ones.
_EDITING = "image editing (input images next to the noisy latents) is not supported yet"
_VIDEO = "video (5-D latents with frames, a video VAE) is not supported yet"
NOT_SUPPORTED: dict[str, str] = {
    "QwenImageEditPipeline": _EDITING,
    "QwenImageEditPlusPipeline": _EDITING,
    "FluxKontextPipeline": _EDITING,
    "WanPipeline": _VIDEO,
    "WanImageToVideoPipeline": _VIDEO,
    "LTXPipeline": _VIDEO,
    "LTX2Pipeline": "LTX-2's audio-video generation is not supported",
}


def find_architecture(name: str) -> Architecture | None:
    """The entry of a short name (any case) or a pipeline class name; None when neither is supported."""
    return ARCHITECTURES.get(name.lower()) or BY_PIPELINE.get(name)


def unsupported_pipeline_reason(class_name: str | None) -> str | None:
    """Why a saved pipeline class cannot be trained (None: it can): a class of `NOT_SUPPORTED` with its reason, any
    other unknown one (BAGEL or MiniMax-H3 save no diffusers pipeline at all) with the supported classes."""
    if class_name in BY_PIPELINE:
        return None
    supported = ", ".join(sorted(BY_PIPELINE))
    if class_name is None:
        return f"its model_index.json names no pipeline class (_class_name); OmniFlow trains {supported}"
    why = NOT_SUPPORTED.get(class_name, "not a pipeline OmniFlow trains")
    return f"it holds a {class_name} ({why}); OmniFlow trains {supported}"


def architecture_choices() -> list[str]:
    """Every accepted spelling, for error messages: the pipeline class names, then the short names."""
    return sorted(BY_PIPELINE) + sorted(ARCHITECTURES)
