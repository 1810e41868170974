"""Pipeline stage 1 — `prepare_base_model`: the diffusers folder that fine-tuning starts from.

No verl-omni counterpart (verl-omni expects `actor_rollout_ref.model.path` to exist): the tiny
random-weight model is built when asked and missing (as `omniflow make-tiny-model` does), and any folder
is checked to be a diffusers pipeline of the expected architecture, so a bad path fails here, with the
parameter's name, before Ray starts.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from omni_core.models.loader import ModelLoadError, _check_components, read_model_index, resolve_architecture
from omni_core.models.tiny import build_tiny_pipeline


@task(name="prepare_base_model", cache_policy=NO_CACHE, retries=0)
def prepare_base_model(base_model: str, build_tiny_if_missing: bool, arch: str = "sd3") -> str:
    """The absolute path of a diffusers pipeline folder; builds the tiny `arch` model there if missing and asked."""
    path = Path(base_model).expanduser().resolve()
    if not (path / "model_index.json").is_file():
        if not build_tiny_if_missing:
            raise ModelLoadError(
                f"base_model={base_model}: no diffusers pipeline there (no model_index.json); point base_model at a "
                f"save_pretrained folder, or set build_tiny_if_missing=true to build the tiny test model there"
            )
        print(f"base_model={base_model} is missing: building the tiny {arch} model there")
        build_tiny_pipeline(path, arch=arch, seed=0)
    try:
        index = read_model_index(path)
        _check_components(path, index)
    except ModelLoadError as err:
        raise ModelLoadError(f"base_model={base_model}: {err}") from err
    saved, expected = index.get("_class_name"), resolve_architecture(arch)
    if saved != expected:
        raise ModelLoadError(
            f"base_model={base_model} holds a {saved}, but arch={arch!r} expects a {expected}; set arch to match"
        )
    return str(path)
