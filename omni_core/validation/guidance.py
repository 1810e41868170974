"""Guidance: what `rollout.pipeline.guidance_scale` and `true_cfg_scale` mean for the model's architecture.

The diffusers pipelines give the two scales different jobs, and OmniFlow follows them (as verl-omni does):

  StableDiffusion3Pipeline   guidance_scale is classifier-free guidance; there is no true_cfg_scale (keep 1.0)
  FluxPipeline, distilled    guidance_scale feeds only the guidance embedding (FLUX.1-dev); true_cfg_scale > 1
                             runs true CFG with negative prompts ("" when a prompt has none)
  FluxPipeline, not          no guidance embedding (FLUX.1-schnell style): guidance_scale has nothing to feed
  distilled                  (keep 1.0); true_cfg_scale is CFG
  QwenImagePipeline          true_cfg_scale is CFG (norm-preserving); guidance_scale has nothing to feed (keep 1.0)

The rules are the architecture's entry in `omni_core.models.architectures.ARCHITECTURES` (`cfg_scale`: which of
the two is CFG; `guidance_embedding`: whether guidance_scale may feed a guidance embedding). The architecture comes
from `actor_rollout_ref.model.architecture` or the model folder's `model_index.json`, and "distilled" from its
`transformer/config.json` (`guidance_embeds`), read without importing diffusers. A missing or unreadable folder is
left to the `paths` group.
"""

from __future__ import annotations

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.models.architectures import BY_PIPELINE
from omni_core.models.hub import resolve_model_path
from omni_core.models.model_index import ModelLoadError, pipeline_class_name, transformer_guidance_embeds

_KEY = "actor_rollout_ref.rollout.pipeline."


def guidance_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    model, pipeline = config.actor_rollout_ref.model, config.actor_rollout_ref.rollout.pipeline
    try:  # a Hub id is read in the cache only (a model not there yet is the `paths` group's problem)
        path = resolve_model_path(model.path, model.revision, download=False)
    except ModelLoadError:
        return []
    if not (path / "model_index.json").is_file():
        return []
    try:
        name = pipeline_class_name(path, model.architecture)
    except ModelLoadError:
        return []
    entry = BY_PIPELINE.get(name or "")
    if entry is None:  # an unsupported architecture is the `paths` group's problem
        return []
    guidance, true_cfg = pipeline.guidance_scale, pipeline.true_cfg_scale
    if entry.cfg_scale == "guidance_scale" and true_cfg != 1.0:
        return [
            ConfigProblem(
                _KEY + "true_cfg_scale",
                f"{name} has no true CFG: its classifier-free guidance is {_KEY}guidance_scale. "
                f"Set true_cfg_scale=1.0 and guidance_scale={true_cfg}",
                true_cfg,
            )
        ]
    embedded = entry.guidance_embedding and transformer_guidance_embeds(path)
    if entry.cfg_scale == "true_cfg_scale" and guidance != 1.0 and not embedded:
        return [
            ConfigProblem(
                _KEY + "guidance_scale",
                f"{name}'s classifier-free guidance is {_KEY}true_cfg_scale; its guidance_scale only feeds the "
                f"guidance embedding of a guidance-distilled transformer, and the transformer in {path} has no guidance "
                f"embedding ({entry.none_reason}), so guidance_scale has nothing to feed. Set guidance_scale=1.0 and "
                f"true_cfg_scale={guidance} (negative prompts from data.negative_prompt_key, '' where a prompt has none)",
                guidance,
            )
        ]
    return []
