"""The base model a pipeline run fine-tunes: a diffusers folder of the expected architecture, or the
tiny random-weight test model, built there when asked and missing (as `omniflow make-tiny-model` does).

No verl-omni counterpart (verl-omni expects `actor_rollout_ref.model.path` to exist). Errors name
`base_model` (the pipeline flow's parameter), so a bad path fails before Ray starts, with the fix.
"""

from __future__ import annotations

from pathlib import Path

from omni_core.models.hub import is_hub_id, resolve_model_path
from omni_core.models.loader import ModelLoadError, check_pipeline_folder, resolve_architecture


def ensure_base_model(base_model: str, build_tiny_if_missing: bool, arch: str = "sd3") -> tuple[Path, bool]:
    """(the absolute folder, whether the tiny `arch` model was built there now). A Hugging Face Hub id is its snapshot
    folder in the Hugging Face cache (`hub.resolve_model_path`); no tiny model is ever built under a Hub id's name."""
    built = False
    if is_hub_id(base_model):
        path = resolve_model_path(base_model, key="base_model").resolve()
    else:
        path = Path(base_model).expanduser().resolve()
    if not (path / "model_index.json").is_file():
        if not build_tiny_if_missing:
            raise ModelLoadError(
                f"base_model={base_model}: no diffusers pipeline there (no model_index.json); point base_model at a "
                f"save_pretrained folder, or set build_tiny_if_missing=true to build the tiny test model there"
            )
        from omni_core.models.tiny import build_tiny_pipeline

        build_tiny_pipeline(path, arch=arch, seed=0)
        built = True
    try:
        saved = check_pipeline_folder(path)
    except ModelLoadError as err:
        raise ModelLoadError(f"base_model={base_model}: {err}") from err
    expected = resolve_architecture(arch)
    if saved != expected:
        raise ModelLoadError(
            f"base_model={base_model} holds a {saved}, but arch={arch!r} expects a {expected}; set arch to match"
        )
    return path, built
