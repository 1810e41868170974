"""Pipeline stage 1 — `prepare_base_model`: the diffusers folder that fine-tuning starts from.

No verl-omni counterpart (verl-omni expects `actor_rollout_ref.model.path` to exist): the tiny
random-weight model is built when asked and missing, and any folder is checked to be a diffusers
pipeline of the expected architecture, so a bad path fails here, with the parameter's name, before
Ray starts.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from omni_core.models.base_model import ensure_base_model


@task(name="prepare_base_model", cache_policy=NO_CACHE, retries=0)
def prepare_base_model(base_model: str, build_tiny_if_missing: bool, arch: str = "sd3") -> str:
    """The absolute path of a diffusers pipeline folder; builds the tiny `arch` model there if missing and asked."""
    path, built = ensure_base_model(base_model, build_tiny_if_missing, arch)
    if built:
        print(f"base_model={base_model} was missing: built the tiny {arch} model there")
    return str(path)
