"""Image size: `rollout.pipeline.height` / `width` against what the saved model can sample, before anything loads.

Every side must be a multiple of the VAE scale factor times the transformer's patch (SD3's patch embedding, FLUX's and
Qwen-Image's 2 x 2 packing), and SD3's learned position table covers at most `pos_embed_max_size` patches a side
(SD3.5-Medium: 384 patches, 6,144 px; a tiny test model: 32 patches, 128 px). Without this check the run would fail
in the rollout workers after the whole set-up, once per sample. The limits come from the model folder's
`vae/config.json` and `transformer/config.json` (`omni_core.models.model_index.image_size_limits`); the validation
samples use the same sides. A missing or unreadable folder is left to the `paths` group.
"""

from __future__ import annotations

from omni_core.config import ConfigProblem, OmniFlowConfig
from omni_core.models.architectures import BY_PIPELINE
from omni_core.models.hub import resolve_model_path
from omni_core.models.model_index import ModelLoadError, image_size_limits, pipeline_class_name

_KEY = "actor_rollout_ref.rollout.pipeline."


def image_size_problems(config: OmniFlowConfig) -> list[ConfigProblem]:
    model, pipeline = config.actor_rollout_ref.model, config.actor_rollout_ref.rollout.pipeline
    try:  # a Hub id is read in the cache only (a model not there yet is the `paths` group's problem)
        path = resolve_model_path(model.path, model.revision, download=False)
        entry = BY_PIPELINE.get(pipeline_class_name(path, model.architecture) or "")
    except ModelLoadError:
        return []
    limits = image_size_limits(path, entry) if entry is not None else None
    if limits is None:
        return []
    multiple, largest, why = limits
    problems = []
    for side in ("height", "width"):
        value = getattr(pipeline, side)
        if value % multiple:
            down, up = value // multiple * multiple, (value // multiple + 1) * multiple
            fix = f"{down} or {up}" if down else str(up)
            problems.append(ConfigProblem(_KEY + side, f"must be a multiple of {multiple} for {path} ({why}); try {fix}", value))
        elif largest is not None and value > largest:
            problems.append(
                ConfigProblem(
                    _KEY + side,
                    f"is larger than the {largest} px the transformer in {path} can place ({why}); use at most {largest}, "
                    "or a model built with a larger pos_embed_max_size",
                    value,
                )
            )
    return problems
